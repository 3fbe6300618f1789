"""ctypes glue for forward.c: a C view of a Transformer over a paged KV cache, and the calls.

Every matrix is described by a pointer and a format (kernels.h: Mat): dense fp32/bf16 weights
packed in panels of 16 outputs (skinny.c), GGUF matrices by their prepared panels (the only
copy a QuantLinear keeps), the embedding by its rows as stored (a QuantEmbedding's GGUF rows,
dequantized a row at a time in C with model/quant.py's operations).

A `CView` is built once per (model, cache) pair and owned by the model (Transformer keeps
them in a weak dictionary keyed by the cache); the packed weights belong to their modules
(`Linear.packed()`, `QuantLinear.prepared`), so nothing is stored on the cache or on the
modules by this file. The view holds references to the weights and cache tensors its pointers
point into.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_float, c_int, c_void_p

import torch

from . import qformats


class _Mat(ctypes.Structure):
    _fields_ = [("w", c_void_p), ("fmt", c_int)]


class _LoraMat(ctypes.Structure):
    _fields_ = [("a", c_void_p), ("bt", c_void_p), ("nseg", c_int), ("seg", c_int * 3), ("bf16", c_int)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", c_void_p), ("post_norm", c_void_p), *[(n, _Mat) for n in ("qkv", "o", "gate_up", "down")],
                *[(n, c_void_p) for n in ("qkv_bias", "q_norm", "k_norm", "k_cache", "v_cache", "k_scale", "v_scale")],
                ("use_rope", c_int), ("attn_out_norm", c_void_p), ("ffn_out_norm", c_void_p), ("window", c_int),
                ("local_rope", c_int), *[(n, c_int) for n in ("n_experts", "top_k", "norm_topk", "moe_hidden")],
                ("router", _Mat), ("experts", POINTER(_Mat)), ("shared_hidden", c_int), ("shared_gate", _Mat),
                *[(n, c_int) for n in ("router_sigmoid", "n_group", "topk_group")], ("scaling", c_float),
                ("score_bias", c_void_p), ("group_by_max", c_int),
                *[(n, c_void_p) for n in ("sinks", "o_bias", "router_bias", "expert_bias")], ("moe_act", c_int),
                ("q_a", _Mat), ("kv_a", _Mat), *[(n, c_void_p) for n in ("q_a_norm", "kv_a_norm", "uk", "uv")],
                ("mla_bf16", c_int), ("e_norm", c_void_p), ("norm_before_residual", c_int), ("lora", _LoraMat * 4)]


class _Model(ctypes.Structure):
    _fields_ = [*[(n, c_int) for n in ("dim", "hidden", "n_heads", "n_kv", "head_dim", "vocab",
                                       "n_layers", "num_blocks", "block_size", "max_blocks", "kv_type")],
                ("eps", c_float), ("rope_attn", c_float),
                *[(n, c_float) for n in ("embed_scale", "residual_scale", "attn_scale", "logit_scale", "attn_softcap",
                                         "final_softcap")], ("act", c_int),
                ("embed", _Mat), ("final_norm", c_void_p), ("lm_head", _Mat), ("inv_freq", c_void_p),
                ("inv_freq_local", c_void_p), ("layers", POINTER(_Layer)), ("block_table", c_void_p),
                ("qk_full", c_int), ("rot_dim", c_int), ("swiglu_alpha", c_float), ("swiglu_limit", c_float),
                *[(n, c_int) for n in ("mla_latent", "mla_nope", "mla_rope", "mla_v", "q_lora")], ("mla_eps", c_float),
                ("two_inputs", c_int), ("lora_rank", c_int), ("lora_ranks", c_void_p)]

ACTS = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}       # forward.h: ACT_SILU, ACT_GELU_TANH, ACT_SWIGLU_OAI


class _Fuse(ctypes.Structure):
    _fields_ = [("fc_w", c_void_p), ("fc_bf16", c_int), *[(n, c_void_p) for n in ("fc_b", "e_norm", "h_norm")],
                ("embeds_first", c_int), ("state_before_norm", c_int), ("fc_q", _Mat)]


class _Batch(ctypes.Structure):
    _fields_ = [("n_seqs", c_int), *[(n, c_void_p) for n in ("cu_seqlens", "start", "rows", "mask_from",
                                                             "mask_offset", "masks", "pos", "lora")]]


def declare(lib) -> None:
    lib.llama_forward.restype = ctypes.c_long
    lib.llama_forward.argtypes = [POINTER(_Model), POINTER(_Batch), c_void_p, c_void_p, c_int, c_void_p, c_int,
                                  c_void_p, c_void_p, c_int, c_int, c_void_p, c_void_p, c_void_p, ctypes.c_long]
    lib.paged_attention.restype = None
    lib.paged_attention.argtypes = [POINTER(_Model), c_int, POINTER(_Batch), c_void_p, c_void_p, c_void_p, c_void_p,
                                    c_int]
    lib.eagle_chain.restype = c_int
    lib.eagle_chain.argtypes = [POINTER(_Model), POINTER(_Fuse), POINTER(_Mat), c_void_p, c_int, c_void_p,
                                c_void_p, c_void_p, c_void_p, c_void_p, c_int, c_void_p]
    lib.specdec_set_threads.restype = None
    lib.specdec_set_threads.argtypes = [c_int]


def _linears(model) -> list:
    return [model.lm_head, *(m for layer in model.model.layers for m in (
        *_attention_linears(layer.self_attn), layer.self_attn.o_proj, *_mlp_linears(layer.mlp)))]


def _attention_linears(att) -> list:
    """The attention's input projections: qkv, or latent attention's q (q_proj, or q_a then q_b)
    and kv_a (its kv_b is read per head through dense panels: _absorbed)."""
    from ..model.mla import MLAttention

    if not isinstance(att, MLAttention):
        return [att.qkv_proj]
    q = [att.q_proj] if att.q_proj is not None else [att.q_a_proj, att.q_b_proj]
    return [*q, att.kv_a_proj_with_mqa]


def _absorbed(att) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent attention's per-head products as forward.c reads them: each head's W_UK^T [latent,
    nope], then each head's W_UV [v, latent], dense panels (pack) one head after another. bf16
    panels when every weight is a bf16 value (a bf16 checkpoint, widened to fp32 at load): the
    same products from half the bytes."""
    from . import pack

    H, P, V, C = att.n_heads, att.nope, att.v_dim, att.latent
    w = att.kv_b_proj.weight.detach()
    if w.dtype == torch.float32 and torch.equal(w.to(torch.bfloat16).float(), w):
        w = w.to(torch.bfloat16)
    w = w.view(H, P + V, C)
    uk = torch.cat([pack(w[h, :P].t().contiguous()).reshape(-1) for h in range(H)])
    uv = torch.cat([pack(w[h, P:].contiguous()).reshape(-1) for h in range(H)])
    return uk, uv


