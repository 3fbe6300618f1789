"""The batch engine (vLLM's LLMEngine shape): add_request / step / abort, and a per-request stream.

Each step runs, for every running request at once:
    schedule (scheduler.py) -> propose (one draft pass per depth over the drafting requests)
    -> ONE target forward over all their tokens, flat: decoding requests feed
       [last token, drafts or tree nodes], prefilling ones a chunk of their prompt
    -> verify every decoding request (greedy and sampled in one batch, one host sync)
    -> commit: roll back rejected slots, move accepted tree paths, tell the proposer.
Invariant: a running request's target cache holds every committed token but the last one, so a
plain decoding step is the K = 0 case. A request's tokens meet only its own cache slots and its
own generator, so its output is the same as when it runs alone (greedy: always; seeded
sampling: with a fixed K, since "auto" K's choices depend on measured timings). "auto" chooses
each request's K per step by goodput (goodput.py); the scheduler reserves KV slots for the
chosen K only, so K = 0 costs no slots for drafts.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field

import torch

from .adaptive import SpeculationPolicy
from .goodput import Outcome, SeqInfo, StepCosts
from .config import LoRAConfig, SamplingParams, SchedulerConfig, StructuredOutputsConfig
from .model import graphs as graphs_module
from .model.graphs import CudaGraphs
from .detokenize import Detokenizer
from .logprobs import LOGPROBS_MODES, TokenLogprob, step_logprobs
from .lora import LoRAManager, LoRARequest
from .metrics import ITERATION_TOKENS_BUCKETS, ITL_BUCKETS, HistogramTally, RequestStats, tree_depth
from .model import BlockManager, ForwardBatch, Transformer
from .model.kv import plan_blocks
from .profiler import StepProfiler, range_of
from .proposers import Committed, Draft, ProposeItem, Proposer, ProposerCaps, RequestContext
from .prediction import Prediction
from .proposers.base import draft_room, merge_committed, prune_tree
from .sampling import Controls, bad_words_of, make_generator, needs_controls
from .structured import GrammarCompiler
from .scheduler import Request, Scheduler
from .verifier import (Verified, controlled_logits, cut_to_grammar, extend_with_forced, feed_of, limit_depth,
                       verify_batch)
from .tokenizer import Tokenizer


# a request not drafting under "auto" hands its proposer its steps at once after this many rows
# (bounds the features held: 256 x SmolLM2's 576 floats = 0.6 MB a request)
DEFER_ROWS = 256


@dataclass
class StepEvent:
    """What one decoding step adds to a request's output."""
    token_ids: list[int]                 # new output tokens
    text: str                            # new text (held back while it could still change)
    num_accepted: int                    # token_ids[:num_accepted] were accepted drafts
    finished: bool = False
    finish_reason: str | None = None     # "stop" | "length"
    stop_reason: int | str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    request_id: str | None = None
    logprobs: list[TokenLogprob] | None = None   # one per token_ids entry, when params.logprobs is set
    cumulative_logprob: float | None = None   # the output's so far (requests with best_of > n)
    prompt_logprobs: list[TokenLogprob | None] | None = None   # on a request's first event (params.prompt_logprobs)


log = logging.getLogger("specdec.engine")


