"""What every proposer returns, and the interface the engine drives."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from ..config import SamplingParams
from ..sampling import Controls, Row, adjust_rows, process, sample
from ..verify import greedy_tokens


@dataclass(frozen=True)
class Draft:
    """A chain of K proposed tokens, or a tree of K nodes (parents set; see verify.py)."""
    tokens: Tensor                 # [K] int64 proposed tokens (K may be 0: nothing to propose)
    probs: Tensor | None = None    # [K, V] float32: row i = the processed q node i was drawn from
                                   # (siblings share it); None = deterministic draft
    parents: list[int] | None = None   # tree only: parents[i] = node i's parent, -1 = the root

    @property
    def k(self) -> int:
        return self.tokens.shape[0]

    @property
    def is_tree(self) -> bool:
        return self.parents is not None


@dataclass
class RequestContext:
    """What a proposer needs to know about the request it drafts for."""
    params: SamplingParams
    generator: torch.Generator
    vocab_size: int                # the target's logits width: q is padded or cut to it
    controls: Controls | None = None   # penalties, bias, bad words, min_tokens, grammar (None: none)
    prompt_len: int | None = None      # the request's prompt length (None: not given; the suffix cache reads it)
    prediction: object | None = None   # specdec.prediction.Prediction: OpenAI's Predicted Outputs (the engine drafts from it)

    def adjust(self, logits: Tensor, seq: list[int], paths: list[list[int]]) -> Tensor:
        """logits [N, V] (row i after seq + paths[i]) with the request's controls applied, as the
        verifier applies them to p; unchanged without controls. seq: prompt + output so far."""
        if self.controls is None:
            return logits
        output = seq[len(self.controls.prompt):]
        return adjust_rows(logits, [Row(self.controls, output, list(p)) for p in paths])


@dataclass(frozen=True)
class ProposerCaps:
    """What a proposer is, declared on it (the engine never probes for attributes)."""
    tree: bool = False                 # drafts are token trees, listed best first ("auto" adapts the size)
    chain: bool = False                # with tree: every draft is a chain (EAGLE at topk 1): "auto" models
                                       # its acceptance per position (a size it rarely tried is estimated
                                       # from the positions before it, not from an optimistic tree prior)
    needs_hidden: bool = False         # reads the target's final-norm features (Medusa, EAGLE)
    feature_layers: tuple[int, ...] = ()   # with needs_hidden: reads instead the residual stream
                                           # entering these target layers, side by side (EAGLE-3)
    max_tree_size: int | None = None   # the most nodes it can draft ("auto" builds its ladder up to it)
    max_len: int | None = None         # its context (a draft model's, or speculative_config.max_model_len's):
                                       # it drafts k tokens after a sequence of n only while n + k - 1 <=
                                       # max_len (draft_room), and a draft model's cache never holds a slot
                                       # past it; the target's context is not shortened
    deferrable: bool = False           # update() may be skipped for some steps and then given one
                                       # Committed that merges them (merge_committed): it catches up
    weighs_costs: bool = False         # under "auto" the engine hands it each step's measured costs
                                       # (measured(plain_s, verify_s, drafting_s): the hybrids)
    next_token_in_cache: bool = False  # its cache's slot j also depends on token j + 1 (EAGLE's pairs of
                                       # feature j and token j + 1): a prefix-cache hit's last block is
                                       # computed again, since the token after it may differ (vLLM's use_eagle)


def draft_room(caps: ProposerCaps, seq_len: int, k: int) -> int:
    """k cut to what a drafter of context caps.max_len may draft after seq_len tokens: it feeds
    the last k - 1 drafts at positions seq_len .. seq_len + k - 2 (0 past its context: the
    request decodes plainly from there, as vLLM skips speculation for such sequences)."""
    return k if caps.max_len is None else max(0, min(k, caps.max_len + 1 - seq_len))


@dataclass(frozen=True)
class ProposeItem:
    request_id: Hashable
    seq: list[int]                 # prompt + output so far; the target's cache holds seq[:-1]
    k: int                         # tokens (tree nodes) wanted, >= 1


@dataclass(frozen=True)
class Committed:
    """After a step, for one request: the target's cache now holds seq[:num_cached]."""
    request_id: Hashable
    seq: list[int]
    num_cached: int
    hidden: Tensor | None          # [m, D] the target's features of seq[num_cached - m : num_cached]
                                   # (proposers with needs_hidden only)
    prefill: bool                  # a prompt chunk; else a verified decoding step


