"""Prompt lookup first, a learned drafter where lookup has nothing worth drafting: "ngram+eagle"
and "ngram+draft_model".

Lookup is nearly free, and where an answer copies from its context (summaries, answers from a
given text) it drafts long runs the target keeps; a learned drafter guesses anywhere, but each
token it drafts costs a fraction of a target forward. Per request and step:

1. lookup proposes the continuation of the longest earlier match of the sequence's tail (n
   tokens, n_min <= n <= n_max), as `ngram` does;
2. each source's expected accepted tokens for a draft of m tokens come from what it achieved
   for this request (SourceRecords): per-position conditional acceptance a_j, counted with
   forgetting, E(m) = sum_{j<m} prod_{l<=j} a_l; lookup's per match length n, since long matches
   are kept far more often (shrunk towards all of the request's lookups while an n has few
   samples); both start from an optimistic prior;
3. the step drafts the source and length that maximise expected tokens per unit of cost,
   (1 + E(m)) / (1 + m * (verify_cost + c) + u), c = 0 for lookup and learned_cost for the
   learned drafter, u its catch-up (below: catch_up_cost per feature row it has not seen yet);
   m = 0 (plain decoding) competes too, so a source that does not pay for a request stops
   drafting for it. A source that has never drafted for the request drafts one token the first
   time the step would otherwise draft nothing (a first try: the prior alone need not beat plain
   decoding, as the learned drafter's does not at the default costs; not while its catch-up would
   cost more than a plain step); a source left unused for
   probe_every steps drafts one token the next such time, so its figures stay measured.

Lossless. A step's choice depends only on the request's sequence and the outcomes of its
earlier steps, never on anything drawn in this step; the learned drafter is then asked for
exactly m tokens. So the draft verified was drawn from a known q: a point mass (lookup; probs
None) or the learned drafter's own q rows for the tokens it drew, and rejection sampling is
exact for any q (tests/test_hybrid.py enumerates two steps whose second choice depends on the
first step's outcome). Greedy decoding checks the target's argmax either way.

The learned drafter's update() is deferred while lookup serves a request (when its caps say
`deferrable`): the request's committed steps are kept and merged into one update just before the
learned drafter next drafts for it, so steps served by lookup (or plain) skip its per-step work
(for EAGLE one head forward, ~0.17 of a SmolLM2 forward). Prompt chunks are handed at once, as
the target prefills them: its cache holds every prompt, so prefix caching can register them.
"""

from __future__ import annotations

from collections.abc import Hashable
import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from ..goodput import OnlineLinear
from .base import (Committed, Draft, ProposeItem, Proposer, ProposerBase, ProposerCaps, RequestContext, draft_room,
                   merge_committed)
from .ngram import match

LOOKUP, LEARNED = "lookup", "learned"
PRIOR = 0.6            # optimistic start (and a first try of each source): outcomes decide afterwards
PRIOR_WEIGHT = 2.0     # ... worth this many observations
BUCKET_WEIGHT = 2.0    # a match length's own figures against all of the request's lookups
MAX_DEFERRED = 4096    # feature rows kept per request before the learned drafter catches up anyway
                       # (SmolLM2: 2.3 KB a row)


@dataclass(frozen=True)
class HybridSettings:
    # Costs in plain decoding steps, measured in `specdec bench` steps of SmolLM2 Q4_1 on one Xeon core
    # (README): a verified draft token 0.15-0.2 (0.12 at 64 tokens of context, 0.3 at 1000; ~0 on a
    # GPU); an EAGLE-drafted token 0.5-0.8 all told (the head forward, its catch-up, q's processing
    # when sampling) on top of its verification.
    verify_cost: float = 0.25
    learned_cost: float = 0.5
    catch_up_cost: float = 0.02    # per feature row the learned drafter catches up on (EAGLE: ~0.1 ms a row)
    probe_every: int = 16          # steps a source may stay unused before it drafts one token again
    decay: float = 0.95            # forgetting per observation of a record

    def __post_init__(self):
        for name in ("verify_cost", "learned_cost", "catch_up_cost"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 10):
                raise ValueError(f"speculative_config.{name} must be a number in [0, 10], got {v!r}")
        if not (isinstance(self.probe_every, int) and not isinstance(self.probe_every, bool) and self.probe_every >= 1):
            raise ValueError(f"speculative_config.probe_every must be an integer >= 1, got {self.probe_every!r}")


