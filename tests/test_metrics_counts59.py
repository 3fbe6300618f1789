"""How many observations each per-request family gets (an observability tester's findings,
metrics59): vLLM's per parent request figures once per prompt, max_tokens once per finished
completion; a pooled input observed in every per-request family, on the server and offline;
offline get_metrics observes each finished request once in every family, as /metrics does; a
stream whose client left before the engine took it makes no finished-request record."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import make_checkpoint
from specdec import LLM, SamplingParams
from specdec.server import ServerConfig, build_app
from test_server import LiveServer

# every family observed once per finished completion (README: "their counts equal its sum")
PER_COMPLETION = ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                  "request_decode_time_seconds", "request_inference_time_seconds",
                  "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens")


def scrape(url: str) -> dict[str, float]:
    """name (with its labels but vLLM's model_name and engine) -> value, through prometheus_client's parser."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine"))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if "_bucket" not in k}


@pytest.fixture(scope="module")
def live(tiny_pair):
    target, draft = tiny_pair
    llm = LLM(target, speculative_model=str(draft), num_speculative_tokens=2, max_model_len=128)
    app = build_app(llm, ServerConfig(served_model_names=("m",), metrics_prefix="vllm"))
    with LiveServer(app) as server:
        server.app = app
        yield server


def test_n_and_max_generation_per_prompt_max_tokens_per_completion(live):
    """vLLM runs each prompt of a list as its own (parent) request: request_params_n and
    request_max_num_generation_tokens once per prompt; request_params_max_tokens per finished
    completion (FinishedRequestStats.max_tokens_param)."""
    def counted(**fields) -> dict:
        """What one completions request adds to /metrics."""
        before = scrape(live.url)
        body = {"model": "m", "max_tokens": 5, "temperature": 0, "ignore_eos": True, **fields}
        assert httpx.post(live.url + "/v1/completions", json=body, timeout=60).status_code == 200
        return delta(before, scrape(live.url))

    d = counted(prompt=["def f(x):", "class A:"])
    assert d["vllm:request_success_total{finished_reason=length}"] == 2
    assert d["vllm:request_params_n_count"] == 2 and d["vllm:request_params_n_sum"] == 2
    assert d["vllm:request_max_num_generation_tokens_count"] == 2
    assert d["vllm:request_max_num_generation_tokens_sum"] == 10
    assert d["vllm:request_params_max_tokens_count"] == 2 and d["vllm:request_params_max_tokens_sum"] == 10

    d = counted(prompt="def f(x):", n=3, temperature=0.8, seed=1)
    assert d["vllm:request_success_total{finished_reason=length}"] == 3
    assert d["vllm:request_params_n_count"] == 1 and d["vllm:request_params_n_sum"] == 3
    assert d["vllm:request_max_num_generation_tokens_count"] == 1
    assert d["vllm:request_max_num_generation_tokens_sum"] == 5
    assert d["vllm:request_params_max_tokens_count"] == 3 and d["vllm:request_params_max_tokens_sum"] == 15


