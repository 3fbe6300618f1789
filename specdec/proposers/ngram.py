"""Prompt lookup: propose what followed the most recent earlier occurrence of the last n tokens."""

from __future__ import annotations

import numpy as np
import torch

from .base import Draft, ProposeItem, ProposerBase, ProposerCaps


class NgramProposer(ProposerBase):
    name = "ngram"
    caps = ProposerCaps(reuses_cached_prefix=True)       # it reads the tokens, nothing else

    def __init__(self, n_max: int = 4, n_min: int = 1):
        super().__init__()
        self.n_max, self.n_min = n_max, n_min

    def propose(self, items: list[ProposeItem]) -> list[Draft]:
        return [Draft(torch.from_numpy(lookup(np.asarray(it.seq, dtype=np.int64), it.k, self.n_max,
                                              self.n_min).copy())) for it in items]


def lookup(seq: np.ndarray, k: int, n_max: int, n_min: int) -> np.ndarray:
    """Up to k tokens that followed an earlier match of seq's last n tokens (longest n first):
    the latest match with k tokens after it, else the one with the most (the earliest). The
    latest match alone is often the tail's own neighbour in a repeating stretch, with a single
    token after it."""
    L = len(seq)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        tail = seq[L - n:]
        windows = np.lib.stride_tricks.sliding_window_view(seq[:L - 1], n)   # starts 0..L-1-n
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            full = hits[L - (hits + n) >= k]
            start = (full[-1] if full.size else hits[0]) + n
            return seq[start:start + k]
    return seq[:0]
