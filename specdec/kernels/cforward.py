"""ctypes glue for forward.c: a C view of a Transformer over a paged KV cache, and the calls.

A `CView` is built once per (model, cache) pair and owned by the model (Transformer keeps
them in a weak dictionary keyed by the cache); the packed weights belong to their Linear
modules (`Linear.packed()`), so nothing is stored on the cache or on the modules by this file.
The view holds references to the packed weights and cache tensors its pointers point into.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_float, c_int, c_void_p

import torch



class _Layer(ctypes.Structure):
    _fields_ = [(n, c_void_p) for n in ("in_norm", "post_norm", "qkv", "o", "gate_up", "down",
                                        "qkv_bias", "k_cache", "v_cache")]


class _Model(ctypes.Structure):
    _fields_ = [*[(n, c_int) for n in ("dim", "hidden", "n_heads", "n_kv", "head_dim", "vocab",
                                       "n_layers", "num_blocks", "block_size", "max_blocks", "w_bf16", "kv_bf16")],
                ("eps", c_float), ("embed", c_void_p), ("final_norm", c_void_p), ("lm_head", c_void_p),
                ("inv_freq", c_void_p), ("layers", POINTER(_Layer)), ("block_table", c_void_p)]


class _Batch(ctypes.Structure):
    _fields_ = [("n_seqs", c_int), *[(n, c_void_p) for n in ("cu_seqlens", "start", "rows", "mask_from",
                                                             "mask_offset", "masks")]]


def declare(lib) -> None:
    lib.llama_forward.restype = None
    lib.llama_forward.argtypes = [POINTER(_Model), POINTER(_Batch), c_void_p, c_void_p, c_int, c_void_p, c_int,
                                  c_void_p, c_int, c_void_p, c_void_p]
    lib.paged_attention.restype = None
    lib.paged_attention.argtypes = [POINTER(_Model), c_int, POINTER(_Batch), c_void_p, c_void_p, c_void_p, c_void_p,
                                    c_int]
    lib.eagle_chain.restype = None
    lib.eagle_chain.argtypes = [POINTER(_Model), c_void_p, c_int, c_void_p, c_void_p, c_int, c_void_p, c_int,
                                c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_int, c_void_p]


def attention_supported(model, kv) -> bool:
    """paged_attention covers an fp32 or bf16 cache (and activations of the same dtype) on the
    CPU, whatever the matrices are (packed GGUF ones too)."""
    dt = kv.k[0].dtype
    return (kv.k[0].device.type == "cpu" and dt in (torch.float32, torch.bfloat16) and model.dtype == dt
            and model.config.head_dim % 8 == 0)


def supported(model, kv) -> bool:
    """forward.c covers fp32 activations and an fp32 cache with bf16 or fp32 weights, on the CPU
    (not packed GGUF matrices yet: those run through PyTorch, model/quant.py)."""
    if not _dense(model):
        return False
    cfg = model.config
    w = model.lm_head.weight
    return (w.device.type == "cpu" and model.dtype == torch.float32 and kv.k[0].dtype == torch.float32
            and w.dtype in (torch.bfloat16, torch.float32) and cfg.head_dim % 8 == 0
            and model.model.embed_tokens.weight.is_contiguous())


def _dense(model) -> bool:
    """Every matrix forward.c reads is a plain tensor (no QuantLinear / QuantEmbedding)."""
    linears = [model.lm_head, *(m for layer in model.model.layers for m in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))]
    return isinstance(getattr(model.model.embed_tokens, "weight", None), torch.Tensor) and \
        all(isinstance(getattr(m, "weight", None), torch.Tensor) for m in linears)


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


class CView:
    """The C description of (model, kv): the cache's layers and block table, and the weights
    unless weights=False (an attention-only view, for paged_attention)."""

    def __init__(self, model, kv, weights: bool = True):
        cfg = model.config
        self._keep = [kv.blocks.table, *kv.k, *kv.v]      # every tensor a pointer below points into
        layers = (_Layer * len(kv.k))()
        for i, (layer, k, v) in enumerate(zip(model.model.layers, kv.k, kv.v)):
            if not weights:
                layers[i] = _Layer(*([None] * 7), _ptr(k), _ptr(v))
                continue
            att, mlp = layer.self_attn, layer.mlp
            packed = [lin.packed() for lin in (att.qkv_proj, att.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            self._keep += packed
            layers[i] = _Layer(_ptr(layer.input_layernorm.weight), _ptr(layer.post_attention_layernorm.weight),
                               *(_ptr(p) for p in packed), _ptr(att.qkv_proj.bias), _ptr(k), _ptr(v))
        head = model.lm_head.packed() if weights else None
        self._keep.append(head)
        self.layers = layers   # the array must live as long as the struct points at it
        self.struct = _Model(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                             cfg.head_dim, cfg.vocab_size, len(kv.k), kv.blocks.num_blocks, kv.block_size,
                             kv.blocks.max_blocks_per_seq,
                             int(weights and model.lm_head.weight.dtype == torch.bfloat16),
                             int(kv.k[0].dtype == torch.bfloat16), cfg.rms_norm_eps,
                             _ptr(model.model.embed_tokens.weight) if weights else None,
                             _ptr(model.model.norm.weight) if weights else None, _ptr(head),
                             _ptr(model.inv_freq), layers, _ptr(kv.blocks.table))


class CAttention:
    """One forward's attention through forward.c (paged_attention), for the PyTorch path on the
    CPU: per token over its own sequence's slots, as the C forward attends."""

    def __init__(self, lib, view: CView, batch):
        self.lib, self.view, self.batch = lib, view, batch
        self.struct = _batch_struct(batch)

    def __call__(self, layer: int, q, k, v, gqa: bool = True):
        """q [N, H, hd], k/v [N, KV, hd] in the cache's dtype (RoPE applied) -> [N, H * hd];
        writes k/v. (gqa: implied by the sizes here.)"""
        N, H, hd = q.shape
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.empty(N, H * hd, dtype=q.dtype)
        self.lib.paged_attention(ctypes.byref(self.view.struct), layer, ctypes.byref(self.struct), q.data_ptr(),
                                 k.data_ptr(), v.data_ptr(), out.data_ptr(), N)
        return out