def _mlp_linears(mlp) -> list:
    """An MLP's matrices, or a mixture's: its router, then each expert's gate_up and down (then
    its shared expert's and that one's gate, where it has them)."""
    if hasattr(mlp, "experts"):
        shared = [] if mlp.shared_expert is None else [mlp.shared_expert.gate_up_proj, mlp.shared_expert.down_proj]
        gate = [] if mlp.shared_expert_gate is None else [mlp.shared_expert_gate]
        return [mlp.gate, *(m for e in mlp.experts for m in (e.gate_up_proj, e.down_proj)), *shared, *gate]
    return [mlp.gate_up_proj, mlp.down_proj]


def _mat(module) -> tuple[_Mat, torch.Tensor] | None:
    """A linear module as forward.c reads it (and the tensor to keep alive), or None when no
    kernel covers it: dense fp32/bf16 weights packed in panels, or GGUF panels prepared."""
    from ..model.quant import QuantLinear

    if isinstance(module, QuantLinear):
        p = module.prepared
        return None if p is None else (_Mat(p.data.data_ptr(), qformats.FORMATS[p.qtype]), p.data)
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
        return None
    packed = module.packed()
    return _Mat(packed.data_ptr(), qformats.DENSE[str(w.dtype).removeprefix("torch.")]), packed


