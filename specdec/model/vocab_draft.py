"""A draft model that predicts over a draft vocabulary and reads the target's token embeddings.

On a small target the LM head is a large share of a forward (SmolLM2-135M: 28M of 135M
weights), so a draft with its own full-vocabulary head or embedding table would cost a quarter
of a target forward before its first layer. This draft keeps neither:
- its input is the target's own embedding of each token (looked up, not multiplied: free);
- its LM head scores only V' draft-vocabulary tokens (the most frequent of the target's
  answers); tokens outside are never proposed, which costs acceptance, not correctness.
Everything between is one ordinary Llama decoder (`Transformer` fed `embeds`), so the C path
and the KV cache are the target's own. `forward` returns logits over the *target's* vocabulary
(-inf off the draft vocabulary), so the draft_model proposer drives it like any draft.

Folder: config.json ("architectures": ["SpecdecVocabDraft"], "decoder": a Llama config with
vocab_size V'), model.safetensors (decoder weights in Hugging Face names, plus "draft_vocab"
[V'] target ids), README.md, training.json.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from .batch import ForwardBatch, ForwardOutput
from .checkpoint import CheckpointError, fused_to_hf, hf_to_fused
from .config import ModelConfig
from .kv import KVCache
from .llama import Transformer
from .quant import pack_q8_0

VOCAB_DRAFT = "SpecdecVocabDraft"


class VocabDraft(nn.Module):
    def __init__(self, cfg: ModelConfig, draft_vocab: Tensor, embed: nn.Embedding, target_vocab_size: int):
        super().__init__()
        self.decoder = Transformer(cfg.replace(vocab_size=draft_vocab.numel(), tie_word_embeddings=False))
        # the input comes from the target's embedding table, never from the decoder's own
        self.decoder.model.embed_tokens.weight = nn.Parameter(torch.empty(0, cfg.hidden_size))
        self.register_buffer("draft_vocab", draft_vocab.to(torch.long))
        self.target_embed = (embed,)       # a tuple: the target's module, not one of this draft's parameters
        self.target_vocab_size = target_vocab_size

    @property
    def config(self) -> ModelConfig:
        return self.decoder.config

    @property
    def device(self) -> torch.device:
        return self.decoder.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.dtype

    def kv_bytes_per_slot(self) -> int:
        return self.decoder.kv_bytes_per_slot()

    def new_kv(self, blocks) -> KVCache:
        return self.decoder.new_kv(blocks)

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> KVCache:
        return self.decoder.new_cache(batch, max_len)

    def draft_logits(self, tokens: Tensor, kv: KVCache | None = None, batch: ForwardBatch | None = None,
                     logits: bool = True) -> Tensor | None:
        """tokens [B, T] (no cache) or [N] target ids -> logits over the draft vocabulary
        ([B, T, V'], or the rows `batch` asks for), None when logits is False."""
        x = self.target_embed[0](tokens).to(self.decoder.dtype)
        return self.decoder(None, kv, batch, embeds=x, logits=logits).logits

    def forward(self, tokens: Tensor, kv: KVCache | None = None, batch: ForwardBatch | None = None, *,
                logits: bool = True) -> ForwardOutput:
        """Transformer's interface, with logits over the target's vocabulary (-inf off V')."""
        out = self.draft_logits(tokens, kv, batch, logits)
        if out is None:
            return ForwardOutput(None, None)
        full = out.new_full((*out.shape[:-1], self.target_vocab_size), float("-inf"))
        return ForwardOutput(full.scatter(-1, self.draft_vocab.expand(*out.shape[:-1], -1), out), None)

    def config_dict(self) -> dict:
        return {"architectures": [VOCAB_DRAFT], "hidden_size": self.config.hidden_size,
                "draft_vocab_size": self.draft_vocab.numel(), "target_vocab_size": self.target_vocab_size,
                "decoder": self.config.to_hf()}


def is_vocab_draft(folder: str | os.PathLike) -> bool:
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (cfg.get("architectures") or [None])[0] == VOCAB_DRAFT


def save_vocab_draft(draft: VocabDraft, folder: str | os.PathLike, dtype=torch.bfloat16, extra: dict | None = None) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to("cpu", dtype) for k, v in draft.decoder.state_dict().items()
          if not k.endswith("embed_tokens.weight")}
    sd = fused_to_hf(sd, draft.config)
    sd["draft_vocab"] = draft.draft_vocab.cpu().contiguous()
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = {**draft.config_dict(), "torch_dtype": str(dtype).removeprefix("torch."), **(extra or {})}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def load_vocab_draft(folder: str | os.PathLike, target: Transformer, dtype: torch.dtype | None = None) -> VocabDraft:
    """A vocab draft for `target`: weights in the target's dtype (or `dtype`), on its device."""
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    tcfg = target.config
    if cfg.get("hidden_size") != tcfg.hidden_size or cfg.get("target_vocab_size") != tcfg.vocab_size:
        raise CheckpointError(f"{folder}: a draft for hidden size {cfg.get('hidden_size')} and vocabulary "
                              f"{cfg.get('target_vocab_size')}; the target has {tcfg.hidden_size} and {tcfg.vocab_size}")
    try:
        dec = ModelConfig.from_hf(cfg["decoder"])
        sd = load_file(str(folder / "model.safetensors"))
    except (KeyError, ValueError, OSError) as e:
        raise CheckpointError(f"{folder}: not a readable draft ({str(e).splitlines()[0]})") from None
    vocab = sd.pop("draft_vocab", None)
    if vocab is None or vocab.numel() == 0 or int(vocab.max()) >= tcfg.vocab_size or int(vocab.min()) < 0:
        raise CheckpointError(f"{folder}: draft vocabulary missing or outside the target's [0, {tcfg.vocab_size})")
    draft = VocabDraft(dec, vocab, target.model.embed_tokens, tcfg.vocab_size)
    missing, unexpected = draft.decoder.load_state_dict(hf_to_fused(sd, draft.config), strict=False)
    missing = [m for m in missing if not m.endswith("embed_tokens.weight")]
    if missing or unexpected:
        raise CheckpointError(f"{folder}: weights do not match the config: "
                              f"{(missing or unexpected)[0]} {'missing' if missing else 'unexpected'}")
    # a GGUF target kept packed has no dense LM-head weight: its draft is stored and run in bf16
    dtype = dtype or getattr(getattr(target.lm_head, "weight", None), "dtype", torch.bfloat16)
    draft = draft.to(device=target.device)
    for name, p in draft.decoder.named_parameters():
        if not name.endswith("embed_tokens.weight"):
            p.data = p.data.to(dtype)
    if target.compute_dtype == torch.float32 and dtype != torch.float32:   # bf16 weights, fp32 activations (checkpoint.finish)
        draft.decoder.use_fp32_activations()
        if getattr(target.lm_head, "weight", None) is None:        # packed GGUF target: Q8_0 panels, as the head's
            pack_q8_0(draft.decoder)
    return draft.eval().requires_grad_(False)