class Engine:
    def __init__(self, target: Transformer, tokenizer: Tokenizer, proposer: Proposer | None = None,
                 num_speculative_tokens: int | str = 0, max_model_len: int | None = None, max_k: int = 8,
                 scheduler_config: SchedulerConfig | None = None, typical: tuple[float, float] | None = None,
                 logprobs_mode: str = "raw_logprobs", disable_by_batch_size: int | None = None,
                 kv_cache_dtype: str = "auto", clock=time.perf_counter, max_logprobs: int = 20,
                 lora_config: LoRAConfig | None = None, cuda_graph_sizes: tuple[int, ...] | None = None,
                 structured_outputs_config: StructuredOutputsConfig | None = None):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.target, self.tokenizer, self.proposer = target, tokenizer, proposer
        # times the parts of a step (the stats' draft / target / prefill times, "auto"'s cost
        # model); time.process_time on a shared machine (`specdec bench --clock cpu`). Arrival,
        # queue and first-token times stay on the wall clock.
        self.clock = clock
        # called right before each target forward, once its batch is built: the server hands the
        # previous step's events to its event loop there, so that their Python runs while the
        # forward has released the GIL instead of beside the step's own (drafting, scheduling)
        self.before_forward: Callable[[], None] | None = None
        # called with each request's last event as it leaves the engine (a step's, or abort()'s),
        # on the thread that stepped or aborted it: LLM.get_metrics counts every request there
        self.on_finished: Callable[[StepEvent], None] | None = None
        self.logprobs_mode = logprobs_mode
        if not (isinstance(max_logprobs, int) and max_logprobs >= -1):
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 for the whole vocabulary, got {max_logprobs!r}")
        # vLLM's --max-logprobs: the most alternatives a request may ask for per token (-1: any)
        self.max_logprobs = target.config.vocab_size if max_logprobs == -1 else min(max_logprobs, target.config.vocab_size)
        self.num_speculative_tokens = num_speculative_tokens if proposer is not None else 0
        self.max_model_len = min(max_model_len or target.config.max_position_embeddings,
                                 target.config.max_position_embeddings)
        self.eos_ids = set(tokenizer.eos_token_ids)
        self.caps = proposer.caps if proposer is not None else ProposerCaps()
        self._deferred: dict = {}       # request id -> its Committed steps not yet given to the proposer (_update_proposer)
        self._deferred_rows: dict = {}  # request id -> the feature rows those steps hold
        self._warned_vocab = False      # a draft held a token outside the target's vocabulary (_in_vocab)
        self._warned_draft = False      # a proposer returned a malformed draft (_well_formed)
        self.typical = typical          # (threshold, alpha) of Medusa's typical acceptance: lossy, opt-in
        self.max_k = max_k
        self.policy = SpeculationPolicy(self.num_speculative_tokens, self.caps.tree and not self.caps.chain, max_k,
                                        self.caps.max_tree_size,
                                        disable_by_batch_size)
        self.config = scheduler_config or SchedulerConfig()
        self.tree_nodes_cap = _tree_nodes_cap(target) if self.caps.tree else None
        self.kv_dtype = kv_cache_dtype_of(target, kv_cache_dtype)
        self.blocks, self.kv = self._allocate_kv(max_k, spare=cuda_graph_sizes is not None)
        # CUDA graphs of the target's forwards over this engine's cache (--compilation-config), or None
        self.graphs = None if cuda_graph_sizes is None else \
            CudaGraphs(target, self.kv, cuda_graph_sizes, emulate=graphs_module.EMULATE)
        self.blocks.prefix_caching = self.config.enable_prefix_caching
        # EAGLE: its slots read the next token, which block keys then cover; Medusa, MLP speculators:
        # they draft from the feature of the token before the last, which a hit up to the last
        # token would leave uncomputed
        self.blocks.key_overlap = int(self.caps.next_token_in_cache)
        self.blocks.recompute_last_hit = self.caps.needs_hidden and not self.caps.next_token_in_cache
        # LoRA adapters beside the target's matrices (vLLM's --enable-lora), or None
        self.lora = LoRAManager(target, lora_config) if lora_config is not None else None
        self.scheduler = Scheduler(self.config, self.blocks, self._lookahead,
                                   lora_config.max_loras if lora_config is not None else None)
        self._ids = itertools.count()
        # OpenTelemetry: a span per retired request (specdec/tracing.RequestTracer), or None
        self.tracer = None
        # what the last step did, and running totals: read by the server's metrics
        self.num_preemptions = 0
        self.last_step_tokens = 0          # tokens fed to the target (drafts and prompt chunks included)
        self.last_step_drafting = 0        # decoding requests that drafted
        # vLLM's tokens per step: the prompts whose first token came (whole, once per request)
        # plus the tokens generated, observed per step that ran a forward; and its inter-token
        # latencies, one per decoding step after a request's first token: LLM.get_metrics reads them
        self.last_step_iteration_tokens = 0
        self.iteration_tokens = HistogramTally(ITERATION_TOKENS_BUCKETS)
        self.inter_token_latency = HistogramTally(ITL_BUCKETS)
        self.grammars = GrammarCompiler(tokenizer, target.config.vocab_size, sorted(self.eos_ids),
                                        structured_outputs_config)
        # torch.profiler around steps while start_profile() .. stop_profile() (profiler.py), or None
        self.profiler: StepProfiler | None = None
        # the EngineWorker whose thread steps this engine for a server or an AsyncLLM, or None: while
        # it runs, LLM's offline calls from other threads run on that thread (one stepper at a time)
        self.owner = None

    def _lookahead(self, k: int) -> int:
        return self.proposer.lookahead_slots(k) if self.proposer is not None and k > 0 else 0

    def _allocate_kv(self, max_k: int, spare: bool = False):
        """One block pool for the target and the proposer's own caches (they share block tables);
        spare: the target's cache gets a block more, for CUDA graphs' padding rows."""
        k = max_k if self.num_speculative_tokens == "auto" else int(self.num_speculative_tokens)
        # a step reserves len(seq) - 1 + max(j + 1, lookahead(j)) slots for the j it drafts, and
        # near the end of the context j is cut below k: an EAGLE tree's lookahead stops growing at
        # its depth, so the excess may peak at a j < k
        max_slots = self.max_model_len + max([0, *(self._lookahead(j) - j - 1 for j in range(1, k + 1))])
        per_slot = self.target.kv_bytes_per_slot(dtype=self.kv_dtype) + \
            (self.proposer.kv_bytes_per_slot() if self.proposer else 0)
        num_blocks, max_blocks = plan_blocks(self.config, per_slot, max_slots, self.target.device)
        blocks = BlockManager(num_blocks, self.config.block_size, self.config.max_num_seqs, max_blocks)
        kv = self.target.new_kv(blocks, dtype=self.kv_dtype, spare=spare)
        if self.proposer is not None:
            self.proposer.initialize_kv(blocks, kv)
        return blocks, kv

    # -- the public surface ------------------------------------------------------------------

    def truncation(self, params: SamplingParams) -> int | None:
        """vLLM's truncate_prompt_tokens as a length: None keeps the whole prompt, -1 as many
        tokens as the context holds with room for one generated token; more than max_model_len
        is vLLM's ValueError."""
        k = params.truncate_prompt_tokens
        if k is None:
            return None
        if k > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
                             f"({self.max_model_len}). Please, select a smaller truncation size.")
        return self.max_model_len - 1 if k == -1 else k

    def truncated(self, prompt: list[int], params: SamplingParams) -> list[int]:
        """vLLM's truncate_prompt_tokens on token ids: the prompt's last k (a text prompt is cut
        where it is tokenized, keeping its special tokens: Tokenizer.encode_last)."""
        k = self.truncation(params)
        return prompt if k is None else prompt[-k:]

    def check_prompt(self, prompt: list[int], params: SamplingParams, room: int = 1) -> None:
        """prompt: as the request runs it (already truncated: truncate_prompt_tokens); room: the
        slots it needs past the prompt (one output token; pooling needs none)."""
        if not prompt:
            raise ValueError("prompt is empty: it must have at least one token")
        if len(prompt) > self.max_model_len - room:
            raise ValueError(f"prompt is too long: {len(prompt)} tokens, the context holds "
                             f"{self.max_model_len} (prompt + output)")
        vocab = self.target.config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in params.logit_bias or {} if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in params.allowed_token_ids or [] if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"allowed_token_ids token id {bad} is outside the vocabulary [0, {vocab})")
        bad = [t for t in params.stop_token_ids if t >= vocab]       # vLLM's _validate_stop_token_ids
        if bad:
            raise ValueError(f"token_id(s) {bad} in stop_token_ids contain out-of-vocab token ids. "
                             f"Vocabulary size: {vocab}")
        if params.structured_outputs is not None:
            self.grammars.check(params.structured_outputs)
        if params.bad_words:        # tokenized here, where the server prepares the request, and kept on params
            bad_words_of(params, self.tokenizer)
        self.check_logprobs(params)

    def check_logprobs(self, params: SamplingParams) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            n = self.target.config.vocab_size if asked == -1 else asked
            if n is not None and n > self.max_logprobs:
                raise ValueError(f"{name} must be at most {self.max_logprobs} (max_logprobs), got {asked}"
                                 + (" (every token: start with max_logprobs=-1)" if asked == -1 else ""))

    def controls(self, prompt: list[int], params: SamplingParams) -> Controls | None:
        """A request's sequence-reading controls, or None when it has none (the fast path)."""
        if not needs_controls(params):
            return None
        bad_words = bad_words_of(params, self.tokenizer)      # tokenized by check_prompt already
        # vLLM's _all_stop_token_ids: EOS is banned under min_tokens whatever ignore_eos says
        stop_ids = sorted({*self.eos_ids} | set(params.stop_token_ids))
        grammar = self.grammars.grammar(params.structured_outputs, prompt) if params.structured_outputs is not None else None
        return Controls(params, list(prompt), bad_words, stop_ids, grammar)

    def add_request(self, prompt: list[int], params: SamplingParams, seed_offset: int = 0,
                    request_id: str | None = None, stream: bool = False, priority: int = 0,
                    lora_request: LoRARequest | None = None, prediction: list[int] | None = None,
                    trace_headers: dict | None = None, trace_name: str | None = None,
                    cache_salt: str | None = None) -> Request:
        """Queue a request; it joins the running batch at a step when a seat and blocks are free
        (priority: under scheduling_policy="priority", lower joins first; lora_request: the
        LoRA adapter it runs with; prediction: OpenAI's Predicted Outputs, token ids the output is
        expected to repeat, drafted from where it does (specdec/prediction.py; a speculative engine
        with a chain proposer: otherwise counted as rejected); trace_headers / trace_name: the W3C
        trace context its span goes under and the id the span names, when `tracer` is set;
        cache_salt: vLLM's, prefix-cache blocks are shared only between requests with the same salt)."""
        self.check_priority(priority)
        if request_id is not None and request_id in self.scheduler.ids:       # vLLM's refusal: ids key KV blocks
            raise ValueError(f"request id {request_id!r} is already running")
        params = params.clone()            # the request's own: later changes to the caller's do not reach it
        prompt = self.truncated(prompt, params)
        self.check_prompt(prompt, params)
        for name in ("logprobs", "prompt_logprobs"):       # -1: every token
            if getattr(params, name) == -1:
                object.__setattr__(params, name, self.target.config.vocab_size)
        adapter = self.check_lora(lora_request)
        seed = None if params.seed is None else params.seed + seed_offset
        ctx = RequestContext(params, make_generator(seed, self.target.device), self.target.config.vocab_size,
                             self.controls(prompt, params), prompt_len=len(prompt),
                             prediction=self._prediction(prediction))
        req = Request(request_id if request_id is not None else str(next(self._ids)), list(prompt), params, ctx,
                      params.max_tokens or self.max_model_len - len(prompt),
                      Detokenizer(self.tokenizer, params.stop, params.skip_special_tokens,
                                  params.include_stop_str_in_output, params.min_tokens, prompt), time.perf_counter(),
                      stream=stream, priority=priority, lora=adapter, lora_request=lora_request if adapter is not None else None,
                      trace_headers=trace_headers, trace_name=trace_name, cache_salt=check_salt(cache_salt))
        if ctx.prediction is not None:
            req.stats.prediction_tokens = len(ctx.prediction.ids)
        req.stats.arrival_time, req.stats.queued_ts = time.time(), req.arrival
        self.scheduler.add(req)
        return req

    # vLLM's LLMEngine LoRA calls (llm.llm_engine forwards to these; AsyncLLM runs them on its worker)
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now, not at its first request."""
        self.check_lora(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget the adapter of that lora_int_id (running requests keep theirs)."""
        return self.lora is not None and self.lora.remove_id(lora_id)

    def list_loras(self) -> set[int]:
        return {a.id for a in self.lora.loaded()} if self.lora is not None else set()

    def pin_lora(self, lora_id: int) -> bool:
        """Keep the loaded adapter of that id loaded past max_cpu_loras (until removed)."""
        return self.lora is not None and self.lora.pin(lora_id)

    def check_lora(self, lora_request: LoRARequest | None):
        """The adapter a request names, loaded (None for none); a ValueError says what is wrong."""
        if lora_request is None:
            return None
        if self.lora is None:
            raise ValueError(f"LoRA adapter {getattr(lora_request, 'lora_name', lora_request)!r} requested, but LoRA "
                             f"is not enabled (LLM(enable_lora=True), specdec serve --enable-lora)")
        return self.lora.check(lora_request)

    def check_priority(self, priority) -> None:
        """vLLM's rule: a priority other than 0 needs scheduling_policy="priority"."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"got priority {priority} but priority scheduling is not enabled "
                             f"(--scheduling-policy priority)")

    def abort(self, request_id: Hashable) -> StepEvent | None:
        """The request leaves the engine now, its seat, blocks and proposer state freed. -> its
        last event (finish_reason "abort", its statistics so far), or None when it is not here."""
        req = next((r for r in itertools.chain(self.scheduler.running, self.scheduler.waiting)
                    if r.request_id == request_id), None)
        if req is None:
            return None
        self._retire(req)
        event = StepEvent([], "", 0, finished=True, finish_reason="abort", stats=req.stats, request_id=request_id)
        if self.on_finished is not None:
            self.on_finished(event)
        return event

    def preempt_all(self) -> int:
        """Every running request back to the waiting queue, its KV blocks freed, as a preemption
        does: its prompt and output so far are computed again when it is next scheduled (vLLM's
        reset_running_requests after new weights: no KV of the old weights stays in use).
        -> how many were running."""
        running = list(self.scheduler.running)
        for r in reversed(running):           # the oldest ends first in the queue, as it was
            self.scheduler.preempt(r)
        self._preempted(running)
        return len(running)

    def weights_changed(self, reset_running_requests: bool = True) -> int:
        """After the target's weights changed in place: no KV of the old weights is found again
        (every prefix block forgotten) and, with reset_running_requests, none is read again either
        (running requests preempted: recomputed with the new weights at their next step; without
        it they go on over the KV they have). -> how many running requests were reset."""
        n = self.preempt_all() if reset_running_requests else 0
        self.blocks.forget_prefixes()
        return n

    def _preempted(self, reqs) -> None:
        self.num_preemptions += len(reqs)
        for r in reqs:
            if self.proposer is not None:
                self.proposer.preempt_request(r.request_id)
                self._deferred.pop(r.request_id, None)
                self._deferred_rows.pop(r.request_id, None)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop every cached prefix block (vLLM's reset_prefix_cache); False, and nothing dropped,
        while requests hold KV blocks, unless reset_running_requests preempts them first (they are
        recomputed at their next step)."""
        if reset_running_requests:
            self.preempt_all()
        return self.blocks.reset_prefix_cache()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries)."""
        return self.blocks.prefix_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.blocks.prefix_hits

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV pool's blocks held by requests."""
        return 1.0 - self.blocks.num_free_blocks / self.blocks.num_blocks

    def generate(self, prompt: list[int], params: SamplingParams, seed_offset: int = 0,
                 lora_request: LoRARequest | None = None, stop: Callable[[], bool] | None = None) -> Iterator[StepEvent]:
        """Stream one request; the last event has finished=True and the final stats. Stepping
        advances every request in the engine: other requests' events wait in their own queues.
        stop(): checked between steps; once true the request leaves (its KV blocks and proposer
        state freed) and the stream ends without a finished event (chat's Ctrl-C)."""
        req = self.add_request(prompt, params, seed_offset=seed_offset, stream=True, lora_request=lora_request)
        try:
            while True:
                while not req.events:
                    if stop is not None and stop():
                        return
                    self.step()
                event = req.events.popleft()
                yield event
                if event.finished:
                    return
        finally:
            if not req.finished:
                self._retire(req)

    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        """Advance every running request by one step; returns the step's events (each request's
        last one also to on_finished)."""
        prof = self.profiler
        if prof is None or not prof.active:
            events = self._step(None)
        else:
            if not prof.ranges:                   # delay_iterations still passing
                events = self._step(None)
            else:
                with prof.range(f"specdec:step {self.num_running} running {self.num_waiting} waiting"):
                    events = self._step(prof)
            if self.last_step_tokens:             # a step that ran a forward (not an idle one) counts
                prof.after_step()
        if self.on_finished is not None:
            for event in events:
                if event.finished:
                    self.on_finished(event)
        return events

    def _step(self, prof: StepProfiler | None) -> list[StepEvent]:
        t0, wall0 = self.clock(), time.perf_counter()
        self._choose_s = 0.0                  # the policy's time this step (_choose_k)
        with range_of(prof, "schedule"):
            plan = self.scheduler.schedule(self._choose_k)
        self._preempted(plan.preempted)
        for r in plan.admitted:
            if not r.num_preemptions:
                r.stats.queue_time_s = wall0 - r.arrival
                r.stats.scheduled_ts = wall0
            if self.proposer is not None:
                self.proposer.add_request(r.request_id, r.ctx)
        self.last_step_tokens = self.last_step_drafting = self.last_step_iteration_tokens = 0
        if plan.empty:
            return []
        t1 = self.clock()
        with range_of(prof, "propose"):
            drafts = self._propose(plan)
        t2 = self.clock()
        drafts, host = self._on_host(drafts)
        with range_of(prof, "forward"):
            out, offsets, num_tokens, attention, scored = self._forward(plan, drafts, host)
        if scored:                            # prompt chunks' rows, after every decoding row
            self._score_prompts(scored, out.logits)
            out = dataclasses.replace(out, logits=out.logits[:scored[0][3]])
        self.last_step_tokens = num_tokens
        self.last_step_drafting = sum(d is not None for d in drafts)
        # p's controls (penalties, bias, grammar...) per row path, once: verification and
        # processed logprobs read the same rows
        with range_of(prof, "verify"):
            # raw logprobs under a grammar see its mask, as vLLM's (it masks before its sampler),
            # and so does best_of's ranking, asked for logprobs or not
            raw = self.logprobs_mode.startswith("raw_")
            masked = [] if raw and any((r.params.logprobs is not None or _ranked(r.params))
                                       and r.ctx.controls is not None and r.ctx.controls.grammar is not None
                                       for r in plan.decode) else None
            logits = controlled_logits(plan.decode, drafts, out.logits, offsets, masked)
            results = verify_batch(plan.decode, drafts, logits, offsets, self.typical)
            logprobs = self._logprobs(plan, results, (masked[0] if masked else out.logits) if raw else logits,
                                      offsets)
        t3 = self.clock()
        with range_of(prof, "commit"):
            committed = self._commit(plan, drafts, results, out.hidden, offsets)
        t4 = self.clock()
        if self.proposer is not None and committed:
            with range_of(prof, "proposer update"):
                self._update_proposer(plan, committed)
        if self.blocks.prefix_caching:
            self._register(committed)
        if self.blocks.window is not None:        # every cache windowed: blocks behind it go back
            for c in committed:
                self.blocks.trim(c.request_id)
        # what the proposer does after verification (EAGLE re-reads the kept features, a draft
        # model prefills its prompt chunks) is drafting cost too: "auto" must weigh it
        propose_s = (t2 - t1) + (self.clock() - t4)
        events = self._finish_step(plan, drafts, results, logprobs, propose_s, t3 - t2, self.clock() - t0)
        self.iteration_tokens.observe(self.last_step_iteration_tokens)
        self._observe(plan, drafts, results, attention, propose_s, self.clock() - t0)
        return events

    # -- one step, in order ------------------------------------------------------------------

    def _choose_k(self, decoding: list[Request]) -> list[int]:
        """K per decoding request: the policy's choice, cut to what can still be emitted. A tree
        may hold more nodes than that (as long as they fit in the context), no deeper path."""
        if self.proposer is None:
            return [0] * len(decoding)
        seqs = []
        for r in decoding:
            room = self._room(r)
            cap = 0 if room <= 0 else (self.max_model_len - len(r.seq) if self.caps.tree else room)
            cap = draft_room(self.caps, len(r.seq), max(0, cap))     # a draft model's shorter context
            if self.tree_nodes_cap is not None:                         # no tree as deep as a sliding window
                cap = min(cap, self.tree_nodes_cap)
            seqs.append(SeqInfo(r.request_id, r.params.greedy, len(r.seq), cap))
        t = self.clock()
        ks = self.policy.choose(seqs, len(self.scheduler.running), self._pending_prefill(len(decoding)))
        self._choose_s = self.clock() - t
        ks = [max(0, min(k, s.cap)) for k, s in zip(ks, seqs)]
        if not self.caps.tree:
            for i, r in enumerate(decoding):
                pred = r.ctx.prediction
                if pred is not None:
                    ks[i] = self._predicted_k(r, pred, ks[i], seqs[i].cap)
        return ks

    def _predicted_k(self, r: Request, pred: Prediction, k: int, cap: int) -> int:
        """Predicted Outputs: while the reply follows its prediction (the last draft from it kept
        whole), the next draft runs as far as the prediction goes, up to max_k, whatever K the
        policy chose (a followed prediction is accepted far more often than any drafter)."""
        pred.peeked = None
        longest = min(self.max_k, cap)
        if not pred.following or longest <= k or self._lookahead(longest) > longest + 1:
            return k
        pred.peeked = pred.draft(r.seq[r.ctx.prompt_len:], longest)
        return max(k, len(pred.peeked))

    def _pending_prefill(self, decoding: int) -> int:
        """Prompt tokens this step will likely prefill: what running and seatable waiting
        requests have left, within the step's token budget."""
        sched = self.scheduler
        left = sum(len(r.seq) - 1 - r.num_cached for r in sched.running if not r.prefilled)
        seats = self.config.max_num_seqs - len(sched.running)
        left += sum(len(r.seq) - 1 for r in itertools.islice(sched.waiting, max(0, seats)))
        return max(0, min(left, self.config.max_num_batched_tokens - decoding))

    def _room(self, r: Request) -> int:
        return min(self.max_model_len - len(r.seq) - 1, r.max_tokens - len(r.out) - 1)

    def _update_proposer(self, plan, committed: list[Committed]) -> None:
        """Hand the proposer what the step kept. Under "auto" a deferrable proposer (EAGLE, MTP,
        a draft model: their update is a forward of their own) is not updated for a decoding
        request that did not draft this step: its steps are kept and merged into one update when
        it drafts again (_propose), or when DEFER_ROWS rows have piled up. While speculation is
        off ("auto" choosing plain, or disable_by_batch_size reached), the proposer then costs
        nothing."""
        if not self.caps.deferrable or (self.policy.goodput is None and self.policy.disable_by_batch_size is None):
            self.proposer.update(committed)
            return
        idle = {r.request_id for r, k in zip(plan.decode, plan.ks) if k == 0}
        now = []
        for c in committed:
            rid = c.request_id
            if rid in idle and not c.prefill:
                self._deferred.setdefault(rid, []).append(
                    c if c.hidden is None else dataclasses.replace(c, hidden=c.hidden.clone()))
                self._deferred_rows[rid] = self._deferred_rows.get(rid, 0) + (1 if c.hidden is None else len(c.hidden))
                if self._deferred_rows[rid] >= DEFER_ROWS:
                    now.append(self._merged(rid))
            elif rid in self._deferred:
                now.append(self._merged(rid, c))
            else:
                now.append(c)
        if now:
            self.proposer.update(now)

    def _register(self, committed: list[Committed]) -> None:
        """Prefix caching: the full blocks that every cache now holds become findable (a draft
        model's or an EAGLE head's cache may trail the target's: deferred updates, drafts fed)."""
        for c in committed:
            n = self.proposer.cached_upto(c.request_id) if self.proposer is not None else None
            self.blocks.register(c.request_id, c.seq, c.num_cached if n is None else min(n, c.num_cached))

    def _merged(self, rid, *after: Committed) -> Committed:
        """rid's deferred steps (and `after`) as one, no longer held."""
        self._deferred_rows.pop(rid, None)
        return merge_committed([*self._deferred.pop(rid), *after])

    def _catch_up(self, ids: list) -> None:
        """The deferred updates of these requests, now (they are about to draft)."""
        merged = [self._merged(i) for i in ids if i in self._deferred]
        if merged:
            self.proposer.update(merged)

    def _prediction(self, ids: list[int] | None):
        """A request's Predicted Outputs, checked; None for none."""
        if not ids:
            return None
        vocab = self.target.config.vocab_size
        try:
            ids = [operator.index(t) if not isinstance(t, bool) else None for t in ids]   # numpy / torch ints too
        except TypeError:
            ids = [None]
        bad = next((t for t in ids if t is None or not 0 <= t < vocab), False)
        if bad is not False:
            raise ValueError(f"prediction token ids must be integers in [0, {vocab})"
                             + (f", got {bad}" if bad is not None else ""))
        return Prediction.of(ids)

    def _propose(self, plan) -> list:
        drafts = [None] * len(plan.decode)
        asks = [(i, ProposeItem(r.request_id, r.seq, k)) for i, (r, k) in enumerate(zip(plan.decode, plan.ks)) if k > 0]
        if not asks:
            return drafts
        predicted = {}                    # Predicted Outputs: drafted from the request's prediction where it has one
        if not self.proposer.caps.tree:
            for i, ask in asks:
                r = plan.decode[i]
                pred = r.ctx.prediction
                if pred is not None:
                    tokens = pred.peeked[:ask.k] if pred.peeked is not None else \
                        pred.draft(r.seq[r.ctx.prompt_len:], ask.k)
                    pred.peeked = None
                    pred.drafted = len(tokens) > 0
                    if pred.drafted:
                        predicted[i] = Draft(torch.from_numpy(tokens.copy()))
            asks = [(i, ask) for i, ask in asks if i not in predicted]
        if self._deferred and asks:
            self._catch_up([a.request_id for _, a in asks])
        proposed = self.proposer.propose([a for _, a in asks]) if asks else []
        pairs = [*zip(asks, proposed), *(((i, None), d) for i, d in predicted.items())]
        for (i, ask), draft in pairs:
            k = plan.ks[i]
            draft = self._well_formed(draft, k)
            if draft is None:
                continue
            if draft.is_tree:
                draft = limit_depth(draft, self._room(plan.decode[i]))
            controls = plan.decode[i].ctx.controls
            if controls is not None and controls.grammar is not None:
                draft = cut_to_grammar(draft, controls.grammar) if draft.k > 0 else draft
                draft = extend_with_forced(draft, controls.grammar, plan.ks[i])
            drafts[i] = draft if draft is not None and draft.k > 0 else None
        for i in predicted:
            if drafts[i] is None:                 # cut away (a grammar): this step drafts nothing from it
                plan.decode[i].ctx.prediction.drafted = False
        return drafts

    def _well_formed(self, draft: Draft | None, k: int) -> Draft | None:
        """A proposer's draft as verification needs it, or None (the request decodes plainly this
        step, lossless) with one warning per proposer: one row of tokens; a tree's parents one per
        token, each an earlier node or -1; q [tokens, vocab]. A draft longer than the k asked for
        is cut to k (a tree keeps its first k nodes: their parents come before them)."""
        if draft is None or draft.k == 0:
            return draft
        vocab, parents, q = self.target.config.vocab_size, draft.parents, draft.probs
        if draft.tokens.dim() != 1:
            why = f"tokens of shape {tuple(draft.tokens.shape)}, not one row"
        elif parents is not None and (len(parents) != draft.k or any(not -1 <= int(a) < j for j, a in enumerate(parents))):
            why = f"{len(parents)} tree parents for {draft.k} tokens, or a parent that is not an earlier node (or -1)"
        elif q is not None and (q.dim() != 2 or tuple(q.shape) != (draft.k, vocab)):
            why = f"q of shape {tuple(q.shape)}, not [{draft.k}, {vocab}]"
        else:
            if draft.k <= k:
                return draft
            return Draft(draft.tokens[:k], None if q is None else q[:k], None if parents is None else list(parents[:k]))
        if not self._warned_draft:
            log.warning("the %s proposer returned a malformed draft (%s): such drafts are dropped, the request "
                        "decodes plainly that step; warned once", getattr(self.proposer, "name", "?"), why)
            self._warned_draft = True
        return None

    def _on_host(self, drafts: list) -> tuple[list, list[int]]:
        """Every draft's tokens to the host at once (proposers may leave them on either device:
        one sync), and the drafts cut at their first token outside the target's vocabulary
        [0, vocab_size) (a datastore or drafter made for another tokenizer): such a token would
        index past the target's embedding. Returns (drafts, their tokens on the host, in order)."""
        proposed = [d.tokens.to(self.target.device) for d in drafts if d is not None]
        host = torch.cat(proposed).tolist() if proposed else []
        vocab = self.target.config.vocab_size
        if host and (min(host) < 0 or max(host) >= vocab):
            drafts, host = self._in_vocab(drafts, host, vocab)
        return drafts, host

    def _in_vocab(self, drafts: list, host: list[int], vocab: int) -> tuple[list, list[int]]:
        """The drafts with their tokens outside [0, vocab) dropped: a chain is cut before its
        first such token, a tree loses those nodes and everything below them. Exact for fixed
        drafts (q = None, the lookup methods): the target gives such a token p = 0, so it and what
        follows would be rejected, and the position then draws from p, as it does with no draft.
        A draft drawn from q never holds one (q is cut to the target's vocabulary)."""
        if not self._warned_vocab:
            bad = next(t for t in host if not 0 <= t < vocab)
            log.warning("the %s proposer drafted token id %d, outside the target's vocabulary of %d: drafts are "
                        "cut before such tokens (a drafter or datastore made for another tokenizer?); warned once",
                        getattr(self.proposer, "name", "?"), bad, vocab)
            self._warned_vocab = True
        out, kept_host, at = [], [], 0
        for d in drafts:
            if d is None:
                out.append(None)
                continue
            toks = host[at:at + d.k]
            at += d.k
            keep = [0 <= t < vocab for t in toks]
            if all(keep):
                out.append(d)
                kept_host += toks
                continue
            if not d.is_tree:
                n = keep.index(False)
                d = Draft(d.tokens[:n], d.probs[:n] if d.probs is not None else None) if n else None
                toks = toks[:n]
            else:
                toks, parents, kept = prune_tree(toks, d.parents, keep)
                d = Draft(d.tokens[kept], d.probs[kept] if d.probs is not None else None, parents) if kept else None
            out.append(d)
            kept_host += toks
        return out, kept_host

    def _forward(self, plan, drafts, host: list[int]):
        """One target forward: decoding requests first, then prompt chunks; returns the output,
        each entry's first row in it (for decoding requests also their first logits row: they
        come first and every one of their rows has logits), the number of tokens fed and the
        slots they attend over (each sees its sequence's earlier slots: the attention's work), in
        all and by the decoding requests' drafted rows. host: the drafts' tokens (_on_host)."""
        ids, counts, trees, logits, tokens, offsets = [], [], [], [], [], []
        at = 0
        for r, draft in zip(plan.decode, drafts):
            k = draft.k if draft is not None else 0
            fed, tree = feed_of(r.seq[-1], draft, host[at:at + k], self.typical is not None and not r.params.greedy)
            at += k
            offsets.append(sum(counts))
            ids.append(r.request_id), counts.append(len(fed)), trees.append(tree), logits.append(len(fed))
            tokens += fed
        scored, row = [], sum(logits)         # (request, chunk start, rows, first logits row)
        for r, start, n in plan.chunks:
            offsets.append(sum(counts))
            # a chunk's row j predicts position start + j + 1: rows for the prompt positions
            # not scored yet, when the request asks for prompt logprobs
            want = r.prompt_logprobs is not None and start + n >= r.prompt_logprobs_next and start + 1 < len(r.prompt)
            ids.append(r.request_id), counts.append(n), trees.append(None), logits.append(n if want else 0)
            if want:
                scored.append((r, start, n, row))
                row += n
            tokens += r.seq[start:start + n]
        starts = [r.num_cached for r in plan.decode] + [start for _, start, _ in plan.chunks]
        batch = ForwardBatch.build(self.kv, ids, counts, starts, trees, logits, self._lora_slots(plan))
        if self.before_forward is not None:
            self.before_forward()
        out = self.target(torch.tensor(tokens, dtype=torch.long), self.kv, batch,
                          logits=bool(plan.decode) or bool(scored),
                          hidden=self.caps.feature_layers or self.caps.needs_hidden, graphs=self.graphs)
        attention = sum(n * st + n * (n + 1) // 2 for n, st in zip(counts, starts))
        # of which the drafted rows' (each decoding entry's rows after its first)
        drafted = sum(n * st + n * (n + 1) // 2 - (st + 1) for n, st in zip(counts, starts[:len(plan.decode)]))
        return out, offsets, len(tokens), (attention, drafted), scored

    def _lora_slots(self, plan) -> list[int] | None:
        """Each entry's LoRA slot (-1: none), in the forward's order; None when none has one."""
        if self.lora is None:
            return None
        reqs = [*plan.decode, *(r for r, _, _ in plan.chunks)]
        adapters = [r.lora for r in reqs if r.lora is not None]
        if not adapters:
            return None
        slot_of = self.lora.activate(adapters)
        return [-1 if r.lora is None else slot_of[r.lora.uid] for r in reqs]

    def _score_prompts(self, scored, logits) -> None:
        """Prompt logprobs (raw log-softmax of the target, as vLLM reports them) of the positions
        the chunks' rows predict (row: the chunk's first row in the step's logits), into each
        request's list."""
        wanted, spans = [], []
        for r, start, n, row in scored:
            lo, hi = max(r.prompt_logprobs_next, start + 1), min(len(r.prompt), start + n + 1)   # positions
            if lo >= hi:          # nothing of the prompt left to score (a preempted request's recompute)
                continue
            wanted.append((_TopK(r.params.prompt_logprobs), [row + p - 1 - start for p in range(lo, hi)],
                           r.prompt[lo:hi]))
            spans.append((r, lo, hi))
        for (r, lo, hi), lps in zip(spans, step_logprobs(logits, wanted, "raw_logprobs")):
            r.prompt_logprobs[lo:hi] = lps
            r.prompt_logprobs_next = hi

    def _logprobs(self, plan, results: list[Verified], logits, offsets) -> dict[int, list[TokenLogprob]]:
        """{decoding index: logprobs of its emitted tokens} for the requests that ask (or rank
        their candidates by them: best_of > n), from this step's logits (the row that predicted
        each token)."""
        asking = [i for i, r in enumerate(plan.decode) if r.params.logprobs is not None or _ranked(r.params)]
        wanted = [(plan.decode[i].params, [offsets[i] + row for row in results[i].rows], results[i].emitted)
                  for i in asking]
        return dict(zip(asking, step_logprobs(logits, wanted, self.logprobs_mode)))

    def _commit(self, plan, drafts, results: list[Verified], hidden, offsets) -> list[Committed]:
        """Rejected slots are forgotten (rollback), accepted tree paths moved next to the prefix."""
        committed = []
        for r, res, off in zip(plan.decode, results, offsets):
            start = len(r.seq) - 1
            if res.tree:
                self.kv.move(r.request_id, [start + row for row in res.rows[1:]], start + 1)
            r.seq += res.emitted
            r.num_cached = len(r.seq) - 1
            if r.ctx.controls is not None and r.ctx.controls.grammar is not None:
                r.ctx.controls.grammar.advance(res.emitted)
            self.kv.set_length(r.request_id, r.num_cached)
            feats = hidden[torch.tensor([off + row for row in res.rows])] if hidden is not None else None
            committed.append(Committed(r.request_id, r.seq, r.num_cached, feats, prefill=False))
        for (r, start, n), off in zip(plan.chunks, offsets[len(plan.decode):]):
            r.num_cached = start + n
            self.kv.set_length(r.request_id, r.num_cached)
            committed.append(Committed(r.request_id, r.seq, r.num_cached,
                                       hidden[off:off + n] if hidden is not None else None, prefill=True))
        return committed

    def _finish_step(self, plan, drafts, results: list[Verified], logprobs: dict, draft_s: float,
                     verify_s: float, step_s: float) -> list[StepEvent]:
        now = time.perf_counter()
        events = []
        for i, (r, draft, res) in enumerate(zip(plan.decode, drafts, results)):
            k = draft.k if draft is not None else 0
            stats = r.stats
            stats.draft_time_s += draft_s
            stats.target_time_s += verify_s
            first = not r.out
            event = self._accept(r, res.emitted, res.accepted)
            if first and r.prompt_logprobs is not None:
                event.prompt_logprobs = list(r.prompt_logprobs)
            if i in logprobs:
                lps = logprobs[i][:len(event.token_ids)]
                if r.params.logprobs is not None:
                    event.logprobs = lps
                if _ranked(r.params):
                    r.cumulative_logprob += sum(x.logprob for x in lps)
                    event.cumulative_logprob = r.cumulative_logprob
            # a tree's per-position counts go by depth (the accepted path's positions), a chain's by K
            depth = tree_depth(draft.parents) if draft is not None and draft.is_tree else None
            stats.record_step(k, res.accepted, len(event.token_ids), depth)
            pred = r.ctx.prediction
            if pred is not None and pred.drafted:
                # drafts kept by verification and left in the output (a stop string or max_tokens may
                # cut the step's tokens): OpenAI's accepted tokens appear in the completion
                pred.following = res.accepted == k          # kept whole: the next draft may run longer
                pred.drafted = False
            self.last_step_iteration_tokens += len(event.token_ids) + (stats.prompt_tokens if first else 0)
            if not stats.first_token_ts:                 # the request's first token
                stats.first_token_ts = now
                stats.time_to_first_token_s = stats.time_to_first_token_s or now - r.arrival
            else:
                self.inter_token_latency.observe(now - stats.last_token_ts)
            stats.wall_time_s = now - r.arrival
            stats.last_token_ts = now
            event.stats, event.request_id = stats, r.request_id
            events.append(event)
            if r.stream:
                r.events.append(event)
            if event.finished:
                r.finish_reason, r.stop_reason = event.finish_reason, event.stop_reason
                if r.ctx.prediction is not None:       # OpenAI's: of the prediction, what the reply holds
                    appear = r.ctx.prediction.appearing_in(r.out)
                    stats.accepted_prediction_tokens = appear
                    stats.rejected_prediction_tokens = len(r.ctx.prediction.ids) - appear
                self._retire(r)
        for r, _, _ in plan.chunks:
            r.stats.prefill_time_s += step_s
        return events

    def _observe(self, plan, drafts, results: list[Verified], attention: tuple[int, int], propose_s: float,
                 step_s: float) -> None:
        """Tell the policy what each decoding request's draft yielded and what the step fed and
        cost (greedy tree steps also tell what every smaller, nested tree would have kept)."""
        if not plan.decode or self.proposer is None:
            return
        ks = [d.k if d is not None else 0 for d in drafts]
        outcomes = [Outcome(r.request_id, r.params.greedy, k, res.accepted, res.path if r.params.greedy else None)
                    for r, k, res in zip(plan.decode, ks, results)]
        # drafting costs follow what was asked (a lookup that finds nothing still ran)
        # the policy's own time is left out: it refits only now and then, which would read as
        # noise in what a fed token costs
        costs = StepCosts(len(plan.decode), sum(ks), sum(n for _, _, n in plan.chunks), attention[0],
                          sum(k > 0 for k in plan.ks), max(plan.ks), propose_s,
                          step_s - propose_s - self._choose_s, attention[1])
        self.policy.observe(outcomes, costs)
        if self.caps.weighs_costs and self.policy.goodput is not None:
            # the hybrid weighs its sources by the costs measured here rather than its constants
            unit = self.policy.goodput.unit_costs([len(r.seq) for r in plan.decode])
            if unit is not None:
                self.proposer.measured(*unit, propose_s)

    def _retire(self, r: Request) -> None:
        """r leaves the engine (finished or aborted): its seat, blocks and proposer state are freed."""
        self.scheduler.finish(r)
        self.policy.forget(r.request_id)
        if self.tracer is not None:
            try:
                self.tracer.request_done(r, r.finish_reason or "abort",
                                         r.lora.name if r.lora is not None else None)
            except Exception:           # noqa: BLE001 - a span never fails a request
                log.exception("tracing: the span of request %s was not recorded", r.request_id)
        if self.proposer is not None:
            # running, or waiting: a preempted request keeps proposer state (preempt_request) until
            # here; every proposer takes an id it holds nothing for (one never admitted)
            self.proposer.remove_request(r.request_id)
        self._deferred.pop(r.request_id, None)
        self._deferred_rows.pop(r.request_id, None)

    def _accept(self, r: Request, emitted: list[int], n: int) -> StepEvent:
        """Append emitted tokens one by one until a stop condition; nothing after it is kept."""
        params, new, reason, stop_reason = r.params, [], None, None
        for tok in emitted:
            new.append(tok)
            r.out.append(tok)
            eos = tok in self.eos_ids and not params.ignore_eos
            if eos or tok in params.stop_token_ids:
                # vLLM's: EOS has no stop reason; the stop token's text is left out unless asked for
                reason, stop_reason = "stop", (None if eos else tok)
                if params.include_stop_str_in_output and params.detokenize:
                    r.detok.add(tok)
                break
            if params.detokenize and r.detok.add(tok):
                reason, stop_reason = "stop", r.detok.stop_reason
                break
            if len(r.out) >= r.max_tokens or len(r.prompt) + len(r.out) >= self.max_model_len:
                reason = "length"
                break
        grammar = r.ctx.controls.grammar if r.ctx.controls is not None else None
        if grammar is not None and grammar.error is not None and reason != "length":
            # the grammar's matcher failed (a parser or lexer limit) and allowed EOS alone: not a
            # "stop" whose output breaks the constraint, an abort that says why
            reason, stop_reason = "abort", f"structured output failed: {grammar.error}"
            log.warning("request %s: %s", r.request_id, stop_reason)
        text = r.detok.delta(final=reason is not None) if params.detokenize else ""
        return StepEvent(new, text, min(n, len(new)), reason is not None, reason, stop_reason)


KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8")


def check_salt(salt) -> str | None:
    """vLLM's cache_salt: None, or a non-empty string (a ValueError otherwise)."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
    return salt


def kv_cache_dtype_of(target: Transformer, name: str) -> torch.dtype:
    """vLLM's --kv-cache-dtype for the target's cache. "auto": bf16 for a target whose matrices
    stay GGUF-packed on the CPU (their activations are already rounded to int8 per block, and
    reading half the bytes measured +4% (short contexts) to +10% (~430 tokens) tokens per CPU
    second for SmolLM2 Q4_1 at 16 sequences; llama.cpp keeps f16 caches), else the
    activations' dtype (exact against the model's own full-precision forward). "int8"
    (opt-in, like vLLM's fp8): each row of keys or values as int8 with one fp32 scale
    (model/kv.py), ~1.9x the slots of bf16 in the same memory; outputs differ from bf16's."""
    from .model.quant import QuantLinear

    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    if name != "auto":
        return getattr(torch, name)
    packed = any(isinstance(m, QuantLinear) for m in target.modules())
    return torch.bfloat16 if packed and target.device.type == "cpu" and target.dtype == torch.float32 else target.dtype


def _tree_nodes_cap(target) -> int | None:
    """The most nodes a verified tree may hold on a target with sliding windows: its smallest
    window - 1. The attention lets a tree node see every node of its path (the tree mask decides
    past the tree's first slot), which is the window's answer only while the path is shorter
    than the window; a tree of at most window - 1 nodes is at most that deep. Chains apply the
    window row by row and need no cap. None: no windowed layer (real windows, 128 and more, are
    above every K specdec drafts)."""
    layers = getattr(getattr(target, "model", None), "layers", None) or []
    windows = [w for layer in layers if (w := getattr(getattr(layer, "self_attn", None), "window", None))]
    return max(1, min(windows) - 1) if windows else None


def kv_cache_dtype_name(engine: "Engine") -> str:
    """The kv_cache_dtype name that gives another engine on the same target this engine's cache
    (a plain baseline compared with it must decode over the same cache)."""
    return str(engine.kv_dtype).removeprefix("torch.")


def _ranked(params) -> bool:
    """best_of > n: the candidates are ranked by cumulative logprob."""
    return (params.best_of or params.n) > params.n


@dataclass(frozen=True)
class _TopK:
    """What step_logprobs reads of a request's parameters, for its prompt logprobs."""
    logprobs: int
    greedy: bool = True
