"""Self-speculation by early exit: the target's first L layers, its final norm and LM head.

The draft writes its keys and values into the target's own cache (layers < L) past the
committed prefix; the verification forward then rewrites those same slots with identical
values, so no second cache and no extra weights are needed.
"""

from __future__ import annotations

import torch

from ..model import ForwardBatch, Transformer
from .base import Draft, ProposeItem, ProposerBase, grow_chains


class LayerSkipProposer(ProposerBase):
    name = "layer_skip"

    def __init__(self, model: Transformer, num_layers: int):
        super().__init__()
        n = model.config.num_hidden_layers
        if not 1 <= num_layers < n:
            raise ValueError(f"speculative_config.num_layers must be in [1, {n - 1}] for this target, got {num_layers}")
        self.model, self.num_layers = model, num_layers
        self.kv = None

    def initialize_kv(self, blocks, target_kv) -> None:
        self.kv = target_kv

    def _forward(self, ids, tokens, starts):
        batch = ForwardBatch.build(self.kv, ids, [1] * len(ids), starts, logits=[1] * len(ids))
        return self.model(tokens.to(self.model.device), self.kv, batch, exit_layer=self.num_layers).logits

    @torch.inference_mode()
    def propose(self, items: list[ProposeItem]) -> list[Draft]:
        ids = [it.request_id for it in items]
        # the target's cache holds seq[:-1]: the last token goes to slot len(seq) - 1
        first = torch.tensor([it.seq[-1] for it in items], dtype=torch.long)
        logits = self._forward(ids, first, [len(it.seq) - 1 for it in items])

        def step(active, tokens, depth):
            return self._forward([ids[i] for i in active], tokens, [len(items[i].seq) + depth for i in active])

        return grow_chains(items, [self.ctx[rid] for rid in ids], logits, step)
