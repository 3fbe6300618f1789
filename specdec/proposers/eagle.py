"""EAGLE: a one-layer head drafts at the feature level; EAGLE-2's dynamic tree; EAGLE-3 heads
(model/eagle3.py: features from three target layers, fused) and the MTP layers a target ships
(model/mtp.py: DeepSeek-V3, MiMo, GLM-4.5) through the same steps.

The head's cache slot j holds the pair (feature of token j, token j + 1); its output there is a
predicted feature of token j + 1 and logits for token j + 2. Committed slots are always fed the
target's true features (after each verification the accepted tokens are re-fed), draft slots
the head's own predictions.

Tree growth (EAGLE-2): the root's `topk` best candidates form depth 1; at each further depth
the `topk` nodes of highest cumulative draft log-probability are expanded (one head forward for
all of them, a tree mask over the head's cache), each with `topk` children. Greedy decoding
then keeps the N best nodes overall (a tree, since scores only fall along a path). Sampling
draws each node's children without replacement from its q and keeps every drawn node (node
counts decided before drawing, never by the drawn values), so verification stays exact.

Batched: the head's cache lives on the engine's blocks (the target's block tables); feeding,
each chain depth and each tree expansion run one head forward over every request at once,
each request's nodes under its own tree mask. Greedy chains on the CPU run in one C call for
the whole batch (kernels/forward.c: eagle_chain).
"""

from __future__ import annotations

import math

import torch

from .. import kernels
from ..kernels import cforward
from ..model import ForwardBatch, Transformer, TreeAttention
from ..model.eagle3 import Eagle3Head
from ..model.heads import EagleHead
from ..model.mtp import MTPHead
from ..sampling import process
from .base import (Committed, Draft, ProposeItem, ProposerBase, ProposerCaps, RequestContext,
                   draw_without_replacement, to_target_vocab)