@dataclass(frozen=True)
class Choice:
    source: str | None     # LOOKUP, LEARNED, or None: draft nothing
    m: int                 # tokens to draft
    n: int = 0             # lookup's match length


class _Record:
    """Per-position conditional acceptance of one source's chains, counted with forgetting."""

    def __init__(self, size: int, decay: float):
        self.tried, self.kept, self.decay = np.zeros(size), np.zeros(size), decay

    def rates(self, m: int, prior: float | np.ndarray, weight: float) -> np.ndarray:
        """[m] rates, each shrunk towards its prior with `weight` observations' worth: prior[j]
        when given per position, else the rate of the position before (the first: prior)."""
        if isinstance(prior, np.ndarray):
            return (self.kept[:m] + weight * prior[:m]) / (self.tried[:m] + weight)
        out = np.empty(m)
        for j in range(m):
            prior = out[j] = (self.kept[j] + weight * prior) / (self.tried[j] + weight)
        return out

    def observe(self, drafted: int, accepted: int) -> None:
        self.tried *= self.decay
        self.kept *= self.decay
        reached = min(drafted, accepted + 1)      # positions tried: up to the first rejection
        self.tried[:reached] += 1
        self.kept[:min(accepted, drafted)] += 1


def best_length(rates: np.ndarray, cost: float, fixed: float = 0.0) -> tuple[float, int]:
    """(expected tokens per unit of cost, m) of the best draft length m >= 1 for conditional
    acceptance rates [M] (position j kept given 0..j-1 kept) at `cost` per drafted token plus
    `fixed` for drafting at all (units: a plain decoding step)."""
    emitted = 1.0 + np.cumsum(np.cumprod(rates))
    ratio = emitted / (1.0 + fixed + cost * np.arange(1, len(rates) + 1))
    m = int(np.argmax(ratio))
    return float(ratio[m]), m + 1


class SourceRecords:
    """What one request's sources achieved, and the step's choice (pure: no model, no tensors)."""

    def __init__(self, size: int, settings: HybridSettings):
        self.size, self.s = size, settings
        self.lookup, self.learned = _Record(size, settings.decay), _Record(size, settings.decay)
        self.by_n: dict[int, _Record] = {}
        self.idle = {LOOKUP: 0, LEARNED: 0}

    def lookup_rates(self, n: int, m: int) -> np.ndarray:
        overall = self.lookup.rates(m, PRIOR, PRIOR_WEIGHT)
        bucket = self.by_n.get(n)
        return overall if bucket is None else bucket.rates(m, overall, BUCKET_WEIGHT)

    def learned_rates(self, m: int) -> np.ndarray:
        return self.learned.rates(m, PRIOR, PRIOR_WEIGHT)

    def choose(self, n: int, lookup_len: int, learned_max: int, catch_up: int = 0,
               costs: tuple[float, float] | None = None) -> Choice:
        """n, lookup_len: lookup's match length and how many tokens it found (0: none);
        learned_max: the most the learned drafter may draft now (0: it may not); catch_up: the
        feature rows it would have to catch up on first; costs: (verify, learned) per token in
        plain steps as measured (None: the settings')."""
        verify, learned = costs or (self.s.verify_cost, self.s.learned_cost)
        best, choice = 1.0, Choice(None, 0)               # plain decoding: 1 token per forward
        if lookup_len:
            ratio, m = best_length(self.lookup_rates(n, lookup_len), verify)
            best, choice = (ratio, Choice(LOOKUP, m, n)) if ratio > best else (best, choice)
        if learned_max:
            ratio, m = best_length(self.learned_rates(learned_max), verify + learned,
                                   self.s.catch_up_cost * catch_up)
            best, choice = (ratio, Choice(LEARNED, m)) if ratio > best else (best, choice)
        if choice.source is None:
            # a first try: a source that has never drafted for this request drafts one token the
            # first time it may (its measured acceptance decides from then on; the prior alone
            # does not pay at every cost, e.g. the learned drafter's at the default costs), unless
            # catching the learned drafter up first would cost more than a plain step
            if lookup_len and self.lookup.tried[0] == 0:
                choice = Choice(LOOKUP, 1, n)
            elif learned_max and self.learned.tried[0] == 0 and self.s.catch_up_cost * catch_up <= 1.0:
                choice = Choice(LEARNED, 1)
            # a probe: one token from a tried source left unused too long
            elif lookup_len and self.idle[LOOKUP] >= self.s.probe_every:
                choice = Choice(LOOKUP, 1, n)
            elif learned_max and self.idle[LEARNED] >= self.s.probe_every:
                choice = Choice(LEARNED, 1)
        for src, able in ((LOOKUP, lookup_len), (LEARNED, learned_max)):
            self.idle[src] = 0 if choice.source == src else self.idle[src] + bool(able)
        return choice

    def observe(self, choice: Choice, accepted: int) -> None:
        if choice.source == LEARNED:
            self.learned.observe(choice.m, accepted)
        elif choice.source == LOOKUP:
            self.lookup.observe(choice.m, accepted)
            self.by_n.setdefault(choice.n, _Record(self.size, self.s.decay)).observe(choice.m, accepted)


