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

from .. import kernels
from ..model.heads import MedusaHeads
from ..sampling import process
from .base import (Draft, LastFeatureProposer, ProposeItem, ProposerCaps, draw_without_replacement, prune_tree,
                   to_target_vocab)

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


class MedusaProposer(LastFeatureProposer):
    """M heads on the feature of the token before the sequence's last (LastFeatureProposer)."""
    name = "medusa"

    def __init__(self, heads: MedusaHeads, vocab_size: int, accuracy: list[list[float]] | None = None):
        super().__init__()
        self.heads, self.vocab_size = heads, vocab_size
        self.caps = ProposerCaps(tree=True, needs_hidden=True)
        self.accuracy = accuracy or default_accuracy(heads.num_heads)
        self._tree = lru_cache(maxsize=None)(lambda n: build_tree(self.accuracy, n))

    @torch.inference_mode()
    def propose(self, items: list[ProposeItem]) -> list[Draft]:
        heads = self.heads
        dev = heads.draft_vocab.device
        empty = Draft(torch.empty(0, dtype=torch.long, device=dev), parents=[])
        live = [i for i, it in enumerate(items) if it.request_id in self.feature]
        drafts = [empty] * len(items)
        if not live:
            return drafts
        # head d, fed the feature of seq[-2], predicts the token d + 1 places after seq[-1]; the
        # requests go through in groups small enough for the row-exact CPU kernel, so that a
        # request's heads give the same values whatever the batch
        feats = torch.stack([self.feature[items[i].request_id] for i in live])
        group = max(1, kernels.MAX_ROWS // heads.num_heads)
        logits = torch.cat([heads(feats[g:g + group]) for g in range(0, len(live), group)], dim=1)   # [M, B, V']
        trees = [self._tree(items[i].k) for i in live]
        greedy = [self.ctx[items[i].request_id].params.greedy for i in live]
        top = None
        if any(greedy):
            ranks = max(max(rank) for (_, _, rank), g in zip(trees, greedy) if g) + 1
            top = heads.draft_vocab[logits.topk(ranks, dim=-1).indices].tolist()         # [M][B][R]
        for j, i in enumerate(live):
            parents, depth, rank = trees[j]
            ctx = self.ctx[items[i].request_id]
            if ctx.controls is not None:
                drafts[i] = self._controlled(logits[:, j], parents, depth, rank, ctx, items[i].seq)
            elif greedy[j]:
                tokens = [top[d][j][r] for d, r in zip(depth, rank)]
                drafts[i] = Draft(torch.tensor(tokens, device=dev), parents=list(parents))
            else:
                drafts[i] = self._sampled(logits[:, j], parents, depth, rank, self.ctx[items[i].request_id])
        return drafts

    def _controlled(self, logits, parents, depth, rank, ctx, seq) -> Draft:
        """A request with penalties, bias or a grammar: each node's children come from head d's
        logits adjusted for the node's own path (greedy: the best ranks; sampling: drawn
        without replacement from that q), so every node's q is processed as p will be there."""
        n_children: dict[int, int] = {}
        for par in parents:
            n_children[par] = n_children.get(par, 0) + 1
        drawn, q, paths = {}, {}, {-1: []}
        tokens, keep = [], []
        for i, (par, d, r) in enumerate(zip(parents, depth, rank)):
            if par not in paths:           # below a node that was not drawn
                keep.append(False)
                tokens.append(-1)
                continue
            if par not in drawn:
                row = ctx.adjust(to_target_vocab(logits[d:d + 1].float(), self.heads.draft_vocab, self.vocab_size),
                                 seq, [paths[par]])
                allowed = int((row > float("-inf")).sum())
                if allowed == 0:       # the controls leave nothing in the heads' vocabulary
                    drawn[par] = []
                elif ctx.params.greedy:
                    drawn[par] = row[0].topk(min(n_children[par], allowed)).indices.tolist()
                else:
                    q[par] = process(row, ctx.params)[0]
                    drawn[par] = draw_without_replacement(q[par], n_children[par], ctx.generator).tolist()
            keep.append(r < len(drawn[par]))
            tokens.append(drawn[par][r] if keep[-1] else -1)
            if keep[-1]:
                paths[i] = paths[par] + [tokens[-1]]
        tokens, new_parents, kept = prune_tree(tokens, parents, keep)
        probs = torch.stack([q[parents[i]] for i in kept]) if q and kept else None
        return Draft(torch.tensor(tokens, dtype=torch.long), probs, new_parents)

    def _sampled(self, logits, parents, depth, rank, ctx) -> Draft:
        used = sorted(set(depth))
        q = {d: process(to_target_vocab(logits[d:d + 1], self.heads.draft_vocab, self.vocab_size),
                        ctx.params)[0] for d in used}
        n_children: dict[int, int] = {}
        for par in parents:
            n_children[par] = n_children.get(par, 0) + 1
        drawn = {}   # parent -> its children's tokens in draw order
        tokens, keep = [], []
        for par, d, r in zip(parents, depth, rank):
            if par not in drawn:
                drawn[par] = draw_without_replacement(q[d], n_children[par], ctx.generator).tolist()
            keep.append(r < len(drawn[par]))
            tokens.append(drawn[par][r] if keep[-1] else -1)
        tokens, parents, kept = prune_tree(tokens, parents, keep)
        probs = torch.stack([q[depth[i]] for i in kept]) if kept else None
        return Draft(torch.tensor(tokens, dtype=torch.long), probs, parents)