def embedding_mat(embedding) -> tuple[_Mat, torch.Tensor] | None:
    """An embedding table's rows as stored (dense, or the GGUF rows of a QuantEmbedding)."""
    from ..model.quant import QuantEmbedding

    if isinstance(embedding, QuantEmbedding):
        rows = embedding.qweight
        ok = embedding.qtype in qformats.FORMATS and rows.device.type == "cpu" and rows.is_contiguous()
        return (_Mat(rows.data_ptr(), qformats.FORMATS[embedding.qtype]), rows) if ok else None
    w = getattr(embedding, "weight", None)
    if not isinstance(w, torch.Tensor) or w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16) \
            or not w.is_contiguous():
        return None
    return _Mat(w.data_ptr(), qformats.DENSE[str(w.dtype).removeprefix("torch.")]), w


KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}   # forward.h: kv_type


def attention_supported(model, kv) -> bool:
    """paged_attention covers an fp32 or bf16 cache with activations of the same dtype, or an
    int8 cache with fp32 activations, on the CPU, whatever the matrices are."""
    activations = {torch.float32: torch.float32, torch.bfloat16: torch.bfloat16, torch.int8: torch.float32}
    return (kv.k[0].device.type == "cpu" and model.config.head_dim % 8 == 0
            and activations.get(kv.dtype) == model.dtype)


def supported(model, kv) -> bool:
    """forward.c covers fp32 activations and an fp32, bf16 or int8 cache (keys and values rounded
    or quantized when written) on the CPU, with every matrix in a format a kernel multiplies (fp32,
    bf16, or GGUF blocks with prepared panels)."""
    from ..model.mla import MLAttention
    from ..model.quant import QuantLinear

    cfg = model.config
    kv_b = [layer.self_attn.kv_b_proj for layer in model.model.layers if isinstance(layer.self_attn, MLAttention)]
    ok = (model.device.type == "cpu" and model.dtype == torch.float32
          and all(_dense_ok(m) for m in kv_b)
          and kv.dtype in KV_TYPES
          and cfg.head_dim % 8 == 0 and embedding_mat(model.model.embed_tokens) is not None)
    biases = [layer.mlp.e_score_correction_bias for layer in model.model.layers
              if getattr(layer.mlp, "e_score_correction_bias", None) is not None]
    return (ok and all(b.dtype == torch.float32 for b in biases)
            and all((m.prepared is not None) if isinstance(m, QuantLinear) else _dense_ok(m) for m in _linears(model)))


def _dense_ok(module) -> bool:
    w = getattr(module, "weight", None)
    return isinstance(w, torch.Tensor) and w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16)


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _qk_norms(att) -> tuple:
    """Pointers to Qwen3's q_norm and k_norm weights (fp32 here: cforward.supported), or NULLs."""
    if att.q_norm is None:
        return None, None
    return _ptr(att.q_norm.weight), _ptr(att.k_norm.weight)


