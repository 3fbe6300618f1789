"""ctypes glue for forward.c: a C view of a Transformer and its KV cache, built once per pair."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_float, c_int, c_void_p

import torch

from . import packed_of


class _Layer(ctypes.Structure):
    _fields_ = [(n, c_void_p) for n in ("in_norm", "post_norm", "qkv", "o", "gate_up", "down",
                                        "qkv_bias", "k_cache", "v_cache")]


class _Model(ctypes.Structure):
    _fields_ = [*[(n, c_int) for n in ("dim", "hidden", "n_heads", "n_kv", "head_dim", "vocab",
                                       "n_layers", "max_len", "w_bf16")],
                ("eps", c_float), ("embed", c_void_p), ("final_norm", c_void_p), ("lm_head", c_void_p),
                ("inv_freq", c_void_p), ("layers", POINTER(_Layer))]


def declare(lib) -> None:
    declare_eagle(lib)
    lib.llama_forward.restype = None
    lib.llama_forward.argtypes = [POINTER(_Model), c_void_p, c_void_p, c_int, c_int, c_void_p, c_void_p, c_int, c_int,
                                  c_void_p, c_int, c_void_p]


def declare_eagle(lib) -> None:
    lib.eagle_chain.restype = None
    lib.eagle_chain.argtypes = [POINTER(_Model), c_void_p, c_int, c_void_p, c_void_p, c_int, c_void_p, c_void_p,
                                ctypes.c_int64, c_int, c_int, c_void_p]


def eagle_chain(lib, head, cache, embed_weight, feat, tok: int, start: int, n: int) -> list[int]:
    """n greedy EAGLE steps in one C call (forward.c: eagle_chain); feat [D] fp32 is not modified."""
    fc = head.fc
    out = torch.empty(n, dtype=torch.long)
    feat = feat.to(torch.float32).clone().contiguous()
    bias = fc.bias.to(torch.float32).contiguous()
    lib.eagle_chain(ctypes.byref(c_model(head.decoder, cache)), packed_of(fc).data_ptr(),
                    int(fc.weight.dtype == torch.bfloat16), bias.data_ptr(), embed_weight.data_ptr(),
                    int(embed_weight.dtype == torch.bfloat16), head.draft_vocab.data_ptr(), feat.data_ptr(),
                    tok, start, n, out.data_ptr())
    return out.tolist()


def supported(model, cache) -> bool:
    """forward.c covers one fp32-activation sequence with bf16 or fp32 weights (not packed
    GGUF matrices yet: those run through PyTorch, model/quant.py)."""
    if not _dense(model):
        return False
    cfg = model.config
    w = model.lm_head.weight
    return (w.device.type == "cpu" and model.dtype == torch.float32 and len(cache.lengths) == 1
            and cache.k[0].dtype == torch.float32 and w.dtype in (torch.bfloat16, torch.float32)
            and cfg.head_dim % 8 == 0 and model.model.embed_tokens.weight.is_contiguous())


def _dense(model) -> bool:
    """Every matrix forward.c reads is a plain tensor (no QuantLinear / QuantEmbedding)."""
    linears = [model.lm_head, *(m for layer in model.model.layers for m in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))]
    return isinstance(getattr(model.model.embed_tokens, "weight", None), torch.Tensor) and \
        all(isinstance(getattr(m, "weight", None), torch.Tensor) for m in linears)


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def c_model(model, cache) -> _Model:
    """The C description of (model, cache); kept on the cache, which outlives many forwards."""
    views = cache.__dict__.setdefault("_c_views", {})
    if id(model) in views:
        return views[id(model)][0]
    cfg = model.config
    layers = (_Layer * len(cache.k))()
    for i, (layer, k, v) in enumerate(zip(model.model.layers, cache.k, cache.v)):
        att, mlp = layer.self_attn, layer.mlp
        layers[i] = _Layer(_ptr(layer.input_layernorm.weight), _ptr(layer.post_attention_layernorm.weight),
                           *(_ptr(packed_of(lin)) for lin in (att.qkv_proj, att.o_proj, mlp.gate_up_proj, mlp.down_proj)),
                           _ptr(att.qkv_proj.bias), _ptr(k), _ptr(v))
    m = _Model(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
               cfg.head_dim, cfg.vocab_size, len(cache.k), cache.max_len,
               int(model.lm_head.weight.dtype == torch.bfloat16), cfg.rms_norm_eps,
               _ptr(model.model.embed_tokens.weight), _ptr(model.model.norm.weight),
               _ptr(packed_of(model.lm_head)), _ptr(model.inv_freq), layers)
    views[id(model)] = (m, layers)   # the array must live as long as the struct points at it
    return m


def forward(lib, model, tokens, cache, start: int, positions, mask, n_layers: int,
            logit_from: int | None, want_hidden: bool, embeds=None, past: int = 0):
    """tokens [T] int64, or None with embeds [T, D] float32; positions [T] int64; mask
    [T, past + T] bool over slots start - past .. start + T - 1, or None (causal). Returns (logits [T - logit_from, V] or None, hidden [T, D] or None)."""
    if embeds is not None:
        embeds = embeds.to(torch.float32).contiguous()
        T = embeds.shape[0]
    else:
        tokens = tokens.contiguous()
        T = tokens.shape[0]
    positions = positions.to(torch.long).contiguous()
    mask_u8 = mask.to(torch.uint8).contiguous() if mask is not None else None
    hidden = torch.empty(T, model.config.hidden_size) if want_hidden else None
    logits = None
    if logit_from is not None and logit_from < T:
        logits = torch.empty(T - logit_from, model.config.vocab_size)
    lib.llama_forward(ctypes.byref(c_model(model, cache)), _ptr(tokens if embeds is None else None),
                      _ptr(embeds), T, start, positions.data_ptr(),
                      _ptr(mask_u8), start - past, n_layers, _ptr(hidden), logit_from if logit_from is not None else T,
                      _ptr(logits))
    return logits, hidden
