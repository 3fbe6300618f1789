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
"""

from __future__ import annotations

import os

import torch

from .config import ModelConfig
from .llama import Transformer
from .quant import QuantEmbedding, QuantLinear


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


def llama_config(cfg: ModelConfig):
    """The transformers config (LlamaConfig, or Qwen2Config with q/k/v biases) of a plain-Llama ModelConfig."""
    import transformers

    _check(cfg)
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling,
        tie_word_embeddings=cfg.tie_word_embeddings, hidden_act="silu", bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id)
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


def to_transformers(model: Transformer, dtype: torch.dtype | None = None):
    """A transformers LlamaForCausalLM / Qwen2ForCausalLM (eval mode) holding `model`'s weights, in `dtype`
    (default: the weights' own)."""
    import transformers

    state = llama_state_dict(model)
    dtype = dtype or next(iter(state.values())).dtype
    config = llama_config(model.config)
    cls = transformers.Qwen2ForCausalLM if _family(model.config) == "qwen2" else transformers.LlamaForCausalLM
    hf = cls(config).to(dtype)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ExportError(f"weights do not match {cls.__name__}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if model.config.tie_word_embeddings:
        hf.tie_weights()
    return hf.to(model.model.embed_tokens.weight.device).eval()


def save_transformers(model: Transformer, out: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
    """Write `model` as a Hugging Face folder (config.json + model.safetensors; no tokenizer)."""
    to_transformers(model, dtype).save_pretrained(out)
