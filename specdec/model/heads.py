"""Speculative heads that ride on the target: Medusa and EAGLE.

Both read the target's final-norm hidden state (its "feature") and predict over a *draft
vocabulary*: the V' most frequent tokens of the target's own generations (`draft_vocab`, a
[V'] map from draft index to target token id). A full 16k-row LM head per draft step would
cost a quarter of a target forward on the bundled model; V' = 4096 rows cost a sixteenth.
Tokens outside the draft vocabulary are never proposed, which costs acceptance, not
correctness: verification decides every emitted token.

- MedusaHeads (Cai et al. 2024): head i (1-based) maps the feature of token t to logits for
  token t + 1 + i, through its own residual block h + SiLU(W_i h + b_i) and an LM head
  shared by the heads (one weight read scores all heads at once).
- EagleHead (Li et al. 2024): fc([feature_t ; embed(token_{t+1})]) -> one Llama decoder
  layer -> norm = a predicted feature for token t + 1 -> LM head over V'. It drafts
  autoregressively at the feature level with its own one-layer KV cache.

A heads folder is self-contained: config.json ("architectures": ["SpecdecMedusaHeads"] or
["SpecdecEagleHead"]), model.safetensors, README.md (the card) and training.json.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from .checkpoint import CheckpointError, _not_a_folder, check_state
from .config import GEMMA, MOE, OLMO, ModelConfig
from .batch import ForwardBatch, ForwardOutput
from .kv import KVCache
from .llama import Linear, Transformer
from .quant import pack_q8_0

MEDUSA, EAGLE = "SpecdecMedusaHeads", "SpecdecEagleHead"


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, draft_vocab: Tensor):
        super().__init__()
        self.num_heads = num_heads
        self.blocks = nn.ModuleList(Linear(hidden_size, hidden_size, bias=True) for _ in range(num_heads))
        self.lm_head = Linear(hidden_size, draft_vocab.numel(), bias=False)
        self.register_buffer("draft_vocab", draft_vocab.to(torch.long))
        for b in self.blocks:   # Medusa's init: each block starts as the identity
            nn.init.zeros_(b.weight)
            nn.init.zeros_(b.bias)

    def forward(self, h: Tensor) -> Tensor:
        """h [..., D] features -> logits [num_heads, ..., V'] over the draft vocabulary."""
        h = h.to(self.lm_head.weight.dtype) if self.lm_head.weight.requires_grad else h
        xs = torch.stack([h + F.silu(b(h)) for b in self.blocks])
        return self.lm_head(xs)

    def config(self) -> dict:
        return {"architectures": [MEDUSA], "hidden_size": self.lm_head.in_features,
                "num_heads": self.num_heads, "draft_vocab_size": self.draft_vocab.numel()}


class EagleHead(nn.Module):
    """authors: the EAGLE authors' layout (vLLM's `"method": "eagle"` heads, load_eagle_authors):
    fc over [embedding ; feature] (a bias only where the checkpoint has one), no input norm in the
    first layer, no final norm, the target's LM head over its whole vocabulary. specdec's own
    heads: fc over [feature ; embedding] with a bias, a norm before every block and a final norm,
    an LM head over the draft vocabulary."""

    def __init__(self, target_cfg: ModelConfig, draft_vocab: Tensor, authors: bool = False, fc_bias: bool = True):
        super().__init__()
        D = target_cfg.hidden_size
        # authors: target_cfg is the head's own llama config (its layers, the target's vocabulary)
        cfg = target_cfg if authors else self._plain_layer(target_cfg, draft_vocab.numel())
        self.fc = Linear(2 * D, D, bias=fc_bias)
        self.fc.row_invariant = True      # over prompt features of requests batched together
        self.decoder = Transformer(cfg)
        # the decoder's input comes from fc, never from a token lookup
        self.decoder.model.embed_tokens.weight = nn.Parameter(torch.empty(0, D))
        self.register_buffer("draft_vocab", draft_vocab.to(torch.long))
        self.embeds_first = authors
        if authors:
            self.decoder.model.layers[0].input_layernorm = nn.Identity()
            self.decoder.final_norm = False

    @staticmethod
    def _plain_layer(target_cfg: ModelConfig, vocab: int) -> ModelConfig:
        """specdec's head: one decoder layer of the target's kind over the draft vocabulary."""
        D = target_cfg.hidden_size
        # a plain decoder layer whatever the target's quirks (SmolLM3's NoPE, Granite's multipliers,
        # Gemma's GeGLU, norms, soft-caps and windows, OLMo's norms, experts: a llama layer, saved as one)
        plain = target_cfg.model_type in (*GEMMA, *OLMO, *MOE)     # saved as a llama layer (whole-head RoPE)
        if target_cfg.kv_lora_rank:      # DeepSeek's latent attention: plain heads of hidden / heads dims
            H = target_cfg.num_attention_heads
            target_cfg = target_cfg.replace(head_dim=D // H, num_key_value_heads=H, kv_lora_rank=0, q_lora_rank=0,
                                            qk_nope_head_dim=0, v_head_dim=0)
        cfg = target_cfg.replace(num_hidden_layers=1, rotary_dim=None if plain else target_cfg.rotary_dim,
                                 vocab_size=vocab, tie_word_embeddings=False,
                                 nope_layers=(), embedding_multiplier=1.0, residual_multiplier=1.0,
                                 attention_multiplier=None, logits_scaling=1.0, hidden_act="silu",
                                 sandwich_norms=False, attn_softcap=0.0, final_softcap=0.0, sliding_window=None,
                                 sliding_layers=(), local_rope_theta=None, pre_norms=True, qk_norm_full=False,
                                 num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, norm_topk_prob=False,
                                 moe_layers=(), shared_expert_size=0, shared_expert_gate=False, router_sigmoid=False,
                                 n_group=1, topk_group=1, routed_scaling_factor=1.0, group_by_max=False,
                                 attn_sinks=False, o_bias=False, mlp_bias=False,
                                 model_type="llama" if plain else target_cfg.model_type)
        return cfg

    @property
    def decoder_config(self) -> ModelConfig:
        return self.decoder.config

    def forward(self, feats: Tensor, token_embeds: Tensor, kv: KVCache | None = None,
                batch: ForwardBatch | None = None) -> ForwardOutput:
        """feats: features of tokens t; token_embeds: the target's embeddings of tokens t + 1;
        both [B, T, D] without a cache, [N, D] flat with one. Returns logits (for tokens t + 2,
        over the draft vocabulary; the rows batch.logits_indices asks for) and hidden: the
        predicted features of tokens t + 1."""
        pair = [token_embeds, feats] if self.embeds_first else [feats, token_embeds]
        x = self.fc(torch.cat(pair, -1).to(self.decoder.dtype))
        return self.decoder(None, kv, batch, hidden=True, embeds=x)

    def use_fp32_activations(self) -> "EagleHead":
        self.decoder.use_fp32_activations()
        if self.fc.bias is not None:
            self.fc.bias.data = self.fc.bias.data.float()
        return self

    def config(self) -> dict:
        return {"architectures": [EAGLE], "hidden_size": self.fc.out_features,
                "draft_vocab_size": self.draft_vocab.numel(), "decoder": self.decoder.config.to_hf()}


def save_heads(heads: MedusaHeads | EagleHead, folder: str | os.PathLike, dtype=torch.bfloat16,
               extra: dict | None = None) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().cpu()).contiguous()
          for k, v in heads.state_dict().items() if not k.endswith("embed_tokens.weight")}
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = {**heads.config(), "torch_dtype": str(dtype).removeprefix("torch."), **(extra or {})}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def whole_lm_head(target: Transformer, folder, what: str) -> nn.Module:
    """The target's LM head, for a drafter that shares it. Under tensor parallelism the target's
    head is split over the ranks and only rank 0 drafts, so a tied target's embedding (whole on
    every rank) serves rank 0 as the whole head; an untied head is refused (the drafter would need
    the other ranks' rows in a collective they never join)."""
    if getattr(target, "tp_size", 1) == 1:
        return target.lm_head
    emb = getattr(target.model.embed_tokens, "weight", None)
    if target.config.tie_word_embeddings and isinstance(emb, Tensor) and emb.dim() == 2 \
            and emb.shape[0] == target.config.vocab_size:
        with torch.device("meta"):
            head = Linear(emb.shape[1], emb.shape[0], bias=False)
        head.weight = nn.Parameter(emb, requires_grad=False)
        return head
    raise CheckpointError(f"{folder}: {what} shares the target's LM head, which is split over tensor-parallel "
                          "ranks here (a target whose LM head is its embedding, tied, can share it)")


