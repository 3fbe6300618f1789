"""The server on the batch engine: streams share steps and queue for seats, logprobs over HTTP
equal the model's own (both shapes, streaming or not, under speculation), the engine metrics."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest

from specdec.llm import LLM
from specdec.server import ServerConfig, build_app
from test_logprobs import TOL, reference
from test_server import PROMPTS, LiveServer, metric, streamed_text

SEATS = 4


@pytest.fixture(scope="module")
def server(tiny_pair, near_draft):
    target, _ = tiny_pair
    llm = LLM(target, speculative_model=str(near_draft), num_speculative_tokens=3, max_model_len=128,
              max_num_seqs=SEATS, dtype="float32")
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))) as live:
        live.llm = llm
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _ids(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens)
    return [int(t.split(":", 1)[1]) for t in tokens]


def _check(llm, prompt_ids, ids, logprobs, top, params, n_top):
    chosen, ref_top = reference(llm, prompt_ids, ids, params, llm.engine.logprobs_mode, n_top)
    assert len(logprobs) == len(ids) > 0
    assert max(abs(a - b) for a, b in zip(logprobs, chosen)) < TOL
    for j, alts in enumerate(top):
        assert sorted(alts, reverse=True)[:n_top] == pytest.approx(ref_top.values[j].tolist(), abs=TOL)


def test_completion_logprobs_equal_the_models_own(server, client):
    from specdec.config import SamplingParams

    llm, prompt_ids = server.llm, server.llm.tokenizer.encode(PROMPTS[0])
    for kw in (dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=5, n=2)):
        r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, logprobs=3,
                                      extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, **kw)
        params = SamplingParams(max_tokens=16, **{k: v for k, v in kw.items() if k != "n"})
        streamed = {}
        for chunk in client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, logprobs=3, stream=True,
                                               extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, **kw):
            for c in chunk.choices:
                if c.logprobs is not None:
                    streamed.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
        for c in r.choices:
            lp = c.logprobs
            _check(llm, prompt_ids, _ids(lp.tokens), lp.token_logprobs, [list(t.values()) for t in lp.top_logprobs],
                   params, 3)
            assert streamed[c.index] == lp.token_logprobs
    assert r.choices[0].text != r.choices[1].text or r.choices[0].logprobs.tokens != r.choices[1].logprobs.tokens


def test_chat_logprobs_equal_the_models_own(server, client):
    from specdec.config import SamplingParams

    llm = server.llm
    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    prompt_ids = llm.chat_prompt(messages)["prompt_token_ids"]
    content = r.choices[0].logprobs.content
    ids = _ids([t.token for t in content])
    _check(llm, prompt_ids, ids, [t.logprob for t in content], [[a.logprob for a in t.top_logprobs] for t in content],
           SamplingParams(temperature=0), 2)
    assert r.usage.completion_tokens == len(ids) == 12


def test_streams_share_steps_and_wait_for_seats(server, client, monkeypatch):
    engine = server.llm.engine
    real_step = engine.step
    seen = {"running": 0, "waiting": 0}

    def paced():
        seen["running"] = max(seen["running"], engine.num_running)
        seen["waiting"] = max(seen["waiting"], engine.num_waiting)
        time.sleep(0.005)
        return real_step()

    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(3 * SEATS)]
    kw = dict(max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    solo = [client.completions.create(model="tiny", prompt=p, **kw).choices[0].text for p in prompts]
    with httpx.Client(base_url=server.url) as h:
        steps_before = metric(h, "specdec:iteration_tokens_total_count")
        single_before = metric(h, 'specdec:iteration_tokens_total_bucket{le="1.0"}')
    monkeypatch.setattr(engine, "step", paced)

    async def streams():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
        try:
            return await asyncio.gather(*(streamed_text(aclient, p, **kw) for p in prompts))
        finally:
            await aclient.close()

    assert asyncio.run(streams()) == solo
    assert seen["running"] == SEATS and seen["waiting"] > 0       # max_num_seqs held, the rest queued
    with httpx.Client(base_url=server.url) as h:
        steps = metric(h, "specdec:iteration_tokens_total_count") - steps_before
        single = metric(h, 'specdec:iteration_tokens_total_bucket{le="1.0"}') - single_before
        assert steps > 0 and single < steps                         # steps fed several requests' tokens
        assert metric(h, "specdec:num_requests_running") == 0 and metric(h, "specdec:kv_cache_usage_perc") == 0
        text = h.get("/metrics").text
        for name in ("specdec:num_preemptions_total", "specdec:request_queue_time_seconds_count",
                     "specdec:request_time_per_output_token_seconds_count", "specdec:request_decode_time_seconds_count"):
            assert name in text, name


def test_preemption_under_a_small_pool_keeps_outputs(tiny_pair):
    """A KV pool that holds two sequences: the engine preempts and recomputes, clients see
    nothing but complete, unchanged answers, and /metrics counts the preemptions."""
    target, _ = tiny_pair
    small = LLM(target, num_speculative_tokens=0, max_model_len=128, max_num_seqs=8, dtype="float32",
                kv_cache_memory=LLM(target, num_speculative_tokens=0, max_model_len=128).target.kv_bytes_per_slot() * 256)
    kw = dict(max_tokens=90, temperature=0, extra_body={"ignore_eos": True})
    with LiveServer(build_app(small, ServerConfig(served_model_names=("t",)))) as live:
        c = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=60)
        solo = [c.completions.create(model="t", prompt=p, **kw).choices[0].text for p in PROMPTS[:6]]
        # whether the six overlap enough to overflow the pool depends on how fast the client's
        # threads start against the engine's steps (a loaded machine staggers them): rounds until
        # one preempts, each checked
        with httpx.Client(base_url=live.url) as h:
            for _ in range(5):
                out = [None] * 6

                def run(i):
                    out[i] = c.completions.create(model="t", prompt=PROMPTS[i], **kw).choices[0].text
                threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(60)
                assert out == solo
                if metric(h, "specdec:num_preemptions_total") > 0:
                    break
            assert metric(h, "specdec:num_preemptions_total") > 0
