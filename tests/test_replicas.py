"""Replicas behind Ray Serve: `specdec serve --replicas 2` as a real subprocess starting a local
Ray cluster, a tiny checkpoint, the official openai client. Completions and streams through
the one endpoint, requests spread over both replicas, every replica's metrics at /metrics, and
a replica killed mid-traffic: its in-flight requests end with a clear error, the others finish,
the endpoint keeps answering and Ray Serve starts a replacement.

One cluster serves the module (about 20-30 s to start on 2 cores; marked `ray`: `pytest -m
"not ray"` skips it). The builder and option tests need no cluster."""

from __future__ import annotations

import collections
import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

pytest.importorskip("ray.serve")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from specdec.server.cli import parse_args  # noqa: E402
from specdec.server.proxy import MESSAGE  # noqa: E402
from specdec.server.replicas import deployment_options  # noqa: E402

from conftest import make_checkpoint  # noqa: E402

pytestmark = pytest.mark.ray
LONG = 1200          # tokens of a request kept in flight while a replica is killed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _replica_pids(driver: int) -> list[int]:
    """The engine replicas of the cluster `driver` started (Ray titles them
    ServeReplica:<app>:<deployment>; their raylet is the driver's child)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"ServeReplica:specdec:specdec" in f.read() and _parent(_parent(int(entry))) == driver:
                    pids.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return pids


def _replicas_in(text: str) -> set[str]:
    """The replica labels of a federated /metrics text."""
    return {s.labels["replica"] for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = make_checkpoint(tmp_path_factory.mktemp("replicas") / "target", layers=2, max_position_embeddings=2048)
    port = _free_port()
    log = open(tmp_path_factory.mktemp("replicas-log") / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "specdec", "serve", "--model", str(model), "--served-model-name", "tiny",
                             "--replicas", "2", "--replica-cpus", "1", "--max-num-seqs", "4", "--port", str(port),
                             "--uvicorn-log-level", "warning"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_replicas(proc, url, log)
        yield {"url": url, "driver": proc.pid, "log": log,
               "client": openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)}
    finally:
        proc.send_signal(signal.SIGTERM)          # drains, shuts Serve and the local cluster down
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _wait_for_replicas(proc, url: str, log, replicas: int = 2) -> None:
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, _tail(log)
        try:            # every replica up: each lists its metrics in the federated /metrics
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200 and len(_requests_by_replica(url)) == replicas:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def _tail(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-3000:]


def _complete(client, **kw):
    r = client.completions.with_raw_response.create(model="tiny", **kw)
    return r.headers["x-specdec-replica"], r.parse()


def _requests_by_replica(url: str) -> dict[str, float]:
    totals = collections.Counter()
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        if fam.name == "specdec:requests":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    totals[s.labels["replica"]] += s.value
    return totals


def test_completions_and_streams_spread_over_both_replicas(cluster):
    client, url = cluster["client"], cluster["url"]
    served = collections.Counter()
    results = []
    lock = threading.Lock()

    start = threading.Barrier(8)

    def one(i):
        start.wait(30)               # all 8 sent together, each long enough to still run when the last comes
        replica, out = _complete(client, prompt=f"def f{i}(x):", max_tokens=1000, temperature=0,
                                 extra_body={"ignore_eos": True})
        with lock:
            served[replica] += 1
            results.append(out)

    # 4 seats per replica (--max-num-seqs 4 = Ray's max_ongoing_requests): 8 at once need both
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert len(results) == 8 and all(r.choices[0].finish_reason in ("length", "stop") for r in results)
    assert len(served) == 2, served
    whole = _complete(client, prompt="class Point:", max_tokens=24, temperature=0)[1].choices[0].text
    chunks = client.completions.create(model="tiny", prompt="class Point:", max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                          stream=True, stream_options={"include_usage": True})
    assert [c.usage for c in chat][-1].completion_tokens >= 1
    with pytest.raises(openai.NotFoundError, match="does not exist"):       # the same errors as one server
        client.completions.create(model="other", prompt="x", max_tokens=4)
    # every replica's metrics through the one endpoint, labelled by replica
    counts = _requests_by_replica(url)
    assert set(counts) == set(served) and sum(counts.values()) >= 8 + 3


def test_control_routes_reach_every_replica(cluster):
    """/pause on the shared endpoint pauses both replicas (every later request waits, whichever
    replica Ray picks), /get_world_size counts both, /resume lets the waiting request finish."""
    url = cluster["url"]
    assert httpx.post(url + "/pause", params={"mode": "keep"}, timeout=60).json() == {"status": "paused"}
    for _ in range(4):          # whichever replica answers, all are paused
        assert httpx.get(url + "/is_paused", timeout=60).json() == {"is_paused": True}
    assert httpx.get(url + "/get_world_size", timeout=60).json() == {"world_size": 2}
    got = {}
    held = [threading.Thread(target=lambda i=i: got.update({i: _complete(
        cluster["client"], prompt=f"def h{i}():", max_tokens=4, temperature=0)})) for i in range(4)]
    for t in held:
        t.start()
    time.sleep(2.0)
    assert not got                         # held by whichever replica each reached
    assert httpx.post(url + "/resume", timeout=60).json() == {"status": "resumed"}
    for t in held:
        t.join(60)
    assert len(got) == 4 and httpx.get(url + "/is_paused", timeout=60).json() == {"is_paused": False}



def test_with_ray_serve_responses_follow_ups_and_a_frozen_replica(cluster):
    """A stored response is answered by the replica that holds it whichever one a follow-up
    reaches; a replica frozen through a few /metrics scrapes stays on the board, so /metrics lists
    it and /pause holds it too (tests/test_replicas63.py has the pieces without a cluster)."""
    client, url = cluster["client"], cluster["url"]
    kw = {"model": "tiny", "max_output_tokens": 4, "temperature": 0}
    first = client.responses.with_raw_response.create(input="hello", **kw)
    rid, maker = first.parse().id, first.headers["x-specdec-replica"]
    answered = set()
    for _ in range(8):               # Ray spreads them: some reach the other replica
        got = client.responses.with_raw_response.retrieve(rid)
        answered.add(got.headers["x-specdec-replica"])
        assert got.parse().id == rid
        follow = client.responses.with_raw_response.create(input="more", previous_response_id=rid, **kw)
        assert follow.headers["x-specdec-replica"] == maker
    assert answered == {maker}       # every answer from the replica that holds it

    # one replica frozen through a few scrapes (each waits 2 s for it): it stays on the board
    pids = _replica_pids(cluster["driver"])
    assert len(pids) == 2
    os.kill(pids[0], signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                httpx.get(url + "/metrics", timeout=4)
            except httpx.TimeoutException:      # Ray gave it to the frozen one
                pass
    finally:
        os.kill(pids[0], signal.SIGCONT)
    for _ in range(4):
        assert len(_replicas_in(httpx.get(url + "/metrics", timeout=30).text)) == 2, _tail(cluster["log"])
    paused = httpx.post(url + "/pause?mode=keep", timeout=30)
    try:
        assert paused.status_code == 200
        assert httpx.get(url + "/is_paused", timeout=30).json() == {"is_paused": True}
        # every replica paused: requests wait, whichever replica they reach
        def one(_):
            try:
                return httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2},
                                  timeout=4).headers["x-specdec-replica"]
            except httpx.TimeoutException:
                return None
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(one, range(4))) == [None] * 4
    finally:
        assert httpx.post(url + "/resume", timeout=30).status_code == 200


def test_a_killed_replica_fails_its_requests_clearly_and_the_service_recovers(cluster):
    client = cluster["client"]
    outcome, replica_of, started = {}, {}, threading.Semaphore(0)

    def stream(i):
        try:
            raw = client.completions.with_raw_response.create(
                model="tiny", prompt=f"def g{i}():", max_tokens=LONG, temperature=0, stream=True,
                extra_body={"ignore_eos": True})
            replica_of[i] = raw.headers["x-specdec-replica"]
            started.release()
            finish = [c.choices[0].finish_reason for c in raw.parse() if c.choices][-1]
            outcome[i] = ("finished", finish)
        except openai.APIError as e:
            outcome[i] = ("error", str(e))

    threads = []
    while len(set(replica_of.values())) < 2 and len(threads) < 12:   # until both hold a stream
        threads.append(threading.Thread(target=stream, args=(len(threads),)))
        threads[-1].start()
        assert started.acquire(timeout=30)
    assert len(set(replica_of.values())) == 2
    victim = _replica_pids(cluster["driver"])[0]
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    answer = None
    while answer is None and time.monotonic() - killed_at < 10:       # the endpoint answers again
        try:
            answer = _complete(client, prompt="x = ", max_tokens=4)
        except openai.APIError:
            time.sleep(0.2)
    assert answer is not None
    for t in threads:
        t.join(120)
        assert not t.is_alive()                                          # nothing hangs
    failed = {replica_of[i] for i, (kind, _) in outcome.items() if kind == "error"}
    assert len(failed) == 1, outcome                                     # one replica died with its requests
    for i, (kind, detail) in outcome.items():
        if replica_of[i] in failed:
            assert kind == "error" and MESSAGE in detail, detail
        else:
            assert (kind, detail) == ("finished", "length")              # the other replica's are unaffected
    deadline = time.monotonic() + 90
    while not (len(_replica_pids(cluster["driver"])) == 2 and victim not in _replica_pids(cluster["driver"])):
        assert time.monotonic() < deadline, "no replacement replica"     # Ray Serve replaced it
        time.sleep(0.5)


def test_flags_map_to_ray_serve_options():
    args, _ = parse_args(["--replicas", "3", "--max-num-seqs", "8", "--tensor-parallel-size", "2"])
    opts = deployment_options(args)
    assert opts["num_replicas"] == 3 and opts["max_ongoing_requests"] == 8
    assert opts["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 0}
    args, _ = parse_args(["--autoscale", "1,4", "--max-num-seqs", "8"])
    assert deployment_options(args)["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 4, "initial_replicas": 1, "target_ongoing_requests": 4}


def test_app_builder_takes_the_serve_flags(tiny_pair):
    from ray.serve import Application

    from specdec.serve import app, argv_of

    assert argv_of({"model": "m", "num_speculative_tokens": 4, "speculative_config": {"method": "ngram"},
                    "ignore_eos": True}) == ["--model", "m", "--num-speculative-tokens", "4",
                                             "--speculative-config", '{"method": "ngram"}', "--ignore-eos"]
    assert isinstance(app({"model": str(tiny_pair[0]), "replicas": "2"}), Application)
    with pytest.raises(ValueError, match="port: set by Ray"):
        app({"model": str(tiny_pair[0]), "port": 8000})


def test_a_bad_model_fails_before_ray_starts(tmp_path):
    r = subprocess.run([sys.executable, "-m", "specdec", "serve", "--model", str(tmp_path / "missing"), "--replicas", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("specdec: error: ") and "does not exist" in r.stderr


def test_federated_metrics_keep_each_replicas_samples_apart(tiny_pair):
    from specdec import LLM
    from specdec.server.federate import merge
    from specdec.server.metrics import ServerMetrics

    a, b = ServerMetrics(LLM(tiny_pair[0]).engine), ServerMetrics(LLM(tiny_pair[0]).engine)
    for _ in range(3):
        a.count("stop")
        a.finished("stop", None, 3, 2, 0.0, 0.1, 0.2, 0.2)
    a.ttft.observe(0.2)
    for _ in range(2):
        b.count("length")
        b.finished("length", None, 3, 2, 0.0, 0.1, 0.2, 0.2)
    fams = {f.name: f for f in text_string_to_metric_families(merge({"a": a.render().decode(),
                                                                      "b": b.render().decode()}).decode())}
    totals = {(s.labels["replica"], s.labels["outcome"]): s.value for s in fams["specdec:requests"].samples
              if s.name.endswith("_total")}
    assert totals[("a", "stop")] == 3 and totals[("b", "length")] == 2 and totals[("b", "stop")] == 0
    counts = {s.labels["replica"]: s.value for s in fams["specdec:time_to_first_token_seconds"].samples
              if s.name.endswith("_count")}
    assert fams["specdec:time_to_first_token_seconds"].type == "histogram" and counts == {"a": 1, "b": 0}


def test_ray_address_joins_a_running_cluster_and_leaves_it_running(tmp_path):
    """`--ray-address` joins a cluster someone else started (a driver process here, holding a local
    cluster until its stdin closes): the replica runs there and answers; on SIGTERM serve deletes
    its own application only (serve.delete), so the cluster and its Serve proxy keep running (the
    proxy then answers 404 on the port: no application), where a cluster of serve's own would have
    been shut down with it."""
    model = make_checkpoint(tmp_path / "target", layers=2, max_position_embeddings=512)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | {"OMP_NUM_THREADS": "1"}
    head = subprocess.Popen([sys.executable, "-c", "import ray, sys; ray.init(num_cpus=2, include_dashboard=False, "
                             "logging_level='WARNING'); print(ray.get_runtime_context().gcs_address, flush=True); "
                             "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)
    log = open(tmp_path / "serve.log", "w+")
    proc = None
    try:
        address = head.stdout.readline().strip()
        assert address and head.poll() is None
        port = _free_port()
        argv = [sys.executable, "-m", "specdec", "serve", "--model", str(model), "--served-model-name", "tiny",
                "--replicas", "1", "--replica-cpus", "1", "--ray-address", address, "--port", str(port),
                "--uvicorn-log-level", "warning"]
        # Ray 2.59+ starts ray.init()'s clusters with token authentication: a process joining without
        # RAY_AUTH_MODE=token sends no token and is refused; serve says so in one line and what to set
        r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and last.startswith("specdec: error: Failed to connect to Ray cluster at "), r.stderr[-2000:]
        assert "RAY_AUTH_MODE=token" in last
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env | {"RAY_AUTH_MODE": "token"})
        url = f"http://127.0.0.1:{port}"
        _wait_for_replicas(proc, url, log, replicas=1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        replica, out = _complete(client, prompt="def f(x):", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        assert replica and out.usage.completion_tokens == 6
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, _tail(log)
        assert "replica(s) serving on" in _tail(log)
        assert head.poll() is None                     # the cluster serve joined is still up ...
        deadline = time.monotonic() + 60
        while (status := httpx.get(url + "/v1/models", timeout=10).status_code) != 404:
            assert time.monotonic() < deadline, status   # ... its proxy too, without the application
            time.sleep(0.5)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        head.stdin.close()                             # the driver leaves: its local cluster stops
        try:
            head.wait(120)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait(10)
        log.close()