def merge_committed(items: list[Committed]) -> Committed:
    """Consecutive Committed of one request (oldest first) as one: the latest sequence and cache
    length, the features of every token kept since the first (their rows are contiguous: each
    step's start where the previous one ended). A proposer whose caps say `deferrable` takes it
    as if it had seen every step."""
    last = items[-1]
    hidden = [it.hidden for it in items]
    merged = None if any(h is None for h in hidden) else torch.cat(hidden) if len(hidden) > 1 else hidden[0]
    return Committed(last.request_id, last.seq, last.num_cached, merged, last.prefill)


class Proposer(Protocol):
    """A drafting method over a batch of requests. It holds what requests share (weights, its
    own KV cache over the engine's blocks) and each request's state, keyed by request id.

    Per step the engine calls propose() for the requests that draft (one draft forward per
    depth over all of them, where a model drafts), then, after the target's forward and
    verification, update() with what each request now holds. A request's drafts must depend
    only on its own tokens and generator (never on the batch), so that its output is the same
    as when it runs alone."""
    name: str
    caps: ProposerCaps

    def kv_bytes_per_slot(self) -> int:
        """Bytes of the proposer's own KV per token slot (0 = none); sizes the shared pool."""

    def initialize_kv(self, blocks, target_kv) -> None:
        """Called once: allocate own caches over `blocks` (shared block tables); layer_skip
        drafts into `target_kv`."""

    def lookahead_slots(self, k: int) -> int:
        """Slots past the committed prefix (len(seq) - 1) its caches write when drafting k."""

    def cached_upto(self, request_id: Hashable) -> int | None:
        """n: its own caches hold, for the request's first n slots, what they hold for the committed
        sequence (drafts fed beyond, or steps not yet handed to update, are not counted); None: it
        keeps no cache of its own. Prefix caching registers a block only once every cache holds it."""

    def add_request(self, request_id: Hashable, ctx: RequestContext) -> None: ...

    def remove_request(self, request_id: Hashable) -> None: ...

    def preempt_request(self, request_id: Hashable) -> None:
        """The request leaves to be recomputed later (its KV blocks freed): it comes back through
        add_request and prompt-chunk updates of its whole sequence so far. What the proposer
        learnt from its earlier steps may be kept, so that its drafts (and a seeded request's
        draws) go on as if it had never left."""

    def propose(self, items: list[ProposeItem]) -> list[Draft]: ...

    def update(self, items: list[Committed]) -> None: ...


class ProposerBase:
    """Defaults for the Proposer interface: no KV of its own, per-request contexts."""
    name = "base"
    caps = ProposerCaps()

    def __init__(self):
        self.ctx: dict[Hashable, RequestContext] = {}

    def kv_bytes_per_slot(self) -> int:
        return 0

    def initialize_kv(self, blocks, target_kv) -> None:
        pass

    def lookahead_slots(self, k: int) -> int:
        return k

    def cached_upto(self, request_id: Hashable) -> int | None:
        return None

    def add_request(self, request_id: Hashable, ctx: RequestContext) -> None:
        self.ctx[request_id] = ctx

    def remove_request(self, request_id: Hashable) -> None:
        self.ctx.pop(request_id, None)

    def preempt_request(self, request_id: Hashable) -> None:
        self.remove_request(request_id)

    def update(self, items: list[Committed]) -> None:
        pass


class LastFeatureProposer(ProposerBase):
    """A proposer that drafts from the target's final-norm feature of the token before the
    sequence's last one (the last token the target has processed: its cache holds seq[:-1]), kept
    per request by update and dropped with the request (Medusa, MLP speculators)."""

    def __init__(self):
        super().__init__()
        self.feature: dict = {}

    def remove_request(self, request_id: Hashable) -> None:
        super().remove_request(request_id)
        self.feature.pop(request_id, None)

    def update(self, items: list[Committed]) -> None:
        for it in items:
            if it.hidden is not None and len(it.hidden):
                self.feature[it.request_id] = it.hidden[-1]


def draw(logits: Tensor, ctx: RequestContext, seq: list[int] | None = None,
         path: list[int] | None = None) -> tuple[Tensor, Tensor | None]:
    """One draft token from logits [1, V] after seq + path: the argmax when greedy (q unused),
    else a sample from the processed q, returned with it."""
    if ctx.controls is not None:
        adjusted = ctx.adjust(logits, seq, [path or []])
        # a draft vocabulary narrower than the target's may have nothing the controls allow:
        # then draw from the raw q (the verifier rejects what the target forbids, exactly)
        logits = adjusted if bool((adjusted > float("-inf")).any()) else logits
    if ctx.params.greedy:
        return greedy_tokens(logits), None
    q = process(logits, ctx.params)
    return sample(q, ctx.generator), q


