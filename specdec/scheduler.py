"""Which requests run in a step, what each feeds, who waits (vLLM's scheduler, small).

Per step, in order:
1. every running request that has its prompt in the cache decodes: its K (drafts) is chosen,
   and its blocks grow to hold the step's slots. When the pool is out of blocks the newest
   running request is preempted (vLLM's default, recompute): its blocks are freed and it goes
   back to the front of the queue with everything it generated, to be prefilled again later.
   Nothing ever fails for lack of memory: the pool always holds one full-length sequence.
2. requests still prefilling get the next chunk of their prompt, within the step's token
   budget (max_num_batched_tokens, decoding tokens counted first);
3. waiting requests join, oldest first, while there is a free seat (max_num_seqs), budget,
   and blocks for their whole prompt; none joins in a step that preempted. With prefix caching,
   one whose prompt starts with full blocks that a request already planned computes in this step
   (n > 1 siblings, a burst sharing a long prefix), at least half of the blocks it would compute,
   waits a step and then takes those blocks from the cache, instead of computing a copy of them
   (the requests behind it are admitted meanwhile).

Why each waiting request waits (vLLM's vllm:num_requests_waiting_by_reason, waiting_by_reason()):
"deferred" when the last schedule() passed over it for a transient reason (its LoRA adapter
could not be loaded beside the running ones, max_loras; or it waits a step for prompt blocks
another request computed in that step), "capacity" otherwise (no seat, no room in the step's
token budget, no free KV blocks for its prompt, or a step that preempted).

When every cache is windowed (model/kv.py: the blocks behind the window are given back after
each step), a request joins with blocks for its first chunk only, and each later chunk reserves
its own slots as decoding does (preempting when the pool is out of blocks): a long prompt then
never holds more than its window and a chunk.

Under vLLM's `scheduling_policy="priority"` the queue is ordered by (priority, arrival), lower
first; the running requests reserve their blocks in that order and the victim of a preemption
is the least urgent running request (the largest (priority, arrival)), which rejoins the queue
at its place. A running request is never preempted to seat a waiting one (as in vLLM).

Invariant of a running request: the target's cache holds seq[:num_cached]; it decodes once
num_cached == len(seq) - 1 (the last token is fed by the next step, with the drafts). With
prefix caching a request may join with num_cached > 0 (its prompt's leading blocks found in the
cache), even == len(seq) - 1.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .config import SamplingParams, SchedulerConfig
from .detokenize import Detokenizer
from .metrics import RequestStats
from .model import BlockManager
from .proposers import RequestContext

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    ctx: RequestContext
    max_tokens: int
    detok: Detokenizer
    arrival: float
    stream: bool = False            # keep events for a streaming iterator (Engine.generate)
    priority: int = 0               # scheduling_policy="priority": lower runs first
    seq: list[int] = field(default_factory=list)        # prompt + output so far
    out: list[int] = field(default_factory=list)        # output tokens
    stats: RequestStats = field(default_factory=RequestStats)
    status: str = WAITING
    num_cached: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    events: deque = field(default_factory=deque)
    cumulative_logprob: float = 0.0     # of the kept output under the raw target (best_of only)
    # params.prompt_logprobs: each prompt token's (None for the first), filled as chunks are prefilled
    prompt_logprobs: list | None = None
    prompt_logprobs_next: int = 1       # the first prompt position not yet scored
    lora: object | None = None          # its LoRA adapter (specdec/lora: LoRAAdapter), or None
    lora_request: object | None = None  # the LoRARequest that named it (RequestOutput.lora_request)
    cache_salt: str | None = None       # vLLM's: its prefix-cache blocks are shared only under the same salt
    trace_headers: dict | None = None   # W3C trace context its span is a child of (specdec/tracing.py)
    trace_name: str | None = None       # its span's gen_ai.request.id (the API request's id), else request_id

    def __post_init__(self):
        self.seq = list(self.prompt)
        self.stats.prompt_tokens = len(self.prompt)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt)

    @property
    def prefilled(self) -> bool:
        return self.status == RUNNING and self.num_cached == len(self.seq) - 1

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    @property
    def urgency(self) -> tuple[int, float]:
        """The priority policy's order key: smaller runs first."""
        return self.priority, self.arrival


