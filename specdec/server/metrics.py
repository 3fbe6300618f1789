"""Prometheus metrics of one server, in a registry of its own (two apps in a process never collide).

Names follow vLLM's (`vllm:` -> `specdec:`), so its meanings carry over:
- `specdec:spec_decode_num_drafts_total`: decoding steps that scored a draft
- `specdec:spec_decode_num_draft_tokens_total`: draft tokens scored by the target
- `specdec:spec_decode_num_accepted_tokens_total`: draft tokens the target kept
- `specdec:spec_decode_num_accepted_tokens_per_pos_total{position="i"}`: kept at draft position i
  (0-based); `..._num_draft_tokens_per_pos_total` is its denominator when K adapts. Both exist at 0
  from the start for positions 0..K-1 (with "auto", the largest K it may choose), as vLLM's.
acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts.
The token and speculative counters grow step by step with what each engine step did (StepDelta:
a request whose client left counts all the engine computed for it, as vLLM counts per step and as
the log lines and the spans count); requests_total and the per-request histograms as each ends.
The engine's own state (requests running and waiting, the waiting by reason as vLLM's
`num_requests_waiting_by_reason{reason="capacity"|"deferred"}`, KV cache usage, preemptions, and with CUDA
graphs `specdec:cuda_graph_forwards_total{mode="captured"|"replayed"|"eager: <reason>"}`) is read at
scrape time; per-step figures are observed by the worker: iteration_tokens_total as vLLM's (the
prompts whose first token came plus the tokens generated), and specdec's iteration_fed_tokens (what
the step fed the target: decoding rows with their drafts, and prompt chunks).
With LoRA enabled, `specdec:lora_requests_info` is vLLM's vllm:lora_requests_info: one sample
whose labels name the adapters of the running and the waiting requests (comma-separated) and
max_lora, and whose value is the scrape's time.
Every series also carries vLLM's label pair, `model_name` (the first served name) and
`engine="0"` (one engine per server: vLLM's data-parallel index), so that vLLM dashboards'
`{model_name="...", engine="0"}` selectors find them; lora_requests_info keeps its own labels (and
model_name). Each counter and histogram has its `*_created` series (its start time), as
prometheus_client writes them and vLLM's exposition has them. Histogram bounds are vLLM's
(specdec/metrics.py). The spec_decode families exist only with a speculative method (an engine
with a proposer, "auto" K included), as vLLM registers them only with a speculative config.
`specdec:requests_total{outcome}` counts each request to the API once: by its completions'
outcomes when it ran any (an engine's refusal, a ValueError, as invalid), else by the status of
its answer (RequestCounter: 4xx invalid, 5xx error).
vLLM's per-request families are here too under their vLLM names (request_success_total by
finished_reason, the request_prompt_tokens / request_generation_tokens /
request_prefill_kv_computed_tokens / request_params_n / request_params_max_tokens /
request_max_num_generation_tokens histograms, request_inference_time, prompt_tokens_cached,
cache_config_info, and the older names its Grafana dashboard reads, time_per_output_token_seconds
and gpu_cache_usage_perc); with `prefix="vllm:"` (--metrics-prefix vllm) every family is named as
vLLM's, so its dashboards and alerts read a specdec server unchanged.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.routing import Match

from .errors import app_path
from ..llm import FINISH_REASONS, cache_config_info, lora_requests_info
from ..metrics import (ITERATION_TOKENS_BUCKETS, ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, REQUEST_N_BUCKETS, TTFT_BUCKETS,
                       RequestStats, draft_positions, one_two_five)

PREFIX = "specdec:"
PREFIXES = {"specdec": "specdec:", "vllm": "vllm:"}      # --metrics-prefix
MODEL_LABEL = "model_name"      # on every series, as vLLM labels its own: {model_name="<first served name>"}
ENGINE = {"engine": "0"}        # vLLM's other label on every series: its engine (data-parallel) index
# FINISH_REASONS (specdec/llm.py, shared with LLM.get_metrics): vLLM's FinishReason, each a series of
# request_success_total from the start
WAITING_REASONS = ("capacity", "deferred")      # vLLM's num_requests_waiting_by_reason{reason}


class _EngineLabelled:
    """A registry's families, each sample with vLLM's engine label added at scrape time (the
    metrics are kept and recorded by model_name alone); lora_requests_info as it is, as vLLM's."""

    def __init__(self, registry):
        self.registry = registry

    def collect(self):
        for fam in self.registry.collect():
            if not fam.name.endswith("lora_requests_info"):
                fam.samples = [s._replace(labels={**s.labels, **ENGINE}) for s in fam.samples]
            yield fam


