"""What every proposer returns, and the interface the engine drives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from ..config import SamplingParams
from ..sampling import process, sample


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


class DraftSession(Protocol):
    """One request's proposer state (a draft KV cache, an n-gram index, ...)."""

    def propose(self, seq: list[int], k: int) -> Draft:
        """Propose up to k tokens to follow `seq` (prompt + output so far)."""

    def commit(self, seq: list[int]) -> None:
        """`seq` is the sequence after verification: roll back whatever was rejected.

        Proposers with `needs_hidden` are called as commit(seq, hidden) with hidden [n, D]: the
        target's final-norm features of the tokens the step fed and kept, i.e. of
        seq[len(seq) - 1 - n : len(seq) - 1] (the last token is fed by the next step)."""


class Proposer(Protocol):
    """A drafting method; holds what is shared across requests (weights).

    Optional attributes: `needs_hidden` (Medusa, EAGLE: the engine passes the target's
    features to start(..., hidden=[len(prompt) - 1, D]) and commit) and `tree` (drafts are
    token trees, listed best first; "auto" then adapts the tree size)."""
    name: str

    def start(self, prompt: list[int], ctx: RequestContext, target_cache=None) -> DraftSession: ...


def draw(logits: Tensor, ctx: RequestContext) -> tuple[Tensor, Tensor | None]:
    """One draft token from logits [1, V]: the argmax when greedy (q unused), else a sample from
    the processed q, returned with it."""
    if ctx.params.greedy:
        return logits.argmax(-1), None
    q = process(logits, ctx.params)
    return sample(q, ctx.generator), q


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
    u = torch.rand(q.shape, generator=generator, device=q.device).clamp_min(1e-30)
    keys = q.log() - (-u.log()).log()
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