@dataclass
class StepPlan:
    decode: list[Request] = field(default_factory=list)
    ks: list[int] = field(default_factory=list)                             # K per decoding request
    chunks: list[tuple[Request, int, int]] = field(default_factory=list)   # (request, start, count)
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, lookahead: Callable[[int], int],
                 max_loras: int | None = None):
        """max_loras: the most distinct LoRA adapters running requests may use (None: no LoRA)."""
        self.config, self.blocks, self.lookahead = config, blocks, lookahead
        self.max_loras = max_loras
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.ids: set[str] = set()          # the ids of the requests waiting or running
        self.by_priority = config.scheduling_policy == "priority"
        # the waiting requests the last schedule() passed over for a transient reason (LoRA slots,
        # blocks another request computes): replaced whole, so readers on other threads see one set
        self.deferred: frozenset[Request] = frozenset()

    def add(self, req: Request) -> None:
        self.ids.add(req.request_id)
        if self.by_priority:
            self._enqueue(req)
        else:
            self.waiting.append(req)

    def _enqueue(self, req: Request) -> None:
        """Into the priority queue at its (priority, arrival) place."""
        self.waiting.insert(bisect.bisect_right(self.waiting, req.urgency, key=lambda r: r.urgency), req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, choose_k: Callable[[list[Request]], list[int]]) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        decoding = [r for r in self.running if r.prefilled]
        if self.by_priority:        # the most urgent reserve first: a victim is never already planned
            decoding.sort(key=lambda r: r.urgency)
        for i, (r, k) in enumerate(zip(decoding, choose_k(decoding) if decoding else [])):
            if r.status != RUNNING:         # preempted for an older request in this loop
                continue
            # drafts fit the step's token budget, every later decoding row keeping its one token
            # (vLLM trims speculative tokens to the budget the same way); K = 0 is always lossless
            k = max(0, min(k, budget - (len(decoding) - i)))
            if self._reserve(r, len(r.seq) - 1 + max(k + 1, self.lookahead(k)), plan):
                plan.decode.append(r)
                plan.ks.append(k)
                budget -= k + 1
        windowed = self.blocks.window is not None
        for r in list(self.running):
            if not r.prefilled and budget > 0 and r.status == RUNNING:
                n = min(len(r.seq) - 1 - r.num_cached, budget)
                if windowed:    # the chunk's own blocks; it never preempts r or what this step planned
                    spare = frozenset([r, *plan.decode, *(q for q, _, _ in plan.chunks)])
                    if not self._reserve(r, r.num_cached + n, plan, spare):
                        continue
                plan.chunks.append((r, r.num_cached, n))
                budget -= n
        deferred: set = set()           # waiting a step for blocks this step computes: the others go on
        lora_blocked: set = set()       # passed over: their adapters cannot be loaded now (max_loras)
        while self.waiting and not plan.preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            r = self._next_seatable(deferred, lora_blocked)
            if r is None:
                break
            if self._computed_by_other(r, plan):
                deferred.add(r)
                continue
            if not self._admit(r, budget + 1 if windowed else None):
                break
            self.waiting.remove(r)
            plan.admitted.append(r)
            n = min(len(r.seq) - 1 - r.num_cached, budget)
            if n > 0:
                plan.chunks.append((r, r.num_cached, n))
                budget -= n
        self.deferred = frozenset(deferred | lora_blocked)
        return plan

    def _next_seatable(self, skip: set = frozenset(), passed: set | None = None) -> Request | None:
        """The first waiting request whose LoRA adapter (if any) can run now: one the running
        requests use, or a new one while fewer than max_loras are in use. The others keep their
        places (as in vLLM); and once one of them waits, later requests for adapters wait behind
        it (requests without one still go ahead), so that the running adapters' requests drain
        and free a slot instead of keeping it forever. `skip`: requests left for the next step;
        `passed`: gets the requests passed over for their adapters (vLLM's skipped waiting queue)."""
        if self.max_loras is None:
            return next((r for r in self.waiting if r not in skip), None)
        in_use = {r.lora.uid for r in self.running if r.lora is not None}   # each reading of an adapter
        blocked = False
        for r in self.waiting:
            if r in skip:
                continue
            if r.lora is None:
                return r
            if not blocked and (r.lora.uid in in_use or len(in_use) < self.max_loras):
                return r
            blocked = True
            if passed is not None:
                passed.add(r)
        return None

    def waiting_by_reason(self) -> dict[str, int]:
        """The waiting requests by why they wait (vLLM's num_requests_waiting_by_reason; the two
        add up to the queue's length): "deferred", passed over by the last schedule() for a
        transient reason, and "capacity", the others. Read from one copy of the queue (list()
        copies the deque without running Python code: a reader on another thread is not
        interrupted by the worker's changes)."""
        waiting, deferred = list(self.waiting), self.deferred
        n = sum(r in deferred for r in waiting)
        return {"capacity": len(waiting) - n, "deferred": n}

    def _reserve(self, r: Request, num_slots: int, plan: StepPlan, spare: frozenset = frozenset()) -> bool:
        """Blocks for r's step, preempting the newest (or least urgent) running requests outside
        `spare`: r itself last when it is not spared; False when r cannot have them."""
        while not self.blocks.ensure(r.request_id, num_slots):
            others = [q for q in self.running if q not in spare]
            if not others:
                return False
            victim = max(others, key=lambda q: q.urgency) if self.by_priority else others[-1]
            self.preempt(victim)
            plan.preempted.append(victim)
            if victim is r:
                return False
        return True

    @staticmethod
    def _wanted(r: Request) -> list[int]:
        """What r's cache may take from the prefix cache: its sequence but the last token (none
        when prompt logprobs need every prompt token's forward)."""
        return r.seq[:-1] if r.prompt_logprobs is None or r.prompt_logprobs_next >= len(r.prompt) else []

    @staticmethod
    def _root(r: Request) -> bytes:
        """What r's blocks' keys depend on beside the tokens: an adapter's blocks are its own
        reading's (one added again, a folder rewritten, shares none); a salted request's are its
        salt's (vLLM's cache_salt: tenants' prefixes kept apart)."""
        return (b"" if r.lora is None else f"lora:{r.lora.id}:{r.lora.uid}:{r.lora.path}".encode()) \
            + (b"" if r.cache_salt is None else b"salt:" + r.cache_salt.encode("utf-8", "surrogatepass"))

    def _computed_by_other(self, r: Request, plan: StepPlan) -> bool:
        """Does a request planned before r compute, in this step, full blocks of r's prompt that
        the prefix cache does not hold yet (a burst sharing a system prompt, n > 1 siblings)? Then r
        waits: blocks become findable after the step's forward, and at its next admission r takes
        them instead of computing its own copies (vLLM caches a block as it is scheduled, which
        shares them within the step; here it costs r a step, so r waits only when those blocks are
        at least half of the full blocks it would compute). Only a request prefilling in this step
        holds r back, so r waits at most until that prompt is in the cache."""
        if not self.blocks.prefix_caching or not plan.chunks:     # nothing prefilled this step: no lookup
            return False
        wanted = self._wanted(r)
        bs, over = self.blocks.block_size, self.blocks.key_overlap
        full = max(0, len(wanted) - over) // bs
        if full == 0:
            return False
        root = self._root(r)
        have = len(self.blocks.cached_prefix(wanted, root))
        for q, start, n in plan.chunks:
            if self._root(q) != root or not self.blocks.shares(q.request_id):
                continue
            upto = min(full, (start + n) // bs, max(0, len(q.seq) - over) // bs)   # q's full blocks after this step
            i = have
            while i < upto and q.seq[i * bs:(i + 1) * bs + over] == wanted[i * bs:(i + 1) * bs + over]:
                i += 1
            # worth a step only where the gain is half of what r would compute or more (n > 1 siblings,
            # a long shared prefix); a short shared system prompt is computed again, not waited for
            if i > have and 2 * (i - have) >= full - have and q.seq[:have * bs] == wanted[:have * bs]:
                return True
        return False

    def _admit(self, r: Request, ahead: int | None = None) -> bool:
        """A seat for r when its whole prompt (and the slot of its first step) fits now, or its
        first `ahead` slots (sliding windows); the prompt's leading blocks come from the prefix
        cache when it holds them."""
        wanted = self._wanted(r)
        # a first admission counts its whole prompt as looked up (vLLM's), a return after preemption nothing
        queries = None if r.num_preemptions or not wanted else len(r.prompt)
        cached = self.blocks.admit(r.request_id, wanted, len(r.seq), ahead, self._root(r), queries)
        if cached is None:
            return False
        r.status, r.num_cached = RUNNING, cached
        if not r.num_preemptions:
            r.stats.cached_tokens = min(cached, len(r.prompt))
        self.running.append(r)
        return True

    def preempt(self, r: Request) -> None:
        """r (running) back to waiting, its blocks freed: recomputed when next scheduled."""
        self.running.remove(r)
        self.blocks.remove(r.request_id)
        r.status, r.num_cached = WAITING, 0
        r.num_preemptions += 1
        if self.by_priority:
            self._enqueue(r)
        else:
            self.waiting.appendleft(r)

    def finish(self, r: Request) -> None:
        """r is done (finished or aborted): its seat and blocks are free."""
        if r in self.running:
            self.running.remove(r)
            self.blocks.remove(r.request_id)
            self.ids.discard(r.request_id)
        elif r in self.waiting:
            self.waiting.remove(r)
            self.ids.discard(r.request_id)
        if r in self.deferred:          # an abort of a deferred request: not kept until the next step
            self.deferred = self.deferred - {r}
        r.status = FINISHED