class EagleProposer(ProposerBase):
    name = "eagle"

    def __init__(self, head: EagleHead | Eagle3Head | MTPHead, target: Transformer, topk: int = 4,
                 depth: int | None = None):
        super().__init__()
        if topk < 1:
            raise ValueError(f"speculative_config.topk must be >= 1, got {topk}")
        self.head, self.target, self.topk, self.depth = head, target, topk, depth
        eagle3 = isinstance(head, Eagle3Head)
        self.name = "eagle3" if eagle3 else "mtp" if isinstance(head, MTPHead) else "eagle"
        # token embeddings: the target's, or an EAGLE-3 head's or an MTP layer's own
        own = None if isinstance(head, EagleHead) else head.embed_tokens
        self.embedding = own if own is not None else target.model.embed_tokens
        # a chain (topk 1) holds at most `depth` nodes; a tree is bounded only by the request
        # deferrable: update() rewrites the pairs of every token kept since the head's last update
        # (drafted pairs beyond them included), so merged steps catch it up
        # its cache's slot j holds the pair (feature j, token j + 1): next_token_in_cache
        self.caps = ProposerCaps(tree=True, chain=topk == 1, needs_hidden=True, deferrable=True, next_token_in_cache=True,
                                 feature_layers=() if isinstance(head, EagleHead) else head.feature_layers,
                                 max_tree_size=(depth or DEFAULT_DEPTH) if topk == 1 else None)
        self.kv = None
        self.c_chain = None      # cforward.chain_fuse's description where forward.c drafts chains
        self.state: dict = {}    # request id -> (logits [V'] after its last token, that token's predicted feature [D])

    def kv_bytes_per_slot(self) -> int:
        return self.head.decoder.kv_bytes_per_slot()

    def initialize_kv(self, blocks, target_kv) -> None:
        self.kv = self.head.decoder.new_kv(blocks)
        self.c_chain = self._c_chain_ok()      # decided once, not every step

    def lookahead_slots(self, k: int) -> int:
        levels = max(0, min(k, self.depth or DEFAULT_DEPTH) - 1)       # head forwards past the root
        return levels * self.topk

    def cached_upto(self, request_id) -> int:
        """update() alone sets the length (the pairs of kept tokens); drafting writes past it."""
        return self.kv.length(request_id)

    def remove_request(self, request_id) -> None:
        super().remove_request(request_id)
        self.state.pop(request_id, None)

    def _c_chain_ok(self):
        """forward.c's eagle_chain (a chain of greedy drafts in one call) for EAGLE-1/2 heads,
        EAGLE-3's and MTP layers, where the C forward runs the head: how it feeds the head
        (cforward.chain_fuse), else None."""
        if self.head.decoder.c_view(self.kv) is None or cforward.embedding_mat(self.embedding) is None:
            return None
        return cforward.chain_fuse(self.head)

    def _embed(self, tokens: list[int]):
        return self.embedding(torch.tensor(tokens, dtype=torch.long, device=self.target.device)).to(self.head.decoder.dtype)

    def _run(self, ids, feats, tokens: list[int], counts, starts, trees=None, last_only=False):
        """One head forward: pairs (feats [N, D], tokens [N]) of several requests."""
        batch = ForwardBatch.build(self.kv, ids, counts, starts, trees, logits=[1] * len(ids) if last_only else None)
        return self.head(feats.to(self.head.decoder.dtype), self._embed(tokens), self.kv, batch)

    @torch.inference_mode()
    def update(self, items: list[Committed]) -> None:
        """Write the pairs (feature_j, token_{j+1}) of the tokens the target just kept."""
        items = [it for it in items if it.hidden is not None and len(it.hidden)]
        if not items:
            return
        ids = [it.request_id for it in items]
        counts = [it.hidden.shape[0] for it in items]
        starts = [it.num_cached - n for it, n in zip(items, counts)]
        tokens = [t for it, st, n in zip(items, starts, counts) for t in it.seq[st + 1:st + 1 + n]]
        out = self._run(ids, torch.cat([it.hidden for it in items]), tokens, counts, starts, last_only=True)
        last = torch.tensor(counts).cumsum(0) - 1
        for b, it in enumerate(items):
            self.state[it.request_id] = (out.logits[b], out.hidden[last[b]])
            self.kv.set_length(it.request_id, it.num_cached)

    @torch.inference_mode()
    def propose(self, items: list[ProposeItem]) -> list[Draft]:
        drafts = [Draft(torch.empty(0, dtype=torch.long), parents=[])] * len(items)
        live = [i for i, it in enumerate(items) if it.request_id in self.state]
        if self.topk == 1:
            greedy_c = [i for i in live if self.c_chain and self.ctx[items[i].request_id].params.greedy
                        and self.ctx[items[i].request_id].controls is None]
            self._c_chains(items, greedy_c, drafts)
            self._chains(items, [i for i in live if i not in greedy_c], drafts)
        else:
            self._trees(items, live, drafts)
        return drafts

    def _c_chains(self, items, idx: list[int], drafts: list) -> None:
        """topk = 1, greedy, CPU: every request's chain in one C call."""
        if not idx:
            return
        vocab = self.head.draft_vocab
        n = [min(items[i].k, self.depth or DEFAULT_DEPTH) for i in idx]
        first = [int(vocab[self.state[items[i].request_id][0].argmax()]) for i in idx]
        steps = [m - 1 for m in n]
        rest = [[] for _ in idx]
        if max(steps) > 0:
            feats = torch.stack([self.state[items[i].request_id][1] for i in idx])
            rest = cforward.eagle_chain(kernels.load(), self.head.decoder.c_view(self.kv), self.c_chain, self.embedding,
                                        vocab,
                                        [self.kv.blocks.row(items[i].request_id) for i in idx],
                                        [len(items[i].seq) - 1 for i in idx], steps, feats, first)
        for j, i in enumerate(idx):
            drafts[i] = Draft(torch.tensor([first[j]] + rest[j], dtype=torch.long), None, list(range(-1, n[j] - 1)))

    def _chains(self, items, idx: list[int], drafts: list) -> None:
        """topk = 1: the tree is a chain, and a chain needs no tree mask (causal is right)."""
        if not idx:
            return
        n = {i: min(items[i].k, self.depth or DEFAULT_DEPTH) for i in idx}
        cur = {i: self.state[items[i].request_id] for i in idx}
        tokens, probs = {i: [] for i in idx}, {i: [] for i in idx}
        active, depth = list(idx), 0
        vocab = self.head.draft_vocab
        plain = {i for i in idx if self.ctx[items[i].request_id].params.greedy and self.ctx[items[i].request_id].controls is None}
        last = None         # (the rows of the head's last forward, its output): read whole where they still line up
        while active:
            # greedy rows without controls: every row's argmax in one op (on a GPU each row's own
            # log-softmax and top-k is a handful of launches), the others one by one
            fast = [i for i in active if i in plain]
            if fast:
                rows = (torch.stack([cur[i][0] for i in fast]) if last is None else _rows(last, "logits", fast))
                for i, tok in zip(fast, vocab[rows.argmax(-1)].tolist()):
                    tokens[i].append(tok)
            for i in active:
                if i in plain:
                    continue
                picks = self._children(cur[i][0], 1, self.ctx[items[i].request_id], items[i].seq, tokens[i])
                for tok, _, q in picks:     # none: the controls leave nothing in the draft vocabulary
                    tokens[i].append(tok)
                    probs[i] += [q] if q is not None else []
                if not picks:
                    n[i] = len(tokens[i])
            active = [i for i in active if n[i] > depth + 1]
            if not active:
                break
            feats = torch.stack([cur[i][1] for i in active]) if last is None else _rows(last, "hidden", active)
            out = self._run([items[i].request_id for i in active], feats, [tokens[i][-1] for i in active],
                            [1] * len(active), [len(items[i].seq) - 1 + depth for i in active])
            last = (active, out)
            for row, i in enumerate(active):
                if i not in plain:      # the rows read one by one
                    cur[i] = (out.logits[row], None)
            depth += 1
        for i in idx:
            drafts[i] = Draft(torch.tensor(tokens[i], dtype=torch.long), torch.stack(probs[i]) if probs[i] else None,
                              list(range(-1, n[i] - 1)))

    def _trees(self, items, idx: list[int], drafts: list) -> None:
        """EAGLE-2 trees, grown one depth per head forward over every request at once."""
        grow = {i: _Growth(self, items[i], self.ctx[items[i].request_id], *self.state[items[i].request_id])
                for i in idx}
        while pending := [i for i in idx if grow[i].expand]:
            asks = [grow[i].ask() for i in pending]
            out = self._run([items[i].request_id for i in pending], torch.cat([a[0] for a in asks]),
                            [t for a in asks for t in a[1]], [len(a[1]) for a in asks], [a[3] for a in asks],
                            [a[2] for a in asks])
            at = 0
            for i, a in zip(pending, asks):
                T = len(a[1])
                grow[i].absorb(out.logits[at:at + T], out.hidden[at:at + T])
                at += T
        for i in idx:
            drafts[i] = grow[i].draft()

    def _children(self, logits, m: int, ctx: RequestContext, seq: list[int], path: list[int]):
        """m candidates after a node (path: the drafts before it): (target token id, log q, q or
        None) each. With controls the logits are adjusted for the node's path first, so q is
        processed exactly as p will be there."""
        vocab = self.head.draft_vocab
        if ctx.controls is not None:
            row = ctx.adjust(to_target_vocab(logits[None].float(), vocab, ctx.vocab_size), seq, [path])
            allowed = int((row > float("-inf")).sum())
            if allowed == 0:        # the controls leave nothing in the draft vocabulary
                return []
            if ctx.params.greedy:
                lp = torch.log_softmax(row[0], -1)
                top = lp.topk(min(m, allowed))
                return [(tok, lq, None) for tok, lq in zip(top.indices.tolist(), top.values.tolist())]
            q = process(row, ctx.params)[0]
            picks = draw_without_replacement(q, m, ctx.generator).tolist()
            return [(tok, math.log(max(q[tok].item(), 1e-30)), q) for tok in picks]
        if ctx.params.greedy:
            lp = torch.log_softmax(logits.float(), -1)
            top = lp.topk(min(m, lp.shape[0]))
            return [(tok, lq, None) for tok, lq in zip(vocab[top.indices].tolist(), top.values.tolist())]
        q = process(to_target_vocab(logits[None].float(), vocab, ctx.vocab_size), ctx.params)[0]
        picks = draw_without_replacement(q, m, ctx.generator).tolist()
        return [(tok, math.log(max(q[tok].item(), 1e-30)), q) for tok in picks]