def _batch_struct(batch) -> _Batch:
    return _Batch(len(batch.seqs), _ptr(batch.cu_seqlens), _ptr(batch.start_slots), _ptr(batch.rows),
                  _ptr(batch.mask_from), _ptr(batch.mask_offsets), _ptr(batch.masks))


def forward(lib, view: CView, tokens, embeds, batch, n_layers: int, want_logits: bool, want_hidden: bool):
    """tokens [N] int64, or None with embeds [N, D] float32; batch: a ForwardBatch. Returns
    (logits [R, V] (rows batch.logits_indices, or all N) or None, hidden [N, D] or None)."""
    N = batch.num_tokens
    cfg = view.struct
    if embeds is not None:
        embeds = embeds.to(torch.float32).contiguous()
    else:
        tokens = tokens.contiguous()
    rows = batch.logits_indices
    hidden = torch.empty(N, cfg.dim) if want_hidden else None
    logits = torch.empty(N if rows is None else rows.shape[0], cfg.vocab) if want_logits else None
    lib.llama_forward(ctypes.byref(view.struct), ctypes.byref(_batch_struct(batch)),
                      _ptr(tokens if embeds is None else None), _ptr(embeds), N, batch.positions.data_ptr(),
                      n_layers, _ptr(hidden), logits.shape[0] if logits is not None else 0, _ptr(rows), _ptr(logits))
    return logits, hidden


def eagle_chain(lib, view: CView, fc, embed_weight, draft_vocab, rows, base, steps, feats, toks) -> list[list[int]]:
    """Greedy EAGLE chains of B sequences in one C call (forward.c: eagle_chain).

    rows, base, steps: [B] host ints (block-table row, first slot, chain length after the first
    token); feats [B, D]: each sequence's last predicted feature; toks [B]: its first drafted
    token. Returns the further tokens of each chain (steps[b] of them)."""
    B, max_steps = len(rows), max(steps)
    out = torch.empty(B, max_steps, dtype=torch.long)
    feats = feats.to(torch.float32).contiguous().clone()
    toks = torch.tensor(toks, dtype=torch.long)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    rows_t, base_t, steps_t = i32(rows), i32(base), i32(steps)
    bias = fc.bias.to(torch.float32).contiguous()
    lib.eagle_chain(ctypes.byref(view.struct), fc.packed().data_ptr(), int(fc.weight.dtype == torch.bfloat16),
                    bias.data_ptr(), embed_weight.data_ptr(), int(embed_weight.dtype == torch.bfloat16),
                    draft_vocab.data_ptr(), B, rows_t.data_ptr(), base_t.data_ptr(), steps_t.data_ptr(),
                    feats.data_ptr(), toks.data_ptr(), max_steps, out.data_ptr())
    return [out[b, :steps[b]].tolist() for b in range(B)]
