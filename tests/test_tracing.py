"""OpenTelemetry traces (vLLM's --otlp-traces-endpoint): one `llm_request` span per request,
exported over real OTLP (gRPC and HTTP/protobuf) to collectors run here, under the caller's W3C
trace context; checked against what the requests returned."""

from __future__ import annotations

import asyncio
import gzip
import http.server
import subprocess
import sys
import threading
import time
from concurrent import futures

import httpx
import openai
import pytest

pytest.importorskip("opentelemetry.sdk.trace")
grpc = pytest.importorskip("grpc")
pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402

from specdec import SamplingParams  # noqa: E402
from specdec.async_llm import AsyncLLM  # noqa: E402
from specdec.llm import LLM  # noqa: E402
from specdec.server import ServerConfig, build_app  # noqa: E402
from tests.test_server import LiveServer  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
SERVER_KIND = 2        # opentelemetry.proto.trace.v1.Span.SPAN_KIND_SERVER


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind)


class Collector:
    """The spans an OTLP receiver got: name, kind, ids, times and attributes of each."""

    def __init__(self):
        self.spans, self.resources, self._lock = [], [], threading.Lock()

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self._lock:
            for rs in request.resource_spans:
                self.resources.append({a.key: _value(a.value) for a in rs.resource.attributes})
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append({"name": s.name, "kind": s.kind, "trace_id": s.trace_id.hex(),
                                           "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                                           "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                                           "status": s.status.code,
                                           "attrs": {a.key: _value(a.value) for a in s.attributes}})

    def wait(self, n: int, timeout: float = 20.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while len(self.spans) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        return list(self.spans)

    def by_id(self, request_id: str) -> dict:
        [span] = [s for s in self.spans if s["attrs"]["gen_ai.request.id"] == request_id]
        return span


@pytest.fixture
def grpc_collector():
    got = Collector()

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            got.add(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    got.endpoint = f"http://127.0.0.1:{port}"
    yield got
    server.stop(0)


@pytest.fixture
def http_collector(monkeypatch):
    """An OTLP/HTTP receiver (POST /v1/traces, protobuf); the exporter is told to speak it."""
    got = Collector()
    got.paths = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            got.paths.append(self.path)
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            got.add(request)
            out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    got.endpoint = f"http://127.0.0.1:{server.server_address[1]}"        # no path: /v1/traces is added
    yield got
    server.shutdown()
    server.server_close()


def _check_latencies(attrs: dict) -> None:
    a = attrs
    assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert a["gen_ai.latency.time_in_model_inference"] == pytest.approx(
        a["gen_ai.latency.time_in_model_prefill"] + a["gen_ai.latency.time_in_model_decode"], abs=1e-6)


def test_offline_llm_exports_a_span_per_request_over_http(tiny_pair, http_collector):
    target, draft = tiny_pair
    llm = LLM(target, speculative_model=str(draft), num_speculative_tokens=3, max_model_len=128,
              otlp_traces_endpoint=http_collector.endpoint, collect_detailed_traces="model,worker")
    prompts = ["def add(a, b):", "class Point:"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    long = "import os\nimport sys\n" * 4              # its second run finds its blocks in the prefix cache
    again = [llm.generate([long], SamplingParams(temperature=0, max_tokens=2))[0] for _ in range(2)]
    llm.shutdown()                                   # exports what is queued
    spans = http_collector.wait(4)
    assert http_collector.paths and set(http_collector.paths) == {"/v1/traces"}
    assert len(spans) == 4 and {s["name"] for s in spans} == {"llm_request"}
    cached = [s["attrs"]["specdec.usage.cached_prompt_tokens"] for s in spans
              if s["attrs"]["gen_ai.usage.prompt_tokens"] == len(again[0].prompt_token_ids)]
    assert cached == [0, again[1].num_cached_tokens] and cached[1] > 0
    spans = [s for s in spans if s["attrs"]["gen_ai.usage.prompt_tokens"] != len(again[0].prompt_token_ids)]
    assert http_collector.resources[0]["service.name"] == "specdec"
    by_tokens = {s["attrs"]["gen_ai.usage.prompt_tokens"]: s for s in spans}
    done_stats = {len(o.prompt_token_ids): o.metrics.mean_accepted_length for o in outs}
    for out in outs:
        a = by_tokens[len(out.prompt_token_ids)]["attrs"]
        done = out.outputs[0]
        assert a["gen_ai.usage.completion_tokens"] == len(done.token_ids) == 12
        assert a["gen_ai.response.finish_reasons"] == ("length",)
        assert a["gen_ai.request.max_tokens"] == 12 and a["gen_ai.request.temperature"] == 0.0
        assert a["gen_ai.response.model"] == str(target)
        assert a["gen_ai.request.id"] == out.request_id           # the RequestOutput the span belongs to
        assert a["specdec.usage.cached_prompt_tokens"] == 0
        # the speculative counts are those the engine measured for the request
        assert a["specdec.spec_decode.num_draft_tokens"] == out.stats.draft_tokens > 0
        assert a["specdec.spec_decode.num_accepted_tokens"] == out.stats.accepted_tokens
        # vLLM's mean acceptance length (the response's and the log lines' figure)
        assert a["specdec.spec_decode.mean_accepted_length"] == pytest.approx(done_stats[len(out.prompt_token_ids)])
        # collect_detailed_traces "model" and "worker": the forwards' time; the execution's, drafting's in it
        assert 0 < a["gen_ai.latency.time_in_model_forward"] <= a["gen_ai.latency.time_in_model_execute"]
        assert a["specdec.latency.time_in_draft"] > 0
        _check_latencies(a)
    for s in spans:
        assert s["kind"] == SERVER_KIND and s["parent"] == "" and s["start"] < s["end"]
        assert (s["end"] - s["start"]) / 1e9 == pytest.approx(s["attrs"]["gen_ai.latency.e2e"], abs=0.01)


def test_server_spans_follow_the_callers_trace_context_over_grpc(tiny_pair, grpc_collector):
    target, draft = tiny_pair
    llm = LLM(target, speculative_model=str(draft), num_speculative_tokens=3, max_model_len=128,
              otlp_traces_endpoint=grpc_collector.endpoint)
    app = build_app(llm, ServerConfig(served_model_names=("tiny", "tiny-alias")))
    with LiveServer(app) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x")
        traced = client.completions.create(model="tiny-alias", prompt="def add(a, b):", max_tokens=8, temperature=0,
                                           extra_headers={"traceparent": TRACEPARENT, "tracestate": "vendor=1",
                                                          "x-request-id": "traced-1"})
        plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=5, n=2, temperature=0.8, top_p=0.9, seed=3,
                                               extra_headers={"x-request-id": "plain-1"})
        # a stream the client leaves: its span says abort
        with httpx.stream("POST", live.url + "/v1/completions", headers={"x-request-id": "gone-1"},
                          json={"model": "tiny", "prompt": "x", "max_tokens": 100, "stream": True,
                                "ignore_eos": True}) as r:
            next(r.iter_lines())
    llm.shutdown()
    spans = grpc_collector.wait(4)
    assert len(spans) == 4, spans
    t = grpc_collector.by_id("cmpl-traced-1")
    assert t["trace_id"] == TRACE_ID and t["parent"] == PARENT_ID and t["kind"] == SERVER_KIND
    a = t["attrs"]
    assert a["gen_ai.usage.completion_tokens"] == traced.usage.completion_tokens
    assert a["gen_ai.usage.prompt_tokens"] == traced.usage.prompt_tokens
    assert a["gen_ai.response.finish_reasons"] == (traced.choices[0].finish_reason,)
    assert a["gen_ai.response.model"] == "tiny"        # the first served name, as vLLM's spans
    _check_latencies(a)
    # n=2: a span per choice, in a trace of their own (no context came), the request's parameters on both
    choices = [grpc_collector.by_id(f"chatcmpl-plain-1-{i}") for i in range(2)]
    assert sum(c["attrs"]["gen_ai.usage.completion_tokens"] for c in choices) == plain.usage.completion_tokens
    for c in choices:
        assert c["parent"] == "" and c["trace_id"] != TRACE_ID
        assert c["attrs"]["gen_ai.request.n"] == 2 and c["attrs"]["gen_ai.request.top_p"] == pytest.approx(0.9)
        assert c["attrs"]["gen_ai.request.temperature"] == pytest.approx(0.8)
    gone = grpc_collector.by_id("cmpl-gone-1")["attrs"]
    assert gone["gen_ai.response.finish_reasons"] == ("abort",) and gone["gen_ai.usage.completion_tokens"] < 100


def test_async_llm_trace_headers(tiny_pair, grpc_collector):
    target, _ = tiny_pair
    engine = AsyncLLM(model=str(target), max_model_len=128, otlp_traces_endpoint=grpc_collector.endpoint)

    async def main():
        async for out in engine.generate("hello", SamplingParams(temperature=0, max_tokens=4), "req-a",
                                         trace_headers={"Traceparent": TRACEPARENT}):
            last = out
        return last

    try:
        last = asyncio.run(main())
    finally:
        engine.shutdown()
        engine.llm.shutdown()
    [span] = grpc_collector.wait(1)
    assert span["attrs"]["gen_ai.request.id"] == "req-a" and span["trace_id"] == TRACE_ID
    assert span["parent"] == PARENT_ID
    assert span["attrs"]["gen_ai.usage.completion_tokens"] == len(last.outputs[0].token_ids) == 4
    assert span["attrs"]["specdec.spec_decode.num_drafts"] == 0         # plain decoding


def test_bad_tracing_settings_are_one_line_errors(tiny_pair, monkeypatch):
    target, _ = tiny_pair
    with pytest.raises(ValueError, match="requires otlp_traces_endpoint"):
        LLM(target, collect_detailed_traces="model")
    with pytest.raises(ValueError, match="not one of model, worker, all"):
        LLM(target, otlp_traces_endpoint="http://127.0.0.1:1", collect_detailed_traces="everything")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "carrier-pigeon")
    with pytest.raises(ValueError, match="unsupported OTLP protocol 'carrier-pigeon'"):
        LLM(target, otlp_traces_endpoint="http://127.0.0.1:1")
    run = subprocess.run([sys.executable, "-m", "specdec", "serve", "--model", str(target),
                          "--collect-detailed-traces", "all"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "requires otlp_traces_endpoint" in run.stderr and "Traceback" not in run.stderr


def test_trace_context_without_an_endpoint_is_said_once(tiny_pair, caplog):
    """vLLM's warning: a request carried trace context but tracing is off (once, not per request)."""
    import specdec.tracing as tracing

    tracing._warned.clear()
    target, _ = tiny_pair
    llm = LLM(target, max_model_len=128)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x")
        for _ in range(3):
            client.completions.create(model="tiny", prompt="a", max_tokens=2, extra_headers={"traceparent": TRACEPARENT})
    said = [r for r in caplog.records if "trace context but tracing is disabled" in r.getMessage()]
    assert len(said) == 1
