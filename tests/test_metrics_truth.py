"""The figures agree with each other (an observability tester's findings): a client that leaves
counts all the engine computed, in /metrics as in the log lines; a prompt's cached tokens are
counted once whatever n is; offline prompt counts per choice, as the server's."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

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
        deadline = time.monotonic() + 30
        while metric(http, 'specdec:request_success_total{finished_reason="abort",}') < 3:    # recorded once stopped
            assert time.monotonic() < deadline
            time.sleep(0.05)
        accepted = metric(http, "specdec:spec_decode_num_accepted_tokens_total")
        drafted = metric(http, "specdec:spec_decode_num_draft_tokens_total")
        generated = metric(http, "specdec:generation_tokens_total")
        # each left request is one finished-request record, made once the engine stopped it: its
        # generated tokens are all the engine made for it, and every per-request family counts it
        assert metric(http, "specdec:request_generation_tokens_sum") == generated
        for family in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_decode_time_seconds",
                       "request_inference_time_seconds", "request_time_per_output_token_seconds"):
            assert metric(http, f"specdec:{family}_count") == 3, family
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


def test_echo_with_max_tokens_0_counts_no_generated_token(tiny_pair):
    """The one token echo-only makes is dropped from the response: no generated token anywhere."""
    llm = LLM(tiny_pair[0], max_model_len=128)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("m",)))) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http:
        r = http.post("/v1/completions", json={"model": "m", "prompt": "def f(x):", "echo": True, "max_tokens": 0})
        assert r.json()["usage"]["completion_tokens"] == 0
        assert r.json()["speculative"]["output_tokens"] == 0         # the same count in specdec's block
        assert metric(http, "specdec:generation_tokens_total") == 0
        assert metric(http, "specdec:request_generation_tokens_sum") == 0
        assert metric(http, "specdec:request_max_num_generation_tokens_sum") == 0
        assert metric(http, 'specdec:request_success_total{finished_reason="length",}') == 1
        assert metric(http, "specdec:e2e_request_latency_seconds_count") == 1
        assert metric(http, "specdec:prompt_tokens_total") == r.json()["usage"]["prompt_tokens"]
        with http.stream("POST", "/v1/completions", json={"model": "m", "prompt": "def f(x):", "echo": True,
                                                           "max_tokens": 0, "stream": True,
                                                           "stream_options": {"include_usage": True}}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        counts = [c["speculative"]["output_tokens"] for c in chunks if "speculative" in c]
        assert counts and set(counts) == {0}, chunks


def _counts(llm) -> dict:
    return {m.name + m.labels.get("finished_reason", ""): getattr(m, "value", getattr(m, "count", None))
            for m in llm.get_metrics()}


def test_offline_metrics_count_every_request_the_engine_runs(tiny_pair):
    """get_metrics counts what LLM.stream, llm_engine.add_request + step (aborted too) and AsyncLLM
    ran, as LLM.generate's: each request once, as it leaves the engine."""
    import asyncio

    from specdec.async_llm import AsyncLLM

    target, draft = tiny_pair
    llm = LLM(target, speculative_model=str(draft), num_speculative_tokens=2, max_model_len=128)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    # a stream read to its end, then one left after a few steps
    done = list(llm.stream("def f(x):", params))
    seen = 0
    for i, event in enumerate(llm.stream("def g(x):", params)):
        seen += len(event.token_ids)
        if i == 2:
            break
    m = _counts(llm)
    assert m["vllm:request_successlength"] == 1 and m["vllm:request_successabort"] == 1
    assert m["vllm:generation_tokens"] == 30 + seen and m["vllm:spec_decode_num_drafts"] > 0
    assert m["vllm:e2e_request_latency_seconds"] == 2 and llm.engine.num_running == 0
    assert done[-1].finished
    # vLLM's LLMEngine loop: add_request, a few steps, abort_request
    engine = llm.llm_engine
    engine.add_request("r", "def h(x):", params)
    for _ in range(3):
        engine.step()
    engine.abort_request("r")
    after = _counts(llm)
    assert after["vllm:request_successabort"] == 2 and after["vllm:generation_tokens"] > m["vllm:generation_tokens"]
    assert after["vllm:spec_decode_num_draft_tokens"] > m["vllm:spec_decode_num_draft_tokens"]
    # LLM.generate: counted once (not again by its own outputs)
    out = llm.generate(["def k(x):"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    gen = _counts(llm)
    assert gen["vllm:generation_tokens"] == after["vllm:generation_tokens"] + 5 == \
        after["vllm:generation_tokens"] + len(out.outputs[0].token_ids)
    assert gen["vllm:prompt_tokens"] == after["vllm:prompt_tokens"] + len(out.prompt_token_ids)

    # an AsyncLLM's requests (its engine's thread steps the engine)
    async def run():
        engine = AsyncLLM(llm)
        try:
            async for last in engine.generate("def a(x):", SamplingParams(max_tokens=7, temperature=0,
                                                                         ignore_eos=True), "a1"):
                pass
            return last
        finally:
            engine.shutdown()

    last = asyncio.run(run())
    final = _counts(llm)
    assert final["vllm:generation_tokens"] == gen["vllm:generation_tokens"] + len(last.outputs[0].token_ids) == \
        gen["vllm:generation_tokens"] + 7
    assert final["vllm:request_successlength"] == gen["vllm:request_successlength"] + 1


def test_async_do_log_stats_shows_each_finish_reason(tiny_pair, caplog):
    import asyncio
    import logging

    from specdec.async_llm import AsyncLLM

    llm = LLM(tiny_pair[0], max_model_len=64)
    llm.generate(["a", "b", "c"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))

    async def run():
        engine = AsyncLLM(llm)
        try:
            await engine.do_log_stats()
        finally:
            engine.shutdown()

    with caplog.at_level(logging.INFO, logger="specdec.async_llm"):
        asyncio.run(run())
    line = next(r.getMessage() for r in caplog.records if "engine stats" in r.getMessage())
    assert "vllm:request_success{finished_reason=length}=3" in line
    assert "vllm:request_success{finished_reason=abort}=0" in line


def test_tree_drafts_count_per_position_by_depth():
    """A token tree's per-position series are indexed by depth, as its accepted ones: a 6-node tree
    of depth 3 drafts positions 0..2 (not 0..5), so accepted / drafted at each position is the
    fraction of the drafts offering it whose path reached it."""
    from specdec.metrics import RequestStats, tree_depth

    assert tree_depth([-1, -1, 0, 0, 2, -1]) == 3 and tree_depth([-1, 0, 1]) == 3 and tree_depth([]) == 0
    s = RequestStats()
    s.record_step(6, 2, 3, depth=3)      # path reached depth 2
    s.record_step(6, 0, 1, depth=3)
    s.record_step(3, 3, 4)               # a chain: its depth is its length
    assert s.drafted_per_position == [3, 3, 3] and s.accepted_per_position == [2, 2, 1]
    assert s.draft_tokens == 15 and s.num_drafts == 3
    assert s.per_position_acceptance == [2 / 3, 2 / 3, 1 / 3]


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_a_tree_engine_counts_positions_by_depth(method):
    """Through the engine: a token tree's drafted-per-position run only as deep as its trees, and
    no position is accepted more often than drafted (it counted nodes: positions past the depth
    were drafted ~180 times and never accepted)."""
    from specdec.defaults import BUNDLED_TARGET, MODELS_DIR

    cfg = {"method": method, "model": str(MODELS_DIR / method), "num_speculative_tokens": 6}
    if method == "eagle":
        cfg.update(topk=3, depth=3)
    llm = LLM(str(BUNDLED_TARGET), speculative_config=cfg, max_model_len=256)
    out = llm.generate(["def add(a, b):", "class Point:"], SamplingParams(temperature=0, max_tokens=40))
    for o in out:
        s = o.stats
        assert s.num_drafts > 0 and len(s.drafted_per_position) <= (3 if method == "eagle" else 6)
        assert s.draft_tokens > sum(s.drafted_per_position)                      # nodes, not positions
        assert all(a <= d for a, d in zip(s.accepted_per_position, s.drafted_per_position))
        assert sum(s.accepted_per_position) == s.accepted_tokens