def grow_chains(items: list[ProposeItem], ctxs: list[RequestContext], logits: Tensor, step) -> list[Draft]:
    """Autoregressive chains for a batch: draw each request's next token from its row of
    logits [B, V] (its own generator, in the same order as alone), then call
    step(active, tokens, depth) -> logits [len(active), V] for the requests (indices into
    items) that want more, fed their newest token (tokens [len(active)]) at depth + 1."""
    tokens: list[list[Tensor]] = [[] for _ in items]
    probs: list[list[Tensor]] = [[] for _ in items]
    active, depth = list(range(len(items))), 0
    while True:
        # the greedy rows without controls: one argmax for all of them (the same per row)
        plain = [row for row, i in enumerate(active) if ctxs[i].params.greedy and ctxs[i].controls is None]
        argmax = {}
        if plain:
            rows = logits if len(plain) == len(active) else logits[plain]
            argmax = dict(zip(plain, greedy_tokens(fit_vocab(rows, ctxs[active[plain[0]]].vocab_size)).split(1)))
        for row, i in enumerate(active):
            if row in argmax:
                tokens[i].append(argmax[row])
                continue
            path = [int(t) for t in tokens[i]] if ctxs[i].controls is not None else None
            tok, q = draw(fit_vocab(logits[row:row + 1], ctxs[i].vocab_size), ctxs[i], items[i].seq, path)
            tokens[i].append(tok)
            probs[i] += [q] if q is not None else []
        active = [i for i in active if items[i].k > depth + 1]
        if not active:
            break
        logits = step(active, torch.cat([tokens[i][-1] for i in active]), depth)
        depth += 1
    return [chain(t, q, logits.device) for t, q in zip(tokens, probs)]


def chain(tokens: list[Tensor], probs: list[Tensor], device) -> Draft:
    """The Draft of a chain of single-token proposals."""
    if not tokens:
        return Draft(torch.empty(0, dtype=torch.long, device=device))
    return Draft(torch.cat(tokens), torch.cat(probs) if probs else None)


def draw_without_replacement(q: Tensor, m: int, generator: torch.Generator) -> Tensor:
    """Up to m distinct tokens drawn one after another without replacement from q [V], in draw
    order (Gumbel-top-k: sorting log q + Gumbel noise is sequential sampling without
    replacement). Fewer when q has fewer than m tokens with mass."""
    m = min(m, int((q > 0).sum()))
    # float64: a float32 uniform caps the Gumbel noise near 16.6 (u <= 1 - 2^-24), which cuts its
    # tail where, over a vocabulary of 16k-50k tokens, about one draw in a thousand reaches: the
    # proposal then differs slightly from the q that verification divides by (a tester's find)
    u = torch.rand(q.shape, generator=generator, device=q.device, dtype=torch.float64).clamp_min(1e-300)
    keys = q.double().log() - (-u.log()).log()
    return keys.topk(m).indices


def to_target_vocab(logits: Tensor, draft_vocab: Tensor, vocab_size: int) -> Tensor:
    """Logits [..., V'] over a draft vocabulary -> [..., vocab_size], -inf off the draft vocabulary."""
    out = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return out.scatter(-1, draft_vocab.expand(*logits.shape[:-1], -1), logits)


def prune_tree(tokens: list[int], parents: list[int], keep: list[bool]) -> tuple[list[int], list[int], list[int]]:
    """Drop the nodes not kept (and everything below them); returns (tokens, parents, kept
    old indices), re-indexed."""
    new_index, out_t, out_p, kept = {-1: -1}, [], [], []
    for i, (t, par) in enumerate(zip(tokens, parents)):
        if keep[i] and par in new_index:
            new_index[i] = len(out_t)
            out_t.append(t)
            out_p.append(new_index[par])
            kept.append(i)
    return out_t, out_p, kept


def fit_vocab(logits: Tensor, vocab_size: int) -> Tensor:
    """Cut or pad (with -inf) the last dimension to the target's vocabulary width."""
    V = logits.shape[-1]
    if V == vocab_size:
        return logits
    if V > vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - V), float("-inf"))
    return torch.cat([logits, pad], dim=-1)
