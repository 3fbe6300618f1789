"""Prometheus metrics of one server, in a registry of its own (two apps in a process never collide).

Names follow vLLM's (`vllm:` -> `specdec:`), so its meanings carry over:
- `specdec:spec_decode_num_drafts_total`: decoding steps that scored a draft
- `specdec:spec_decode_num_draft_tokens_total`: draft tokens scored by the target
- `specdec:spec_decode_num_accepted_tokens_total`: draft tokens the target kept
- `specdec:spec_decode_num_accepted_tokens_per_pos_total{position="i"}`: kept at draft position i
  (0-based); `..._num_draft_tokens_per_pos_total` is its denominator when K adapts.
acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts.
Counters are added when a completion ends (finished, aborted or failed), from its RequestStats.
The engine's own state (requests running and waiting, KV cache usage, preemptions, and with CUDA
graphs `specdec:cuda_graph_forwards_total{mode="captured"|"replayed"|"eager: <reason>"}`) is read at
scrape time; per-step figures (tokens per step, drafted tokens) are observed by the worker.
With LoRA enabled, `specdec:lora_requests_info` is vLLM's vllm:lora_requests_info: one sample
whose labels name the adapters of the running and the waiting requests (comma-separated) and
max_lora, and whose value is the scrape's time.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..metrics import RequestStats

PREFIX = "specdec:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _EngineCollector:
    """What the engine knows, read when /metrics is scraped (plain integer reads of the
    worker-owned engine: a scrape never waits for a step)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        e = self.engine
        yield GaugeMetricFamily(PREFIX + "num_requests_running", "Requests in the running batch.", value=e.num_running)
        yield GaugeMetricFamily(PREFIX + "num_requests_waiting", "Requests queued for a seat or KV blocks.",
                                value=e.num_waiting)
        yield GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "Fraction of the KV pool's blocks in use (1 = full).",
                                value=e.kv_cache_usage)
        c = CounterMetricFamily(PREFIX + "num_preemptions", "Requests preempted (blocks freed, to be recomputed).")
        c.add_metric([], e.num_preemptions)
        yield c
        c = CounterMetricFamily(PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        c.add_metric([], e.prefix_cache_queries)
        yield c
        c = CounterMetricFamily(PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        c.add_metric([], e.prefix_cache_hits)
        yield c
        graphs = getattr(e, "graphs", None)
        if graphs is not None:      # --compilation-config's CUDA graphs: how the target's forwards ran
            c = CounterMetricFamily(PREFIX + "cuda_graph_forwards", "Target forwards by how they ran: a graph "
                                    "captured or replayed, or eager (with the reason).", labels=["mode"])
            for mode, n in dict(graphs.stats).items():     # a copy: the worker adds keys meanwhile
                c.add_metric([mode], n)
            yield c
        if e.lora is not None:
            yield self._lora_info(e)

    @staticmethod
    def _lora_info(e) -> GaugeMetricFamily:
        g = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running stats on LoRA requests: the adapters of "
                              "the running and the waiting requests.",
                              labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        g.add_metric([str(e.lora.max_loras), _adapter_names(e.scheduler.waiting), _adapter_names(e.scheduler.running)],
                     time.time())
        return g


def _adapter_names(requests) -> str:
    """The adapters of requests, each once, comma-separated. The worker thread changes the
    queue meanwhile: list() copies it without running Python code, so without interruption."""
    return ",".join(dict.fromkeys(r.lora.name for r in list(requests) if r.lora is not None))


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine):
        self.registry = reg = CollectorRegistry()
        reg.register(_EngineCollector(engine))
        self.requests = Counter(
            PREFIX + "requests", "Completions by outcome: stop, length, abort (client gone), error; "
            "invalid counts requests refused with a 4xx before decoding.", ["outcome"], registry=reg)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens prefilled.", registry=reg)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=reg)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Request arrival to first token.",
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between consecutive deliveries "
                             "of tokens to one completion (one decoding step may deliver several).",
                             buckets=_LATENCY_BUCKETS, registry=reg)
        self.tpot = Histogram(PREFIX + "request_time_per_output_token_seconds", "Per completion: (last token - "
                              "first token) / (output tokens - 1).", buckets=_LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request arrival to last token.",
                             buckets=_E2E_BUCKETS, registry=reg)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Arrival to the first step that "
                                    "schedules the completion.", buckets=_E2E_BUCKETS, registry=reg)
        self.prefill_time = Histogram(PREFIX + "request_prefill_time_seconds", "First scheduled to first token.",
                                      buckets=_E2E_BUCKETS, registry=reg)
        self.decode_time = Histogram(PREFIX + "request_decode_time_seconds", "First token to last token.",
                                     buckets=_E2E_BUCKETS, registry=reg)
        self.iteration_tokens = Histogram(PREFIX + "iteration_tokens_total", "Tokens one engine step fed the target "
                                          "(decoding tokens, drafts and prompt chunks).", buckets=_TOKEN_BUCKETS,
                                          registry=reg)
        self.num_drafts = Counter(PREFIX + "spec_decode_num_drafts", "Decoding steps that scored a draft.", registry=reg)
        self.draft_tokens = Counter(PREFIX + "spec_decode_num_draft_tokens", "Draft tokens scored.", registry=reg)
        self.accepted_tokens = Counter(PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=reg)
        self.accepted_per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position.", ["position"], registry=reg)
        self.drafted_per_pos = Counter(PREFIX + "spec_decode_num_draft_tokens_per_pos",
                                       "Draft tokens scored at each draft position.", ["position"], registry=reg)
        self.speculating = Gauge(PREFIX + "spec_decode_speculating_fraction", "Of the last step's decoding "
                                 "requests, the fraction that drafted (the goodput policy's choice).", registry=reg)
        for outcome in ("stop", "length", "abort", "error", "invalid"):
            self.requests.labels(outcome)     # present at 0 from the start, so rates are defined

    def pooled(self, prompt_tokens: int, seconds: float) -> None:
        """One pooling request (embeddings, score, rerank, classify) answered, as vLLM counts them:
        a finished request, its input tokens as prompt tokens, its end-to-end latency."""
        self.requests.labels("stop").inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.e2e.observe(seconds)

    def rejected(self, status: int) -> None:
        if 400 <= status < 500:
            self.requests.labels("invalid").inc()

    def step(self, engine, events) -> None:
        """After each engine step (on the worker thread)."""
        if engine.last_step_tokens:
            self.iteration_tokens.observe(engine.last_step_tokens)
        if events:
            self.speculating.set(engine.last_step_drafting / len(events))

    def finished(self, outcome: str, stats: RequestStats | None) -> None:
        """One completion is over: count its outcome and its speculative work."""
        self.requests.labels(outcome or "stop").inc()
        if stats is None:
            return
        self.num_drafts.inc(stats.num_drafts)
        self.draft_tokens.inc(stats.draft_tokens)
        self.accepted_tokens.inc(stats.accepted_tokens)
        for i, (d, a) in enumerate(zip(stats.drafted_per_position, stats.accepted_per_position)):
            self.drafted_per_pos.labels(str(i)).inc(d)
            self.accepted_per_pos.labels(str(i)).inc(a)

    def latencies(self, stats: RequestStats, first_token: float, last_token: float, arrival: float) -> None:
        """A completion that produced tokens has ended: its per-request latencies."""
        self.e2e.observe(last_token - arrival)
        self.decode_time.observe(last_token - first_token)
        if stats.output_tokens > 1:
            self.tpot.observe((last_token - first_token) / (stats.output_tokens - 1))
        self.queue_time.observe(stats.queue_time_s)
        self.prefill_time.observe(max(0.0, first_token - arrival - stats.queue_time_s))

    def render(self) -> bytes:
        return generate_latest(self.registry)