class _EngineCollector:
    """What the engine knows, read when /metrics is scraped (plain integer reads of the
    worker-owned engine: a scrape never waits for a step)."""

    def __init__(self, engine, model_name: str, prefix: str = PREFIX):
        self.engine, self.model, self.prefix = engine, model_name, prefix
        self.created = time.time()      # its counters' `*_created` (they count from the engine's start)

    def collect(self):
        e, labels, values, PREFIX = self.engine, [MODEL_LABEL], [self.model], self.prefix
        usage = e.kv_cache_usage
        waiting = e.scheduler.waiting_by_reason()     # one reading of the queue: the reasons add up to it
        for name, doc, value in (("num_requests_running", "Requests in the running batch.", e.num_running),
                                 ("num_requests_waiting", "Requests queued for a seat or KV blocks.",
                                  sum(waiting.values())),
                                 ("kv_cache_usage_perc", "Fraction of the KV pool's blocks in use (1 = full).", usage),
                                 ("gpu_cache_usage_perc", "kv_cache_usage_perc under vLLM's older name (its Grafana "
                                  "dashboard reads it).", usage)):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric(values, value)
            yield g
        g = GaugeMetricFamily(PREFIX + "num_requests_waiting_by_reason", "Waiting requests by reason (vLLM's): "
                              "'capacity' = waiting for a seat, the step's token budget or KV blocks; 'deferred' = "
                              "passed over by the last step for a transient reason (its LoRA adapter's slot, "
                              "prompt blocks another request was computing). They add up to num_requests_waiting.",
                              labels=[MODEL_LABEL, "reason"])
        for reason in WAITING_REASONS:
            g.add_metric([self.model, reason], waiting[reason])
        yield g
        for name, doc, value in (("num_preemptions", "Requests preempted (blocks freed, to be recomputed).",
                                  e.num_preemptions),
                                 ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  e.prefix_cache_queries),
                                 ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", e.prefix_cache_hits)):
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            c.add_metric(values, value, created=self.created)
            yield c
        graphs = getattr(e, "graphs", None)
        if graphs is not None:      # --compilation-config's CUDA graphs: how the target's forwards ran
            c = CounterMetricFamily(PREFIX + "cuda_graph_forwards", "Target forwards by how they ran: a graph "
                                    "captured or replayed, or eager (with the reason).", labels=[MODEL_LABEL, "mode"])
            for mode, n in dict(graphs.stats).items():     # a copy: the worker adds keys meanwhile
                c.add_metric([self.model, mode], n, created=self.created)
            yield c
        yield self._cache_config_info(e)
        if e.lora is not None:
            yield self._lora_info(e)

    def _cache_config_info(self, e) -> GaugeMetricFamily:
        """vLLM's vllm:cache_config_info: 1, labelled with the KV cache's configuration under its
        CacheConfig field names (specdec/llm.cache_config_info), and model_name as lora_requests_info."""
        info = cache_config_info(e)
        g = GaugeMetricFamily(self.prefix + "cache_config_info", "Information of the LLMEngine CacheConfig",
                              labels=[MODEL_LABEL, *info])
        g.add_metric([self.model, *info.values()], 1)
        return g

    def _lora_info(self, e) -> GaugeMetricFamily:
        info = lora_requests_info(e)
        g = GaugeMetricFamily(self.prefix + "lora_requests_info", "Running stats on LoRA requests: the adapters of "
                              "the running and the waiting requests.", labels=[MODEL_LABEL, *info])
        g.add_metric([self.model, *info.values()], time.time())
        return g


class _Answer:
    """One HTTP request being answered: whether its completions have counted it in requests_total."""
    __slots__ = ("counted",)

    def __init__(self):
        self.counted = False


# the request the current task answers (set by RequestCounter; asyncio copies it into the tasks
# a route starts, and they all share the one _Answer)
_ANSWERING: contextvars.ContextVar[_Answer | None] = contextvars.ContextVar("specdec_answering", default=None)


log = logging.getLogger("specdec.server.stats")


