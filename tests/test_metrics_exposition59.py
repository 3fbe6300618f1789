"""The /metrics exposition as vLLM's PrometheusStatLogger writes it (vllm/v1/metrics/loggers.py and
buckets.py): its histograms' bucket bounds, the engine="0" label beside model_name, prometheus_client's
`*_created` series, and the spec_decode families only where speculation can happen; offline
LLM.get_metrics() with the same bounds and labels."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specdec import LLM, SamplingParams
from specdec.metrics import one_two_five
from specdec.server import ServerConfig, build_app
from specdec.server.metrics import ServerMetrics
from tests.test_server import LiveServer

# vLLM's defaults (vllm/v1/metrics/buckets.py)
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
        160.0, 640.0, 2560.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
           960.0, 1920.0, 7680.0]
STEP_TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
MAX_LEN = 128
BOUNDS = {"time_to_first_token_seconds": TTFT, "inter_token_latency_seconds": ITL,
          "time_per_output_token_seconds": ITL, "request_time_per_output_token_seconds": ITL,
          **{name: REQUEST for name in ("e2e_request_latency_seconds", "request_queue_time_seconds",
                                        "request_prefill_time_seconds", "request_decode_time_seconds",
                                        "request_inference_time_seconds")},
          "iteration_tokens_total": STEP_TOKENS, "request_params_n": [1, 2, 5, 10, 20],
          **{name: [1, 2, 5, 10, 20, 50, 100] for name in ("request_prompt_tokens", "request_generation_tokens",
                                                          "request_params_max_tokens",
                                                          "request_max_num_generation_tokens")}}


def bounds(families, name: str) -> list[float]:
    fam = families[name]
    return [float(s.labels["le"]) for s in fam.samples if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]


@pytest.fixture(scope="module")
def exposition(tiny_pair):
    """A speculative server's /metrics text after one request, and a plain server's."""
    target, draft = tiny_pair
    texts = []
    for kw in (dict(speculative_model=str(draft), num_speculative_tokens=3), {}):
        llm = LLM(target, max_model_len=MAX_LEN, **kw)
        with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",), metrics_prefix="vllm"))) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
            texts.append(httpx.get(server.url + "/metrics").text)
    return texts


def test_histogram_bounds_are_vllms(exposition):
    families = {f.name: f for f in text_string_to_metric_families(exposition[0])}
    assert one_two_five(MAX_LEN) == (1, 2, 5, 10, 20, 50, 100)          # vLLM's build_1_2_5_buckets(128)
    for name, want in BOUNDS.items():
        assert bounds(families, "vllm:" + name) == want, name


def test_every_series_carries_model_name_and_engine(exposition):
    families = list(text_string_to_metric_families(exposition[0]))
    samples = [s for f in families for s in f.samples]
    assert samples and all(s.labels.get("model_name") == "tiny" and s.labels.get("engine") == "0" for s in samples), \
        [s for s in samples if s.labels.get("engine") != "0"][:3]
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 1.0' in exposition[0]


def test_counters_and_histograms_have_created_series(exposition):
    text = exposition[0]
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("prompt_tokens", "generation_tokens", "request_success", "prefix_cache_queries", "num_preemptions",
                 "spec_decode_num_drafts", "e2e_request_latency_seconds", "time_to_first_token_seconds"):
        created = families["vllm:" + name + "_created"]
        assert created.type == "gauge" and created.samples and all(s.value > 1e9 for s in created.samples), name
        assert all(s.labels["engine"] == "0" for s in created.samples)
    assert {s.labels["finished_reason"] for s in families["vllm:request_success_created"].samples} >= \
        {"stop", "length", "abort"}
    assert "vllm:num_requests_running_created" not in families        # a gauge has none


def test_spec_decode_families_only_with_speculation(exposition, tiny_pair):
    spec, plain = ({f.name for f in text_string_to_metric_families(t)} for t in exposition)
    names = {"vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
             "vllm:spec_decode_num_accepted_tokens_per_pos"}
    assert names <= spec
    assert not any("spec_decode" in name for name in plain), sorted(n for n in plain if "spec_decode" in n)
    # "auto" K may choose not to draft, at any step: speculation can happen, so the families are there
    auto = LLM(tiny_pair[0], speculative_model=str(tiny_pair[1]), num_speculative_tokens="auto", max_model_len=MAX_LEN)
    text = generate_latest(ServerMetrics(auto.engine, "tiny", "vllm:").registry).decode()
    assert "vllm:spec_decode_num_drafts_total{" in text


def test_offline_get_metrics_has_the_servers_bounds_and_labels(tiny_pair):
    llm = LLM(tiny_pair[0], speculative_model=str(tiny_pair[1]), num_speculative_tokens=3, max_model_len=MAX_LEN)
    llm.generate(["def add(a, b):"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    metrics = llm.get_metrics()
    assert all({"model_name", "engine"} <= set(m.labels) and m.labels["engine"] == "0" for m in metrics)
    # labels of their own: the finish reason, the waiting reason, the cache's configuration
    assert {m.name.split(":")[-1] for m in metrics if set(m.labels) - {"model_name", "engine"}} <= {
        "request_success_total", "request_success", "num_requests_waiting_by_reason", "cache_config_info"}
    hist = {m.name: m for m in metrics if hasattr(m, "buckets")}
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        got = [float(b) for b in hist["vllm:" + name].buckets if b != "+Inf"]
        assert got == BOUNDS[name], name