class CView:
    """The C description of (model, kv): the cache's layers and block table, the weights unless
    weights=False (an attention-only view, for paged_attention), and the workspace forwards
    reuse (grown when a forward needs more)."""

    def __init__(self, model, kv, weights: bool = True):
        from ..model.eagle3 import Eagle3Layer
        from ..model.mla import LATENT_NORM_EPS, MLAttention

        cfg = model.local_config       # a tensor-parallel shard's own heads (= config without one)
        two_inputs = 0                 # EAGLE-3's decoder: input rows [h ; e]
        # every tensor a pointer below points into
        self._keep = [kv.blocks.table, *kv.k, *kv.v, *(kv.k_scale or ()), *(kv.v_scale or ())]
        none = _Mat(None, 0)
        layers = (_Layer * len(kv.k))()
        for i, layer in enumerate(model.model.layers[:len(kv.k)]):
            cache = (_ptr(kv.k[i]), _ptr(kv.v[i]), *((_ptr(kv.k_scale[i]), _ptr(kv.v_scale[i])) if kv.k_scale else (None, None)))
            att, mlp = layer.self_attn, layer.mlp
            latent = isinstance(att, MLAttention)
            window, local = att.window or 0, int(att.local_rope)
            sinks = self._fp32(getattr(att, "sinks", None))     # gpt-oss: attention needs them, weights or not
            if not weights:      # no weights, bias, norms
                layers[i] = _Layer(None, None, *[none] * 4, None, None, None, *cache, 1, None, None, window, local,
                                   0, 0, 0, 0, none, None, 0, none, 0, 1, 1, 1.0, None, 0, sinks, None, None, None, 0)
                continue
            moe = (0, 0, 0, 0, none, None, 0, none, 0, 1, 1, 1.0, None, 0)
            if hasattr(mlp, "experts"):   # a mixture: its router and experts; its shared expert as the dense MLP
                n = len(mlp.experts)
                experts = (_Mat * (2 * n))(*[self._hold(_mat(m)) for m in _mlp_linears(mlp)[1:2 * n + 1]])
                self._keep.append(experts)
                shared = mlp.shared_expert
                gate = none if mlp.shared_expert_gate is None else self._hold(_mat(mlp.shared_expert_gate))
                moe = (n, mlp.top_k, int(mlp.norm_topk), cfg.moe_intermediate_size, self._hold(_mat(mlp.gate)), experts,
                       cfg.shared_expert_size if shared is not None else 0, gate, int(mlp.sigmoid), mlp.n_group,
                       mlp.topk_group, mlp.scaling, _ptr(mlp.e_score_correction_bias), int(mlp.group_by_max))
                mlp_mats = [none, none] if shared is None else [shared.gate_up_proj, shared.down_proj]
            else:
                mlp_mats = [mlp.gate_up_proj, mlp.down_proj]
            # qkv: the attention's input projection (latent attention's queries: q_proj, or q_b_proj)
            q_in = (att.q_b_proj if att.q_proj is None else att.q_proj) if latent else att.qkv_proj
            mats = [m if isinstance(m, _Mat) else self._hold(_mat(m)) for m in (q_in, att.o_proj, *mlp_mats)]
            out_norms = (None, None)
            if layer.sandwich:   # Gemma 2 / 3: post_attention_layernorm norms the attention's output
                out_norms = (_ptr(layer.post_attention_layernorm.weight), _ptr(layer.post_feedforward_layernorm.weight))
            norms = (layer.in_norm, layer.mlp_norm)     # None (OLMo 2): no norm before the block
            router_bias = expert_bias = None
            if hasattr(mlp, "experts"):       # gpt-oss: the router's and experts' biases
                router_bias = self._fp32(mlp.gate.bias)
                if mlp.experts[0].down_proj.bias is not None:
                    expert_bias = self._fp32(torch.stack([torch.cat([e.gate_up_proj.bias, e.down_proj.bias])
                                                          for e in mlp.experts]))
            moe_act = ACTS["swiglu_oai"] if cfg.hidden_act == "swiglu_oai" else ACTS["silu"]
            oss = (sinks, self._fp32(att.o_proj.bias), router_bias, expert_bias, moe_act)
            mla = ()
            if latent:           # q_a (or none), kv_a, their norms, the absorbed per-head products
                uk, uv = _absorbed(att)
                self._keep += [uk, uv]
                lora = att.q_proj is None
                q_a = self._hold(_mat(att.q_a_proj)) if lora else none
                q_a_norm = _ptr(att.q_a_layernorm.weight) if lora else None
                mla = (q_a, self._hold(_mat(att.kv_a_proj_with_mqa)), q_a_norm, _ptr(att.kv_a_layernorm.weight),
                       uk.data_ptr(), uv.data_ptr(), int(uk.dtype == torch.bfloat16))
            layers[i] = _Layer(*(None if n is None else _ptr(n.weight) for n in norms),
                               *mats, None if latent else _ptr(att.qkv_proj.bias),
                               *((None, None) if latent else _qk_norms(att)), *cache, int(att.use_rope),
                               *out_norms, window, local, *moe, *oss, *mla)
            if isinstance(layer, Eagle3Layer):   # its attention reads [input_layernorm(e) ; hidden_norm(h)]
                layers[i].e_norm = _ptr(layer.input_layernorm.weight)
                layers[i].norm_before_residual = int(layer.norm_before_residual)
                two_inputs = 1
        head = self._hold(_mat(model.lm_head)) if weights else none
        embed = self._hold(embedding_mat(model.model.embed_tokens)) if weights else none
        self.layers = layers   # the array must live as long as the struct points at it
        # the rotated width: every frequency's pair (an odd partial width rotates one dim more, as
        # transformers' cos/sin are twice as wide as its frequencies)
        self.struct = _Model(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                             cfg.head_dim, cfg.vocab_size, len(kv.k), kv.blocks.num_blocks, kv.block_size,
                             kv.blocks.max_blocks_per_seq, KV_TYPES[kv.dtype], cfg.rms_norm_eps,
                             model.rope_attention, cfg.embedding_multiplier, cfg.residual_multiplier,
                             cfg.attention_multiplier or 0.0, cfg.logits_scaling, cfg.attn_softcap, cfg.final_softcap,
                             ACTS[cfg.hidden_act], embed, _ptr(model.model.norm.weight) if weights and model.final_norm else None, head,
                             _ptr(model.inv_freq), _ptr(model.inv_freq_local), layers, _ptr(kv.blocks.table),
                             int(cfg.qk_norm_full), 2 * model.inv_freq.numel(), cfg.swiglu_alpha, cfg.swiglu_limit,
                             *((cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.rotary_dim, cfg.v_head_dim,
                                cfg.q_lora_rank or 0, LATENT_NORM_EPS) if cfg.kv_lora_rank and weights else ()))
        self.struct.two_inputs = two_inputs
        if weights and getattr(model, "lora", None) is not None:    # heads have none
            self._lora(model.lora)
        self.workspace = torch.empty(0, dtype=torch.uint8)

    def _lora(self, stack) -> None:
        """The LoRA stack's slots (specdec/lora) beside each layer's matrices: forward.h's LoraMat."""
        from ..lora.adapter import KINDS

        self._keep.append(stack.ranks)
        self.struct.lora_rank, self.struct.lora_ranks = stack.max_rank, stack.ranks.data_ptr()
        for i, mats in enumerate(stack.mats[:len(self.layers)]):
            for c, kind in enumerate(KINDS):
                m = mats[kind]
                self._keep += [m.a, m.bt]
                self.layers[i].lora[c] = _LoraMat(m.a.data_ptr(), m.bt.data_ptr(), len(m.segs),
                                                  (c_int * 3)(*m.segs, *[0] * (3 - len(m.segs))),
                                                  int(m.a.dtype == torch.bfloat16))

    def _fp32(self, t: torch.Tensor | None):
        """A pointer to an fp32 contiguous copy of t (kept), or None."""
        if t is None:
            return None
        t = t.detach().to(torch.float32).contiguous()
        self._keep.append(t)
        return t.data_ptr()

    def _hold(self, found: tuple[_Mat, torch.Tensor]) -> _Mat:
        mat, tensor = found
        self._keep.append(tensor)
        return mat


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
                  _ptr(batch.mask_from), _ptr(batch.mask_offsets), _ptr(batch.masks), _ptr(batch.positions),
                  _ptr(batch.lora))


