"""Tensor parallelism over gloo, two real processes (rank 0 here, rank 1 spawned): a tiny fp32
checkpoint written by transformers and a tiny packed GGUF. TP=2 logits equal TP=1's within fp32
tolerance; greedy plain and speculative outputs and seeded samples are identical to TP=1's; a
rank that dies or stops answering ends the group with a clear error instead of a hang.

Each LLM(tensor_parallel_size=2) starts a process (a few seconds on 2 cores), so the speculative
engines of a model share one TP=2 target (marked `tp`: `pytest -m "not tp"` skips them)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.distributed import TensorParallelError
from specdec.engine import Engine
from specdec.model import ForwardBatch
from specdec.proposers import build_proposer

from test_heads import _heads_dirs

pytestmark = pytest.mark.tp

MAX_LEN = 96
TEXT = ["def add(a, b):", "class Point:", "for i in range(10):", "import os\n", "    return a + b"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_k=20, max_tokens=20, seed=11, ignore_eos=True)


def _specs(draft, heads=None) -> dict:
    specs = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
             "draft_model": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
             "layer_skip": {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 2}}
    if heads:
        specs["eagle-tree"] = {"method": "eagle", "model": str(heads["eagle"]), "num_speculative_tokens": 4}
        specs["medusa"] = {"method": "medusa", "model": str(heads["medusa"]), "num_speculative_tokens": 3}
    return specs


def _engine(llm: LLM, spec: dict | None) -> Engine:
    """An engine over llm's target (TP or not) with the method of `spec`: one TP group serves all."""
    if spec is None:
        return Engine(llm.target, llm.tokenizer, None, 0, MAX_LEN)
    cfg = SpeculativeConfig.from_dict(spec)
    proposer = build_proposer(cfg, llm.target, llm._load_draft, MAX_LEN)
    return Engine(llm.target, llm.tokenizer, proposer, cfg.num_speculative_tokens, MAX_LEN)


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Every prompt at once through the batch engine; outputs in prompt order."""
    reqs = [engine.add_request(p, params, seed_offset=i) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [list(r.out) for r in reqs]


def _logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    kv = llm.target.new_cache(1, MAX_LEN)
    return llm.target(torch.tensor(ids), kv, ForwardBatch.build(kv, [0], [len(ids)], [0])).logits


@pytest.fixture(scope="module")
def dense(tiny_pair, near_draft, tmp_path_factory):
    target = tiny_pair[0]
    heads = _heads_dirs(target, tmp_path_factory.mktemp("tp-heads"))
    kw = dict(model=target, dtype="float32", num_speculative_tokens=0, max_model_len=MAX_LEN)
    tp2 = LLM(**kw, tensor_parallel_size=2)
    yield {"kind": "dense", "tp1": LLM(**kw), "tp2": tp2, "specs": _specs(near_draft, heads)}
    tp2.shutdown()


@pytest.fixture(scope="module")
def packed(gguf_files):
    kw = dict(model=str(gguf_files["llama_q"]), quantization="gguf", num_speculative_tokens=0, max_model_len=MAX_LEN)
    tp2 = LLM(**kw, tensor_parallel_size=2)
    yield {"kind": "packed", "tp1": LLM(**kw), "tp2": tp2, "specs": _specs(gguf_files["draft"].parent)}
    tp2.shutdown()


@pytest.fixture(params=["dense", "packed"])
def pair(request):
    return request.getfixturevalue(request.param)


def test_logits_equal_tp1_within_fp32_tolerance(pair):
    ids = pair["tp1"].tokenizer.encode(TEXT[0] + TEXT[1])
    a, b = _logits(pair["tp1"], ids), _logits(pair["tp2"], ids)
    assert a.shape == b.shape == (len(ids), pair["tp1"].target.config.vocab_size)
    if pair["kind"] == "packed":
        # GGUF-packed products quantize their input activations to int8 per 32-block (llama.cpp's
        # scheme): a shard's partial sum added in another order can round one activation code the
        # other way, so the bound is a quantization step's effect, not fp32's; the argmax holds.
        torch.testing.assert_close(b, a, rtol=0, atol=1e-2 * a.abs().max().item())
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    else:
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4 * a.abs().max().item())
    assert pair["tp2"].target.lm_head.inner.out_features < a.shape[1]     # each rank scored a share


def test_greedy_and_seeded_outputs_identical_to_tp1(pair):
    prompts = [pair["tp1"].tokenizer.encode(t) for t in TEXT]
    for name, spec in pair["specs"].items():
        for params in (GREEDY, SAMPLED):
            want = _run(_engine(pair["tp1"], spec), prompts, params)
            assert _run(_engine(pair["tp2"], spec), prompts, params) == want, (name, params.temperature)


def test_unseeded_requests_keep_ranks_in_step(dense):
    """Sampling without a seed draws fresh randomness on rank 0 only: the worker just repeats
    rank 0's forwards, so the group keeps working (and a later greedy request is still exact)."""
    prompts = [dense["tp1"].tokenizer.encode(t) for t in TEXT]
    engine = _engine(dense["tp2"], dense["specs"]["draft_model"])
    _run(engine, prompts, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
    assert _run(engine, prompts, GREEDY) == _run(_engine(dense["tp1"], None), prompts, GREEDY)


def test_tp_size_must_divide_the_heads(tiny_pair):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide the model's num_attention_heads"):
        LLM(model=tiny_pair[0], tensor_parallel_size=3)


def _worker(llm: LLM):
    return llm.target.leader.procs[0]


def test_a_killed_rank_stops_the_group_with_a_clear_error(tiny_pair):
    llm = LLM(model=tiny_pair[0], dtype="float32", num_speculative_tokens=0, tensor_parallel_size=2)
    worker = _worker(llm)
    threading.Timer(0.3, os.kill, (worker.pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {worker.pid}\) was killed by SIGKILL"):
        while True:      # keep the group busy until the kill lands
            llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert time.monotonic() - t0 < 20
    with pytest.raises(TensorParallelError):          # the group stays stopped
        llm.check_health()
    with pytest.raises(TensorParallelError):
        llm.generate(TEXT[0], GREEDY)


def test_a_silent_rank_times_out_instead_of_hanging(tiny_pair):
    llm = LLM(model=tiny_pair[0], dtype="float32", num_speculative_tokens=0, tensor_parallel_size=2,
              distributed_timeout_s=2.0)
    worker = _worker(llm)
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        # the silent rank is named (it was "rank 0: RuntimeError: ... Timed out", the healthy leader)
        with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {worker.pid}\) did not answer within 2 s.*Timed out"):
            llm.generate(TEXT[0], GREEDY)
        assert time.monotonic() - t0 < 15
    finally:
        if worker.exitcode is None:
            os.kill(worker.pid, signal.SIGKILL)
        worker.join(5)


def test_an_interrupt_in_a_collective_stops_the_group_at_once(tiny_pair, monkeypatch):
    """Ctrl-C while the ranks are in a collective leaves the workers mid-command: the next call
    hung for distributed_timeout_s, then blamed a rank. Now the group stops there, the interrupt
    goes on up, and every later call is the TensorParallelError saying why."""
    llm = LLM(model=tiny_pair[0], dtype="float32", num_speculative_tokens=0, tensor_parallel_size=2)
    leader = llm.target.leader
    real = leader.comm.send_command

    def interrupted(*a, **kw):
        real(*a, **kw)                    # the workers have the command: they are in it now
        raise KeyboardInterrupt

    monkeypatch.setattr(leader.comm, "send_command", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(TEXT[0], GREEDY)
    monkeypatch.setattr(leader.comm, "send_command", real)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="interrupted"):
        llm.generate(TEXT[0], GREEDY)
    assert time.monotonic() - t0 < 5
    leader.procs[0].join(5)
    assert leader.procs[0].exitcode is not None          # the worker was stopped, not left waiting


def test_health_says_503_once_the_group_has_stopped(tiny_pair):
    import httpx

    from specdec.server import ServerConfig, build_app
    from test_server import LiveServer

    llm = LLM(model=tiny_pair[0], dtype="float32", num_speculative_tokens=0, tensor_parallel_size=2)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tp",)))) as live:
        assert httpx.get(live.url + "/health").status_code == 200
        worker = _worker(llm)
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(5)
        deadline = time.monotonic() + 10          # the watchdog notices within its poll
        while httpx.get(live.url + "/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        r = httpx.get(live.url + "/health")
        assert r.status_code == 503 and "tensor-parallel group" in r.json()["error"]["message"]


def test_torchrun_runs_the_same_command_on_every_rank(tiny_pair):
    """Under torchrun both ranks run `specdec generate --tensor-parallel-size 2`: rank 1 serves
    rank 0's forwards and exits, rank 0 prints what TP=1 prints."""
    cmd = ["-m", "specdec", "generate", "--model", str(tiny_pair[0]), "--dtype", "float32", "--max-tokens", "12",
           "--json", "def add(a, b):"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = lambda *argv: subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env,  # noqa: E731
                                       timeout=240)
    one = run(*cmd)
    launched = run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *cmd,
                   "--tensor-parallel-size", "2")
    for r in (one, launched):
        assert r.returncode == 0, r.stderr[-3000:]
    tokens = lambda r: json.loads(r.stdout.strip().splitlines()[-1])["token_ids"]  # noqa: E731
    assert tokens(launched) == tokens(one)


def test_ctrl_c_in_a_terminal_prints_one_line(tiny_pair):
    """Ctrl-C reaches the terminal's whole process group, the spawned rank too: only rank 0
    answers it (one `interrupted` line, status 130), the worker prints no traceback of its own
    and does not outlive rank 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "specdec", "generate", "--model", str(tiny_pair[0]), "--dtype",
                             "float32", "--tensor-parallel-size", "2", "--max-tokens", "100000", "--max-model-len",
                             "256", "--ignore-eos", "def add(a, b):"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        assert proc.stdout.read(8)                       # generating: both ranks are in the forwards
        os.killpg(proc.pid, signal.SIGINT)               # what the terminal does on Ctrl-C
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = err.decode()
    assert proc.returncode == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == "interrupted"
    deadline = time.monotonic() + 15                     # the worker notices rank 0 is gone within its poll
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break                                        # nobody left in the group
        time.sleep(0.2)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("a process of the group outlived rank 0")


def test_vllms_torchrun_example_with_the_external_launcher(tiny_pair, tmp_path):
    """vLLM's torchrun example (`distributed_executor_backend="external_launcher"`) runs: rank 0's
    LLM() returns and generates what TP=1 does, rank 1 serves its forwards inside LLM() and exits
    with it (code after LLM() runs once); outside torchrun that backend is refused in one line."""
    script = tmp_path / "torchrun_example.py"
    script.write_text(
        "import json, os, sys\n"
        "from specdec import LLM, SamplingParams\n"
        f"llm = LLM(model={str(tiny_pair[0])!r}, dtype='float32', tensor_parallel_size=int(sys.argv[1]),\n"
        "          distributed_executor_backend=sys.argv[2] if len(sys.argv) > 2 else None, seed=0)\n"
        "outs = llm.generate(['def add(a, b):', 'class Point:'], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))\n"
        "print(json.dumps({'rank': os.environ.get('RANK', '0'), 'tokens': [o.outputs[0].token_ids for o in outs]}))\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = lambda *argv: subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env,  # noqa: E731
                                       timeout=240)
    one = run(str(script), "1")
    launched = run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), "2",
                   "external_launcher")
    for r in (one, launched):
        assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in launched.stdout.splitlines() if x.startswith("{")]
    assert [x["rank"] for x in lines] == ["0"] and lines[0]["tokens"] == json.loads(one.stdout.splitlines()[-1])["tokens"]
    alone = run(str(script), "2", "external_launcher")
    assert alone.returncode != 0
    assert "distributed_executor_backend='external_launcher' is not supported" in alone.stderr.strip().splitlines()[-1]


def test_serve_takes_the_rank_timeout(tiny_pair, tmp_path):
    """`specdec serve --distributed-timeout-s 3`: with its worker rank stopped (SIGSTOP), a request
    fails naming the silent rank after ~3 s instead of the fixed 120, and /health says 503."""
    import httpx

    from serve_helpers import wait_listening

    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "specdec", "serve", "--model", str(tiny_pair[0]), "--dtype", "float32",
                                 "--tensor-parallel-size", "2", "--distributed-timeout-s", "3", "--port", "0"],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    worker = None
    try:
        url = wait_listening(proc, log)
        children = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
        worker = next(int(c) for c in children if b"resource_tracker" not in open(f"/proc/{c}/cmdline", "rb").read())
        os.kill(worker, signal.SIGSTOP)
        r = httpx.post(url + "/v1/completions", json={"model": str(tiny_pair[0]), "prompt": TEXT[0], "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 500 and f"rank 1 (pid {worker}) did not answer within 3 s" in r.json()["error"]["message"]
        assert httpx.get(url + "/health", timeout=10).status_code == 503
    finally:
        if worker is not None:
            os.kill(worker, signal.SIGKILL)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
