"""A small draft model sharing the target's tokenizer, drafting K tokens autoregressively.

Its KV cache lives on the engine's blocks (the same block tables as the target's: one
allocation covers both), with its own length per request. Invariant: the draft cache holds a
prefix of the committed sequence (plus, during a step, the drafts fed back). Prompt chunks are
fed as the target prefills them; every step first feeds what the cache lacks: one token after
a rejection, two (the last draft and the bonus) after a step that accepted everything.

A prompt longer than its context is fed up to it, and the engine asks for no drafts past it
(draft_room): those requests decode plainly while the target keeps its whole context.

Deferrable (ProposerCaps): after an update that merges several steps, the cache keeps the
drafts it was fed only as far as they agree with the committed sequence, and the next propose
feeds everything after that in one forward.
"""

from __future__ import annotations

import torch

from ..model import ForwardBatch, Transformer
from .base import Committed, Draft, ProposeItem, ProposerBase, ProposerCaps, grow_chains


class DraftModelProposer(ProposerBase):
    name = "draft_model"

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model
        self.caps = ProposerCaps(max_len=model.config.max_position_embeddings, deferrable=True)
        self.kv = None
        self.fed: dict = {}     # request id -> (slot of its first fed draft, the drafts fed [k - 1])

    def kv_bytes_per_slot(self) -> int:
        return self.model.kv_bytes_per_slot()

    def initialize_kv(self, blocks, target_kv) -> None:
        self.kv = self.model.new_kv(blocks)

    def _forward(self, ids, tokens: list[int] | torch.Tensor, counts, starts, logits: bool):
        kv = self.kv
        batch = ForwardBatch.build(kv, ids, counts, starts, logits=[1] * len(ids) if logits else None)
        tokens = tokens if isinstance(tokens, torch.Tensor) else torch.tensor(tokens, dtype=torch.long)
        out = self.model(tokens.to(self.model.device), kv, batch, logits=logits).logits
        for rid, st, n in zip(ids, starts, counts):
            kv.set_length(rid, st + n)
        return out

    def cached_upto(self, request_id) -> int | None:
        """Its length, but not the drafts fed by the last propose (update keeps the agreeing ones);
        None once it holds its whole context (it never writes past it: the target's blocks after
        it may be registered with its slots unwritten, since it never reads them)."""
        n = self.kv.length(request_id)
        n = min(n, self.fed[request_id][0]) if request_id in self.fed else n
        return None if n >= self.caps.max_len else n

    def remove_request(self, request_id) -> None:
        super().remove_request(request_id)
        self.fed.pop(request_id, None)

    @torch.inference_mode()
    def update(self, items: list[Committed]) -> None:
        feed = []
        for it in items:
            length = min(self.kv.length(it.request_id), it.num_cached)
            if it.request_id in self.fed:     # keep the fed drafts the sequence agrees with
                start, drafts = self.fed.pop(it.request_id)
                agree = next((j for j, (a, b) in enumerate(zip(drafts.tolist(), it.seq[start:])) if a != b),
                             min(len(drafts), len(it.seq) - start))
                length = min(length, start + agree)
            self.kv.rollback(it.request_id, length)
            end = min(it.num_cached, self.caps.max_len)    # a prompt past its context: fed up to it
            if it.prefill and length < end:
                feed.append((it.request_id, it.seq[length:end], length))
        if feed:   # prompt chunks: in the same step as the target's, so proposals cost per-step work
            self._forward([f[0] for f in feed], [t for f in feed for t in f[1]], [len(f[1]) for f in feed],
                          [f[2] for f in feed], logits=False)

    @torch.inference_mode()
    def propose(self, items: list[ProposeItem]) -> list[Draft]:
        ids = [it.request_id for it in items]
        starts = [self.kv.length(rid) for rid in ids]
        pending = [it.seq[st:] for it, st in zip(items, starts)]
        logits = self._forward(ids, [t for p in pending for t in p], [len(p) for p in pending], starts, True)

        def step(active, tokens, depth):
            sel = [ids[i] for i in active]
            return self._forward(sel, tokens, [1] * len(active), [len(items[i].seq) + depth for i in active], True)

        drafts = grow_chains(items, [self.ctx[rid] for rid in ids], logits, step)
        for it, d in zip(items, drafts):      # all but each chain's last token went into the cache
            self.fed[it.request_id] = (len(it.seq), d.tokens[:-1])
        return drafts
