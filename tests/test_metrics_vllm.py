"""vLLM's per-request metric families, and --metrics-prefix vllm: every series a vLLM Grafana
dashboard reads (vLLM's examples/online_serving/prometheus_grafana) is served under its vLLM
name, with the model_name label its `label_values({__name__=~"vllm:.*"}, model_name)` query finds."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec.llm import LLM
from specdec.server import ServerConfig, build_app
from specdec.server.cli import parse_args, server_config
from tests.test_server import LiveServer

# the series vLLM's bundled Grafana dashboard queries (each panel's expression)
DASHBOARD = ["e2e_request_latency_seconds_bucket", "e2e_request_latency_seconds_sum", "e2e_request_latency_seconds_count",
             "prompt_tokens_total", "generation_tokens_total", "time_per_output_token_seconds_bucket",
             "time_per_output_token_seconds_sum", "time_per_output_token_seconds_count", "num_requests_running",
             "num_requests_waiting", "time_to_first_token_seconds_bucket", "time_to_first_token_seconds_sum",
             "time_to_first_token_seconds_count", "gpu_cache_usage_perc", "request_prompt_tokens_bucket",
             "request_generation_tokens_bucket", "request_success_total", "request_queue_time_seconds_sum",
             "request_prefill_time_seconds_sum", "request_decode_time_seconds_sum",
             "request_max_num_generation_tokens_sum"]


def samples(url: str) -> dict[str, list]:
    """name -> [(labels, value)] of every sample at /metrics."""
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(found: dict, name: str, **labels) -> float:
    return sum(v for ls, v in found.get(name, []) if all(ls.get(k) == w for k, w in labels.items()))


@pytest.fixture(scope="module")
def live(tiny_pair):
    target, draft = tiny_pair
    llm = LLM(target, speculative_model=str(draft), num_speculative_tokens=2, max_model_len=128)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",), metrics_prefix="vllm"))) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        done = client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=7, n=2, temperature=0.8,
                                         seed=1, extra_body={"ignore_eos": True})
        server.done, server.prompt_tokens = done, done.usage.prompt_tokens // 2
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       temperature=0, extra_body={"ignore_eos": True})
        # a client that leaves mid-stream: an abort
        with httpx.stream("POST", server.url + "/v1/completions", json={
                "model": "tiny", "prompt": "x", "max_tokens": 100, "stream": True, "ignore_eos": True}) as r:
            next(r.iter_lines())
        deadline = time.monotonic() + 30          # the server notices the client left at its next write
        while value(found := samples(server.url), "vllm:request_success_total", finished_reason="abort") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        server.found = found
        yield server


def test_every_dashboard_series_is_there_under_vllms_name(live):
    found = live.found
    for name in DASHBOARD:
        assert "vllm:" + name in found, name
        assert all(labels.get("model_name") == "tiny" for labels, _ in found["vllm:" + name]), name
    assert not [n for n in found if n.startswith("specdec:")]
    # the spec-decode counters too, under vLLM's names
    assert value(found, "vllm:spec_decode_num_draft_tokens_total") > 0


def test_per_request_families_count_what_the_requests_did(live):
    found = live.found
    assert value(found, "vllm:request_success_total", finished_reason="length") == 3     # n=2, then the chat
    assert value(found, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(found, "vllm:request_success_total", finished_reason="stop") == 0
    # per completion: prompt and generated tokens; the two choices of the first request each saw 7
    assert value(found, "vllm:request_generation_tokens_count") == 4
    assert value(found, "vllm:request_prompt_tokens_count") == 4
    buckets = {ls["le"]: v for ls, v in found["vllm:request_generation_tokens_bucket"]}
    assert buckets["2.0"] <= buckets["5.0"] - 1 and buckets["10.0"] >= 3      # the chat's 3, the choices' 7
    # per prompt: n, the longest completion; per completion: max_tokens (the n=2 request's twice)
    assert value(found, "vllm:request_params_n_count") == 3 and value(found, "vllm:request_params_n_sum") == 4
    assert value(found, "vllm:request_params_max_tokens_sum") == 7 * 2 + 3 + 100
    assert value(found, "vllm:request_max_num_generation_tokens_count") == 3
    assert value(found, "vllm:request_max_num_generation_tokens_sum") >= 7 + 3
    # the older names carry the same figures as the newer
    assert value(found, "vllm:time_per_output_token_seconds_count") == value(
        found, "vllm:inter_token_latency_seconds_count") > 0
    assert value(found, "vllm:gpu_cache_usage_perc") == value(found, "vllm:kv_cache_usage_perc")
    # one finished-request record per completion, the abort's too (vLLM's FinishedRequestStats): every
    # per-completion family counts it, and its generated tokens are all the engine made for it
    success = value(found, "vllm:request_success_total")
    for family in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                   "request_decode_time_seconds", "request_inference_time_seconds",
                   "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert value(found, f"vllm:{family}_count") == success == 4, family
    assert value(found, "vllm:request_generation_tokens_sum") == value(found, "vllm:generation_tokens_total")


def test_metrics_prefix_flag(tiny_pair):
    assert server_config(parse_args(["--metrics-prefix", "vllm"], "x")[0]).metrics_prefix == "vllm"
    assert server_config(parse_args([], "x")[0]).metrics_prefix == "specdec"
    with pytest.raises(ValueError, match="metrics_prefix"):
        ServerConfig(metrics_prefix="prom")
    llm = LLM(tiny_pair[0], max_model_len=64)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))) as server:
        found = samples(server.url)
    assert "specdec:request_success_total" in found and not [n for n in found if n.startswith("vllm:")]