@dataclass
class _Window:
    """What the steps did since the last periodic log line (vLLM's LoggingStatLogger interval)."""
    start: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    cache_queries: int = 0          # the engine's prefix-cache and preemption counters when the window opened
    cache_hits: int = 0
    preemptions: int = 0


@dataclass
class StepDelta:
    """What one engine step did, summed over its events' requests (each counted by what its
    RequestStats gained since the step before: RequestStats.logged, kept on the request's own
    stats, so a request that ends any way leaves nothing behind)."""
    prompt_tokens: int = 0          # prompts whose first tokens came this step (vLLM's: whole, cached or not)
    prompt_cached: int = 0          # ... of which found in the prefix cache
    generation_tokens: int = 0
    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, events) -> "StepDelta":
        d = cls()
        for ev in events:
            s = ev.stats
            if s is None:
                continue
            prev = s.logged
            if prev is None:
                prev = (0, 0, 0, (), ())
                d.prompt_tokens += s.prompt_tokens
                d.prompt_cached += s.cached_tokens
            d.generation_tokens += len(ev.token_ids)
            d.num_drafts += s.num_drafts - prev[0]
            d.draft_tokens += s.draft_tokens - prev[1]
            d.accepted_tokens += s.accepted_tokens - prev[2]
            for total, now, before in ((d.accepted_per_pos, s.accepted_per_position, prev[3]),
                                       (d.drafted_per_pos, s.drafted_per_position, prev[4])):
                if len(total) < len(now):
                    total += [0] * (len(now) - len(total))
                for i, v in enumerate(now):
                    total[i] += v - (before[i] if i < len(before) else 0)
            s.logged = (s.num_drafts, s.draft_tokens, s.accepted_tokens, tuple(s.accepted_per_position),
                        tuple(s.drafted_per_position))
        return d


