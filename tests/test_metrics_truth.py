"""The figures agree with each other (an observability tester's findings): a client that leaves
counts all the engine computed, in /metrics as in the log lines; a prompt's cached tokens are
counted once whatever n is; offline prompt counts per choice, as the server's."""

from __future__ import annotations

import re
import time

import httpx

from specdec import LLM, SamplingParams
from specdec.server import ServerConfig, build_app
from tests.test_server import LiveServer, metric

TARGET, DRAFT = "models/target", "models/draft"


def test_a_client_that_leaves_counts_what_the_engine_did():
    llm = LLM(TARGET, speculative_model=DRAFT, num_speculative_tokens=3, max_model_len=512)
    app = build_app(llm, ServerConfig(served_model_names=("m",), log_stats=True))
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        for i in range(3):
            with http.stream("POST", "/v1/completions", json={"model": "m", "prompt": f"def f{i}(x):", "max_tokens": 300,
                                                              "stream": True, "ignore_eos": True}) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n == 4:
                        break
        deadline = time.monotonic() + 30
        while llm.engine.num_running or llm.engine.num_waiting:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        lines = app.state.service.metrics.stat_logger.log(force=True)
        accepted = metric(http, "specdec:spec_decode_num_accepted_tokens_total")
        drafted = metric(http, "specdec:spec_decode_num_draft_tokens_total")
        generated = metric(http, "specdec:generation_tokens_total")
    spec = next(line for line in lines if line.startswith("SpecDecoding"))
    got = re.search(r"Accepted: (\d+) tokens, Drafted: (\d+) tokens", spec)
    assert (accepted, drafted) == (float(got.group(1)), float(got.group(2))) and drafted > 0
    # each stream was read for a few chunks only; the engine went on until it saw the client gone
    assert generated > 3 * 4


def test_cached_tokens_count_each_prompt_once_whatever_n():
    llm = LLM(TARGET, max_model_len=256)
    prompt = "import os\nimport sys\n" * 4
    params = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=4)
    outs = [llm.generate([prompt], params)[0] for _ in range(2)]
    assert 0 < outs[1].num_cached_tokens <= len(outs[1].prompt_token_ids)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("m",)))) as live:
        body = {"model": "m", "prompt": prompt, "n": 2, "max_tokens": 4, "temperature": 0.8}
        r = [httpx.post(live.url + "/v1/completions", json=body).json() for _ in range(2)][1]
    cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached <= r["usage"]["prompt_tokens"] and r["speculative"]["cached_tokens"] == cached


def test_offline_prompt_tokens_count_each_choice():
    """As the server's counter and vLLM's engine: a prompt counts once per choice it runs."""
    llm = LLM(TARGET)
    out = llm.generate(["def f(x):"], SamplingParams(n=3, temperature=0.8, max_tokens=3))[0]
    metrics = {m.name: m for m in llm.get_metrics()}
    assert metrics["vllm:prompt_tokens"].value == 3 * len(out.prompt_token_ids) == metrics["vllm:request_prompt_tokens"].sum


def test_draft_tokens_per_position_and_the_speculating_fraction():
    """The README's two speculative series no other test read: drafted tokens per position sum to
    the drafted total (position 0 = one per draft), and the fraction of the last step's decoding
    requests that drafted is 1 while a fixed-K request runs, 0 on a server that never drafts."""
    llm = LLM(TARGET, speculative_model=DRAFT, num_speculative_tokens=3, max_model_len=512)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("m",)))) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http:
        body = {"model": "m", "prompt": "def fib(n):", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        spec = http.post("/v1/completions", json=body).json()["speculative"]
        per_pos = [metric(http, f'specdec:spec_decode_num_draft_tokens_per_pos_total{{position="{i}"}}')
                   for i in range(3)]
        assert sum(per_pos) == metric(http, "specdec:spec_decode_num_draft_tokens_total") == spec["draft_tokens"]
        assert per_pos[0] == spec["num_drafts"] > 0 and per_pos[0] >= per_pos[1] >= per_pos[2] > 0
        accepted = [metric(http, f'specdec:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}')
                    for i in range(3)]
        assert all(a <= d for a, d in zip(accepted, per_pos)) and sum(accepted) == spec["accepted_tokens"]
        with http.stream("POST", "/v1/completions", json={**body, "max_tokens": 400, "stream": True}) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n == 6:
                    assert metric(http, "specdec:spec_decode_speculating_fraction") == 1.0
                    break
    plain = LLM(TARGET, num_speculative_tokens=0, max_model_len=512)
    with LiveServer(build_app(plain, ServerConfig(served_model_names=("m",)))) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http:
        http.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 8})
        assert metric(http, "specdec:spec_decode_speculating_fraction") == 0.0
