"""specdec's `Transformer` -> a transformers `LlamaForCausalLM` (or `Qwen2ForCausalLM`) with the same weights.

Training data for drafters comes from the target's own answers (train/answers.py), and bulk
generation runs fastest on transformers' padded batches. A target that exists here only as a
GGUF file (the default model, SmolLM2-135M-Instruct Q4_1) is loaded dequantized by
model/gguf.py, whose loader has already undone llama.cpp's rotary permutation; what is left is
to split the runtime's fused matrices back into Hugging Face's names:

    self_attn.qkv_proj   -> q_proj, k_proj, v_proj   (rows: heads * hd, kv * hd, kv * hd)
    mlp.gate_up_proj     -> gate_proj, up_proj       (rows: intermediate, intermediate)

Only the plain Llama layout is converted (Llama, Mistral without a window, SmolLM2, Qwen2 with
its q/k/v biases); anything else is refused in one line rather than converted wrong.

The rotary frequencies are the runtime's own (`Transformer.inv_freq`), which for a GGUF may
hold llama.cpp's `rope_freqs.weight` divisors (its form of Llama 3's scaling) without any
`rope_scaling` in the config. Those are written back as transformers' `rope_type: "llama3"`
with parameters recovered from the divisors (see `llama3_from_divisors`), and every export is
checked: transformers' own frequencies for the config written must be the runtime's, or the
export is refused (ExportError).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os

import torch

from .config import ModelConfig
from .llama import Transformer, rope_attention_factor, rope_inv_freq
from .quant import QuantEmbedding, QuantLinear

# Two float32 computations of one frequency (transformers' formula, llama.cpp's divisors made in
# float64) differ by up to ~3e-6 relatively in Llama 3's blended band; they count as the same
# within ROPE_RTOL and when the angles they give differ by at most ROPE_ANGLE radians at the last
# position of the context.
ROPE_RTOL, ROPE_ANGLE = 1e-5, 1e-3


class ExportError(ValueError):
    pass


def _check(cfg: ModelConfig) -> None:
    unsupported = {
        "experts": cfg.num_experts > 0, "latent attention": cfg.kv_lora_rank > 0, "q/k norms": cfg.qk_norm,
        "sliding windows": cfg.sliding_window is not None or bool(cfg.sliding_layers),
        "soft-capping": bool(cfg.attn_softcap or cfg.final_softcap), "sandwich norms": cfg.sandwich_norms,
        "layers without rotary embeddings": bool(cfg.nope_layers), "partial rotary": cfg.rotary_dim is not None,
        "embedding / residual / logit multipliers": (cfg.embedding_multiplier, cfg.residual_multiplier,
                                                     cfg.logits_scaling) != (1.0, 1.0, 1.0),
        "an attention multiplier": cfg.attention_multiplier is not None, "an o_proj bias": cfg.o_bias,
        "MLP biases": cfg.mlp_bias, f"activation {cfg.hidden_act!r}": cfg.hidden_act != "silu",
        "post-norms": not cfg.pre_norms, "LongRoPE": cfg.long_rope,
    }
    found = [name for name, present in unsupported.items() if present]
    if found:
        raise ExportError(f"only the plain Llama layout converts to transformers; this model has {', '.join(found)}")


def _family(cfg: ModelConfig) -> str:
    """"qwen2" (q/k/v biases, no o_proj bias: transformers' Llama ties the two) or "llama"."""
    return "qwen2" if cfg.attention_bias else "llama"


def _same_freqs(a: torch.Tensor, b: torch.Tensor, context: int) -> bool:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return a.shape == b.shape and bool(((a - b).abs() <= ROPE_RTOL * b.abs()).all()) and \
        float((a - b).abs().max()) * context <= ROPE_ANGLE


def llama3_from_divisors(cfg: ModelConfig, inv_freq: torch.Tensor) -> dict | None:
    """transformers' llama3 `rope_scaling` whose frequencies are `inv_freq` [hd / 2] (cfg's plain
    frequencies divided per frequency, as llama.cpp's rope_freqs.weight does), or None when no
    such parameters reproduce them (see ROPE_RTOL, through the formula transformers uses).

    Llama 3's rule divides a frequency of wavelength w by 1 when w < L / high_freq_factor, by
    `factor` when w > L / low_freq_factor and blends between: 1 / d = (1 - s) / factor + s, with
    s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor) linear in 1 / w. So
    `factor` is the largest divisor, s comes back from each blended divisor, and a line through
    the (1 / w, s) points gives the two band edges L / low and L / high (only their ratios to L
    matter: L is taken as the low edge rounded, making low_freq_factor about 1 as in Llama 3.x)."""
    import numpy as np

    base = rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None)).double()
    d = (base / inv_freq.detach().double().cpu()).numpy()
    x = base.numpy() / (2 * math.pi)                 # 1 / wavelength, decreasing along the frequencies
    factor = float(d.max())
    if factor <= 1 + 1e-6 or d.min() < 1 - 1e-6 or np.any(np.diff(d) < -1e-6 * factor):
        return None                                  # a llama3 divisor grows from 1 to factor
    ones, full = np.abs(d - 1) <= 1e-6, np.abs(d - factor) <= 1e-6 * factor
    mid = ~ones & ~full
    s = (1 / d - 1 / factor) / (1 - 1 / factor)
    if mid.sum() >= 2:
        a, b = np.polyfit(x[mid], s[mid], 1)
        lo_x, hi_x = -b / a, (1 - b) / a             # s = 0 and s = 1
    elif mid.sum() == 1:                             # the steepest line through it that the neighbours allow
        x0, s0 = float(x[mid][0]), float(s[mid][0])
        slopes = [s0 / (x0 - x[full].max())] + ([(1 - s0) / (x[ones].min() - x0)] if ones.any() else [])
        a = max(slopes)
        lo_x, hi_x = x0 - s0 / a, x0 + (1 - s0) / a
    elif ones.any():                                 # no blended frequency: edges anywhere in the gap
        gap_lo, gap_hi = float(x[full].max()), float(x[ones].min())
        lo_x, hi_x = gap_lo + (gap_hi - gap_lo) / 3, gap_lo + 2 * (gap_hi - gap_lo) / 3
    else:
        return None                                  # one divisor for all: linear scaling, not llama3
    if not 0 < lo_x < hi_x:
        return None
    old = max(1, round(1 / lo_x))
    raw = (factor, old * lo_x, old * hi_x)
    for f, lo, hi in ((round(raw[0], 4), round(raw[1], 4), round(raw[2], 4)), raw):
        if not 0 < lo < hi:
            continue
        scaling = {"rope_type": "llama3", "factor": float(f), "low_freq_factor": float(lo), "high_freq_factor": float(hi),
                   "original_max_position_embeddings": int(old)}
        if _same_freqs(rope_inv_freq(dataclasses.replace(cfg, rope_scaling=scaling)), inv_freq,
                       cfg.max_position_embeddings):
            return scaling
    return None


