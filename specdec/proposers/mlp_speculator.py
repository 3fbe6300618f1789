"""IBM's MLP speculators (model/mlp_speculator.py) as a proposer: vLLM's `"method": "mlp_speculator"`.

Holds, per request, the target's final-norm feature of the token before the sequence's last
(Medusa's input too). A step drafts a chain of min(K, n_predict) tokens, one speculator stage
per depth, every request's stage i in one batched call: greedy takes each stage's argmax; a
sampled request draws from the stage's processed distribution q (its own generator) and keeps
q for the rejection sampler; with penalties, bias or a grammar, each stage's logits are
adjusted for the path drafted so far first, so q is processed exactly as p will be there.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..model.mlp_speculator import MLPSpeculator
from ..sampling import process
from .base import Draft, LastFeatureProposer, ProposeItem, ProposerCaps, to_target_vocab


class MLPSpeculatorProposer(LastFeatureProposer):
    name = "mlp_speculator"

    def __init__(self, speculator: MLPSpeculator, vocab_size: int):
        super().__init__()
        self.spec, self.vocab_size = speculator, vocab_size
        # a chain of at most n_predict tokens ("auto" climbs no higher)
        self.caps = ProposerCaps(needs_hidden=True, max_tree_size=speculator.n_predict)
        self.draft_vocab = torch.arange(speculator.vocab_size)

    @torch.inference_mode()
    def propose(self, items: list[ProposeItem]) -> list[Draft]:
        spec = self.spec
        drafts = [Draft(torch.empty(0, dtype=torch.long), parents=None)] * len(items)
        live = [i for i, it in enumerate(items) if it.request_id in self.feature]
        if not live:
            return drafts
        n = {i: min(items[i].k, spec.n_predict) for i in live}
        tokens, probs = {i: [] for i in live}, {i: [] for i in live}
        active = live                       # the requests still drafting, aligned with the rows of `state`
        state = spec.start(torch.stack([self.feature[items[i].request_id] for i in active]).to(torch.float32))
        last = [items[i].seq[-1] for i in active]
        for depth in range(spec.n_predict):
            if not active:
                break
            logits, state = self._step(depth, state, torch.tensor(last, dtype=torch.long))
            keep, last = [], []
            for r, i in enumerate(active):
                tok, q = self._pick(logits[r], self.ctx[items[i].request_id], items[i].seq, tokens[i])
                if tok is None:             # the controls leave nothing in the speculator's vocabulary
                    continue
                tokens[i].append(tok)
                if q is not None:
                    probs[i].append(q)
                if len(tokens[i]) < n[i]:
                    keep.append(r)
                    last.append(tok)
            state = state[keep]
            active = [active[r] for r in keep]
        for i, toks in tokens.items():
            if toks:
                drafts[i] = Draft(torch.tensor(toks, dtype=torch.long), torch.stack(probs[i]) if probs[i] else None)
        return drafts

    def _step(self, depth: int, state, last):
        """Stage `depth` over the requests in groups small enough for the row-exact CPU kernel,
        so that a request's q (and so its seeded draws) does not depend on the batch."""
        g = kernels.MAX_ROWS
        outs = [self.spec.step(depth, state[a:a + g], last[a:a + g]) for a in range(0, state.shape[0], g)]
        return torch.cat([o[0] for o in outs]).float(), torch.cat([o[1] for o in outs])

    def _pick(self, logits, ctx, seq: list[int], path: list[int]):
        """One stage's token for one request, and the q it was drawn from (None: greedy)."""
        if ctx.controls is None and ctx.params.greedy:
            return int(logits.argmax()), None
        row = to_target_vocab(logits[None], self.draft_vocab, ctx.vocab_size)
        if ctx.controls is not None:
            row = ctx.adjust(row, seq, [path])
            if not bool((row > float("-inf")).any()):
                return None, None
            if ctx.params.greedy:
                return int(row[0].argmax()), None
        q = process(row, ctx.params)[0]
        tok = int(torch.multinomial(q, 1, generator=ctx.generator))
        return tok, q
