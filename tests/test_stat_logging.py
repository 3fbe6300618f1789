"""vLLM's periodic stats lines on the server (LoggingStatLogger: throughput, requests running and
waiting, preemptions, GPU KV cache usage, prefix cache hit rate, and the SpecDecoding metrics line), every
VLLM_LOG_STATS_INTERVAL seconds, off with --disable-log-stats. The lines' counts, summed over the
intervals, are the /metrics counters."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from specdec import LLM
from specdec.server.app import build_app
from specdec.server.config import ServerConfig
from specdec.server.run_batch import asgi_request

from serve_helpers import wait_listening

SPEC = re.compile(r"SpecDecoding metrics: Mean acceptance length: ([\d.]+), Accepted throughput: ([\d.]+) tokens/s, "
                  r"Drafted throughput: ([\d.]+) tokens/s, Accepted: (\d+) tokens, Drafted: (\d+) tokens, "
                  r"Per-position acceptance rate: ([\d., ]+), Avg Draft acceptance rate: ([\d.]+)%")
ENGINE = re.compile(r"Engine 000: Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) "
                    r"tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs, (?:Preemptions: \d+, )?"
                    r"GPU KV cache usage: ([\d.]+)%, "
                    r"Prefix cache hit rate: ([\d.]+)%")


def test_interval_lines_add_up_to_the_counters(tiny_pair):
    target, draft = tiny_pair
    llm = LLM(model=str(target), speculative_model=str(draft), num_speculative_tokens=3)
    app = build_app(llm, ServerConfig(served_model_names=("m",), log_stats_interval=3600))
    stat = app.state.service.metrics.stat_logger
    long = "def add(a, b):\n    return a + b\n\n" * 6             # several KV blocks: cached after its first run
    prompts = [long, "class Point:", "import os\n", long]

    async def run():
        lines = []
        async with app.router.lifespan_context(app):
            assert stat.log() == []                       # idle: nothing to say
            for p in prompts:                              # one at a time: a line after each
                body = {"model": "m", "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
                status, _ = await asgi_request(app, "POST", "/v1/completions", json.dumps(body).encode(), {})
                assert status == 200
                lines += stat.log()
            _, metrics = await asgi_request(app, "GET", "/metrics", b"", {})
        return lines, metrics.decode()

    lines, metrics = asyncio.run(run())
    engine = [ENGINE.search(line) for line in lines if line.startswith("Engine 000")]
    spec = [SPEC.search(line) for line in lines if line.startswith("SpecDecoding")]
    assert len(engine) == len(spec) == len(prompts) and all(engine) and all(spec)

    def counter(name):
        return float(re.search(rf"^specdec:{name}_total\{{[^}}]*\}} ([\d.e+]+)$", metrics, re.M).group(1))

    assert sum(int(m.group(4)) for m in spec) == counter("spec_decode_num_accepted_tokens")
    assert sum(int(m.group(5)) for m in spec) == counter("spec_decode_num_draft_tokens")
    for m in spec:
        accepted, drafted = int(m.group(4)), int(m.group(5))
        assert float(m.group(7)) == pytest.approx(100 * accepted / drafted, abs=0.05)
        assert len(m.group(6).split(", ")) == 3 and float(m.group(1)) >= 1
    for m in engine:
        assert float(m.group(2)) > 0 and (m.group(3), m.group(4)) == ("0", "0")
    assert float(engine[3].group(6)) > 0          # the repeated prompt found its blocks in the prefix cache


def _serve(target, log, *flags, env_extra=None):
    """`specdec serve` on --port 0 (the port it holds, read from its log: no race for a free one),
    its output in the file `log` -> (process, url) once /health answers."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
           **(env_extra or {})}
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--model", str(target), "--port", "0",
                             "--served-model-name", "m", *flags], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env=env)
    try:
        return proc, wait_listening(proc, log, timeout=120)
    except BaseException:
        proc.kill()
        proc.wait()
        raise