def rope_scaling_of(model: Transformer) -> dict | None:
    """The `rope_scaling` that gives transformers the runtime's rotary frequencies: the config's
    own (a copy), or the llama3 parameters of a GGUF's rope_freqs divisors; ExportError when none."""
    cfg = model.config
    if _same_freqs(rope_inv_freq(cfg), model.inv_freq, cfg.max_position_embeddings):
        return copy.deepcopy(cfg.rope_scaling)
    scaling = None if cfg.rope_scaling is not None else llama3_from_divisors(cfg, model.inv_freq)
    if scaling is None:
        raise ExportError("the model's rotary frequencies (e.g. a GGUF's rope_freqs.weight) match no rope_scaling "
                          "transformers computes; not converted")
    return scaling


def _stop_ids(cfg: ModelConfig, tokenizer) -> tuple[int | list[int] | None, int | None]:
    """(eos_token_id, pad_token_id) for the transformers config: the config's eos first, then every
    other id the tokenizer stops on (a GGUF's end-of-generation set), and the tokenizer's pad."""
    eos = copy.deepcopy(cfg.eos_token_id)
    if tokenizer is None:
        return eos, None
    first = eos if isinstance(eos, list) else [] if eos is None else [eos]
    ids = list(dict.fromkeys([*first, *getattr(tokenizer, "eos_token_ids", [])]))
    eos = None if not ids else ids[0] if len(ids) == 1 else ids
    return eos, getattr(tokenizer, "pad_token_id", None)


def _trained_length(cfg: ModelConfig) -> int:
    """config.json's max_position_embeddings: under linear scaling the loaded config holds the
    context times the factor (ModelConfig.configured), which a reload would multiply again."""
    s = cfg.rope_scaling
    if s is not None and s.get("rope_type") == "linear" and s.get("factor"):
        return int(round(cfg.max_position_embeddings / float(s["factor"])))
    return cfg.max_position_embeddings