def _rows(last: tuple, field: str, want: list[int]):
    """Rows `want` of the head's last output (last: (the rows it ran, its output)), in that order:
    the whole tensor while they still line up, one index op once some rows have stopped."""
    ran, out = last
    t = getattr(out, field)
    if ran == want:
        return t
    at = {i: r for r, i in enumerate(ran)}
    return t[torch.tensor([at[i] for i in want], device=t.device)]


class _Growth:
    """One request's EAGLE-2 tree while it grows: draw the current level's children, pick the
    nodes to expand (ask), take the head's outputs for them (absorb), repeat."""

    def __init__(self, p: EagleProposer, item: ProposeItem, ctx: RequestContext, logits, feature):
        self.p, self.ctx, self.k, self.seq = p, ctx, item.k, item.seq
        self.greedy = ctx.params.greedy
        self.base = len(item.seq) - 1          # the head's first free slot: its pairs cover seq[:-1]
        self.depth_max = min(item.k, p.depth or DEFAULT_DEPTH)
        self.t, self.written, self.depth, self.expand = _Tree(), [], 0, None
        # the root: the logits after the sequence, the predicted feature of its last token
        self.level = [(-1, logits, feature)]
        self._grow()

    def _grow(self) -> None:
        t, topk, new = self.t, self.p.topk, []
        for node, logits, feat in self.level:
            m = topk if self.greedy else min(topk, self.k - len(t.tokens))
            if m <= 0:
                break
            path = t.path(node) if self.ctx.controls is not None else []
            for tok, logq, q in self.p._children(logits, m, self.ctx, self.seq, path):
                new.append(t.add(tok, node, t.score(node) + logq, q, feat))
        done = not new or self.depth + 1 == self.depth_max or (not self.greedy and len(t.tokens) >= self.k)
        self.expand = None if done else sorted(new, key=lambda i: (-t.scores[i], i))[:topk]

    def ask(self):
        """The next head forward's part for this request: (pair features [T, D], pair tokens,
        its tree mask, start slot). Each node sees the committed slots and its ancestors' pairs."""
        t, nodes = self.t, self.expand
        past, T = len(self.written), len(nodes)
        slot = {n: i for i, n in enumerate(self.written)}
        mask = torch.zeros(T, past + T, dtype=torch.bool)
        for row, n in enumerate(nodes):
            mask[row, past + row] = True
            a = t.parents[n]
            while a != -1:
                mask[row, slot[a]] = True
                a = t.parents[a]
        # a depth-d node's pair sits at position base + d; its slot is base + past + row
        offsets = torch.full((T,), self.depth - past, dtype=torch.long)
        feats = torch.stack([t.feats[n] for n in nodes])
        return feats, [t.tokens[n] for n in nodes], TreeAttention(offsets, mask, past), self.base + past

    def absorb(self, logits, feats) -> None:
        nodes = self.expand
        self.written.extend(nodes)
        self.level = [(n, logits[i], feats[i]) for i, n in enumerate(nodes)]
        self.depth += 1
        self._grow()

    def draft(self) -> Draft:
        t = self.t.best(self.k) if self.greedy else self.t   # best first: smaller trees are prefixes
        if not t.tokens:
            return Draft(torch.empty(0, dtype=torch.long), parents=[])
        probs = torch.stack(t.probs) if t.probs else None
        return Draft(torch.tensor(t.tokens, dtype=torch.long), probs, t.parents)


DEFAULT_DEPTH = 8


class _Tree:
    """Draft nodes as parallel lists; feats[i] = the feature node i's pair is built from."""

    def __init__(self):
        self.tokens, self.parents, self.scores, self.probs, self.feats = [], [], [], [], []

    def path(self, node: int) -> list[int]:
        """The tokens from the root down to node (inclusive)."""
        out = []
        while node != -1:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    def score(self, node: int) -> float:
        return 0.0 if node == -1 else self.scores[node]

    def add(self, tok, parent, score, q, feat) -> int:
        self.tokens.append(tok)
        self.parents.append(parent)
        self.scores.append(score)
        self.feats.append(feat)
        if q is not None:
            self.probs.append(q)
        return len(self.tokens) - 1

    def best(self, n: int) -> "_Tree":
        """The n nodes of highest score, best first: a tree in topological order, since scores
        only fall along a path (ties go to the earlier node, and parents come before children)."""
        keep = sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], i))[:n]
        out, index = _Tree(), {-1: -1}
        for i in keep:
            index[i] = out.add(self.tokens[i], index[self.parents[i]], self.scores[i], None, self.feats[i])
        return out
