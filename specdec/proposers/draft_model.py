"""A small draft model sharing the target's tokenizer, drafting K tokens autoregressively."""

from __future__ import annotations

import torch

from ..model import Transformer
from .base import Draft, RequestContext, chain, draw, fit_vocab


class DraftModelProposer:
    name = "draft_model"

    def __init__(self, model: Transformer, max_len: int):
        self.model, self.max_len = model, max_len

    @torch.inference_mode()
    def start(self, prompt: list[int], ctx: RequestContext, target_cache=None) -> "DraftModelSession":
        cache = self.model.new_cache(1, self.max_len)
        if len(prompt) > 1:   # prefill here, so that proposal timings (adaptive K) are per-step costs
            self.model(torch.tensor(prompt[:-1], device=self.model.device)[None], cache, logits=False)
        return DraftModelSession(self.model, cache, ctx)


class DraftModelSession:
    """Invariant: the draft cache holds a prefix of the committed sequence (plus, during a step,
    the drafts fed back). Every step first feeds what the cache lacks: the last prompt token on
    the first step, one token after a rejection, two (the last draft and the bonus) after a
    step that accepted everything."""

    def __init__(self, model: Transformer, cache, ctx: RequestContext):
        self.model, self.cache, self.ctx = model, cache, ctx

    @torch.inference_mode()
    def propose(self, seq: list[int], k: int) -> Draft:
        dev = self.model.device
        pending = torch.tensor(seq[self.cache.length:], device=dev)[None]
        logits = self.model(pending, self.cache, logits=slice(-1, None))[0]       # [1, V]
        tokens, probs = [], []
        for i in range(k):
            tok, q = draw(fit_vocab(logits, self.ctx.vocab_size), self.ctx)
            tokens.append(tok)
            probs += [q] if q is not None else []
            if i + 1 < k:
                logits = self.model(tok[None], self.cache)[0]
        return chain(tokens, probs, dev)

    def commit(self, seq: list[int]) -> None:
        # entries past len(seq) - 1 include rejected drafts; the last token is fed next step
        self.cache.rollback(min(self.cache.length, len(seq) - 1))
