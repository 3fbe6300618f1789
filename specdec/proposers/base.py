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
    tokens: Tensor                 # [K] int64 proposed tokens (K may be 0: nothing to propose)
    probs: Tensor | None = None    # [K, V] float32 processed q(x); None = deterministic draft

    @property
    def k(self) -> int:
        return self.tokens.shape[0]


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
        """`seq` is the sequence after verification: roll back whatever was rejected."""


class Proposer(Protocol):
    """A drafting method; holds what is shared across requests (weights)."""
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


def fit_vocab(logits: Tensor, vocab_size: int) -> Tensor:
    """Cut or pad (with -inf) the last dimension to the target's vocabulary width."""
    V = logits.shape[-1]
    if V == vocab_size:
        return logits
    if V > vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - V), float("-inf"))
    return torch.cat([logits, pad], dim=-1)