@pytest.mark.parametrize("disabled", [False, True])
def test_a_live_server_logs_its_stats(tiny_pair, tmp_path, disabled):
    target, draft = tiny_pair
    flags = ["--speculative-model", str(draft), "--num-speculative-tokens", "2"] + (["--disable-log-stats"] if disabled else [])
    log = tmp_path / "serve.log"
    proc, url = _serve(target, log, *flags, env_extra={"VLLM_LOG_STATS_INTERVAL": "0.3"})

    def stats() -> list[str]:
        return [line for line in log.read_text().splitlines() if "specdec.server.stats" in line]

    try:
        for _ in range(3):
            r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "def f(x):", "max_tokens": 40,
                                                          "temperature": 0, "ignore_eos": True}, timeout=60)
            assert r.status_code == 200
        if disabled:
            time.sleep(1.5)              # five intervals: a logger left on would have written by now
        else:                            # both lines, however slowly the logger's thread gets to run
            deadline = time.monotonic() + 60
            while not (any(ENGINE.search(line) for line in stats()) and any(SPEC.search(line) for line in stats())):
                assert time.monotonic() < deadline, stats()
                time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    if disabled:
        assert stats() == []
    else:
        assert any(ENGINE.search(line) for line in stats()) and any(SPEC.search(line) for line in stats())


def test_a_bad_interval_is_refused(tmp_path, capsys, monkeypatch):
    from specdec.cli import main

    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0")
    assert main(["serve", "--model", str(tmp_path / "none"), "--port", "0"]) == 2
    assert "VLLM_LOG_STATS_INTERVAL must be a number of seconds > 0" in capsys.readouterr().err


def test_a_request_is_counted_once_however_it_ends(tiny_pair):
    """An aborted stream's last events could reach the logger after the server had counted its
    abort (ServerMetrics.finished): its prompt was counted again (the tester saw exactly twice the
    prompt tokens). The counts now live on each request's stats, so a late event adds only what
    is new."""
    import dataclasses

    from specdec import SamplingParams
    from specdec.server.metrics import ServerMetrics, StatLogger

    target, draft = tiny_pair
    llm = LLM(model=str(target), speculative_model=str(draft), num_speculative_tokens=3)
    engine = llm.engine
    metrics = ServerMetrics(engine, "m")
    metrics.stat_logger = logger = StatLogger(engine)
    prompt = llm.tokenizer.encode("def add(a, b):\n    return a + b\n")
    req = engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    events = []
    for _ in range(4):
        step = engine.step()
        events += step
        metrics.step(engine, step)
    metrics.finished("abort", req.stats, len(prompt), req.stats.output_tokens, 0.0, None, None, 0.0)  # the abort's record ...
    engine.abort(req.request_id)
    late = dataclasses.replace(events[-1], token_ids=[], text="")
    metrics.step(engine, [late])                      # ... and a step already under way still reports it
    w = logger._window
    assert w.prompt_tokens == len(prompt)
    assert w.generation_tokens == sum(len(e.token_ids) for e in events)
    assert (w.draft_tokens, w.accepted_tokens) == (req.stats.draft_tokens, req.stats.accepted_tokens)


def test_prompt_tokens_are_counted_per_choice_as_vllm_counts_them(tiny_pair):
    """n choices are n requests to vLLM's engine, each counting its whole prompt (cached or not)
    when its prefill is done: /metrics and the log lines count that way, and agree."""
    target, _ = tiny_pair
    llm = LLM(model=str(target))
    app = build_app(llm, ServerConfig(served_model_names=("m",), log_stats_interval=3600))
    stat = app.state.service.metrics.stat_logger
    prompt = "def add(a, b):\n    return a + b\n\n" * 3
    n_prompt = len(llm.tokenizer.encode(prompt))

    async def run():
        async with app.router.lifespan_context(app):
            for _ in range(2):                     # the second finds its prompt in the prefix cache
                body = {"model": "m", "prompt": prompt, "n": 3, "max_tokens": 4, "temperature": 0.5, "seed": 1}
                status, _ = await asgi_request(app, "POST", "/v1/completions", json.dumps(body).encode(), {})
                assert status == 200
            window = stat._window.prompt_tokens
            _, metrics = await asgi_request(app, "GET", "/metrics", b"", {})
        return window, metrics.decode()

    window, metrics = asyncio.run(run())
    counted = float(re.search(r"^specdec:prompt_tokens_total\{[^}]*\} ([\d.e+]+)$", metrics, re.M).group(1))
    assert counted == window == 2 * 3 * n_prompt