def place_head(head: nn.Module, target: Transformer, lm_head: nn.Module | None = None) -> nn.Module:
    """An EAGLE-3 or MTP head (a `decoder` Transformer beside its own modules) made ready to draft
    for `target`: on its device, weights in its weight dtype (bf16 beside a packed GGUF target,
    which has no dense LM head; routers' choice biases stay fp32), `lm_head` put in after the
    cast (the target's own, shared), RoPE rebuilt, and fp32 activations where the target runs
    bf16 weights with them (the decoder as Q8_0 panels beside a packed target)."""
    dtype = getattr(getattr(target.lm_head, "weight", None), "dtype", torch.bfloat16)
    head = head.to(device=target.device)
    for name, p in head.named_parameters():
        if p.numel() and not name.endswith("e_score_correction_bias"):
            p.data = p.data.to(dtype)
    if lm_head is not None:
        head.decoder.lm_head = lm_head
    head.decoder.reset_rope(target.device)
    if target.compute_dtype == torch.float32 and dtype != torch.float32:
        head.use_fp32_activations()
        if getattr(target.lm_head, "weight", None) is None:
            pack_q8_0(head.decoder)
    return head.eval().requires_grad_(False)


def load_heads(folder: str | os.PathLike, target: Transformer, kind: str | None = None):
    """Load a heads folder for `target`: weights in the target's dtype, on its device."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not folder.is_dir():                  # a typo, or a Hugging Face id not cached: said as for --model
        raise CheckpointError(_not_a_folder(folder))
    if not cfg_path.is_file():
        raise CheckpointError(f"{folder}: no config.json (expected a heads folder written by `specdec train`)")
    cfg = json.loads(cfg_path.read_text())
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in (MEDUSA, EAGLE):
        raise CheckpointError(f"{folder}: not a Medusa or EAGLE heads folder (architectures: {arch})")
    if kind is not None and arch != kind:
        want = "Medusa" if kind == MEDUSA else "EAGLE"
        raise CheckpointError(f"{folder}: holds {arch}, the method needs {want} heads")
    tcfg = target.config
    if cfg["hidden_size"] != tcfg.hidden_size:
        raise CheckpointError(f"{folder}: heads of hidden size {cfg['hidden_size']}, the target has {tcfg.hidden_size}")
    sd = load_file(str(folder / "model.safetensors"))
    vocab = sd["draft_vocab"]
    if vocab.numel() == 0 or int(vocab.max()) >= tcfg.vocab_size or int(vocab.min()) < 0:
        raise CheckpointError(f"{folder}: draft vocabulary ids fall outside the target's vocabulary [0, {tcfg.vocab_size})")
    if arch == MEDUSA:
        heads = MedusaHeads(cfg["hidden_size"], cfg["num_heads"], vocab)
    else:
        dec = ModelConfig.from_hf(cfg["decoder"])
        heads = EagleHead(tcfg.replace(**{k: getattr(dec, k) for k in (
            "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "rope_theta", "attention_bias")}), vocab)
    # a GGUF target kept packed has no dense LM-head weight: its heads are stored and run in bf16
    dtype = getattr(getattr(target.lm_head, "weight", None), "dtype", torch.bfloat16)
    missing, unexpected = heads.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not m.endswith("embed_tokens.weight")]
    if missing or unexpected:
        raise CheckpointError(f"{folder}: weights do not match the config: "
                              f"{(missing or unexpected)[0]} {'missing' if missing else 'unexpected'}")
    heads = heads.to(device=target.device)
    for name, p in heads.named_parameters():
        if not name.endswith("embed_tokens.weight"):
            p.data = p.data.to(dtype)
    if target.compute_dtype == torch.float32 and dtype != torch.float32:   # bf16 weights, fp32 activations (checkpoint.finish)
        if isinstance(heads, EagleHead):
            heads.use_fp32_activations()
            if getattr(target.lm_head, "weight", None) is None:    # packed GGUF target: the decoder as Q8_0 panels
                pack_q8_0(heads.decoder)
        else:
            for b in heads.blocks:
                b.bias.data = b.bias.data.float()
    return heads.eval().requires_grad_(False)


def is_eagle_authors(folder: str | os.PathLike) -> bool:
    """An EAGLE(-2) head as its authors ship it (yuhuili/EAGLE-*: a llama config.json beside
    pytorch_model.bin or model.safetensors holding fc.weight and layers.N.*)."""
    folder = Path(folder)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if (cfg.get("architectures") or [None])[0] in (MEDUSA, EAGLE) or "speculators_model_type" in cfg \
            or not isinstance(cfg.get("num_hidden_layers"), int) or cfg["num_hidden_layers"] > 2:
        return False          # (a draft model has more layers: its weights are never read here)
    from .checkpoint import weight_names

    names = weight_names(folder)        # one file, or shards with their index
    if names is None:
        return False
    return "fc.weight" in names and any(k.startswith("layers.0.") for k in names)


def load_eagle_authors(folder: str | os.PathLike, target: Transformer) -> EagleHead:
    """The EAGLE authors' head in `folder` for `target` (vLLM's EAGLE-1 layout, as its
    llama_eagle loads them): fc [hidden, 2 hidden] over [embedding ; feature] (plus fc.bias where
    saved), num_hidden_layers llama layers without the first one's input_layernorm, no final norm,
    logits from the target's own LM head; embed_tokens, when saved, is the target's and unused."""
    from .checkpoint import hf_to_fused, read_head_file

    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    tcfg = target.config
    if raw.get("add_para_norm"):
        raise CheckpointError(f"{folder}: HASS heads (add_para_norm) are not supported")
    sd = read_head_file(folder)
    # q / k / v biases where the checkpoint has them (heads for Qwen2 targets)
    bias = any(k.endswith("self_attn.q_proj.bias") for k in sd)
    try:
        cfg = ModelConfig.from_hf({**raw, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                   "tie_word_embeddings": False, "attention_bias": bias})
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{folder}: EAGLE head config: {e}") from None
    if cfg.hidden_size != tcfg.hidden_size:
        raise CheckpointError(f"{folder}: an EAGLE head of hidden size {cfg.hidden_size}, the target has {tcfg.hidden_size}")
    if cfg.vocab_size != tcfg.vocab_size:
        raise CheckpointError(f"{folder}: an EAGLE head for a vocabulary of {cfg.vocab_size} tokens, the target "
                              f"has {tcfg.vocab_size}")
    sd.pop("embed_tokens.weight", None)
    fc = {k: sd.pop(k) for k in ("fc.weight", "fc.bias") if k in sd}
    layers = hf_to_fused({"model." + k: v for k, v in sd.items()}, cfg)
    head = EagleHead(cfg.replace(vocab_size=tcfg.vocab_size), torch.arange(tcfg.vocab_size), authors=True,
                     fc_bias="fc.bias" in fc)
    state = {**fc, **{"decoder." + k: v for k, v in layers.items()}}
    check_state(folder, "EAGLE weights", state, {
        k: v.shape for k, v in head.state_dict().items()
        if not k.startswith(("decoder.lm_head.", "decoder.model.norm.", "decoder.model.embed_tokens.", "draft_vocab"))})
    head.load_state_dict(state, strict=False)
    return place_head(head, target, lm_head=whole_lm_head(target, folder, "an EAGLE head in the authors' layout"))


class ResidualMedusaHeads(nn.Module):
    """Medusa heads as vLLM and the Medusa authors ship them (load_medusa_released): head i is
    num_layers residual blocks x + SiLU(W x (+ b)) on the target's final-norm feature, then its
    own LM head (or one shared by every head: vLLM's original_lm_head), over the target's
    vocabulary or a truncated one (vLLM's token_map: draft_vocab). The proposer's interface is
    MedusaHeads': forward(h) -> logits [num_heads, ..., V'], num_heads, draft_vocab."""

    def __init__(self, hidden_size: int, num_heads: int, num_layers: int, draft_vocab: Tensor, bias: bool,
                 shared_lm_head: bool):
        super().__init__()
        self.num_heads = num_heads
        self.blocks = nn.ModuleList(_ResidualBlock(hidden_size, num_layers, bias) for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(Linear(hidden_size, draft_vocab.numel(), bias=False)
                                      for _ in range(1 if shared_lm_head else num_heads))
        self.register_buffer("draft_vocab", draft_vocab.to(torch.long))

    def forward(self, h: Tensor) -> Tensor:
        out = []
        for i, block in enumerate(self.blocks):
            out.append(self.lm_heads[min(i, len(self.lm_heads) - 1)](block(h)))
        return torch.stack(out)


class _ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int, num_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


def _released_medusa(folder: Path) -> tuple[dict, dict[str, Tensor]] | None:
    """(config, weights in vLLM's names) of a released Medusa folder, or None: vLLM's layout
    (config model_type "medusa": blocks.{i}.layers.{j}.*, lm_heads.{i}.weight or lm_head.weight,
    token_map) or the Medusa authors' (medusa_num_heads in config.json, medusa_lm_head.pt or
    .safetensors: {i}.{j}.linear.* then {i}.{num_layers}.weight)."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if cfg.get("model_type") == "medusa" or "MedusaModel" in (cfg.get("architectures") or []):
        from .checkpoint import read_head_file
        return cfg, read_head_file(folder)
    if "medusa_num_heads" not in cfg:
        return None
    if (folder / "medusa_lm_head.safetensors").is_file():
        sd = load_file(str(folder / "medusa_lm_head.safetensors"))
    elif (folder / "medusa_lm_head.pt").is_file():
        sd = torch.load(folder / "medusa_lm_head.pt", map_location="cpu", weights_only=True)
    else:
        raise CheckpointError(f"{folder}: no medusa_lm_head.pt or medusa_lm_head.safetensors")
    L = int(cfg.get("medusa_num_layers", 1))
    out = {}
    for name, t in sd.items():
        i, j, *rest = name.split(".")
        if int(j) < L:       # a residual block's linear
            out[f"blocks.{i}.layers.{j}.{rest[-1]}"] = t
        else:                # the head's LM head
            out[f"lm_heads.{i}.weight"] = t
    return {"num_heads": int(cfg["medusa_num_heads"]), "num_hidden_layers": L,
            "hidden_size": cfg.get("hidden_size"), "medusa_fc_bias": True}, out


def is_released_medusa(folder: str | os.PathLike) -> bool:
    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return cfg.get("model_type") == "medusa" or "MedusaModel" in (cfg.get("architectures") or []) \
        or "medusa_num_heads" in cfg


def load_medusa_released(folder: str | os.PathLike, target: Transformer) -> ResidualMedusaHeads:
    """Medusa heads as vLLM (`MedusaModel` folders) or the Medusa authors (medusa_lm_head.pt)
    ship them, for `target`: weights in its weight dtype, on its device."""
    folder = Path(folder)
    found = _released_medusa(folder)
    if found is None:
        raise CheckpointError(f"{folder}: not a Medusa heads folder")
    cfg, sd = found
    tcfg = target.config
    D = int(cfg.get("hidden_size") or tcfg.hidden_size)
    if D != tcfg.hidden_size:
        raise CheckpointError(f"{folder}: Medusa heads of hidden size {D}, the target has {tcfg.hidden_size}")
    token_map = sd.pop("token_map", None)
    if "lm_head.weight" in sd:            # vLLM's original_lm_head: one LM head for every head
        sd["lm_heads.0.weight"] = sd.pop("lm_head.weight")
    shared = "lm_heads.1.weight" not in sd
    if "lm_heads.0.weight" not in sd:
        raise CheckpointError(f"{folder}: Medusa heads without their LM-head weights (lm_heads.N.weight or lm_head.weight)")
    rows = sd["lm_heads.0.weight"].shape[0]
    vocab = token_map.to(torch.long) if token_map is not None else torch.arange(rows)
    if rows == 0 or vocab.numel() != rows or int(vocab.max()) >= tcfg.vocab_size or int(vocab.min()) < 0:
        raise CheckpointError(f"{folder}: the heads' vocabulary ({rows} rows) does not fit the target's "
                              f"({tcfg.vocab_size} tokens)")
    heads = ResidualMedusaHeads(D, int(cfg.get("num_heads", 0)), int(cfg.get("num_hidden_layers", 1)), vocab,
                                bias=any(k.endswith(".bias") for k in sd), shared_lm_head=shared)
    check_state(folder, "Medusa weights", sd, {k: v.shape for k, v in heads.state_dict().items() if k != "draft_vocab"})
    heads.load_state_dict(sd, strict=False)
    return heads.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
