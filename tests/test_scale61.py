"""Scale-out fixes (tester report 61), `--replicas` on Ray Serve: runtime LoRA loads and unloads
reach every replica (and the replicas Ray starts later); SIGTERM drains the replicas, new
requests meanwhile getting 503; a signal during the start-up stops it cleanly; a stream cut by a
dead replica ends with `data: [DONE]`; RAY_ADDRESS without --ray-address is one clear error; a
replica's metrics port stays on loopback; LoRA with tensor parallelism is refused before Ray starts.

The tests without a cluster take seconds; those marked `ray` start local clusters as
tests/test_replicas.py does (its helpers)."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

pytest.importorskip("ray.serve")

from specdec import LLM  # noqa: E402
from specdec.server import ServerConfig, build_app  # noqa: E402
from specdec.server.proxy import MESSAGE, ReplicaLost  # noqa: E402
from specdec.server.replicas import ReplicaApp, RequireToken, application, broadcast, combine  # noqa: E402

from conftest import make_checkpoint  # noqa: E402
from test_replicas import _free_port, _replica_pids, _tail, _wait_for_replicas  # noqa: E402
from test_server import LiveServer  # noqa: E402

pytest.importorskip("peft")
from test_lora import make_adapter  # noqa: E402 - needs peft

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


# --- 1. runtime LoRA updates reach every replica ---------------------------------------------------

def test_a_lora_update_reaching_one_replica_reaches_every_replica(tiny_pair, tmp_path):
    """Two real apps, the second behind its direct port: a load through the first serves the
    adapter on both, an unload drops it on both (vLLM's DP client sends add_lora / remove_lora
    to every engine)."""
    adapter = make_adapter(tiny_pair[0], tmp_path / "three", 3)
    llms = [LLM(str(tiny_pair[0]), num_speculative_tokens=0, max_model_len=128, enable_lora=True) for _ in range(2)]
    config = ServerConfig(served_model_names=("tiny",), allow_runtime_lora_updating=True)
    apps = [build_app(llm, config) for llm in llms]

    async def metrics():
        return b""

    with LiveServer(apps[0]) as a, LiveServer(RequireToken(apps[1], "tok")) as b:
        async def fan_out(*request):
            status, body, _ = await broadcast(apps[0], "a", {"b": b.url}, *request, "tok")
            return status, body
        front = ReplicaApp(apps[0], "a", metrics, fan_out)

        async def main():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front), base_url="http://x",
                                         timeout=60) as c:
                out = {"load": await c.post("/v1/load_lora_adapter",
                                            json={"lora_name": "three", "lora_path": str(adapter)})}
                out["models"] = [[m["id"] for m in httpx.get(u + "/v1/models", headers=h).json()["data"]]
                                 for u, h in ((a.url, {}), (b.url, {"x-specdec-replica-token": "tok"}))]
                out["again"] = await c.post("/v1/load_lora_adapter", json={"lora_name": "three",
                                                                          "lora_path": str(adapter)})
                out["unload"] = await c.post("/v1/unload_lora_adapter", json={"lora_name": "three"})
                out["after"] = [apps[0].state.service.adapters.cards(), apps[1].state.service.adapters.cards()]
                return out
        out = asyncio.run(main())
    assert out["load"].status_code == 200 and out["load"].text == "Success: LoRA adapter 'three' added successfully."
    assert out["load"].headers["content-type"].startswith("text/plain")
    assert out["models"] == [["tiny", "three"], ["tiny", "three"]]
    # both refuse a second load, and the one error says so for each
    assert out["again"].status_code == 400
    message = out["again"].json()["error"]["message"]
    assert message.startswith("replica a: The lora adapter 'three' has already been loaded") and "failed on replica b too" in message
    assert out["unload"].status_code == 200 and out["after"] == [[], []]


def test_a_partial_failure_names_the_replicas_that_failed_and_those_where_it_was_done():
    ok = httpx.Response(200, text="Success: LoRA adapter 'x' added successfully.")
    bad = httpx.Response(400, json={"error": {"message": "invalid LoRA adapter", "type": "BadRequestError",
                                              "param": "lora_path", "code": 400}})
    status, body = combine("/v1/load_lora_adapter", b"", {"a": ok, "b": bad, "c": ok})
    assert status == 400
    assert json.loads(body)["error"]["message"] == "replica b: invalid LoRA adapter; done on replica a, c"
    assert combine("/v1/load_lora_adapter", b"", {"a": ok, "c": ok}) == (200, ok.content)


# --- 4. a stream cut by a dead replica ends with [DONE] ------------------------------------------

def test_a_stream_cut_by_a_lost_replica_ends_with_an_error_event_and_done():
    async def dies_mid_stream(scope, receive, send):        # what the proxy does when the replica dies
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True})
        raise RuntimeError("the replica's actor died")

    with LiveServer(ReplicaLost(dies_mid_stream)) as live:
        with httpx.stream("POST", live.url + "/v1/completions", json={"stream": True}, timeout=30) as r:
            events = [line for line in r.iter_lines() if line]
    assert events[0] == 'data: {"choices": []}'
    assert json.loads(events[1][len("data: "):])["error"]["message"] == MESSAGE
    assert events[2:] == ["data: [DONE]"]


# --- 5. RAY_ADDRESS without --ray-address; 7. LoRA with TP: one line before Ray starts ------------

def test_ray_address_without_the_flag_is_one_clear_error(tiny_pair):
    r = subprocess.run([sys.executable, "-m", "specdec", "serve", "--model", str(tiny_pair[0]), "--replicas", "1"],
                       capture_output=True, text=True, timeout=120, env={**ENV, "RAY_ADDRESS": "127.0.0.1:9"})
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith("specdec: error: RAY_ADDRESS=127.0.0.1:9 names a Ray cluster"), r.stderr
    assert "--ray-address 127.0.0.1:9" in last and "unset RAY_ADDRESS" in last


def test_lora_with_tensor_parallelism_is_refused_by_the_driver(tiny_pair):
    with pytest.raises(ValueError, match="LoRA adapters are not supported with tensor parallelism"):
        application([str(tiny_pair[0]), "--replicas", "1", "-tp", "2", "--enable-lora"])


# --- on a cluster ---------------------------------------------------------------------------------

def _descendants(pid: int) -> set[int]:
    import psutil

    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _wait_for_process(driver: subprocess.Popen, word: bytes, deadline_s: float = 120) -> None:
    """Until a process of the driver's with `word` in its command line runs."""
    deadline = time.monotonic() + deadline_s
    while True:
        for pid in _descendants(driver.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if word in f.read():
                        return
            except OSError:
                continue
        assert driver.poll() is None and time.monotonic() < deadline, f"no {word!r} process"
        time.sleep(0.1)


def _stopped(proc: subprocess.Popen, log) -> str:
    """Its output, once it has exited 0 and its own Ray processes (the raylet, the GCS) are gone."""
    children = _descendants(proc.pid)
    try:
        assert proc.wait(120) == 0, _tail(log)
    finally:
        if proc.poll() is None:
            proc.kill()
    import psutil

    left = [pid for pid in children if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
            and any(w in " ".join(psutil.Process(pid).cmdline()) for w in ("raylet", "gcs_server"))]
    assert not left
    return _tail(log)


@pytest.mark.ray
@pytest.mark.parametrize("sig, when", [(signal.SIGTERM, b"gcs_server"), (signal.SIGINT, b"ServeReplica:specdec:specdec")])
def test_a_signal_during_the_start_up_stops_it_cleanly(tiny_pair, tmp_path, sig, when):
    """SIGTERM while ray.init runs (Ray's own handler had exited 15 there, its helpers left
    running); Ctrl-C (to the process group, as a terminal sends it) while the replica loads (the
    server had come up all the same)."""
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "specdec", "serve", "--model", str(tiny_pair[0]), "--replicas", "1",
                             "--replica-cpus", "1", "--port", str(_free_port())], stdout=log, stderr=subprocess.STDOUT,
                            env=ENV, start_new_session=True)
    try:
        _wait_for_process(proc, when)
        os.killpg(proc.pid, sig) if sig == signal.SIGINT else proc.send_signal(sig)
        assert "serving on" not in _stopped(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """--replicas 2 with runtime LoRA updates on; the last test here stops it (SIGTERM)."""
    root = tmp_path_factory.mktemp("scale61")
    model = make_checkpoint(root / "target", layers=2, max_position_embeddings=4096)
    adapter = make_adapter(model, root / "three", 3)
    port = _free_port()
    log = open(root / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "specdec", "serve", "--model", str(model), "--served-model-name",
                             "tiny", "--replicas", "2", "--replica-cpus", "1", "--max-num-seqs", "4",
                             "--enable-lora", "--port", str(port), "--host", "127.0.0.1",
                             "--uvicorn-log-level", "warning"], stdout=log, stderr=subprocess.STDOUT,
                            env={**ENV, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_replicas(proc, url, log)
        yield {"url": url, "proc": proc, "log": log, "adapter": adapter,
               "client": openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()


def _by_replica(send, want: int = 2, deadline_s: float = 60) -> dict:
    """send() -> (replica, outcome), until `want` replicas have answered: {replica: [outcomes]}."""
    seen: dict = {}
    deadline = time.monotonic() + deadline_s
    while len(seen) < want:
        assert time.monotonic() < deadline, seen
        replica, outcome = send()
        seen.setdefault(replica, []).append(outcome)
    return seen


def _complete(url: str, model: str):
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "def f(x):", "max_tokens": 2}, timeout=60)
    return r.headers["x-specdec-replica"], r.status_code


def _models(url: str):
    r = httpx.get(url + "/v1/models", timeout=60)
    return r.headers["x-specdec-replica"], [m["id"] for m in r.json()["data"]]


@pytest.mark.ray
def test_runtime_lora_updates_reach_every_replica_and_its_replacement(cluster):
    url = cluster["url"]
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "three", "lora_path": str(cluster["adapter"])},
                   timeout=120)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'three' added successfully."
    assert all(o == ["tiny", "three"] for outs in _by_replica(lambda: _models(url)).values() for o in outs)
    assert all(o == 200 for outs in _by_replica(lambda: _complete(url, "three")).values() for o in outs)
    # a replica Ray starts in place of a dead one loads it too
    victim = _replica_pids(cluster["proc"].pid)[0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 90
    while not (len(pids := _replica_pids(cluster["proc"].pid)) == 2 and victim not in pids):
        assert time.monotonic() < deadline, "no replacement replica"
        time.sleep(0.5)
    _wait_for_replicas(cluster["proc"], url, cluster["log"])
    assert all(o == 200 for outs in _by_replica(lambda: _complete(url, "three")).values() for o in outs)
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "three"}, timeout=120)
    assert r.status_code == 200, r.text
    assert all(o == 404 for outs in _by_replica(lambda: _complete(url, "three")).values() for o in outs)


