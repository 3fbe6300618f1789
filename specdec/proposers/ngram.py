"""Prompt lookup: propose what followed the most recent earlier occurrence of the last n tokens."""

from __future__ import annotations

import numpy as np
import torch

from .base import Draft, RequestContext


class NgramProposer:
    name = "ngram"

    def __init__(self, n_max: int = 4, n_min: int = 1):
        self.n_max, self.n_min = n_max, n_min

    def start(self, prompt: list[int], ctx: RequestContext, target_cache=None) -> "NgramSession":
        return NgramSession(self.n_max, self.n_min, ctx)


def lookup(seq: np.ndarray, k: int, n_max: int, n_min: int) -> np.ndarray:
    """The up-to-k tokens after the latest earlier match of seq's last n tokens (longest n first)."""
    L = len(seq)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        tail = seq[L - n:]
        windows = np.lib.stride_tricks.sliding_window_view(seq[:L - 1], n)   # starts 0..L-1-n
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = hits[-1] + n
            return seq[start:start + k]
    return seq[:0]


class NgramSession:
    def __init__(self, n_max: int, n_min: int, ctx: RequestContext):
        self.n_max, self.n_min, self.ctx = n_max, n_min, ctx

    def propose(self, seq: list[int], k: int) -> Draft:
        found = lookup(np.asarray(seq, dtype=np.int64), k, self.n_max, self.n_min)
        return Draft(torch.from_numpy(found.copy()))

    def commit(self, seq: list[int]) -> None:
        pass