def forward(lib, view: CView, tokens, embeds, batch, n_layers: int, want_logits: bool,
            want_hidden: bool | tuple[int, ...]):
    """tokens [N] int64, or None with embeds [N, D] float32; batch: a ForwardBatch. Returns
    (logits [R, V] (rows batch.logits_indices, or all N) or None, hidden or None): hidden [N, D]
    final-norm states, or with want_hidden a tuple of layers, [N, len * D] the residual stream
    entering each of them (Transformer.forward)."""
    N = batch.num_tokens
    cfg = view.struct
    if embeds is not None:
        embeds = embeds.to(torch.float32).contiguous()
    else:
        tokens = tokens.contiguous()
    rows = batch.logits_indices
    aux = torch.tensor(want_hidden, dtype=torch.int32) if isinstance(want_hidden, tuple) else None
    hidden = torch.empty(N, cfg.dim * (len(aux) if aux is not None else 1)) if want_hidden else None
    logits = torch.empty(N if rows is None else rows.shape[0], cfg.vocab) if want_logits else None
    b = _batch_struct(batch)
    args = (ctypes.byref(view.struct), ctypes.byref(b), _ptr(tokens if embeds is None else None), _ptr(embeds), N,
            batch.positions.data_ptr(), n_layers, _ptr(hidden), _ptr(aux), len(aux) if aux is not None else 0,
            logits.shape[0] if logits is not None else 0,
            _ptr(rows), _ptr(logits))
    need = lib.llama_forward(*args, view.workspace.data_ptr(), view.workspace.numel())
    if need > 0:       # a longer batch than any before: grow the workspace once, run again
        view.workspace = torch.empty(need, dtype=torch.uint8)
        need = lib.llama_forward(*args, view.workspace.data_ptr(), view.workspace.numel())
        assert need == 0
    return logits, hidden