@pytest.mark.ray
def test_each_replicas_own_metrics_port_is_on_loopback(cluster):
    """--host 127.0.0.1 and a local cluster: no replica serves its metrics on another address."""
    import psutil

    listening = [c.laddr for pid in _replica_pids(cluster["proc"].pid)
                 for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
    assert listening
    exposed = []
    for ip, port in listening:
        if ipaddress.ip_address(ip).is_loopback:
            continue
        try:
            host = f"[{ip}]" if ":" in ip else ip
            if "specdec" in httpx.get(f"http://{host}:{port}/metrics", timeout=2).text:
                exposed.append((ip, port))
        except httpx.HTTPError:        # Ray's own gRPC ports
            pass
    assert not exposed


@pytest.mark.ray
def test_sigterm_lets_requests_in_flight_finish_and_refuses_new_ones(cluster):
    """The last test on the cluster: SIGTERM, a stream and a plain request finish whole (the
    stream with [DONE]), a request sent meanwhile gets 503, the server exits 0."""
    url, proc = cluster["url"], cluster["proc"]
    body = {"model": "tiny", "prompt": "def g(x):", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    out, streaming = {}, threading.Event()

    def stream():
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
            lines = []
            for line in r.iter_lines():
                streaming.set()
                if line:
                    lines.append(line)
        out["stream"] = r.status_code, lines

    def plain():
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        out["plain"] = r.status_code, r.json()

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    [t.start() for t in threads]
    assert streaming.wait(60)
    proc.send_signal(signal.SIGTERM)
    refused = None
    deadline = time.monotonic() + 60
    while refused is None:
        assert time.monotonic() < deadline and "stream" not in out, out.keys()
        r = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 1}, timeout=60)
        if r.status_code == 503:
            refused = r.json()
    assert refused["error"]["message"] == "the server is shutting down"
    [t.join(300) for t in threads]
    status, lines = out["stream"]
    assert status == 200 and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
    status, answer = out["plain"]
    assert status == 200 and answer["usage"]["completion_tokens"] == 3000
    assert proc.wait(120) == 0, _tail(cluster["log"])
