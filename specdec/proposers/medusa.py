"""Medusa: M heads on the target's last feature propose a token tree in one shot.

The tree is static per size: node = a path of ranks (r_1, .., r_d), meaning "the r_1-th
candidate of head 1, then the r_2-th of head 2, ...". Sizes are chosen as Medusa does: the N
paths of highest estimated acceptance, the product of each head's measured top-r accuracy
(`accuracy` in the heads' config.json, written by `specdec train medusa`).

Greedy: the rank-r candidate of head d is its r-th most likely token. Sampling: the children
of each node are drawn without replacement from head d's processed distribution q_d (rank =
draw order), which is what recursive rejection sampling needs to stay exact (verify.py).
"""

from __future__ import annotations

import heapq
from functools import lru_cache

import torch

from ..model.heads import MedusaHeads
from ..sampling import process
from .base import Draft, RequestContext, draw_without_replacement, prune_tree, to_target_vocab

MAX_RANK = 10


def default_accuracy(num_heads: int) -> list[list[float]]:
    """A prior for heads without measured accuracies: deeper heads and lower ranks worse."""
    return [[0.7 * 0.75 ** d / (r + 1) for r in range(MAX_RANK)] for d in range(num_heads)]


def build_tree(accuracy: list[list[float]], size: int) -> tuple[list[int], list[int], list[int]]:
    """The `size` rank paths of highest product accuracy, best-first; returns (parents, head
    index d (0-based) of each node, rank of each node). Nodes come in topological order and
    each node's children have ranks 0..c-1 (a prefix of the draw order)."""
    acc = []
    for row in accuracy:   # non-increasing in rank, so best-first keeps rank prefixes
        run, best = [], 1.0
        for a in row[:MAX_RANK]:
            best = min(best, max(float(a), 1e-6))
            run.append(best)
        acc.append(run)
    M = len(acc)
    heap = [(-acc[0][0], (0,))]
    index: dict[tuple, int] = {(): -1}
    parents, depth, rank = [], [], []
    while heap and len(parents) < size:
        neg, path = heapq.heappop(heap)
        index[path] = len(parents)
        parents.append(index[path[:-1]])
        depth.append(len(path) - 1)
        rank.append(path[-1])
        d, r = len(path) - 1, path[-1]
        parent_value = -neg / acc[d][r]
        if r + 1 < len(acc[d]):
            heapq.heappush(heap, (-parent_value * acc[d][r + 1], path[:-1] + (r + 1,)))
        if d + 1 < M:
            heapq.heappush(heap, (neg * acc[d + 1][0], path + (0,)))
    return parents, depth, rank


class MedusaProposer:
    name = "medusa"
    needs_hidden = True
    tree = True

    def __init__(self, heads: MedusaHeads, vocab_size: int, accuracy: list[list[float]] | None = None):
        self.heads, self.vocab_size = heads, vocab_size
        self.accuracy = accuracy or default_accuracy(heads.num_heads)
        self._tree = lru_cache(maxsize=None)(lambda n: build_tree(self.accuracy, n))

    def start(self, prompt: list[int], ctx: RequestContext, target_cache=None, hidden=None) -> "MedusaSession":
        return MedusaSession(self, ctx, hidden[-1] if hidden is not None and len(hidden) else None)


class MedusaSession:
    """Holds the target's feature of the token before the last one of the sequence: the last
    token the target has processed (the engine's cache holds seq[:-1])."""

    def __init__(self, proposer: MedusaProposer, ctx: RequestContext, feature):
        self.p, self.ctx, self.feature = proposer, ctx, feature

    @torch.inference_mode()
    def propose(self, seq: list[int], k: int) -> Draft:
        heads = self.p.heads
        dev = heads.draft_vocab.device
        if self.feature is None or k == 0:
            return Draft(torch.empty(0, dtype=torch.long, device=dev), parents=[])
        parents, depth, rank = self.p._tree(k)
        # head d, fed the feature of seq[-2], predicts the token d + 1 places after seq[-1]
        logits = heads(self.feature[None])[:, 0]                       # [M, V']
        if self.ctx.params.greedy:
            top = logits.topk(max(rank) + 1, dim=-1).indices             # [M, R]
            ids = heads.draft_vocab[top].tolist()
            tokens = [ids[d][r] for d, r in zip(depth, rank)]
            return Draft(torch.tensor(tokens, device=dev), parents=list(parents))
        return self._sampled(logits, parents, depth, rank)

    def _sampled(self, logits, parents, depth, rank) -> Draft:
        used = sorted(set(depth))
        q = {d: process(to_target_vocab(logits[d:d + 1], self.p.heads.draft_vocab, self.p.vocab_size),
                        self.ctx.params)[0] for d in used}
        n_children: dict[int, int] = {}
        for par in parents:
            n_children[par] = n_children.get(par, 0) + 1
        drawn = {}   # parent -> its children's tokens in draw order
        tokens, keep = [], []
        for i, (par, d, r) in enumerate(zip(parents, depth, rank)):
            if par not in drawn:
                drawn[par] = draw_without_replacement(q[d], n_children[par], self.ctx.generator).tolist()
            keep.append(r < len(drawn[par]))
            tokens.append(drawn[par][r] if keep[-1] else -1)
        tokens, parents, kept = prune_tree(tokens, parents, keep)
        probs = torch.stack([q[depth[i]] for i in kept]) if kept else None
        return Draft(torch.tensor(tokens, dtype=torch.long), probs, parents)

    def commit(self, seq: list[int], hidden=None) -> None:
        if hidden is not None and len(hidden):
            self.feature = hidden[-1]
