"""Observability against vLLM: vllm:num_requests_waiting_by_reason{reason="capacity"|"deferred"}
(vLLM's scheduler gauge: "capacity" waits for a seat, budget or KV blocks, "deferred" was passed
over for a transient reason; the two add up to num_requests_waiting) on /metrics and in
LLM.get_metrics(); and get_metrics() holding every family a server's /metrics exports where the
offline engine has the data (prompt_tokens_cached, request_prefill_kv_computed_tokens,
cache_config_info, request_success for each FinishReason, lora_requests_info), with the same names,
labels and counts. Real tiny checkpoints, a real uvicorn (ports 19100-19199), the openai client."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specdec import LLM, SamplingParams
from specdec.metrics import Counter, Gauge, Histogram, Vector
from specdec.server import ServerConfig, build_app
from specdec.server.metrics import ServerMetrics
from test_server import LiveServer

MAX_LEN = 128
PROMPT = [(7 * i + 3) % 90 + 3 for i in range(40)]         # 2 full blocks of 16 before its last token
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
# /metrics families the offline engine has no data for: the API's requests by outcome, and the
# worker's per-step iteration_fed_tokens and speculating fraction (the engine keeps no tally of them)
SERVER_ONLY = {"vllm:requests", "vllm:iteration_fed_tokens", "vllm:spec_decode_speculating_fraction"}


class Server(LiveServer):
    """LiveServer on a port of 19100-19199 (this file's range)."""

    def __init__(self, app):
        super().__init__(app)
        self.sock.close()
        for port in range(19100, 19200):
            self.sock = socket.socket()
            try:
                self.sock.bind(("127.0.0.1", port))
                break
            except OSError:
                self.sock.close()
        else:
            raise RuntimeError("no free port in 19100-19199")
        self.url = f"http://127.0.0.1:{port}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)


def offline(llm) -> dict:
    """get_metrics() by (name, its labels but model_name and engine)."""
    return {(m.name, frozenset((k, v) for k, v in m.labels.items() if k not in ("model_name", "engine"))): m
            for m in llm.get_metrics()}


def waiting(llm) -> tuple[float, dict[str, float]]:
    """get_metrics()' num_requests_waiting and its by-reason gauges."""
    m = llm.get_metrics()
    [total] = [g.value for g in m if g.name == "vllm:num_requests_waiting"]
    by = {g.labels["reason"]: g.value for g in m if g.name == "vllm:num_requests_waiting_by_reason"}
    return total, by


def scraped_waiting(text: str) -> dict[str, float]:
    return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text)
            if f.name.endswith(":num_requests_waiting_by_reason") for s in f.samples}


def test_offline_waiting_by_reason_capacity_and_a_step_deferred_for_blocks(tiny_pair):
    """Two requests for one 40-token prompt: the second waits a step for the blocks the first
    computes (deferred), then takes them from the cache; with one seat, the others wait for capacity."""
    llm = LLM(tiny_pair[0], max_model_len=MAX_LEN, enable_prefix_caching=True, num_speculative_tokens=0)
    e = llm.engine
    gauges = [g for g in llm.get_metrics() if g.name == "vllm:num_requests_waiting_by_reason"]
    assert all(isinstance(g, Gauge) for g in gauges)
    assert sorted((g.labels["reason"], set(g.labels), g.value) for g in gauges) == \
        [("capacity", {"model_name", "engine", "reason"}, 0.0), ("deferred", {"model_name", "engine", "reason"}, 0.0)]
    e.add_request(PROMPT, GREEDY)
    second = e.add_request(PROMPT, GREEDY)
    e.step()
    assert waiting(llm) == (1.0, {"capacity": 0.0, "deferred": 1.0})
    e.step()                                  # admitted, with the first one's two blocks
    assert second.stats.cached_tokens == 32 and waiting(llm) == (0.0, {"capacity": 0.0, "deferred": 0.0})

    seats = LLM(tiny_pair[0], max_model_len=MAX_LEN, max_num_seqs=1, num_speculative_tokens=0)
    for _ in range(3):
        seats.engine.add_request(PROMPT, GREEDY)
    seats.engine.step()
    assert waiting(seats) == (2.0, {"capacity": 2.0, "deferred": 0.0})
    text = generate_latest(ServerMetrics(seats.engine, "tiny", "vllm:").registry).decode()
    assert scraped_waiting(text) == {"capacity": 2.0, "deferred": 0.0}


