"""A token corpus indexed for suffix lookup: what followed the longest match of a context's tail.

The corpus (documents of token ids) is laid end to end with a separator before each document
and reversed; its suffix array, sorted to `depth` tokens, lists every position by the reversed
text that starts there. A context's tail read backwards is then a prefix of the reversed text at
each of its occurrences, so extending the match one token further back narrows one contiguous
range of the array (a binary search inside the range): the longest match costs at most `depth`
searches, whatever the corpus size. The occurrences' next tokens (forward) are read from the
forward text; `continue_chain` follows the most frequent one, token by token, as SuffixDecoding
(Oliaro et al. 2024) follows its suffix tree's most frequent children.

Matches never cross documents: the separator (0; tokens are stored as id + 1) equals no token.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .. import kernels

SEP = 0


def suffix_array(s: np.ndarray, depth: int) -> np.ndarray:
    """Positions of s ordered by their next `depth` values (prefix doubling; ties keep no order
    that matters: lookups never read past `depth`)."""
    n = len(s)
    rank = s.astype(np.int64)
    sa = np.argsort(rank, kind="stable")
    k = 1
    while k < depth:
        key2 = np.full(n, -1, dtype=np.int64)
        key2[:n - k] = rank[k:]
        sa = np.lexsort((key2, rank))
        r, r2 = rank[sa], key2[sa]
        new = np.empty(n, dtype=bool)
        new[0] = True
        new[1:] = (r[1:] != r[:-1]) | (r2[1:] != r2[:-1])
        rank = np.empty(n, dtype=np.int64)
        rank[sa] = np.cumsum(new) - 1
        if rank[sa[-1]] == n - 1:       # every suffix already distinct
            break
        k *= 2
    return sa


class SuffixIndex:
    """Documents of token ids, indexed for longest-suffix lookup to `depth` tokens."""

    def __init__(self, forward: np.ndarray, sa: np.ndarray, depth: int):
        self.fwd = forward                   # [N + pad] int32: separators, ids + 1, then `pad` separators
        self.n = len(forward) - depth - 1    # the text proper: fwd[:n]
        self.rev = np.ascontiguousarray(np.concatenate([forward[:self.n][::-1], np.zeros(depth + 1, np.int32)]))
        self.sa = sa                         # [n] positions in rev
        self.depth = depth

    @classmethod
    def build(cls, docs, depth: int = 32) -> "SuffixIndex":
        parts = []
        for d in docs:
            d = np.asarray(d, dtype=np.int64)
            if d.size:
                parts += [np.zeros(1, np.int64), d + 1]
        text = np.concatenate(parts + [np.zeros(1, np.int64)]) if parts else np.zeros(1, np.int64)
        if text.max(initial=0) >= 2**31 - 1:
            raise ValueError("token ids must be below 2**31 - 1")
        if text.min(initial=0) < 0:
            raise ValueError("token ids must be >= 0")
        fwd = np.concatenate([text, np.zeros(depth + 1, np.int64)]).astype(np.int32)
        n = len(text)
        rev = np.concatenate([text[::-1], np.zeros(depth + 1, np.int64)])
        sa = suffix_array(rev, depth)
        return cls(fwd, sa[sa < n].astype(np.int32), depth)

    @property
    def max_token(self) -> int:
        """The largest token id in the documents (-1: none). An index holding an id below 0 (build
        refuses them; a file written otherwise) reports 2**31 - 1: no vocabulary check passes it."""
        text = self.fwd[:self.n]
        if text.size and int(text.min()) < 0:
            return 2**31 - 1
        return int(text.max(initial=0)) - 1

    @property
    def num_tokens(self) -> int:
        return int(np.count_nonzero(self.fwd[:self.n]))

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        fwd = self.fwd.astype(np.uint16) if int(self.fwd.max(initial=0)) < 2**16 else self.fwd
        with open(tmp, "wb") as f:
            np.savez(f, forward=fwd, sa=self.sa, depth=np.int64(self.depth))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SuffixIndex":
        with np.load(path) as z:
            fwd, sa, depth = z["forward"], z["sa"], int(z["depth"])
        if fwd.ndim != 1 or sa.ndim != 1 or len(sa) != len(fwd) - depth - 1:
            raise ValueError(f"{path}: not a suffix index written by SuffixIndex.save")
        return cls(fwd.astype(np.int32, copy=False), sa.astype(np.int32, copy=False), depth)

    def match(self, tail: np.ndarray, max_len: int | None = None, kernel: bool = True) -> tuple[int, int, int]:
        """(lo, hi, m): the suffix-array range [lo, hi) of the occurrences of tail's last m
        tokens, m as long as the corpus allows (up to max_len and depth); m = 0: no match. On
        the CPU kernels (lookup.c) unless kernel=False."""
        rev, sa = self.rev, self.sa
        lo, hi, m = 0, len(sa), 0
        limit = min(len(tail), self.depth, max_len or self.depth)
        if kernel:
            found = kernels.suffix_match(rev, sa, np.ascontiguousarray(tail, dtype=np.int64), limit)
            if found is not None:
                return found
        while m < limit:
            c = int(tail[len(tail) - 1 - m]) + 1
            # first i in [lo, hi) with rev[sa[i] + m] >= c, then first with > c
            a, b = lo, hi
            while a < b:
                mid = (a + b) >> 1
                if rev[sa[mid] + m] < c:
                    a = mid + 1
                else:
                    b = mid
            start = a
            b = hi
            while a < b:
                mid = (a + b) >> 1
                if rev[sa[mid] + m] <= c:
                    a = mid + 1
                else:
                    b = mid
            if a == start:
                break
            lo, hi, m = start, a, m + 1
        return (lo, hi, m) if m else (0, 0, 0)

    def continue_chain(self, lo: int, hi: int, m: int, k: int, min_prob: float,
                       max_occurrences: int = 4096, kernel: bool = True) -> tuple[list[int], list[float]]:
        """Up to k tokens after the occurrences sa[lo:hi] of a match of length m: each the most
        frequent next token among the occurrences that agree so far (ties: the smaller id),
        while its share of all the occurrences (the path's probability) is >= min_prob.
        Returns (token ids, path probabilities). On the CPU kernels unless kernel=False."""
        if hi <= lo or k <= 0:
            return [], []
        if kernel:
            found = kernels.suffix_continue(self.fwd, self.sa, self.n, lo, hi, k, min_prob, max_occurrences)
            if found is not None:
                return found
        idx = np.arange(lo, hi)
        if len(idx) > max_occurrences:       # an even spread of a very frequent short match
            idx = idx[np.linspace(0, len(idx) - 1, max_occurrences).astype(np.int64)]
        pos = (self.n - 1 - self.sa[idx]).astype(np.int64)      # forward index of the match's last token
        total = len(pos)
        tokens, probs = [], []
        for j in range(1, k + 1):
            nxt = self.fwd[pos + j]
            vals, counts = np.unique(nxt[nxt != SEP], return_counts=True)
            if not len(vals):
                break
            best = int(np.argmax(counts))           # first maximum: the smallest id
            if counts[best] / total < min_prob:
                break
            tok = int(vals[best])
            tokens.append(tok - 1)
            probs.append(float(counts[best] / total))
            pos = pos[nxt == tok]
        return tokens, probs