def llama_config(cfg: ModelConfig, rope_scaling: dict | None = None, tokenizer=None):
    """The transformers config (LlamaConfig, or Qwen2Config with q/k/v biases) of a plain-Llama
    ModelConfig. rope_scaling: instead of cfg's (rope_scaling_of's answer); tokenizer: specdec's
    Tokenizer of the model, whose stop ids and pad id go into the config (and so into the
    generation config transformers derives from it)."""
    import transformers

    _check(cfg)
    eos, pad = _stop_ids(cfg, tokenizer)
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=_trained_length(cfg),
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        # a copy: transformers standardizes the dict it is handed (adds rope_theta), and cfg is frozen
        rope_scaling=copy.deepcopy(cfg.rope_scaling if rope_scaling is None else rope_scaling),
        tie_word_embeddings=cfg.tie_word_embeddings, hidden_act="silu", bos_token_id=cfg.bos_token_id,
        eos_token_id=eos, pad_token_id=pad)
    if _family(cfg) == "qwen2":
        if cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads:
            raise ExportError(f"head_dim {cfg.head_dim} != hidden_size / heads: Qwen2 in transformers derives it")
        return transformers.Qwen2Config(**common, use_sliding_window=False)
    return transformers.LlamaConfig(**common, head_dim=cfg.head_dim, attention_bias=False)


def llama_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """Hugging Face names for the runtime's weights (fused matrices split; no copies made)."""
    cfg = model.config
    _check(cfg)
    packed = [name for name, m in model.named_modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    if packed:
        raise ExportError(f"{packed[0]}: packed (quantized) weights; load the model with quantization='none'")
    src = model.state_dict()
    q, kv, inter = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    out = {}
    for name, t in src.items():
        if ".self_attn.qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                out[name.replace("qkv_proj", part)] = piece
        elif ".mlp.gate_up_proj." in name:
            for part, piece in zip(("gate_proj", "up_proj"), t.split([inter, inter])):
                out[name.replace("gate_up_proj", part)] = piece
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        else:
            out[name] = t
    return out


def to_transformers(model: Transformer, dtype: torch.dtype | None = None, tokenizer=None):
    """A transformers LlamaForCausalLM / Qwen2ForCausalLM (eval mode) holding `model`'s weights, in `dtype`
    (default: the weights' own). tokenizer: see llama_config."""
    import transformers

    state = llama_state_dict(model)
    dtype = dtype or next(iter(state.values())).dtype
    config = llama_config(model.config, rope_scaling_of(model), tokenizer)
    cls = transformers.Qwen2ForCausalLM if _family(model.config) == "qwen2" else transformers.LlamaForCausalLM
    hf = cls(config)
    rotary = hf.model.rotary_emb
    if not _same_freqs(rotary.inv_freq, model.inv_freq, model.config.max_position_embeddings) or \
            not math.isclose(rotary.attention_scaling, rope_attention_factor(model.config), rel_tol=1e-6):
        raise ExportError(f"transformers computes other rotary frequencies for {getattr(config, 'rope_parameters', None)} than the "
                          "model's; not converted")
    freqs = {n: b.clone() for n, b in hf.named_buffers() if n.endswith("inv_freq")}
    hf = hf.to(dtype)
    for name, b in freqs.items():      # fp32 as from_pretrained leaves them (bf16 ones drift at long positions)
        owner, _, leaf = name.rpartition(".")
        setattr(hf.get_submodule(owner), leaf, b)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ExportError(f"weights do not match {cls.__name__}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if model.config.tie_word_embeddings:
        hf.tie_weights()
    return hf.to(model.model.embed_tokens.weight.device).eval()


def save_transformers(model: Transformer, out: str | os.PathLike, dtype: torch.dtype | None = None,
                      tokenizer=None) -> None:
    """Write `model` as a Hugging Face folder (config.json, generation_config.json and
    model.safetensors; no tokenizer files). tokenizer: specdec's Tokenizer of the model (e.g.
    `Tokenizer(gguf_path)`): its stop ids and pad id are written into both configs, so the folder
    stops where specdec stops on the source (a GGUF's end-of-generation set, e.g. SmolLM2's [0, 2, 4])."""
    to_transformers(model, dtype, tokenizer).save_pretrained(out)