def test_a_request_whose_adapter_has_no_slot_is_deferred(tiny_pair, tmp_path):
    """max_loras=1: a request for a second adapter is passed over (vLLM's skipped waiting queue,
    "deferred") while the first adapter's request runs, on /metrics and offline alike; and
    get_metrics() has /metrics' lora_requests_info."""
    pytest.importorskip("peft")
    from specdec.lora import LoRARequest
    from test_lora import make_adapter

    target = tiny_pair[0]
    a, b = (LoRARequest(n, i, str(make_adapter(target, tmp_path / n, i))) for i, n in ((1, "a"), (2, "b")))
    llm = LLM(target, max_model_len=MAX_LEN, max_num_seqs=4, enable_lora=True, max_loras=1, num_speculative_tokens=0)
    e, metrics = llm.engine, ServerMetrics(llm.engine, "tiny", "vllm:")
    e.add_request(PROMPT[:8], GREEDY, lora_request=a)
    e.add_request(PROMPT[:8], GREEDY, lora_request=b)
    e.add_request(PROMPT[:8], GREEDY)                       # no adapter: it goes ahead
    e.step()
    assert (e.num_running, e.num_waiting) == (2, 1)
    assert waiting(llm) == (1.0, {"capacity": 0.0, "deferred": 1.0})
    text = generate_latest(metrics.registry).decode()
    assert scraped_waiting(text) == {"capacity": 0.0, "deferred": 1.0}
    [info] = [g for g in llm.get_metrics() if g.name == "vllm:lora_requests_info"]
    [served] = [s for f in text_string_to_metric_families(text) if f.name == "vllm:lora_requests_info"
                for s in f.samples]
    assert {k: v for k, v in info.labels.items() if k != "model_name"} == \
        {k: v for k, v in served.labels.items() if k != "model_name"} == \
        {"max_lora": "1", "waiting_lora_adapters": "b", "running_lora_adapters": "a"}
    while e.has_unfinished():
        e.step()
    assert waiting(llm) == (0.0, {"capacity": 0.0, "deferred": 0.0})


@pytest.fixture(scope="module")
def served(tiny_pair):
    """A vllm-named server with speculation and prefix caching, and the LLM behind it."""
    target, draft = tiny_pair
    llm = LLM(target, speculative_model=str(draft), num_speculative_tokens=2, max_model_len=MAX_LEN, max_num_seqs=1,
              enable_prefix_caching=True)
    with Server(build_app(llm, ServerConfig(served_model_names=("tiny",), metrics_prefix="vllm"))) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        yield llm, server, http


def test_a_queued_request_waits_for_capacity_on_metrics(served, monkeypatch):
    llm, server, http = served
    assert scraped_waiting(http.get("/metrics").text) == {"capacity": 0.0, "deferred": 0.0}    # from the start
    real_step = llm.engine.step

    def paced():        # the tiny model decodes in milliseconds: the only seat stays taken meanwhile
        time.sleep(0.05)
        return real_step()
    monkeypatch.setattr(llm.engine, "step", paced)
    holder = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": MAX_LEN - 20, "ignore_eos": True,
              "stream": True}
    queued = threading.Thread(target=lambda: httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "class Point:", "max_tokens": 2}))
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=holder) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")                     # the holder runs in the only seat
        queued.start()
        deadline = time.monotonic() + 30
        while True:
            fams = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
            [total] = fams["vllm:num_requests_waiting"].samples
            if total.value == 1:
                break
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.02)
        by = {s.labels["reason"]: s for s in fams["vllm:num_requests_waiting_by_reason"].samples}
        assert {k: s.value for k, s in by.items()} == {"capacity": 1.0, "deferred": 0.0}
        assert {k: v for k, v in by["capacity"].labels.items() if k != "reason"} == total.labels   # engine, model_name
    queued.join(60)                                                 # the holder's client left: it runs
    assert not queued.is_alive()


