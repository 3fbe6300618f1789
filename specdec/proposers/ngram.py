"""Prompt lookup: propose what followed the most recent earlier occurrence of the last n tokens."""

from __future__ import annotations

import numpy as np
import torch

from .. import kernels
from .base import Draft, ProposeItem, ProposerBase


class NgramProposer(ProposerBase):
    name = "ngram"

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
    return match(seq, k, n_max, n_min)[0]


def match(seq: np.ndarray, k: int, n_max: int, n_min: int, kernel: bool = True) -> tuple[np.ndarray, int]:
    """lookup()'s tokens and the length n of the match they follow (0: none).

    Candidates are the earlier positions holding the last token; each is extended backwards
    while it agrees with the tail (at most n_max), so a step costs O(candidates x n_max), not a
    scan of the whole sequence per n. On the CPU kernels (lookup.c) unless kernel=False."""
    if kernel:
        seq = np.ascontiguousarray(seq, dtype=np.int64)
        found = kernels.ngram_match(seq, k, n_max, n_min)
        if found is not None:
            start, n = found
            return (seq[start:start + k], n) if start >= 0 else (seq[:0], 0)
    L = len(seq)
    if L < 2 or n_max < 1:
        return seq[:0], 0
    ends = np.flatnonzero(seq[:L - 1] == seq[L - 1])        # where an earlier match would end
    length = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for d in range(1, min(n_max, L - 1)):
        alive &= ends >= d
        alive[alive] = seq[ends[alive] - d] == seq[L - 1 - d]
        if not alive.any():
            break
        length += alive
    for n in range(min(n_max, L - 1, int(length.max(initial=0))), n_min - 1, -1):
        hits = ends[length >= n]
        if hits.size:
            full = hits[L - 1 - hits >= k]
            start = (full[-1] if full.size else hits[0]) + 1
            return seq[start:start + k], n
    return seq[:0], 0
