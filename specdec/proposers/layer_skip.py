"""Self-speculation by early exit: the target's first L layers, its final norm and LM head.

The draft writes its keys and values into the target's own cache (layers < L); the
verification forward then rewrites those same slots with identical values, so no second cache
and no extra weights are needed.
"""

from __future__ import annotations

import torch

from ..model import Transformer
from .base import RequestContext, chain, draw


class LayerSkipProposer:
    name = "layer_skip"

    def __init__(self, model: Transformer, num_layers: int):
        n = model.config.num_hidden_layers
        if not 1 <= num_layers < n:
            raise ValueError(f"speculative_config.num_layers must be in [1, {n - 1}] for this target, got {num_layers}")
        self.model, self.num_layers = model, num_layers

    def start(self, prompt: list[int], ctx: RequestContext, target_cache=None) -> "LayerSkipSession":
        if target_cache is None:
            raise ValueError("layer_skip drafts into the target's cache; none was given")
        return LayerSkipSession(self.model, self.num_layers, target_cache, ctx)


class LayerSkipSession:
    def __init__(self, model, num_layers, cache, ctx: RequestContext):
        self.model, self.L, self.cache, self.ctx = model, num_layers, cache, ctx

    @torch.inference_mode()
    def propose(self, seq: list[int], k: int) -> Draft:
        start = len(seq) - 1                       # the target cache holds seq[:-1]
        tok = torch.tensor(seq[-1:], device=self.model.device)
        tokens, probs = [], []
        for i in range(k):
            logits = self.model(tok[None], self.cache, start=[start + i], exit_layer=self.L)[0]
            tok, q = draw(logits, self.ctx)
            tokens.append(tok)
            probs += [q] if q is not None else []
        self.cache.rollback(start)                 # the verification forward rewrites them
        return chain(tokens, probs, self.model.device)

    def commit(self, seq: list[int]) -> None:
        pass