def test_get_metrics_has_the_servers_families_with_its_counts(served):
    llm, server, http = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    for _ in range(2):                                              # the second finds the first's 2 blocks
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=2, n=2, temperature=0.5)
    deadline = time.monotonic() + 30
    while llm.engine.has_unfinished():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    fams = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)
            if not f.name.endswith("_created")}
    mine = offline(llm)
    # every family of /metrics (but the server's own), under the same name and label names
    kinds = {Counter: "counter", Gauge: "gauge", Histogram: "histogram", Vector: "counter"}
    served_labels = {name: {k for s in f.samples for k in s.labels} - {"le", "position"} for name, f in fams.items()}
    offline_labels: dict[str, set] = {}
    for (name, _), m in mine.items():
        offline_labels.setdefault(name, set()).update(m.labels)
        assert kinds[type(m)] == fams[name].type, name
    assert set(offline_labels) == set(served_labels) - SERVER_ONLY
    assert offline_labels == {name: served_labels[name] for name in offline_labels}

    def served_value(name, suffix="_total", **labels):
        [v] = [s.value for s in fams[name].samples if all(s.labels.get(k) == x for k, x in labels.items())
               and s.name == name + suffix]
        return v

    assert mine[("vllm:prompt_tokens_cached", frozenset())].value == served_value("vllm:prompt_tokens_cached") \
        == llm.engine.prefix_cache_hits >= 32
    assert mine[("vllm:prompt_tokens", frozenset())].value == served_value("vllm:prompt_tokens")
    for reason in ("stop", "length", "abort", "error", "repetition"):
        assert mine[("vllm:request_success", frozenset({("finished_reason", reason)}))].value == \
            served_value("vllm:request_success", finished_reason=reason), reason
    computed = mine[("vllm:request_prefill_kv_computed_tokens", frozenset())]
    assert (computed.count, computed.sum) == (served_value("vllm:request_prefill_kv_computed_tokens", "_count"),
                                              served_value("vllm:request_prefill_kv_computed_tokens", "_sum"))
    prompts = mine[("vllm:request_prompt_tokens", frozenset())]
    assert prompts.sum - computed.sum == mine[("vllm:prompt_tokens_cached", frozenset())].value
    [info] = [m for (name, _), m in mine.items() if name == "vllm:cache_config_info"]
    [scraped] = fams["vllm:cache_config_info"].samples
    assert info.value == scraped.value == 1.0
    assert {k: v for k, v in info.labels.items() if k != "model_name"} == \
        {k: v for k, v in scraped.labels.items() if k != "model_name"}
    assert info.labels["enable_prefix_caching"] == "True" and info.labels["engine"] == "0"


def test_pooled_inputs_count_their_computed_prompt_tokens(tiny_pair):
    """A pooled input computes its whole prompt: request_prefill_kv_computed_tokens observes it, as
    /metrics' ServerMetrics.pooled does."""
    llm = LLM(tiny_pair[0], convert="embed", max_model_len=MAX_LEN)
    outs = llm.embed(["def add(a, b):", "class Point:"])
    [computed] = [m for m in llm.get_metrics() if m.name == "vllm:request_prefill_kv_computed_tokens"]
    assert (computed.count, computed.sum) == (2, sum(len(o.prompt_token_ids) for o in outs))


def test_beam_usage_reports_cached_prompt_tokens_as_a_plain_request(served):
    """A beam search's usage carries prompt_tokens_details.cached_tokens as a plain request's does
    (each prompt's tokens found in the prefix cache when its search began: its first step's request)."""
    _, _, http = served
    prompt = [(5 * i + 11) % 90 + 3 for i in range(40)]        # not PROMPT: nothing of it is cached yet
    chat = [{"role": "user", "content": "class Point:\n    def __init__(self, x, y):\n" * 2}]

    def usage(route, **body):
        r = http.post(f"/v1/{route}", json={"model": "tiny", "max_tokens": 2, **body})
        assert r.status_code == 200, r.text
        if body.get("stream"):
            return [c for c in r.text.splitlines() if c.startswith("data: {")][-1]
        return r.json()["usage"]

    assert usage("completions", prompt=prompt, use_beam_search=True, n=2)["prompt_tokens_details"] == \
        {"cached_tokens": 0}
    beam = usage("completions", prompt=prompt, use_beam_search=True, n=2)
    plain = usage("completions", prompt=prompt, temperature=0)
    assert beam["prompt_tokens_details"] == plain["prompt_tokens_details"] == {"cached_tokens": 32}
    usage("chat/completions", messages=chat, use_beam_search=True, n=2)
    beam = usage("chat/completions", messages=chat, use_beam_search=True, n=2)
    plain = usage("chat/completions", messages=chat, temperature=0)
    assert beam["prompt_tokens_details"] == plain["prompt_tokens_details"]
    assert plain["prompt_tokens_details"]["cached_tokens"] > 0
    streamed = usage("chat/completions", messages=chat, use_beam_search=True, n=2, stream=True,
                     stream_options={"include_usage": True})
    assert '"prompt_tokens_details": {"cached_tokens": %d}' % plain["prompt_tokens_details"]["cached_tokens"] \
        in streamed
