"""EAGLE: a one-layer head drafts at the feature level; EAGLE-2's dynamic tree.

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
"""

from __future__ import annotations

import math

import torch

from .. import kernels
from ..kernels import cforward
from ..model import Transformer, TreeAttention
from ..model.heads import EagleHead
from ..sampling import process
from .base import Draft, RequestContext, draw_without_replacement, to_target_vocab


class EagleProposer:
    name = "eagle"
    needs_hidden = True
    tree = True

    def __init__(self, head: EagleHead, target: Transformer, max_len: int, topk: int = 4, depth: int | None = None):
        if topk < 1:
            raise ValueError(f"speculative_config.topk must be >= 1, got {topk}")
        self.head, self.target, self.max_len, self.topk, self.depth = head, target, max_len, topk, depth

    @property
    def max_tree_size(self) -> int | None:
        """A chain (topk 1) holds at most `depth` nodes; a tree is bounded only by the request."""
        return (self.depth or DEFAULT_DEPTH) if self.topk == 1 else None

    def start(self, prompt: list[int], ctx: RequestContext, target_cache=None, hidden=None) -> "EagleSession":
        s = EagleSession(self, ctx)
        if hidden is not None and len(hidden):
            s.feed(prompt, hidden, 0)
        return s


class EagleSession:
    def __init__(self, p: EagleProposer, ctx: RequestContext):
        self.p, self.ctx = p, ctx
        self.cache = p.head.new_cache(p.max_len)
        self.c_chain = self._c_chain_ok()     # decided once per request, not every step
        self.logits = None     # [V'] for the token after the sequence's last token
        self.feature = None    # [D] the head's predicted feature of the sequence's last token

    def _embed(self, tokens: list[int]):
        emb = self.p.target.model.embed_tokens
        return emb(torch.tensor(tokens, device=emb.weight.device)).to(self.p.head.decoder.dtype)

    @torch.inference_mode()
    def feed(self, seq: list[int], feats, start: int) -> None:
        """feats [n, D]: the target's features of seq[start : start + n]; write pairs start.. ."""
        n = feats.shape[0]
        self.cache.rollback(start)
        logits, f = self.p.head(feats[None].to(self.p.head.decoder.dtype),
                                self._embed(seq[start + 1:start + 1 + n])[None], self.cache, [start])
        self.logits, self.feature = logits[0, -1], f[0, -1]

    def commit(self, seq: list[int], hidden=None) -> None:
        if hidden is not None and len(hidden):
            self.feed(seq, hidden, len(seq) - 1 - hidden.shape[0])

    @torch.inference_mode()
    def propose(self, seq: list[int], k: int) -> Draft:
        if self.logits is None or k == 0:
            return Draft(torch.empty(0, dtype=torch.long), parents=[])
        greedy, topk = self.ctx.params.greedy, self.p.topk
        depth_max = min(k, self.p.depth or DEFAULT_DEPTH)
        base = len(seq) - 1                     # the head's first free slot: its pairs cover seq[:-1]
        if topk == 1:
            return self._chain(depth_max, base)
        t = _Tree()
        # the root: the logits after the sequence, the predicted feature of its last token
        level = [(-1, self.logits, self.feature)]
        written: list[int] = []                 # nodes whose pairs sit at slots base, base + 1, ...
        for depth in range(depth_max):
            new = []
            for node, logits, feat in level:
                m = topk if greedy else min(topk, k - len(t.tokens))
                if m <= 0:
                    break
                for tok, logq, q in self._children(logits, m):
                    new.append(t.add(tok, node, t.score(node) + logq, q, feat))
            if not new or depth + 1 == depth_max or (not greedy and len(t.tokens) >= k):
                break
            expand = sorted(new, key=lambda i: (-t.scores[i], i))[:topk]
            level = self._expand(t, expand, written, base, depth)
        self.cache.rollback(base)
        if greedy:       # best first (smaller trees are prefixes: adaptive sizes rely on it)
            t = t.best(k)
        if not t.tokens:
            return Draft(torch.empty(0, dtype=torch.long), parents=[])
        probs = torch.stack(t.probs) if t.probs else None
        return Draft(torch.tensor(t.tokens, dtype=torch.long), probs, t.parents)

    def _chain(self, n: int, base: int) -> Draft:
        """topk = 1: the tree is a chain, and a chain needs no tree mask (causal is right).
        Greedy chains on the CPU run in one C call (kernels/forward.c: eagle_chain)."""
        if self.ctx.params.greedy and self.c_chain:
            first = int(self.p.head.draft_vocab[self.logits.argmax()])
            rest = cforward.eagle_chain(kernels.load(), self.p.head, self.cache, self.p.target.model.embed_tokens.weight,
                                        self.feature, first, base, n - 1) if n > 1 else []
            return Draft(torch.tensor([first] + rest, dtype=torch.long), None, list(range(-1, n - 1)))
        tokens, probs = [], []
        logits, feat = self.logits, self.feature
        for depth in range(n):
            (tok, _, q), = self._children(logits, 1)
            tokens.append(tok)
            if q is not None:
                probs.append(q)
            if depth + 1 < n:
                out, f = self.p.head(feat[None, None], self._embed([tok])[None], self.cache, [base + depth])
                logits, feat = out[0, -1], f[0, -1]
        self.cache.rollback(base)
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.stack(probs) if probs else None,
                     list(range(-1, n - 1)))

    def _c_chain_ok(self) -> bool:
        head, emb = self.p.head, self.p.target.model.embed_tokens.weight
        return (kernels.load() is not None and cforward.supported(head.decoder, self.cache)
                and head.fc.weight.dtype in (torch.float32, torch.bfloat16) and emb.device.type == "cpu"
                and emb.dtype in (torch.float32, torch.bfloat16) and emb.is_contiguous())

    def _children(self, logits, m: int):
        """m candidates after a node: (target token id, log q, q or None) each."""
        vocab = self.p.head.draft_vocab
        if self.ctx.params.greedy:
            lp = torch.log_softmax(logits.float(), -1)
            top = lp.topk(min(m, lp.shape[0]))
            return [(tok, lq, None) for tok, lq in zip(vocab[top.indices].tolist(), top.values.tolist())]
        q = process(to_target_vocab(logits[None].float(), vocab, self.ctx.vocab_size), self.ctx.params)[0]
        picks = draw_without_replacement(q, m, self.ctx.generator).tolist()
        return [(tok, math.log(max(q[tok].item(), 1e-30)), q) for tok in picks]

    def _expand(self, t: "_Tree", nodes: list[int], written: list[int], base: int, depth: int):
        """One head forward over the pairs (parent's predicted feature, node's token) of `nodes`
        (all at `depth`, 0-based), each seeing the committed slots and its ancestors' pairs;
        returns the next level: (node, its logits, its predicted feature)."""
        past, T = len(written), len(nodes)
        slot = {n: i for i, n in enumerate(written)}
        mask = torch.zeros(T, past + T, dtype=torch.bool)
        for row, n in enumerate(nodes):
            mask[row, past + row] = True
            a = t.parents[n]
            while a != -1:
                mask[row, slot[a]] = True
                a = t.parents[a]
        # a depth-d node's pair sits at position base + d; its slot is base + past + row
        offsets = torch.full((T,), depth - past, dtype=torch.long)
        feats = torch.stack([t.feats[n] for n in nodes])[None]
        logits, f = self.p.head(feats, self._embed([t.tokens[n] for n in nodes])[None], self.cache,
                                [base + past], tree=TreeAttention(offsets, mask, past))
        written.extend(nodes)
        return [(n, logits[0, i], f[0, i]) for i, n in enumerate(nodes)]


DEFAULT_DEPTH = 8


class _Tree:
    """Draft nodes as parallel lists; feats[i] = the feature node i's pair is built from."""

    def __init__(self):
        self.tokens, self.parents, self.scores, self.probs, self.feats = [], [], [], [], []

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