@dataclass
class SourceCounts:
    """Totals over every request (tests and benchmarks read them)."""
    lookup_drafts: int = 0         # steps that drafted from lookup
    learned_drafts: int = 0        # ... from the learned drafter
    empty: int = 0                 # steps asked to draft that drafted nothing
    lookup_tokens: int = 0
    learned_tokens: int = 0
    lookup_accepted: int = 0
    learned_accepted: int = 0
    learned_catch_ups: int = 0     # requests' deferred updates handed to the learned drafter


@dataclass
class _Request:
    records: SourceRecords
    pending: tuple[Choice, int] | None = None              # this step's choice, the sequence length it drafted after
    deferred: list[Committed] = field(default_factory=list)
    # feature rows the learned drafter has not caught up on, as the request's own steps count
    # them: kept across a preemption (whose recompute hands the drafter everything) so the
    # choices, and a seeded request's draws, go on as if it had never left
    rows: int = 0
    recomputing: bool = False                              # preempted: its prompt chunks are a recompute


class HybridProposer(ProposerBase):
    """Lookup (ngram) and a learned proposer (EAGLE chains, a draft model) behind one interface."""

    def __init__(self, learned: Proposer, n_max: int = 4, n_min: int = 1, settings: HybridSettings | None = None,
                 max_k: int = 64):
        super().__init__()
        if learned.caps.tree and learned.caps.max_tree_size is None:
            raise ValueError(f"{learned.name} drafts trees here; the hybrid drafts chains (EAGLE: topk 1)")
        self.learned, self.n_max, self.n_min = learned, n_max, n_min
        self.name = f"ngram+{learned.name}"
        self.settings = settings or HybridSettings()
        self.max_k = max_k
        lc = learned.caps
        # no max_len: lookup drafts past the learned drafter's context, which propose respects
        self.caps = ProposerCaps(needs_hidden=lc.needs_hidden, next_token_in_cache=lc.next_token_in_cache,
                                 weighs_costs=True)
        self.learned_depth = lc.max_tree_size      # an EAGLE chain's depth; None: no limit
        self.requests: dict[Hashable, _Request] = {}
        self.counts = SourceCounts()
        # measured costs (engine under "auto": measured()): a step's drafting time against the
        # learned tokens it drafted, and (verify, learned) per token in plain steps, or None while
        # unmeasured (the settings' constants are the prior)
        self._drafting = OnlineLinear(2, window=64, half_life=32.0, refit_every=16)
        self._learned_steps = 0            # steps measured that drafted from the learned drafter
        self._step_learned = 0             # learned tokens drafted this step
        self.costs: tuple[float, float] | None = None

    def kv_bytes_per_slot(self) -> int:
        return self.learned.kv_bytes_per_slot()

    def initialize_kv(self, blocks, target_kv) -> None:
        self.learned.initialize_kv(blocks, target_kv)

    def lookahead_slots(self, k: int) -> int:
        return max(k, self.learned.lookahead_slots(k))

    def cached_upto(self, request_id: Hashable) -> int | None:
        return self.learned.cached_upto(request_id)

    def add_request(self, request_id: Hashable, ctx: RequestContext) -> None:
        super().add_request(request_id, ctx)
        self.learned.add_request(request_id, ctx)
        req = self.requests.get(request_id)
        if req is None or not req.recomputing:
            self.requests[request_id] = _Request(SourceRecords(self.max_k, self.settings))

    def remove_request(self, request_id: Hashable) -> None:
        super().remove_request(request_id)
        self.learned.remove_request(request_id)
        self.requests.pop(request_id, None)

    def preempt_request(self, request_id: Hashable) -> None:
        """The records stay; the learned drafter's cache goes (the recompute refills it)."""
        super().remove_request(request_id)
        self.learned.remove_request(request_id)
        req = self.requests.get(request_id)
        if req is not None:
            req.deferred, req.pending, req.recomputing = [], None, True

    def measured(self, plain_s: float, verify_s: float, drafting_s: float) -> None:
        """The engine's measurements of the step just over ("auto"): a plain decoding step's cost
        per request and a verified token's (from its cost model), and what drafting took. The
        learned drafter's cost per token is fitted from the steps' drafting times against the
        learned tokens they drafted; once 8 steps drafted from it, both costs, in plain steps,
        replace the settings' (on SmolLM2 on one core an EAGLE token cost ~0.31 of a plain step all
        told where the settings say 0.75, and the hybrid left EAGLE idle where it paid)."""
        self._drafting.update([1.0, float(self._step_learned)], drafting_s)
        self._learned_steps += self._step_learned > 0
        self._step_learned = 0
        if plain_s > 0 and self._learned_steps >= 8:
            self.costs = (verify_s / plain_s, max(float(self._drafting.w[1]), 0.0) / plain_s)

    def propose(self, items: list[ProposeItem]) -> list[Draft]:
        drafts: list[Draft | None] = [None] * len(items)
        learned: list[tuple[int, ProposeItem]] = []
        for i, it in enumerate(items):
            req = self.requests[it.request_id]
            tokens, n = match(np.asarray(it.seq, dtype=np.int64), it.k, self.n_max, self.n_min)
            cap = draft_room(self.learned.caps, len(it.seq), min(it.k, self.learned_depth or it.k))
            choice = req.records.choose(n, len(tokens), cap, req.rows, self.costs)
            req.pending = (choice, len(it.seq)) if choice.source else None
            if choice.source == LOOKUP:
                drafts[i] = Draft(torch.from_numpy(tokens[:choice.m].copy()))
            elif choice.source == LEARNED:
                learned.append((i, ProposeItem(it.request_id, it.seq, choice.m)))
                self._step_learned += choice.m
            else:
                self.counts.empty += 1
        if learned:
            self._catch_up([it.request_id for _, it in learned])
            for (i, it), d in zip(learned, self.learned.propose([it for _, it in learned])):
                drafts[i] = Draft(d.tokens, d.probs)     # a chain (EAGLE's come as chain-shaped trees)
        return [d if d is not None else Draft(torch.empty(0, dtype=torch.long)) for d in drafts]

    def update(self, items: list[Committed]) -> None:
        now = []
        for it in items:
            req = self.requests.get(it.request_id)
            if req is None:
                continue
            if req.pending is not None and not it.prefill:
                choice, before = req.pending
                accepted = len(it.seq) - before - 1
                req.records.observe(choice, accepted)
                self._count(choice, accepted)
                req.pending = None
            if not it.prefill:
                req.recomputing = False
            if not self.learned.caps.deferrable:
                now.append(it)
                continue
            if it.prefill:     # prompt chunks at once: its cache then holds the prompt, whose blocks
                # prefix caching registers (only blocks every cache holds are), and its catch-up
                # costs count decoding steps alone
                now.append(merge_committed([*req.deferred, it]) if req.deferred else it)
                req.deferred = []
                if not req.recomputing:
                    req.rows = 0
                continue
            # a copy: a prompt chunk's rows are a view of the whole step's features
            req.deferred.append(it if it.hidden is None else dataclasses.replace(it, hidden=it.hidden.clone()))
            req.rows += it.hidden.shape[0] if it.hidden is not None else 0
            if req.rows >= MAX_DEFERRED:          # bound the memory a long lookup run holds
                self._catch_up([it.request_id])
        if now:
            self.learned.update(now)

    def _catch_up(self, request_ids: list[Hashable]) -> None:
        """Hand the learned drafter the steps it has not seen, one merged update per request."""
        merged = []
        for rid in request_ids:
            req = self.requests[rid]
            if req.deferred:
                merged.append(merge_committed(req.deferred))
            req.deferred, req.rows = [], 0
        if merged:
            self.counts.learned_catch_ups += len(merged)
            self.learned.update(merged)

    def _count(self, choice: Choice, accepted: int) -> None:
        c, kept = self.counts, min(max(accepted, 0), choice.m)
        if choice.source == LOOKUP:
            c.lookup_drafts, c.lookup_tokens, c.lookup_accepted = c.lookup_drafts + 1, c.lookup_tokens + choice.m, \
                c.lookup_accepted + kept
        else:
            c.learned_drafts, c.learned_tokens, c.learned_accepted = c.learned_drafts + 1, \
                c.learned_tokens + choice.m, c.learned_accepted + kept
