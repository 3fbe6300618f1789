"""Observability as vLLM v1 writes it (an observability tester's findings): the stats line's words
and its interval's preemptions (LoggingStatLogger), per-position counters at 0 from the start
(SpecDecodingProm), RequestOutput.metrics with RequestStateStats' fields, LLM.get_metrics() with
the families /metrics has, and iteration_tokens_total counting prompts and generated tokens, not
the drafts fed to the target."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from specdec import LLM, SamplingParams
from specdec.metrics import Histogram, Vector
from specdec.server import ServerConfig, build_app
from specdec.server.metrics import ServerMetrics, StatLogger
from tests.test_server import LiveServer, metric

PROMPTS = ["def add(a, b):", "class Point:\n"]


def test_the_stats_line_reads_as_vllms_with_the_intervals_preemptions(tiny_pair):
    llm = LLM(tiny_pair[0], max_model_len=128)
    engine = llm.engine
    metrics = ServerMetrics(engine, "m")
    metrics.stat_logger = logger = StatLogger(engine)
    for p in PROMPTS:
        engine.add_request(llm.tokenizer.encode(p), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))

    def steps(n):
        for _ in range(n):
            metrics.step(engine, engine.step())

    steps(3)
    assert engine.preempt_all() == 2
    steps(3)
    line = logger.log()[0]
    assert f"Waiting: {engine.num_waiting} reqs, Preemptions: 2, GPU KV cache usage: " \
           f"{100 * engine.kv_cache_usage:.1f}%, Prefix cache hit rate: " in line, line
    steps(2)
    line = logger.log()[0]                  # none this interval: no Preemptions field, as vLLM's
    assert "Preemptions" not in line and re.search(r"Waiting: \d+ reqs, GPU KV cache usage: [\d.]+%", line), line


def test_per_position_counters_are_there_at_zero_from_the_start(tiny_pair):
    target, draft = tiny_pair
    for k, positions in ((3, 3), ("auto", None)):
        llm = LLM(target, speculative_model=str(draft), num_speculative_tokens=k, max_model_len=128)
        positions = positions or llm.engine.max_k       # "auto": the largest K it may choose
        with LiveServer(build_app(llm, ServerConfig(served_model_names=("m",), metrics_prefix="vllm"))) as live:
            text = httpx.get(live.url + "/metrics").text          # before any request
        for family in ("accepted_tokens_per_pos", "draft_tokens_per_pos"):
            found = re.findall(rf'^vllm:spec_decode_num_{family}_total\{{[^}}]*position="(\d+)"[^}}]*\}} 0\.0$',
                               text, re.MULTILINE)
            assert sorted(map(int, found)) == list(range(positions)), (k, family, found)
        vectors = {m.name: m for m in llm.get_metrics() if isinstance(m, Vector)}
        assert vectors["vllm:spec_decode_num_accepted_tokens_per_pos"].values == [0] * positions
        assert vectors["vllm:spec_decode_num_draft_tokens_per_pos"].values == [0] * positions
    assert not any(isinstance(m, Vector) for m in LLM(target, max_model_len=128).get_metrics())


def test_request_output_metrics_carry_vllms_request_state_stats(tiny_pair):
    target, draft = tiny_pair
    llm = LLM(target, speculative_model=str(draft), num_speculative_tokens=3, max_model_len=128)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    before = time.time()
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    m = out.metrics
    assert before <= m.arrival_time <= time.time()
    assert 0 < m.queued_ts <= m.scheduled_ts < m.first_token_ts < m.last_token_ts
    assert m.first_token_latency == m.time_to_first_token_s == pytest.approx(m.first_token_ts - m.queued_ts)
    assert m.queue_time_s == pytest.approx(m.scheduled_ts - m.queued_ts)
    assert m.wall_time_s == pytest.approx(m.last_token_ts - m.queued_ts)
    assert m.num_generation_tokens == len(out.outputs[0].token_ids) == 8 and m.is_corrupted is False
    assert m.draft_tokens > 0 and m.accepted_tokens <= m.draft_tokens        # specdec's own fields stay
    # n choices: the request's span (earliest start, latest last token) and all their tokens
    two = llm.generate(PROMPTS[0], SamplingParams(n=2, max_tokens=8, temperature=0.8, seed=1, ignore_eos=True),
                       use_tqdm=False)[0].metrics
    assert two.num_generation_tokens == 16 and 0 < two.queued_ts <= two.first_token_ts < two.last_token_ts
    # the engine view's outputs (AsyncLLM's RequestStream) carry them too
    llm.llm_engine.add_request("r", PROMPTS[1], params)
    while llm.llm_engine.has_unfinished_requests():
        outs = llm.llm_engine.step()
    last = outs[-1].metrics
    assert last.num_generation_tokens == 8 and last.scheduled_ts < last.first_token_ts < last.last_token_ts


def test_get_metrics_has_the_families_metrics_exports(tiny_pair):
    target, draft = tiny_pair
    llm = LLM(target, speculative_model=str(draft), num_speculative_tokens=3, max_model_len=128)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    outs += llm.generate(PROMPTS[:1], SamplingParams(n=2, max_tokens=5, temperature=0.8, seed=3, ignore_eos=True),
                         use_tqdm=False)
    got = {m.name: m for m in llm.get_metrics()}
    hist = {name: m for name, m in got.items() if isinstance(m, Histogram)}

    def seen(name):
        return hist[name].count, hist[name].sum

    assert seen("vllm:request_params_n") == (3, 4)                  # per prompt
    assert seen("vllm:request_max_num_generation_tokens") == (3, 6 + 6 + 5)
    assert seen("vllm:request_params_max_tokens") == (4, 6 + 6 + 5 + 5)     # per completion
    # inter-token latency: one per step after a completion's first, spanning its first to last token
    singles = [o.metrics for o in outs[:2]]
    assert seen("vllm:inter_token_latency_seconds")[0] == \
        sum(m.target_forward_passes - 1 for m in singles) + outs[2].metrics.target_forward_passes - 2
    itl, older = hist["vllm:inter_token_latency_seconds"], hist["vllm:time_per_output_token_seconds"]
    assert (older.count, older.sum, older.buckets) == (itl.count, itl.sum, itl.buckets)
    # per step, vLLM's count: each completion's prompt once, and the tokens generated (no drafts)
    prompts = sum(len(o.prompt_token_ids) * len(o.outputs) for o in outs)
    generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert seen("vllm:iteration_tokens_total")[1] == prompts + generated == got["vllm:prompt_tokens"].value + \
        got["vllm:generation_tokens"].value
    assert hist["vllm:iteration_tokens_total"].buckets["+Inf"] == hist["vllm:iteration_tokens_total"].count > 0
    drafted = got["vllm:spec_decode_num_draft_tokens_per_pos"]
    assert isinstance(drafted, Vector) and sum(drafted.values) == got["vllm:spec_decode_num_draft_tokens"].value > 0


def test_iteration_tokens_total_counts_prompts_and_generated_tokens(tiny_pair):
    target, draft = tiny_pair
    llm = LLM(target, speculative_model=str(draft), num_speculative_tokens=3, max_model_len=128)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("m",)))) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        r = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        spec = r.model_extra["speculative"]
        assert metric(http, "specdec:iteration_tokens_total_sum") == \
            r.usage.prompt_tokens + r.usage.completion_tokens == 12 + r.usage.prompt_tokens
        # what the steps fed the target under specdec's own name: the prompt (its forward makes the
        # first token), then each decoding step's token and its drafts
        fed = metric(http, "specdec:iteration_fed_tokens_sum")
        assert fed == r.usage.prompt_tokens + spec["target_forward_passes"] + spec["draft_tokens"] - 1
        assert metric(http, "specdec:iteration_fed_tokens_count") == metric(http, "specdec:iteration_tokens_total_count")
