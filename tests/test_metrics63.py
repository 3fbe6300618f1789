"""An observability review's findings: vLLM families a `--metrics-prefix vllm` server lacked
(request_success_total{finished_reason} for every vLLM FinishReason, cache_config_info,
prompt_tokens_cached, request_prefill_kv_computed_tokens), counted from the engine's real prefix-cache
hits; and the span of a request aborted while still queued, whose time_in_queue is its whole wait
as /metrics' request_queue_time observes it."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec import LLM
from specdec.engine import kv_cache_dtype_name
from specdec.metrics import one_two_five
from specdec.server import ServerConfig, build_app
from tests.test_server import LiveServer

pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from specdec.tracing import RequestTracer  # noqa: E402

MAX_LEN = 128
SAMPLES = dict[tuple[str, frozenset], float]


@pytest.fixture(scope="module")
def live(tiny_pair):
    """A vllm-named server with one seat (a second request waits), prefix caching on, and spans kept
    in memory."""
    llm = LLM(tiny_pair[0], max_model_len=MAX_LEN, max_num_seqs=1, enable_prefix_caching=True)
    spans = InMemorySpanExporter()
    llm.engine.tracer = RequestTracer("http://127.0.0.1:9/unused", "tiny", exporter=spans)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",), metrics_prefix="vllm"))) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        yield llm, server, http, spans
    llm.engine.tracer.shutdown()


def families(http) -> dict:
    return {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}


def scrape(http) -> SAMPLES:
    """Every sample by (name, its labels but model_name and engine)."""
    return {(s.name, frozenset((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))): s.value
            for f in families(http).values() for s in f.samples}


def value(samples: SAMPLES, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def wait_for(check, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_fresh_server_has_vllms_finish_reasons_cache_config_and_prefix_families(live):
    llm, _, http, _ = live
    fams = families(http)
    success = fams["vllm:request_success"]
    assert success.type == "counter"
    assert sorted(s.labels["finished_reason"] for s in success.samples if s.name.endswith("_total")) == \
        sorted(("stop", "length", "abort", "error", "repetition"))          # vLLM's FinishReason, each from the start
    [info] = fams["vllm:cache_config_info"].samples
    blocks = llm.engine.blocks
    assert fams["vllm:cache_config_info"].type == "gauge" and info.value == 1.0
    assert {k: info.labels[k] for k in ("block_size", "num_gpu_blocks", "kv_cache_size_tokens", "cache_dtype",
                                        "enable_prefix_caching", "num_gpu_blocks_override", "engine",
                                        "model_name")} == \
        {"block_size": "16", "num_gpu_blocks": str(blocks.num_blocks),
         "kv_cache_size_tokens": str(blocks.num_blocks * 16), "cache_dtype": kv_cache_dtype_name(llm.engine),
         "enable_prefix_caching": "True", "num_gpu_blocks_override": "None", "engine": "0", "model_name": "tiny"}
    assert fams["vllm:prompt_tokens_cached"].type == "counter"
    computed = fams["vllm:request_prefill_kv_computed_tokens"]
    assert computed.type == "histogram"
    assert [float(s.labels["le"]) for s in computed.samples if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"] \
        == list(one_two_five(MAX_LEN))


def test_cached_and_computed_prompt_tokens_are_the_prefix_caches_real_hits(live):
    _, server, http, _ = live
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    prompt = [(7 * i + 3) % 90 + 3 for i in range(40)]        # 2 full blocks of 16 before its last token
    before = scrape(http)
    for _ in range(2):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    after = scrape(http)

    def delta(name):
        return value(after, name) - value(before, name)

    # the second request found the first's two full blocks: the engine's own hit count, and no more
    assert delta("vllm:prefix_cache_hits_total") == delta("vllm:prompt_tokens_cached_total") == 32
    assert delta("vllm:prompt_tokens_total") == 80
    assert delta("vllm:request_prefill_kv_computed_tokens_count") == 2
    assert delta("vllm:request_prefill_kv_computed_tokens_sum") == 40 + (40 - 32)
    assert delta("vllm:request_prompt_tokens_sum") - delta("vllm:request_prefill_kv_computed_tokens_sum") == 32


def test_a_request_aborted_in_the_queue_spent_its_span_queued(live, monkeypatch):
    llm, server, http, spans = live
    real_step = llm.engine.step

    def paced():        # the tiny model decodes in milliseconds: the seat stays taken while B waits
        time.sleep(0.02)
        return real_step()
    monkeypatch.setattr(llm.engine, "step", paced)
    spans.clear()
    before = scrape(http)
    holder = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": MAX_LEN - 20, "ignore_eos": True,
              "stream": True}
    queued = json.dumps({"model": "tiny", "prompt": "class Point:\n    def", "max_tokens": 4, "stream": True}).encode()
    with httpx.Client(base_url=server.url, timeout=30) as c, c.stream("POST", "/v1/completions", json=holder) as r:
        lines = r.iter_lines()          # kept: a generator closed early closes A's connection
        assert next(lines).startswith("data: ")                     # A runs in the only seat
        host, port = urlsplit(server.url).hostname, urlsplit(server.url).port
        b = socket.create_connection((host, port))
        b.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(queued) + queued)
        wait_for(lambda: value(scrape(http), "vllm:num_requests_waiting") == 1, "B never queued")
        b.close()                                                   # B's client leaves before B is scheduled
        wait_for(lambda: value(scrape(http), "vllm:request_success_total", finished_reason="abort")
                 - value(before, "vllm:request_success_total", finished_reason="abort") == 1, "B not aborted")
    wait_for(lambda: value(scrape(http), "vllm:num_requests_running") == 0, "A still running")
    llm.engine.tracer.flush()
    [span_b] = [s for s in spans.get_finished_spans() if s.attributes["gen_ai.usage.completion_tokens"] == 0]
    a = span_b.attributes
    assert a["gen_ai.response.finish_reasons"] == ("abort",)
    # its whole life in the queue, as /metrics observes it (there from the HTTP arrival, so no less)
    assert a["gen_ai.latency.time_in_queue"] == a["gen_ai.latency.e2e"] > 0
    after = scrape(http)
    assert value(after, "vllm:request_queue_time_seconds_sum") - value(before, "vllm:request_queue_time_seconds_sum") \
        >= a["gen_ai.latency.time_in_queue"]


def test_an_engine_failure_is_a_finished_record_with_reason_error(live, monkeypatch):
    """vLLM counts a request its engine failed (FinishReason.ERROR) in request_success_total and
    every per-request histogram, as any finished request."""
    llm, server, http, _ = live
    real_step, calls = llm.engine.step, []

    def failing():
        calls.append(1)
        if len(calls) == 3:          # mid-generation: the step's request ends with an error
            raise RuntimeError("boom")
        return real_step()
    monkeypatch.setattr(llm.engine, "step", failing)
    before = scrape(http)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 10,
                                           "ignore_eos": True})
    assert r.status_code == 500 and "boom" in r.text
    monkeypatch.setattr(llm.engine, "step", real_step)
    after = scrape(http)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("vllm:request_success_total", finished_reason="error") == 1
    assert delta("vllm:requests_total", outcome="error") == 1
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_prefill_kv_computed_tokens",
                 "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"vllm:{name}_count") == 1, name
    # the tokens it made before the failing step, as generation_tokens_total counted them
    assert delta("vllm:request_generation_tokens_sum") == delta("vllm:generation_tokens_total") > 0