class StatLogger:
    """vLLM's periodic log lines (LoggingStatLogger, every VLLM_LOG_STATS_INTERVAL = 10 s by default;
    off with --disable-log-stats): prompt and generation throughput, requests running and waiting,
    the interval's preemptions (when any), KV cache usage (vLLM's words, "GPU KV cache usage",
    whatever the device) and the prefix cache's hit rate over the interval, and with speculation vLLM's
    "SpecDecoding metrics" line (mean acceptance length, accepted and drafted throughput and counts,
    per-position acceptance rate, average draft acceptance rate). Counted per step, from each
    request's running RequestStats, on the worker thread; read on the event loop."""

    def __init__(self, engine):
        self.engine = engine
        self._lock = threading.Lock()
        self._window = self._new_window()

    def _new_window(self) -> _Window:
        e = self.engine
        return _Window(cache_queries=e.prefix_cache_queries, cache_hits=e.prefix_cache_hits,
                       preemptions=e.num_preemptions)

    def step(self, d: "StepDelta") -> None:
        """A step's work (ServerMetrics.step's deltas) into the interval."""
        with self._lock:
            w = self._window
            w.prompt_tokens += d.prompt_tokens
            w.generation_tokens += d.generation_tokens
            w.num_drafts += d.num_drafts
            w.draft_tokens += d.draft_tokens
            w.accepted_tokens += d.accepted_tokens
            if len(w.accepted_per_pos) < len(d.accepted_per_pos):
                w.accepted_per_pos += [0] * (len(d.accepted_per_pos) - len(w.accepted_per_pos))
            for i, a in enumerate(d.accepted_per_pos):
                w.accepted_per_pos[i] += a

    def log(self, now: float | None = None, force: bool = False) -> list[str]:
        """Log (and return) the interval's lines and open the next interval; nothing when the
        server was idle all interval (as vLLM's logger)."""
        with self._lock:
            w, self._window = self._window, self._new_window()
        e = self.engine
        elapsed = max((now or time.monotonic()) - w.start, 1e-9)
        running, waiting = e.num_running, e.num_waiting
        if not (force or w.prompt_tokens or w.generation_tokens or running or waiting):
            return []
        queries, hits = e.prefix_cache_queries - w.cache_queries, e.prefix_cache_hits - w.cache_hits
        preempted = e.num_preemptions - w.preemptions
        lines = [f"Engine 000: Avg prompt throughput: {w.prompt_tokens / elapsed:.1f} tokens/s, "
                 f"Avg generation throughput: {w.generation_tokens / elapsed:.1f} tokens/s, "
                 f"Running: {running} reqs, Waiting: {waiting} reqs, "
                 + (f"Preemptions: {preempted}, " if preempted else "")
                 + f"GPU KV cache usage: {100 * e.kv_cache_usage:.1f}%, "
                 f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"]
        if w.num_drafts:
            rates = ", ".join(f"{a / w.num_drafts:.3f}" for a in w.accepted_per_pos)
            lines.append(f"SpecDecoding metrics: Mean acceptance length: {1 + w.accepted_tokens / w.num_drafts:.2f}, "
                         f"Accepted throughput: {w.accepted_tokens / elapsed:.2f} tokens/s, "
                         f"Drafted throughput: {w.draft_tokens / elapsed:.2f} tokens/s, "
                         f"Accepted: {w.accepted_tokens} tokens, Drafted: {w.draft_tokens} tokens, "
                         f"Per-position acceptance rate: {rates}, "
                         f"Avg Draft acceptance rate: {100 * w.accepted_tokens / w.draft_tokens:.1f}%")
        for line in lines:
            log.info("%s", line)
        return lines


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine, model_name: str = "specdec", prefix: str = PREFIX):
        """model_name: the `model_name` label of every series (the first served name, as vLLM's);
        prefix: the families' ("specdec:", or "vllm:" to read as vLLM's)."""
        self.model_name = model = model_name
        self.prefix = PREFIX = prefix
        self.stat_logger: StatLogger | None = None      # the periodic log lines (build_app sets it)
        reg = CollectorRegistry()       # the metrics, by model_name; self.registry adds the engine label
        reg.register(_EngineCollector(engine, model, prefix))
        self.registry = CollectorRegistry()
        self.registry.register(_EngineLabelled(reg))
        # the spec_decode families: only where speculation can happen (a proposer, "auto" K
        # included: it may draft at any step), as vLLM registers them only with a speculative
        # config; without one they are made unregistered, and stay at 0
        spec = reg if engine.proposer is not None else None
        by_model = [MODEL_LABEL]

        def counter(name, doc, registry=reg):
            return Counter(PREFIX + name, doc, by_model, registry=registry).labels(model)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, by_model, buckets=buckets, registry=reg).labels(model)

        self._requests = Counter(
            PREFIX + "requests", "Completions by outcome: stop, length, abort (client gone), error (the "
            "engine failed, or any other 5xx answer); invalid counts requests to the API answered with a "
            "4xx (a failed request counts once).", [MODEL_LABEL, "outcome"], registry=reg)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests whose prefill is done (each "
                                     "choice's, cached or not: vLLM's per-request count).")
        self.prompt_tokens_cached = counter("prompt_tokens_cached", "Of prompt_tokens, those found in the prefix "
                                            "cache (vLLM's: cached prompt tokens, local + external; specdec's "
                                            "are all local).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.ttft = histogram("time_to_first_token_seconds", "Request arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive deliveries of tokens to "
                             "one completion (one decoding step may deliver several).", ITL_BUCKETS)
        self.itl_old = histogram("time_per_output_token_seconds", "inter_token_latency_seconds under vLLM's older "
                                 "name (its Grafana dashboard reads it).", ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds", "Per completion: (last token - first "
                              "token) / (output tokens - 1).", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request arrival to last token.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to the first step that schedules "
                                    "the completion.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to last token.",
                                     REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "First scheduled to last token.",
                                        REQUEST_LATENCY_BUCKETS)
        sizes = one_two_five(max(engine.max_model_len, 1))
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Per finished completion: its prompt's "
                                               "tokens.", sizes)
        self.request_generation_tokens = histogram("request_generation_tokens", "Per finished completion: the "
                                                   "tokens it generated.", sizes)
        self.request_kv_computed = histogram("request_prefill_kv_computed_tokens", "Per finished completion: its "
                                             "prompt's tokens less those found in the prefix cache (vLLM's: the "
                                             "KV computed at prefill).", sizes)
        self.request_max_generation = histogram("request_max_num_generation_tokens", "Per finished request: the "
                                                "most tokens any of its completions generated.", sizes)
        self.request_n = histogram("request_params_n", "Per finished request: its n.", REQUEST_N_BUCKETS)
        self.request_max_tokens = histogram("request_params_max_tokens", "Per finished request: its max_tokens "
                                            "(the context's room when it set none).", sizes)
        self._success = Counter(PREFIX + "request_success_total", "Finished completions by finish reason "
                                "(vLLM's: stop, length, abort, error, repetition).", [MODEL_LABEL, "finished_reason"],
                                registry=reg)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens per engine step (vLLM's): the "
                                          "prompts whose first token came, and the tokens generated.",
                                          ITERATION_TOKENS_BUCKETS)
        self.fed_tokens = histogram("iteration_fed_tokens", "Tokens one engine step fed the target: decoding "
                                    "rows with their drafts, and prompt chunks.", ITERATION_TOKENS_BUCKETS)
        self.num_drafts = counter("spec_decode_num_drafts", "Decoding steps that scored a draft.", spec)
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens scored.", spec)
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec)
        self._accepted_per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens "
                                         "accepted at each draft position.", [MODEL_LABEL, "position"], registry=spec)
        self._drafted_per_pos = Counter(PREFIX + "spec_decode_num_draft_tokens_per_pos", "Draft tokens scored "
                                        "at each draft position.", [MODEL_LABEL, "position"], registry=spec)
        self.speculating = Gauge(PREFIX + "spec_decode_speculating_fraction", "Of the last step's decoding "
                                 "requests, the fraction that drafted (the goodput policy's choice).", by_model,
                                 registry=spec).labels(model)
        for pos in range(draft_positions(engine) if spec is not None else 0):
            self._accepted_per_pos.labels(model, str(pos))      # at 0 from the start, as vLLM's
            self._drafted_per_pos.labels(model, str(pos))
        for outcome in ("stop", "length", "abort", "error", "invalid"):
            self._requests.labels(model, outcome)     # present at 0 from the start, so rates are defined
        for reason in FINISH_REASONS:
            self._success.labels(model, reason)

    def count(self, outcome: str, n: int = 1) -> None:
        """requests_total{outcome} += n, for the request being answered (which then counts no more)."""
        self._requests.labels(self.model_name, outcome).inc(n)
        answer = _ANSWERING.get()
        if answer is not None:
            answer.counted = True

    def pooled(self, input_tokens: list[int], seconds: float) -> None:
        """One pooling request (embeddings, score, rerank, classify) answered: one API request
        (requests_total), and as vLLM's engine counts them each input a finished request (stop),
        observed in every per-request family as vLLM observes a finished pooling request: its
        tokens as prompt tokens, none generated, the request's latency as its end-to-end,
        prefill and inference time (the inputs run in one call: no queue or decode time of
        their own), n 1 and no max_tokens (vLLM's pooling params have none)."""
        self.count("stop")
        self.prompt_tokens.inc(sum(input_tokens))
        for n in input_tokens:
            self._success.labels(self.model_name, "stop").inc()
            self.request_prompt_tokens.observe(n)
            self.request_kv_computed.observe(n)
            self.request_generation_tokens.observe(0)
            self.e2e.observe(seconds)
            self.prefill_time.observe(seconds)
            self.inference_time.observe(seconds)
            for h in (self.queue_time, self.decode_time, self.tpot):
                h.observe(0.0)
            self.request_n.observe(1)
            self.request_max_generation.observe(0)

    def answered(self, status: int | None, api_route: bool) -> None:
        """A request to a route of the API that its completions did not count has been answered:
        a 5xx counts as an error, a 4xx (a body that fails validation, an unknown model) as
        invalid. Not counted: other paths (unknown ones from scanners, /health and the other
        probes), wrong methods, 401 (no key), 499 or no answer (the client left; its completions
        count as abort)."""
        if not api_route or status is None:
            return
        if status >= 500:
            self.count("error")
        elif 400 <= status < 500 and status not in (401, 405, 499):
            self.count("invalid")

    def step(self, engine, events) -> None:
        """After each engine step (on the worker thread): the tokens and the speculative work it
        did, counted as the step did them (vLLM counts per engine step: a request a client left
        counts all it computed, as the log lines and the spans count it)."""
        d = StepDelta.of(events)
        if d.prompt_tokens:
            self.prompt_tokens.inc(d.prompt_tokens)
            self.prompt_tokens_cached.inc(d.prompt_cached)
        if d.generation_tokens:
            self.generation_tokens.inc(d.generation_tokens)
        if d.num_drafts:
            self.num_drafts.inc(d.num_drafts)
            self.draft_tokens.inc(d.draft_tokens)
            self.accepted_tokens.inc(d.accepted_tokens)
            for i, (n, a) in enumerate(zip(d.drafted_per_pos, d.accepted_per_pos)):
                self._drafted_per_pos.labels(self.model_name, str(i)).inc(n)
                self._accepted_per_pos.labels(self.model_name, str(i)).inc(a)
        if self.stat_logger is not None:
            self.stat_logger.step(d)
        if engine.last_step_tokens:             # a step that ran a forward
            self.iteration_tokens.observe(engine.last_step_iteration_tokens)
            self.fed_tokens.observe(engine.last_step_tokens)
        if events:
            self.speculating.set(engine.last_step_drafting / len(events))

    def finished(self, reason: str, stats: RequestStats | None, prompt_tokens: int, generated: int, arrival: float,
                 first: float | None, last: float | None, end: float, max_tokens: int | None = None) -> None:
        """One completion has left the engine (stop, length, abort once the engine stopped it, or
        error when the engine failed it): vLLM's FinishedRequestStats, every per-completion family
        observed together from it: request_success{reason}, its prompt and generated tokens (all
        the engine generated for it: the sum is generation_tokens_total), its prompt tokens less
        those found in the prefix cache (request_prefill_kv_computed_tokens, vLLM's), and its
        latencies: e2e (arrival to its end), queue
        (arrival to first scheduled; its whole wait for one never scheduled), prefill (scheduled to
        first token), decode (first to last token), inference (scheduled to last token) and time
        per output token (decode / (tokens - 1)), each 0 for one that made no token (0 for TPOT
        with fewer than 2), as vLLM observes its finished requests; and its max_tokens (vLLM's
        max_tokens_param, observed per finished completion when set)."""
        self._success.labels(self.model_name, reason).inc()
        if max_tokens:
            self.request_max_tokens.observe(max_tokens)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_kv_computed.observe(prompt_tokens - (stats.cached_tokens if stats is not None else 0))
        self.request_generation_tokens.observe(generated)
        queued = stats.queue_time_s if stats is not None and stats.queue_time_s else None
        self.e2e.observe(end - arrival)
        if first is None:        # no token: its time went to waiting (never scheduled) or to its prompt
            self.queue_time.observe(queued if queued is not None else end - arrival)
            for h in (self.prefill_time, self.decode_time, self.inference_time, self.tpot):
                h.observe(0.0)
            return
        queued = queued or 0.0
        self.queue_time.observe(queued)
        self.prefill_time.observe(max(0.0, first - arrival - queued))
        self.decode_time.observe(last - first)
        self.inference_time.observe(max(0.0, last - arrival - queued))
        self.tpot.observe((last - first) / (generated - 1) if generated > 1 else 0.0)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.itl_old.observe(seconds)

    def prompt_ended(self, n: int, max_generated: int) -> None:
        """Every completion of one prompt has ended (vLLM's parent request: a list of prompts is
        one engine request each): its n and the most tokens one of them generated."""
        self.request_n.observe(n)
        self.request_max_generation.observe(max_generated)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestCounter:
    """ASGI middleware: each HTTP request to the API counts once in requests_total. One that ran
    completions is counted by them (ServerMetrics.finished); any other, by its answer
    (ServerMetrics.answered). `routes`: the API's (not /health, /metrics, ... nor unknown paths)."""

    def __init__(self, app, metrics: ServerMetrics, routes):
        self.app, self.metrics, self.routes = app, metrics, list(routes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        answer, status = _Answer(), None
        token = _ANSWERING.set(answer)

        async def watch(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception:
            status = 500                    # the server's error handler answers it
            raise
        finally:
            _ANSWERING.reset(token)
            if not answer.counted:
                self.metrics.answered(status, self._api_route(scope))

    def _api_route(self, scope) -> bool:
        # a wrong method is a partial match: not counted (nor is the 405 it gets); SageMaker's
        # /invocations is the API's too (a body no route takes: its 400 is counted)
        if scope.get("method") == "POST" and app_path(scope) == "/invocations":
            return True
        return any(route.matches(scope)[0] == Match.FULL for route in self.routes)
