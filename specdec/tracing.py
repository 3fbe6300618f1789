"""OpenTelemetry traces of requests: vLLM's `--otlp-traces-endpoint` and `--collect-detailed-traces`.

With an endpoint set, every request the engine retires (finished or aborted) becomes one span,
`llm_request` (kind SERVER), exported over OTLP by a background thread (the SDK's
BatchSpanProcessor): the span starts when the engine took the request and ends when it left; its
attributes are vLLM's names (the OpenTelemetry GenAI conventions: `gen_ai.request.*`,
`gen_ai.usage.*`, `gen_ai.latency.*`) plus specdec's speculative counts (`specdec.spec_decode.*`).
A request that carried W3C trace context (the HTTP headers `traceparent` / `tracestate`, or
`AsyncLLM.generate(trace_headers=...)`) gets its span under that parent, so a gateway's trace
goes on into the engine. No prompt or output text is recorded.

The protocol is OpenTelemetry's variable OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: "grpc" (the default,
as vLLM's; endpoint like http://collector:4317) or "http/protobuf" (endpoint like
http://collector:4318/v1/traces; a URL without a path gets /v1/traces). The service name is
OTEL_SERVICE_NAME, else "specdec". Needs `pip install 'specdec[otel]'`.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger("specdec.tracing")

TRACE_HEADERS = ("traceparent", "tracestate")
DETAIL_CHOICES = ("model", "worker", "all")
SPAN_NAME = "llm_request"


class SpanAttributes:
    """The attribute names (vLLM's vllm/tracing.py spells the same)."""
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD = "gen_ai.latency.time_in_model_forward"
    GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE = "gen_ai.latency.time_in_model_execute"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    # specdec's own: what speculation did for the request
    SPEC_NUM_DRAFTS = "specdec.spec_decode.num_drafts"
    SPEC_NUM_DRAFT_TOKENS = "specdec.spec_decode.num_draft_tokens"
    SPEC_NUM_ACCEPTED_TOKENS = "specdec.spec_decode.num_accepted_tokens"
    SPEC_FORWARD_PASSES = "specdec.spec_decode.target_forward_passes"
    SPEC_MEAN_ACCEPTED_LENGTH = "specdec.spec_decode.mean_accepted_length"
    CACHED_PROMPT_TOKENS = "specdec.usage.cached_prompt_tokens"
    NUM_PREEMPTIONS = "specdec.num_preemptions"
    LATENCY_TIME_IN_DRAFT = "specdec.latency.time_in_draft"


def otel_available() -> bool:
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        return False
    return True


def extract_trace_headers(headers: Mapping[str, str] | None) -> dict[str, str] | None:
    """The W3C trace-context headers among a request's (names in any case), or None."""
    if not headers:
        return None
    found = {}
    for name, value in headers.items():
        low = name.lower()
        if low in TRACE_HEADERS:
            found[low] = value
    return found or None


_warned = threading.Event()


def warn_tracing_disabled() -> None:
    """Once per process, as vLLM: trace context arrived but no endpoint is set."""
    if not _warned.is_set():
        _warned.set()
        log.warning("Received a request with trace context but tracing is disabled "
                    "(start with --otlp-traces-endpoint to export spans)")


def parse_detailed(value) -> frozenset[str]:
    """--collect-detailed-traces: a comma-separated subset of model, worker, all (or a list)."""
    if value is None or value == "":
        return frozenset()
    parts = value.split(",") if isinstance(value, str) else list(value)
    out = set()
    for p in parts:
        p = str(p).strip()
        if p not in DETAIL_CHOICES:
            raise ValueError(f"collect_detailed_traces: {p!r} is not one of {', '.join(DETAIL_CHOICES)}")
        out.add(p)
    return frozenset(out)


def check_observability(otlp_traces_endpoint, collect_detailed_traces) -> frozenset[str]:
    """vLLM's rules: detailed traces need an endpoint; -> the detail set."""
    detail = parse_detailed(collect_detailed_traces)
    if otlp_traces_endpoint is not None and (not isinstance(otlp_traces_endpoint, str)
                                             or not otlp_traces_endpoint.strip()):
        raise ValueError(f"otlp_traces_endpoint must be a URL, got {otlp_traces_endpoint!r}")
    if detail and not otlp_traces_endpoint:
        raise ValueError("collect_detailed_traces requires otlp_traces_endpoint (--otlp-traces-endpoint) to be set")
    return detail


def _exporter(endpoint: str):
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc").strip()
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as e:
            raise ValueError(f"OTLP over gRPC needs opentelemetry-exporter-otlp-proto-grpc "
                             f"(pip install 'specdec[otel]'): {e}") from None
        return OTLPSpanExporter(endpoint=endpoint)
    if protocol == "http/protobuf":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as e:
            raise ValueError(f"OTLP over HTTP needs opentelemetry-exporter-otlp-proto-http "
                             f"(pip install 'specdec[otel]'): {e}") from None
        parts = urlsplit(endpoint)
        if parts.scheme in ("http", "https") and parts.path in ("", "/"):
            endpoint = urlunsplit(parts._replace(path="/v1/traces"))
        return OTLPSpanExporter(endpoint=endpoint)
    raise ValueError(f"unsupported OTLP protocol {protocol!r} (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: "
                     f"grpc or http/protobuf)")


class RequestTracer:
    """Makes one span per retired engine request (Engine.tracer calls `request_done`)."""

    def __init__(self, endpoint: str, model_name: str, detailed: frozenset[str] = frozenset(), exporter=None):
        if not otel_available():
            raise ValueError("--otlp-traces-endpoint needs OpenTelemetry: pip install 'specdec[otel]' "
                             "(opentelemetry-sdk and the OTLP exporters)")
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.endpoint, self.model_name, self.detailed = endpoint, model_name, detailed
        service = os.environ.get("OTEL_SERVICE_NAME") or "specdec"
        self._provider = TracerProvider(resource=Resource.create({"service.name": service}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter if exporter is not None else _exporter(endpoint)))
        from . import __version__
        self._tracer = self._provider.get_tracer("specdec", __version__)
        self._propagator = TraceContextTextMapPropagator()
        self._kind, self._error = SpanKind.SERVER, Status(StatusCode.ERROR)
        self._closed = False

    def request_done(self, req, reason: str | None, model_name: str | None = None) -> None:
        """req: the engine's Request, leaving it now (reason: its finish reason, "abort", ...)."""
        if self._closed:
            return
        now_perf, now_ns = time.perf_counter(), time.time_ns()
        stats, params, A = req.stats, req.params, SpanAttributes
        start_ns = now_ns - int((now_perf - req.arrival) * 1e9)
        # one never scheduled (aborted while queued) spent its whole life queued: /metrics'
        # request_queue_time observes that wait too (vLLM's scheduled_ts - queued_ts has no value
        # for it; its client aborts make no span)
        queue = stats.queue_time_s if stats.scheduled_ts else now_perf - req.arrival
        attrs = {
            A.GEN_AI_REQUEST_ID: getattr(req, "trace_name", None) or str(req.request_id),
            A.GEN_AI_RESPONSE_MODEL: model_name or self.model_name,
            A.GEN_AI_USAGE_PROMPT_TOKENS: len(req.prompt),
            A.GEN_AI_USAGE_COMPLETION_TOKENS: stats.output_tokens,
            A.GEN_AI_LATENCY_E2E: now_perf - req.arrival,
            A.GEN_AI_LATENCY_TIME_IN_QUEUE: queue,
            A.GEN_AI_REQUEST_TEMPERATURE: float(params.temperature),
            A.GEN_AI_REQUEST_TOP_P: float(params.top_p),
            A.GEN_AI_REQUEST_N: int(params.n),
            A.SPEC_FORWARD_PASSES: stats.target_forward_passes,
            A.SPEC_NUM_DRAFTS: stats.num_drafts,
            A.SPEC_NUM_DRAFT_TOKENS: stats.draft_tokens,
            A.SPEC_NUM_ACCEPTED_TOKENS: stats.accepted_tokens,
            A.CACHED_PROMPT_TOKENS: stats.cached_tokens,
            A.NUM_PREEMPTIONS: req.num_preemptions,
        }
        if reason:
            attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] = (str(reason),)
        if params.max_tokens is not None:
            attrs[A.GEN_AI_REQUEST_MAX_TOKENS] = int(params.max_tokens)
        if stats.num_drafts:        # vLLM's mean acceptance length, as the responses and the log lines give it
            attrs[A.SPEC_MEAN_ACCEPTED_LENGTH] = 1 + stats.accepted_tokens / stats.num_drafts
        if stats.output_tokens:      # vLLM's phases: queued -> scheduled -> first token -> last token
            ttft, last = stats.time_to_first_token_s, stats.wall_time_s
            attrs[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = ttft
            attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = max(0.0, ttft - queue)
            attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = max(0.0, last - ttft)
            attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = max(0.0, last - queue)
        # vLLM's detail levels: "model" the forwards' time, "worker" the whole execution's (drafting too)
        if self.detailed & {"model", "all"}:
            attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD] = stats.target_time_s + stats.prefill_time_s
        if self.detailed & {"worker", "all"}:
            attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE] = (stats.target_time_s + stats.prefill_time_s
                                                             + stats.draft_time_s)
            attrs[A.LATENCY_TIME_IN_DRAFT] = stats.draft_time_s
        headers = getattr(req, "trace_headers", None)
        context = self._propagator.extract(headers) if headers else None
        span = self._tracer.start_span(SPAN_NAME, context=context, kind=self._kind, attributes=attrs,
                                       start_time=start_ns)
        if reason == "error":
            span.set_status(self._error)
        span.end(end_time=now_ns)

    def flush(self, timeout_s: float = 5.0) -> bool:
        return self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Exports what is queued and stops the exporter's thread."""
        if not self._closed:
            self._closed = True
            self._provider.shutdown()