def chain_fuse(head) -> tuple[_Fuse, list] | None:
    """How forward.c's eagle_chain feeds `head` (forward.h: Fuse) and the tensors to keep alive, or
    None when it cannot: EAGLE's fc (dense fp32 / bf16), EAGLE-3's two inputs (positive logit
    scale: the argmax is the same; not with norm_output), an MTP layer's norms and eh_proj (dense fp32 / bf16, or a
    GGUF file's quantized panels)."""
    from ..model.eagle3 import Eagle3Head
    from ..model.heads import EagleHead
    from ..model.mtp import MTPHead

    if isinstance(head, Eagle3Head):      # (norm_output: the chain would hand on the unnormed state)
        return (_Fuse(None, 0, None, None, None, 0, 1), []) if head.logit_scale > 0 and not head.norm_output else None
    if isinstance(head, MTPHead) and head.norm_output:
        # the state handed on is the final norm's output (MiMo, the speculators drafter): forward.c's
        # chain could carry it (state_before_norm 0, EAGLE's way), but no test here separates it from
        # the unnormed state (RMSNorm-scale invariance, small norm weights), so PyTorch drafts them
        return None
    fc = head.fc if isinstance(head, EagleHead) else head.eh_proj if isinstance(head, MTPHead) else None
    if isinstance(head, MTPHead) and fc is not None and not _dense_ok(fc):   # a GGUF file's packed eh_proj
        found = _mat(fc)
        if found is None or fc.bias is not None:
            return None
        norms = [n.weight.detach().to(torch.float32).contiguous() for n in (head.enorm, head.hnorm)]
        return (_Fuse(None, 0, None, norms[0].data_ptr(), norms[1].data_ptr(), int(head.embeds_first),
                      int(not head.norm_output), found[0]),
                [found[1], *norms])
    if fc is None or not _dense_ok(fc):
        return None
    keep = [fc.packed()]
    bf16 = int(fc.weight.dtype == torch.bfloat16)
    if isinstance(head, EagleHead):      # [h ; e], or the authors' [e ; h]; a bias where it has one
        bias = None if fc.bias is None else fc.bias.detach().to(torch.float32).contiguous()
        keep.append(bias)
        return _Fuse(keep[0].data_ptr(), bf16, _ptr(bias), None, None, int(head.embeds_first), 0), keep
    norms = [n.weight.detach().to(torch.float32).contiguous() for n in (head.enorm, head.hnorm)]
    keep += norms
    # the state carried on: before the final norm (DeepSeek, GLM), or its output with norm_output (MiMo, speculators)
    return _Fuse(keep[0].data_ptr(), bf16, None, norms[0].data_ptr(), norms[1].data_ptr(), int(head.embeds_first),
                 int(not head.norm_output)), keep


def eagle_chain(lib, view: CView, fuse: tuple[_Fuse, list], embedding, draft_vocab, rows, base, steps, feats,
                toks) -> list[list[int]]:
    """Greedy drafter chains of B sequences in one C call (forward.c: eagle_chain).

    fuse: chain_fuse(head); rows, base, steps: [B] host ints (block-table row, first slot, chain
    length after the first token); feats [B, D]: each sequence's state after its last token;
    toks [B]: its first drafted token; embedding: the drafter's token embedding module
    (embedding_mat covers it). Returns the further tokens of each chain (steps[b] of them)."""
    B, max_steps = len(rows), max(steps)
    out = torch.empty(B, max_steps, dtype=torch.long)
    feats = feats.to(torch.float32).contiguous().clone()
    toks = torch.tensor(toks, dtype=torch.long)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    rows_t, base_t, steps_t = i32(rows), i32(base), i32(steps)
    embed, _rows = embedding_mat(embedding)
    rc = lib.eagle_chain(ctypes.byref(view.struct), ctypes.byref(fuse[0]), ctypes.byref(embed),
                         draft_vocab.data_ptr(), B, rows_t.data_ptr(), base_t.data_ptr(), steps_t.data_ptr(),
                         feats.data_ptr(), toks.data_ptr(), max_steps, out.data_ptr())
    if rc != 0:
        raise MemoryError("eagle_chain: out of memory")
    return [out[b, :steps[b]].tolist() for b in range(B)]