def test_a_stream_left_before_the_engine_took_it_makes_no_record(live):
    """Its job is cancelled while still in the worker's inbox: the engine never ran it (no span),
    and as vLLM counts no engine request then, no request_success or per-request histogram
    either; requests_total still counts the API request as an abort."""
    worker = live.app.state.service.worker
    a = scrape(live.url)
    worker.pause("keep").result(timeout=30)          # new jobs wait in the inbox
    try:
        with httpx.stream("POST", live.url + "/v1/completions", timeout=30, json={
                "model": "m", "prompt": "def f(x):", "max_tokens": 20, "stream": True}) as r:
            assert r.status_code == 200
            deadline = time.monotonic() + 30
            while worker.num_waiting == 0:             # submitted: in the inbox of the paused engine
                assert time.monotonic() < deadline
                time.sleep(0.02)
        deadline = time.monotonic() + 30
        while delta(a, scrape(live.url)).get("vllm:requests_total{outcome=abort}", 0) < 1:
            assert time.monotonic() < deadline       # the server saw the client leave
            time.sleep(0.05)
        assert worker.num_waiting == 0               # its job left the inbox
    finally:
        worker.resume()
    r = httpx.post(live.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2,
                                                       "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200
    d = delta(a, scrape(live.url))
    assert d["vllm:requests_total{outcome=abort}"] == 1
    assert d["vllm:request_success_total{finished_reason=abort}"] == 0
    assert d["vllm:request_success_total{finished_reason=length}"] == 1
    for family in PER_COMPLETION:
        assert d[f"vllm:{family}_count"] == 1, family
    assert d["vllm:request_params_n_count"] == d["vllm:request_params_max_tokens_count"] == 1


@pytest.fixture(scope="module")
def embed_model(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("embed59") / "src", arch="qwen3", hidden=64, layers=2, seed=1)


def test_pooled_inputs_observed_in_every_per_request_family(embed_model):
    """vLLM observes each finished pooling request in every per-request family: their counts
    equal request_success's, on the server and offline (get_metrics)."""
    llm = LLM(str(embed_model), convert="embed", max_model_len=64)
    texts = ["def add(a, b):", "class A:", "import os"]
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("e",), metrics_prefix="vllm"))) as server:
        a = scrape(server.url)
        assert httpx.post(server.url + "/v1/embeddings", json={"model": "e", "input": texts},
                          timeout=60).status_code == 200
        d = delta(a, scrape(server.url))
    assert d["vllm:request_success_total{finished_reason=stop}"] == 3
    for family in PER_COMPLETION:
        assert d[f"vllm:{family}_count"] == 3, family
    assert d["vllm:request_generation_tokens_sum"] == 0
    # vLLM's parent-request figures for each (n 1, nothing generated); pooling has no max_tokens
    assert d["vllm:request_params_n_count"] == 3 and d["vllm:request_params_n_sum"] == 3
    assert d["vllm:request_max_num_generation_tokens_count"] == 3
    assert d["vllm:request_params_max_tokens_count"] == 0

    offline = LLM(str(embed_model), convert="embed", max_model_len=64)
    offline.embed(texts)
    got = {m.name: m for m in offline.get_metrics() if "finished_reason" not in m.labels}
    for family in PER_COMPLETION:
        assert got[f"vllm:{family}"].count == 3, family


def _histograms(llm) -> dict:
    return {m.name: m for m in llm.get_metrics() if hasattr(m, "count")}


def test_offline_get_metrics_observes_each_finished_request_once(tiny_pair):
    """get_metrics' histograms count every finished request once, as /metrics does: a one-token
    request's time per output token is 0, a request aborted before any step has its e2e, prefill,
    decode and inference observed (0), and its prompt, never prefilled, is not in prompt_tokens."""
    llm = LLM(tiny_pair[0], max_model_len=128)
    out = llm.generate("def add(a, b):", SamplingParams(max_tokens=1, temperature=0))[0]
    h = _histograms(llm)
    for family in (*PER_COMPLETION, "time_to_first_token_seconds"):
        assert h[f"vllm:{family}"].count == 1, family
    assert h["vllm:request_time_per_output_token_seconds"].sum == 0

    engine = llm.llm_engine
    engine.add_request("never-run", "def sub(a, b):", SamplingParams(max_tokens=10, temperature=0))
    engine.abort_request("never-run")
    while engine.has_unfinished_requests():
        engine.step()
    metrics = llm.get_metrics()
    success = sum(m.value for m in metrics if m.name == "vllm:request_success")
    h = {m.name: m for m in metrics if hasattr(m, "count")}
    assert success == 2
    for family in PER_COMPLETION:
        assert h[f"vllm:{family}"].count == 2, family
    assert h["vllm:time_to_first_token_seconds"].count == 1      # only a request with a token has one
    prompt = next(m.value for m in metrics if m.name == "vllm:prompt_tokens")
    assert prompt == len(out.prompt_token_ids)
