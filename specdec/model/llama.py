"""One Llama-family decoder (Llama 1/2/3, Mistral, Qwen2/3, Phi-3, SmolLM3, Granite, Gemma 1/2/3)
over a paged KV cache.

Two ways in, one return type (`ForwardOutput`):
- `model(tokens [B, T])`: full sequences, causal, no cache (training, scoring);
- `model(tokens [N], kv, batch)`: N new tokens of several sequences, flat, written into the
  paged cache `kv` where `batch` (a `ForwardBatch`) says, each seeing its own sequence's earlier
  slots and, among the new ones, the causal pattern or its tree's ancestor mask.

On the CPU with fp32 activations the cached path runs in one C call (kernels/forward.c), whose
per-row matrix products and per-token attention make a token's results bit-identical whatever
else is in the batch and however its prompt was chunked. The PyTorch path (any device) pads
the batch to [B, T_max] and gathers each sequence's blocks; its BLAS and SDPA kernels may sum
in a different order for a different batch shape, so there a token's logits can differ in the
last bits with the batch around it (greedy ties could then break differently).

Module names follow Hugging Face's, except that q/k/v and gate/up are fused into one matmul
each (fewer, larger kernels); `model/checkpoint.py` converts at load and save.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels
from ..kernels import cforward
from .batch import AttentionPlan, ForwardBatch, ForwardOutput, TreeAttention
from .config import ModelConfig
from .kv import KVCache

__all__ = ["ForwardBatch", "ForwardOutput", "KVCache", "Linear", "Transformer", "TreeAttention"]


class Linear(nn.Linear):
    """nn.Linear whose inference path takes the skinny CPU kernel (specdec/kernels). It owns the
    packed copy of its weight that the kernels read (kernels.pack), repacked whenever the weight
    changes."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias)
        self._packed: Tensor | None = None
        self._packed_key: tuple | None = None
        self.lora = None        # a LoRA stack's slots beside this matrix (specdec/lora: LoRAMat), or None
        # True: each row's output never depends on the other rows (kernels.linear), for matrices
        # whose tall inputs pack several requests' rows, e.g. a head's prompt features
        self.row_invariant = False

    def packed(self) -> Tensor:
        w = self.weight
        key = kernels.weight_key(w)
        if self._packed_key != key:
            self._packed, self._packed_key = kernels.pack(w.detach()), key
        return self._packed

    def forward(self, x: Tensor) -> Tensor:
        if self.weight.requires_grad or self.weight.device.type != "cpu" or kernels.load() is None:
            y = kernels.linear(x, self.weight, self.bias)
        else:
            y = kernels.linear(x, self.weight, self.bias, self.packed(), row_invariant=self.row_invariant)
        return y if self.lora is None else self.lora.add(x, y)


def Embedding(rows: int, dim: int) -> nn.Embedding:
    """nn.Embedding, built on the meta device (a checkpoint's load) without its N(0, 1) fill: a
    meta tensor's normal_ imports torch._dynamo, 1.5 s of CPU at every model load."""
    weight = torch.empty(rows, dim)
    return nn.Embedding(rows, dim, _weight=weight) if weight.is_meta else nn.Embedding(rows, dim)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight      # no `to` when the dtypes agree: on a GPU every dispatched op costs host time
        return F.rms_norm(x, x.shape[-1:], w if w.dtype == x.dtype else w.to(x.dtype), self.eps)


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """The rotary frequencies, as transformers computes them for cfg.rope_scaling's rope_type."""
    dim = cfg.rotary_dim or cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    kind = s.get("rope_type", "llama3")
    if kind == "linear":                # positions divided by factor
        return inv_freq / s["factor"]
    if kind == "yarn":
        return _yarn(cfg, s)[0]
    if kind == "longrope":              # the factor set the context chose (ModelConfig.configured)
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        factors = s["long_factor"] if cfg.long_rope else s["short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * cfg.rope_theta ** shape)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, blended, scaled)


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by (YaRN's attention temperature; 1 otherwise)."""
    s = cfg.rope_scaling
    if s is None or s.get("rope_type") not in ("yarn", "longrope"):
        return 1.0
    return _yarn(cfg, s)[1] if s["rope_type"] == "yarn" else float(s["attention_factor"])


def _yarn(cfg: ModelConfig, s: dict) -> tuple[Tensor, float]:
    """YaRN (Peng et al. 2023) as transformers computes it: frequencies that turn fewer than
    beta_slow times over the original context are interpolated (divided by factor), those that
    turn more than beta_fast times are kept, a linear ramp between; cos and sin scaled by
    0.1 ln(factor) + 1 (or mscale / mscale_all_dim's ratio, or attention_factor)."""
    dim, base = cfg.rotary_dim or cfg.head_dim, cfg.rope_theta
    old = s["original_max_position_embeddings"]
    factor = s.get("factor") or cfg.max_position_embeddings / old

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def dim_of(rotations: float) -> float:       # the dimension that turns `rotations` times over `old`
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = dim_of(s.get("beta_fast") or 32), dim_of(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp                               # 1: extrapolate (kept), 0: interpolate
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep
    return inv_freq, float(attention)


def local_inv_freq(cfg: ModelConfig) -> Tensor | None:
    """The rotary frequencies of Gemma 3's sliding layers (their own base, unscaled), or None."""
    if cfg.local_rope_theta is None:
        return None
    dim = cfg.rotary_dim or cfg.head_dim
    return 1.0 / (cfg.local_rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False,
         scale: float | None = None, softcap: float = 0.0, gqa: bool = False, sinks: Tensor | None = None) -> Tensor:
    """F.scaled_dot_product_attention over q [..., H, L, hd], k/v [..., KV, S, hd] (mask: bool,
    True = seen), or its eager form when the scores are soft-capped (Gemma 2: cap tanh(s / cap),
    before the mask) or a sink joins each softmax (gpt-oss: sinks [H], one more logit per head
    whose probability goes to no value), which SDPA cannot do."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa, scale=scale)
    if k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if causal:
        L, S = q.shape[-2], k.shape[-2]
        mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(S - L)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    s = s.float()
    if sinks is not None:
        s = torch.cat([s, sinks.float().view(-1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
        return torch.softmax(s, dim=-1)[..., :-1].to(q.dtype) @ v
    return torch.softmax(s, dim=-1).to(q.dtype) @ v


def sliding_mask(positions: Tensor, span: int, window: int, free_from: int | None = None) -> Tensor:
    """[n, span] bool: the slots that tokens at `positions` [n] see through a sliding window of
    `window` (slot s holds position s; slots from free_from on are left to other masks)."""
    cols = torch.arange(span, device=positions.device)
    seen = cols[None, :] > positions[:, None] - window
    return seen if free_from is None else seen | (cols[None, :] >= free_from)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def signed_sin(sin: Tensor) -> Tensor:
    """sin with its first half negated: rotate_half(x) * sin == x.roll(half, -1) * signed_sin(sin),
    bit for bit (a negation is exact, and -a * b == a * -b), in one roll instead of chunk, neg
    and cat (apply_rope)."""
    key = (sin.shape[-1], sin.dtype, sin.device)
    sign = _SIGNS.get(key)
    if sign is None:
        with torch.inference_mode(False):       # a normal tensor: training's forwards use it too
            sign = _SIGNS[key] = torch.ones(sin.shape[-1], dtype=sin.dtype, device=sin.device)
            sign[:sin.shape[-1] // 2].fill_(-1)     # no host-made scalar tensor: a CUDA graph's warm-up may make it
    return sin * sign


_SIGNS: dict = {}       # signed_sin's [-1 .. -1, 1 .. 1] per (width, dtype, device), made once


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """RoPE over x's last dim, or over its first cos.shape[-1] dims (a partial rotary: Phi-4-mini),
    with sin_signed = signed_sin(sin) (Transformer._ropes gives it): x * cos + rotate_half(x) * sin
    in four ops (a GPU launch each) instead of six; the same bits."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + x.roll(rot // 2, -1) * sin_signed
    xr = x[..., :rot]
    return torch.cat((xr * cos + xr.roll(rot // 2, -1) * sin_signed, x[..., rot:]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        """cfg: the heads this module holds (a tensor-parallel rank's share: `shard_config`)."""
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q, kv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.attention_bias)
        self.o_proj = Linear(q, cfg.hidden_size, bias=cfg.o_bias)
        self.split = (q, kv, kv)
        # gpt-oss: each head's sink logit (a tensor-parallel rank holds its heads')
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if cfg.attn_sinks else None
        # Qwen3: one [hd] weight shared by the heads, so a tensor-parallel rank keeps it whole;
        # OLMo 2 (qk_norm_full): one over the whole projection, [H hd] and [KV hd]
        self.qk_full = cfg.qk_norm_full
        q_dim, k_dim = (q, kv) if self.qk_full else (self.head_dim, self.head_dim)
        self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.use_rope = True             # False in SmolLM3's NoPE layers (Backbone sets it)
        self.scale = cfg.attention_multiplier    # scores' scale; None: 1 / sqrt(head_dim) (Granite, Gemma 2 / 3)
        self.softcap = cfg.attn_softcap          # Gemma 2's tanh cap of the scores (0: none)
        self.window: int | None = None           # a sliding window; Backbone sets it in cfg.sliding_layers
        self.local_rope = False                  # RoPE from the local base (Gemma 3's sliding layers)

    def heads(self, x: Tensor, cos: Tensor | None = None, sin: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """x [..., D] -> q [..., H, hd], k and v [..., KV, hd]: projected, q/k normed per head
        (Qwen3); RoPE applied when cos and sin_signed [..., 1, hd] are given (and self.use_rope).
        Without q/k norms, q and k lie side by side in each projected row and rotate in one
        apply_rope (four ops a layer, not eight)."""
        lead = x.shape[:-1]
        qkv = self.qkv_proj(x)
        if cos is not None and self.use_rope and self.q_norm is None:
            nq = self.n_heads + self.n_kv
            qk = apply_rope(qkv[..., :nq * self.head_dim].view(*lead, nq, self.head_dim), cos, sin)
            v = qkv[..., nq * self.head_dim:].view(*lead, self.n_kv, self.head_dim)
            return qk[..., :self.n_heads, :], qk[..., self.n_heads:, :], v
        q, k, v = qkv.split(self.split, dim=-1)
        if self.qk_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(*lead, self.n_heads, self.head_dim)
        k = k.view(*lead, self.n_kv, self.head_dim)
        v = v.view(*lead, self.n_kv, self.head_dim)
        if self.q_norm is not None and not self.qk_full:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None and self.use_rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int, attend) -> Tensor:
        """x [B, T, D] with cos/sin [B, 1, T, hd] (no cache), or x [N, D] with cos/sin [N, 1, hd]."""
        lead = x.shape[:-1]
        gqa = self.n_kv != self.n_heads
        if attend is None:  # training / full-sequence scoring: [B, H, T, hd]
            q, k, v = (t.transpose(1, 2) for t in self.heads(x, cos.transpose(1, 2), sin.transpose(1, 2)))
            T = q.shape[-2]
            mask = None if self.window is None else sliding_mask(torch.arange(T, device=q.device), T, self.window).tril()
            out = sdpa(q, k, v, mask, mask is None, self.scale, self.softcap, gqa, self.sinks)
            return self.o_proj(out.transpose(1, 2).reshape(*lead, -1))
        q, k, v = self.heads(x, cos, sin)
        return self.o_proj(attend(layer, q, k, v, gqa))


def _aux(captured: dict | None, layers) -> list | None:
    """The residual streams captured entering `layers`, in their order (None: not asked)."""
    return None if captured is None else [captured[i] for i in layers]


class _TorchAttention:
    """One forward's attention in PyTorch (any device): see _paged_attention. windows: each
    layer's sliding window (None: full); sinks: each layer's sink logits (gpt-oss), or None."""

    def __init__(self, kv: KVCache, plan: AttentionPlan, scale: float | None = None, softcap: float = 0.0,
                 windows: list | None = None, sinks: list | None = None):
        self.kv, self.plan, self.scale, self.softcap, self.windows, self.sinks = kv, plan, scale, softcap, windows, sinks

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, gqa: bool) -> Tensor:
        window = self.windows[layer] if self.windows else None
        sinks = self.sinks[layer] if self.sinks else None
        return _paged_attention(q, k, v, self.kv, layer, self.plan, gqa, self.scale, window, self.softcap, sinks)


def _paged_attention(q: Tensor, k: Tensor, v: Tensor, kv: KVCache, layer: int, plan: AttentionPlan,
                     gqa: bool, scale: float | None = None, window: int | None = None,
                     softcap: float = 0.0, sinks: Tensor | None = None) -> Tensor:
    """q [N, H, hd], k/v [N, KV, hd] new tokens; kv: the cache, of which layer `layer` is read.
    Writes k/v at their slots (in the cache's format); each sequence attends over its own
    gathered (dequantized) blocks; returns [N, H * hd].

    A sequence feeding at most kernels.MAX_ROWS tokens (decoding, verification, a short chunk)
    attends one token at a time over exactly the keys that token sees, with no mask: the same
    operation on the same values as when the token is decoded alone, whatever else is in the
    batch (a masked attention over several rows sums in another order, and a last-bit
    difference can flip a greedy near-tie). A longer chunk takes one masked attention: its
    tokens' results depend on how the prompt was chunked (README: losslessness under batching),
    so on the CPU with the kernels on and a head_dim the C attention does not take, every chunk
    goes token by token (Transformer._attention).
    A sliding window (Gemma 2 / 3) leaves out the slots `window` or more positions back.

    On a GPU (plan.padded: batch.PADDED) the sequences feeding at most MAX_ROWS tokens attend
    together in one padded, masked call instead: one launch per layer instead of one per token,
    the same values up to the last bits of the sums (there the matrix products of a batch are not
    those of one row either)."""
    if plan.slot is not None and kv.k_scale is None:    # one token: plain indexing, no index tensors
        kv.k[layer][:, plan.slot[0], plan.slot[1]] = k[0]   # copy_ rounds to the cache's dtype
        kv.v[layer][:, plan.slot[0], plan.slot[1]] = v[0]
    else:
        kv.write(layer, plan.write_blocks, plan.write_offsets, k.transpose(0, 1), v.transpose(0, 1))
    N, H, hd = q.shape
    if plan.padded is not None:         # the decoding sequences together (AttentionPlan.of: on a GPU)
        p = plan.padded
        keys, vals = kv.gather(layer, p.table, q.dtype)      # [KV, B * L, hd]
        keys = keys.view(keys.shape[0], p.B, p.L, keys.shape[-1]).transpose(0, 1)
        vals = vals.view(vals.shape[0], p.B, p.L, vals.shape[-1]).transpose(0, 1)
        mask, unread = p.masks(window)
        keys.masked_fill_(unread, 0)
        vals.masked_fill_(unread, 0)
        if p.dense:         # decoding a batch: the flat rows are the padded layout
            att = sdpa(q.view(p.B, p.T, H, hd).transpose(1, 2), keys, vals, mask, False, scale, softcap, gqa, sinks)
            return att.transpose(1, 2).reshape(N, H * hd)
        out = q.new_empty(N, H, hd)
        qp = q.new_zeros(p.B * p.T, H, hd)
        qp[p.slots] = q[p.rows]
        att = sdpa(qp.view(p.B, p.T, H, hd).transpose(1, 2), keys, vals, mask, False, scale, softcap, gqa, sinks)
        out[p.rows] = att.transpose(1, 2).reshape(p.B * p.T, H, -1)[p.slots]
    else:
        out = q.new_empty(N, H, hd)
    for seq in plan.seqs:
        keys, vals = kv.gather(layer, seq.blocks, q.dtype)      # [KV, nb * bs, hd]
        if seq.mask is not None:
            rows = slice(seq.first, seq.first + seq.count)
            mask = seq.mask
            if window is not None:
                mask = mask & sliding_mask(seq.positions, seq.span, window, seq.free_from)
            out[rows] = sdpa(q[rows].transpose(0, 1)[None], keys[None, :, :seq.span], vals[None, :, :seq.span],
                             mask, False, scale, softcap, gqa, sinks)[0].transpose(0, 1)
            continue
        for t, seen in enumerate(seq.seen):
            if isinstance(seen, int):       # causal: slots lo .. seen - 1 (the token's own is seen - 1)
                lo = 0 if window is None else max(0, seen - window)
                kk, vv = keys[:, lo:seen], vals[:, lo:seen]
            else:
                if window is not None:
                    seen = seen[(seen > int(seq.positions[t]) - window) | (seen >= seq.free_from)]
                kk, vv = keys[:, seen], vals[:, seen]
            row = seq.first + t
            # row 0 starts a fresh buffer; the others get one: sums must not depend on where q starts
            qt = q[row] if row == 0 else q[row].clone()
            att = sdpa(qt[None, :, None], kk[None], vv[None], None, False, scale, softcap, gqa, sinks)
            if N == 1:
                return att.reshape(1, H * hd)
            out[row] = att[0, :, 0]
    return out.reshape(N, H * hd)




class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, size: int | None = None):
        """size: the intermediate size (default cfg.intermediate_size; an expert's may differ)."""
        super().__init__()
        size = size or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * size, bias=cfg.mlp_bias)
        self.down_proj = Linear(size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = cfg.hidden_act       # "silu": SwiGLU; "gelu_tanh": Gemma's GeGLU; "swiglu_oai": gpt-oss's
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.act == "swiglu_oai":
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))
        return self.down_proj((F.gelu(gate, approximate="tanh") if self.act == "gelu_tanh" else F.silu(gate)) * up)


class MoE(nn.Module):
    """A mixture of SwiGLU experts (Mixtral, Qwen3-MoE, OLMoE; Hugging Face's names: `gate` is
    the router). Each token's router probabilities (softmax in fp32) pick its top_k experts,
    whose outputs are summed weighted by those probabilities (renormalised to 1 when
    norm_topk), expert by expert in index order (the C forward's order too). GLM-4.5 and
    DeepSeek-V3 route by sigmoid scores instead (ModelConfig.router_sigmoid: `route`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=cfg.mlp_bias)     # gpt-oss's router has a bias
        self.experts = nn.ModuleList(MLP(cfg, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.sigmoid, self.n_group, self.topk_group = cfg.router_sigmoid, cfg.n_group, cfg.topk_group
        self.scaling, self.group_by_max = cfg.routed_scaling_factor, cfg.group_by_max
        # the experts' choice bias (fp32; DeepSeek-V3's e_score_correction_bias)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts)) if cfg.router_sigmoid else None
        # a shared expert every token takes (Qwen2-MoE, Granite MoE shared), Qwen2-MoE's behind a sigmoid gate
        self.shared_expert = MLP(cfg, cfg.shared_expert_size) if cfg.shared_expert_size else None
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False) if cfg.shared_expert_gate else None
        self.comm = None    # a tensor-parallel shard's (distributed/shard.py): its experts' outputs are partial sums

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, D] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        if self.sigmoid or self.n_group > 1 or self.scaling != 1.0:
            return self._route_deepseek(x)
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def _route_deepseek(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """DeepSeek's routers. V3's "noaux_tc" (GLM-4.5's too): sigmoid scores; the choice biased
        by e_score_correction_bias and kept within the topk_group groups whose two best biased
        scores sum highest; the chosen experts' unbiased scores as weights, renormalised, x
        routed_scaling_factor. V2's: softmax scores, groups ranked by their best (group_by_max),
        x routed_scaling_factor."""
        logits = self.gate(x).float()
        scores = torch.sigmoid(logits) if self.sigmoid else torch.softmax(logits, dim=-1)
        choice = scores + self.e_score_correction_bias.float() if self.sigmoid else scores
        if self.n_group > 1:
            T, E = choice.shape
            per_group = choice.view(T, self.n_group, E // self.n_group)
            groups = per_group.amax(-1) if self.group_by_max else per_group.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, groups.topk(self.topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(E // self.n_group, 1), float("-inf"))
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if self.sigmoid else 0.0))
        return (weights * self.scaling).to(x.dtype), ids

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.route(flat)
        out = torch.zeros_like(flat)
        for e in ids.unique().tolist():
            rows, k = (ids == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](flat[rows]) * weights[rows, k, None])
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        if self.comm is not None:       # each expert's down product saw this rank's columns only: one sum
            out = self.comm.all_reduce(out)
        return out.reshape(x.shape)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks. Gemma 2 / 3's sandwich norms (Hugging Face's names):
    post_attention_layernorm norms the attention's output, pre_feedforward_layernorm the MLP's
    input and post_feedforward_layernorm its output; elsewhere post_attention_layernorm is the
    MLP's input norm (`mlp_norm` is whichever it is). OLMo 2 keeps only the output norms
    (pre_norms false: no input_layernorm, `mlp_norm` None)."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.pre_norms = cfg.pre_norms
        if self.pre_norms:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.kv_lora_rank:                # DeepSeek-V2 / V3's multi-head latent attention
            from .mla import MLAttention
            self.self_attn = MLAttention(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if index in cfg.moe_layers else MLP(cfg)
        self.residual_scale = cfg.residual_multiplier      # Granite: each block's output scaled before its add
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            if self.pre_norms:
                self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def in_norm(self) -> RMSNorm | None:
        """The norm before the attention; None without one (OLMo 2, or an EAGLE head's first
        layer, whose input_layernorm is an Identity: the authors' layout)."""
        return self.input_layernorm if self.pre_norms and isinstance(self.input_layernorm, RMSNorm) else None

    @property
    def mlp_norm(self) -> RMSNorm | None:
        if not self.pre_norms:
            return None
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm

    def forward(self, x, cos, sin, layer, attend):
        h = self.self_attn(self.input_layernorm(x) if self.pre_norms else x, cos, sin, layer, attend)
        if self.sandwich:
            h = self.post_attention_layernorm(h)
        x = x + (h if self.residual_scale == 1.0 else h * self.residual_scale)
        h = self.mlp(self.mlp_norm(x) if self.pre_norms else x)
        if self.sandwich:
            h = self.post_feedforward_layernorm(h)
        return x + (h if self.residual_scale == 1.0 else h * self.residual_scale)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        for i in cfg.nope_layers:            # SmolLM3's NoPE layers (a drafter's shorter copy: those it has)
            if i < len(self.layers):
                self.layers[i].self_attn.use_rope = False
        for i in cfg.sliding_layers:         # Gemma 2 / 3's sliding-window layers
            if i < len(self.layers):
                self.layers[i].self_attn.window = cfg.sliding_window
                self.layers[i].self_attn.local_rope = cfg.local_rope_theta is not None
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def shard_config(cfg: ModelConfig, tp_size: int) -> ModelConfig:
    """What one of `tp_size` tensor-parallel ranks holds (Megatron's split): its attention
    heads, its KV heads (each rank keeps the KV head its query heads read: a share of them, or
    one replicated head when there are fewer KV heads than ranks) and its part of the MLP. The
    embedding and the hidden size stay whole. The same config when tp_size is 1."""
    if tp_size == 1:
        return cfg
    H, KV, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    for name, n in (("num_attention_heads", H), ("intermediate_size", inter),
                    ("moe_intermediate_size", cfg.moe_intermediate_size), ("shared_expert_size", cfg.shared_expert_size)):
        if n % tp_size:
            raise ValueError(f"tensor_parallel_size {tp_size} must divide the model's {name} ({n})")
    if KV % tp_size and tp_size % KV:
        raise ValueError(f"tensor_parallel_size {tp_size} and the model's num_key_value_heads ({KV}) "
                         f"must divide one another")
    return cfg.replace(num_attention_heads=H // tp_size, num_key_value_heads=max(1, KV // tp_size),
                       intermediate_size=inter // tp_size, moe_intermediate_size=cfg.moe_intermediate_size // tp_size,
                       shared_expert_size=cfg.shared_expert_size // tp_size)


def _quantized_module(model: nn.Module, name: str) -> str | None:
    """The module kept quantized (QuantLinear) that a checkpoint weight name points into, or None."""
    from .quant import QuantEmbedding, QuantLinear

    module = name.rsplit(".", 1)[0]
    for part, fused in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                        (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")):
        if module.endswith(part):
            module = module[: -len(part)] + fused
    try:
        found = model.get_submodule(module)
    except AttributeError:
        return None
    return module if isinstance(found, (QuantLinear, QuantEmbedding)) else None


def _is_quantized(model: nn.Module, param_name: str) -> bool:
    """Whether the parameter belongs to a module kept quantized (model/quant.py's QuantLinear)."""
    from .quant import QuantLinear

    module = model.get_submodule(param_name.rsplit(".", 1)[0]) if "." in param_name else model
    return isinstance(module, QuantLinear)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_size: int = 1):
        """tp_size > 1: one rank's shard of a tensor-parallel model (distributed/shard.py fills
        its weights and puts the all-reduces in): layers sized by `shard_config`."""
        super().__init__()
        self.config = cfg
        self.tp_size = tp_size
        self.local_config = shard_config(cfg, tp_size)     # the heads and MLP part this rank holds
        self.model = Backbone(self.local_config)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", None, persistent=False)
        self.register_buffer("inv_freq_local", None, persistent=False)   # None but in Gemma 3
        self.reset_rope(torch.empty(0).device)     # the device it is built on: meta in a checkpoint's load
        # activations and KV cache dtype; None = the weights' dtype (see use_fp32_activations)
        self.compute_dtype: torch.dtype | None = None
        # the C path's views of each cache this model writes into (kernels/cforward.CView): the
        # whole forward's, and the attention-only one of the PyTorch path on the CPU
        self._c_views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._c_attention_views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # False: the LM head reads the last layer's output unnormed (the EAGLE authors' heads)
        self.final_norm = True
        self.lora = None        # LoRA adapters' slots beside the layers' matrices (set_lora), or None
        # DeepSeek's interleaved rotary rows were reordered at load (checkpoint.deinterleave_rope): new weights too
        self.rope_rows_interleaved = False

    def load_weights(self, weights) -> set[str]:
        """vLLM's model.load_weights: replace weights in place from (name, tensor) pairs named as
        the Hugging Face checkpoint names them (q_proj / k_proj / v_proj and gate_proj / up_proj
        land in their rows of the fused qkv_proj / gate_up_proj; a tied lm_head is the embedding's),
        cast to each parameter's dtype. Any subset of the weights may come; a name the model does
        not have, a shape that does not fit, or a weight kept quantized (a GGUF's packed matrices)
        is a ValueError before anything changes. -> the names of the parameters written. The C
        path's views are rebuilt (weights_changed); KV already cached was computed with the old
        weights: LLM.apply_model / collective_rpc reset the prefix cache after them."""
        from .checkpoint import hf_to_fused

        if self.config.model_type == "gpt_oss":
            raise ValueError("load_weights: gpt-oss's MXFP4 experts are kept packed; they cannot be replaced in place")
        given = dict(weights)
        landed: dict[str, str] = {}
        for name in given:        # a name the conversion drops, or two that land on one weight: an error
            outs = hf_to_fused({name: given[name]}, self.config)
            if not outs and not (name == "lm_head.weight" and self.config.tie_word_embeddings):
                raise ValueError(f"load_weights: the model has no weight named {name}")
            for out in outs:
                if out in landed:
                    raise ValueError(f"load_weights: {landed[out]} and {name} both land on {out} (send the names "
                                     "this architecture's checkpoint files use)")
                landed[out] = name
        fused = hf_to_fused(given, self.config)
        if self.config.kv_lora_rank and self.rope_rows_interleaved:
            from .mla import deinterleave_rope

            fused = deinterleave_rope(fused, self.config)     # DeepSeek's rotary rows, as the loader reorders them
        if self.config.tie_word_embeddings and "lm_head.weight" in given and "model.embed_tokens.weight" not in fused:
            fused["model.embed_tokens.weight"] = given["lm_head.weight"]       # a tied head is the embedding
        own = dict(self.state_dict(keep_vars=True))
        writes: list[tuple[str, Tensor, slice, Tensor]] = []
        for name, t in fused.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"load_weights: {name} is a {type(t).__name__}, not a tensor")
            target, rows = name, slice(None)
            if name not in own:
                quantized = _quantized_module(self, name)
                if quantized is not None:
                    raise ValueError(f"load_weights: {quantized} is kept quantized (packed); only unquantized "
                                     "weights can be replaced in place (load the model with quantization='none')")
                target, rows = self._fused_rows(name, own)
            param = own[target]
            if param.dtype in (torch.uint8, torch.int8, torch.int32) or _is_quantized(self, target):
                raise ValueError(f"load_weights: {target} is kept quantized ({param.dtype}); only unquantized "
                                 "weights can be replaced in place")
            shape = tuple(param[rows].shape)
            if tuple(t.shape) != shape:
                raise ValueError(f"load_weights: {name} has shape {tuple(t.shape)}, the model's is {shape}")
            writes.append((target, param, rows, t))
        with torch.no_grad():
            for _, param, rows, t in writes:
                param[rows].copy_(t.to(device=param.device, dtype=param.dtype))
        self.weights_changed()
        return {target for target, *_ in writes}

    def _fused_rows(self, name: str, own: dict) -> tuple[str, slice]:
        """A checkpoint name whose rows live in a fused parameter: (its name, the rows)."""
        for parts, fused in (((".q_proj.", ".k_proj.", ".v_proj."), ".qkv_proj."),
                             ((".gate_proj.", ".up_proj."), ".gate_up_proj.")):
            for i, part in enumerate(parts):
                if part not in name:
                    continue
                target = name.replace(part, fused)
                if target not in own:
                    break
                total = own[target].shape[0]
                if fused == ".gate_up_proj.":
                    sizes = [total // 2, total // 2]
                else:
                    cfg = self.config
                    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
                    if q + 2 * kv != total:
                        raise ValueError(f"load_weights: {name}: {target} has {total} rows, not q + k + v "
                                         f"({q} + {kv} + {kv}) (a tensor-parallel shard?)")
                    sizes = [q, kv, kv]
                start = sum(sizes[:i])
                return target, slice(start, start + sizes[i])
        raise ValueError(f"load_weights: the model has no weight named {name}")

    def weights_changed(self) -> None:
        """After weights change in place: the C path's views (which hold the packed copies they
        were built with) are built again at the next forward; each Linear repacks its weight by
        itself (its key holds the weight's version)."""
        self._c_views.clear()
        self._c_attention_views.clear()

    def set_lora(self, stack) -> None:
        """Serve LoRA adapters from `stack` (specdec/lora: LoRAStack): each projection gets its
        slots, and forwards whose batch carries slots (ForwardBatch.lora) add the adapters."""
        self.lora = stack
        for layer, mats in zip(self.model.layers, stack.mats):
            att, mlp = layer.self_attn, layer.mlp
            for module, kind in ((att.qkv_proj, "qkv"), (att.o_proj, "o"), (mlp.gate_up_proj, "gate_up"),
                                 (mlp.down_proj, "down")):
                module.lora = mats[kind]
        self._c_views.clear()             # the C views read the stack when built

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of activations, logits and the KV cache."""
        return self.compute_dtype or self.lm_head.weight.dtype

    def use_fp32_activations(self) -> "Transformer":
        """bf16 weights, fp32 activations: the weights, read from memory, stay half the bytes
        (the kernels widen them in registers) and the whole forward runs in one C call
        (kernels/forward.c); without the kernels, for CPUs whose bf16 arithmetic PyTorch
        emulates (slow). checkpoint.finish decides."""
        from .mla import MLAttention

        self.compute_dtype = torch.float32
        for mod in self.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.data = mod.weight.data.float()
            if isinstance(mod, MLAttention):     # read per head every step (never through a kernel): widened once
                mod.kv_b_proj.weight.data = mod.kv_b_proj.weight.data.float()
            if isinstance(mod, Linear) and mod.bias is not None:   # Qwen2's q/k/v bias
                mod.bias.data = mod.bias.data.float()
        return self

    @property
    def device(self) -> torch.device:
        return self.inv_freq.device     # every model has it; a packed LM head has no `weight`

    @property
    def values_are_keys(self) -> bool:
        """Its cache reads values from the keys' rows (DeepSeek's latent attention): stored once."""
        return bool(self.config.kv_lora_rank)

    def kv_bytes_per_slot(self, num_layers: int | None = None, dtype: torch.dtype | None = None) -> int:
        cfg = self.local_config
        n = cfg.num_hidden_layers if num_layers is None else num_layers
        return KVCache.bytes_per_slot(n, cfg.num_key_value_heads, cfg.head_dim, dtype or self.dtype,
                                      values_are_keys=self.values_are_keys)

    def new_kv(self, blocks, num_layers: int | None = None, dtype: torch.dtype | None = None,
               spare: bool = False) -> KVCache:
        """A cache for this model over the blocks of a BlockManager (model/kv.py); dtype: the
        cache's (default: the activations'), e.g. bf16 keys and values for fp32 activations, or
        torch.int8 (quantized rows with a scale each); spare: one block more for CUDA graphs' padding."""
        cfg = self.local_config
        n = cfg.num_hidden_layers if num_layers is None else num_layers
        return KVCache(blocks, n, cfg.num_key_value_heads, cfg.head_dim, dtype or self.dtype, self.device,
                       window=self.kv_window(n), values_are_keys=self.values_are_keys, spare=spare)

    def kv_window(self, num_layers: int) -> int | None:
        """The sliding window of the first num_layers layers when each has one (the blocks
        behind it can be given back: BlockManager.trim), else None."""
        windows = {layer.self_attn.window for layer in self.model.layers[:num_layers]}
        return windows.pop() if len(windows) == 1 and None not in windows else None

    def new_cache(self, batch: int = 1, max_len: int | None = None, num_layers: int | None = None) -> KVCache:
        """A contiguous cache: sequences 0..batch-1 of max_len slots each."""
        cfg = self.local_config
        n = cfg.num_hidden_layers if num_layers is None else num_layers
        return KVCache.dense(batch, max_len or cfg.max_position_embeddings, n, cfg.num_key_value_heads,
                             cfg.head_dim, self.dtype, self.device, values_are_keys=self.values_are_keys)

    def forward(
        self,
        tokens: Tensor | None,                # [B, T] (no cache) or [N] int64; None: embeds instead
        kv: KVCache | None = None,
        batch: ForwardBatch | None = None,    # where the N tokens go (required with kv)
        *,
        embeds: Tensor | None = None,         # [B, T, D] / [N, D] input vectors instead of token embeddings
        exit_layer: int | None = None,        # run only the first `exit_layer` layers
        logits: bool = True,                  # False: skip the LM head
        hidden: bool | tuple[int, ...] = False,   # also return the final-norm hidden states [N, D]; a
                                              # tuple of layers: the residual stream entering each,
                                              # side by side [N, len * D] (EAGLE-3's features; the
                                              # number of layers run: after the last, unnormed)
        graphs=None,                          # CudaGraphs over kv (model/graphs.py, an engine's): the
                                              # forward replays one when it fits a bucket
    ) -> ForwardOutput:
        n_layers = self.config.num_hidden_layers if exit_layer is None else exit_layer
        if isinstance(hidden, tuple) and not all(0 <= i <= n_layers for i in hidden):
            raise ValueError(f"hidden states asked entering layers {hidden}; this forward has layers 0..{n_layers - 1} "
                             f"({n_layers}: after the last)")
        if kv is None:
            return self._forward_full(tokens, embeds, exit_layer, logits, hidden)
        if batch.num_tokens == 0:
            empty = torch.empty(0, device=self.device, dtype=self.dtype)
            width = self.config.hidden_size * (len(hidden) if isinstance(hidden, tuple) else 1)
            return ForwardOutput(empty.new_empty(0, self.config.vocab_size) if logits else None,
                                 empty.new_empty(0, width) if hidden else None)
        view = self.c_view(kv)
        if view is not None:
            out, h = cforward.forward(kernels.load(), view, tokens, embeds, batch, n_layers, logits, hidden)
            return ForwardOutput(out, h)
        if graphs is not None and embeds is None and exit_layer is None:
            if kv is not graphs.kv:
                raise ValueError("these CUDA graphs were captured over another KV cache")
            out = graphs(tokens, batch, logits, hidden)     # None: the forward does not fit a graph
            if out is not None:
                return out
        if self.lora is None or batch.lora is None:
            return self._forward_paged(tokens, embeds, kv, batch, n_layers, logits, hidden)
        counts = torch.tensor(batch.counts)
        self.lora.token_slots = batch.lora.to(torch.long).repeat_interleave(counts).to(self.device)
        try:
            return self._forward_paged(tokens, embeds, kv, batch, n_layers, logits, hidden)
        finally:
            self.lora.token_slots = None

    def c_view(self, kv: KVCache) -> cforward.CView | None:
        """The C path's view of (this model, kv), built once; None where the C path does not
        apply (training, no compiler, not the CPU, bf16 activations, a tensor-parallel shard:
        its all-reduces sit between the layers' products)."""
        if self.tp_size > 1 or self.model.norm.weight.requires_grad or kernels.load() is None:
            return None
        if kv not in self._c_views:     # decided once per cache (checking 120 modules costs ~1 ms a step)
            self._c_views[kv] = cforward.CView(self, kv) if cforward.supported(self, kv) else None
        return self._c_views[kv]

    def _attention(self, kv: KVCache, batch: ForwardBatch):
        """Where this forward's attention runs: forward.c's per-token attention on the CPU
        (cforward.attention_supported: whatever the matrices, packed GGUF ones too), else PyTorch.
        Where the C attention does not apply but the kernels run because of a head_dim not a
        multiple of 8, PyTorch too attends token by token however long the chunk, so that a token's
        result does not depend on how its prompt was chunked (as the C path's); other dtypes the C
        attention leaves out (fp16) keep one masked attention per chunk of more than 64 tokens
        (token by token, an fp16 prefill of 1000 tokens took 2.8x as long)."""
        lib = kernels.load()
        exact = lib is not None and not self.model.norm.weight.requires_grad and kv.k[0].device.type == "cpu"
        if exact and cforward.attention_supported(self, kv):
            view = self._c_attention_views.get(kv)
            if view is None:
                view = self._c_attention_views[kv] = cforward.CView(self, kv, weights=False)
            return cforward.CAttention(lib, view, batch)
        rows = batch.num_tokens if exact and self.config.head_dim % 8 else kernels.MAX_ROWS
        return self._torch_attention(kv, AttentionPlan.of(batch, kv, self.device, rows))

    def _torch_attention(self, kv: KVCache, plan: AttentionPlan) -> "_TorchAttention":
        windows = [layer.self_attn.window for layer in self.model.layers]
        sinks = [getattr(layer.self_attn, "sinks", None) for layer in self.model.layers]
        return _TorchAttention(kv, plan, self.config.attention_multiplier, self.config.attn_softcap,
                               windows if any(w is not None for w in windows) else None,
                               sinks if any(t is not None for t in sinks) else None)

    def reset_rope(self, device) -> None:
        """The rotary frequency buffers and the factor cos and sin are scaled by (YaRN) from the
        config (a load leaves the buffers uninitialised on meta), computed on the CPU: on meta
        their ops would import torch._dynamo (1.5 s of CPU)."""
        with torch.device("cpu"):
            inv_freq, local = rope_inv_freq(self.config), local_inv_freq(self.config)
            self.rope_attention = rope_attention_factor(self.config)
        self.inv_freq = inv_freq.to(device)
        self.inv_freq_local = None if local is None else local.to(device)

    def _rope(self, positions: Tensor, dtype, local: bool = False) -> tuple[Tensor, Tensor]:
        """cos, sin [..., hd] at positions (local: from Gemma 3's local base, unscaled)."""
        freqs = positions[..., None].float() * (self.inv_freq_local if local else self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.rope_attention != 1.0 and not local:
            cos, sin = cos * self.rope_attention, sin * self.rope_attention
        return cos.to(dtype), sin.to(dtype)

    def _ropes(self, positions: Tensor, dtype, unsqueeze: int) -> list[tuple[Tensor, Tensor]]:
        """Each layer's (cos, signed_sin(sin)) for apply_rope, unsqueezed at dim `unsqueeze` for the heads."""
        def pair(local: bool = False) -> tuple[Tensor, Tensor]:
            cos, sin = self._rope(positions, dtype, local)
            return cos.unsqueeze(unsqueeze), signed_sin(sin).unsqueeze(unsqueeze)

        glob = pair()
        if self.inv_freq_local is None:
            return [glob] * len(self.model.layers)
        local = pair(local=True)
        return [local if layer.self_attn.local_rope else glob for layer in self.model.layers]

    def _head(self, x: Tensor, logits: bool, hidden, rows: Tensor | None = None, aux=None) -> ForwardOutput:
        h = self.model.norm(x) if self.final_norm else x
        out = None
        if logits:
            out = self.lm_head(h if rows is None else h[rows])
            if self.config.logits_scaling != 1.0:          # Granite
                out = out / self.config.logits_scaling
            if self.config.final_softcap:                  # Gemma 2
                out = torch.tanh(out / self.config.final_softcap) * self.config.final_softcap
        if aux is not None:
            h = torch.cat(aux, -1)
        return ForwardOutput(out, h if hidden else None)

    def _embed(self, tokens: Tensor | None, embeds: Tensor | None) -> Tensor:
        x = (self.model.embed_tokens(tokens) if embeds is None else embeds).to(self.dtype)
        m = self.config.embedding_multiplier              # Granite: inputs (embeddings or given) scaled
        return x if m == 1.0 else x * m

    def _forward_full(self, tokens, embeds, exit_layer, logits, hidden) -> ForwardOutput:
        B, T = embeds.shape[:2] if embeds is not None else tokens.shape
        x = self._embed(tokens, embeds)
        positions = torch.arange(T, device=self.device).expand(B, T)
        ropes = self._ropes(positions, x.dtype, 1)                    # [B, 1, T, hd] each
        layers = self.model.layers if exit_layer is None else self.model.layers[:exit_layer]
        aux = {} if isinstance(hidden, tuple) else None
        for i, layer in enumerate(layers):
            if aux is not None and i in hidden:
                aux[i] = x
            x = layer(x, *ropes[i], i, None)
        if aux is not None and len(layers) in hidden:
            aux[len(layers)] = x
        return self._head(x, logits, hidden, aux=_aux(aux, hidden))

    def _forward_paged(self, tokens, embeds, kv, batch: ForwardBatch, n_layers, logits, hidden) -> ForwardOutput:
        dev = self.device
        rows = batch.logits_indices.to(dev) if batch.logits_indices is not None else None
        return self._run_layers(tokens.to(dev) if embeds is None else None, embeds.to(dev) if embeds is not None else None,
                                batch.positions.to(dev), self._attention(kv, batch), n_layers, logits, hidden, rows)

    def _run_layers(self, tokens, embeds, positions, attend, n_layers, logits, hidden, rows) -> ForwardOutput:
        """The paged forward from its inputs on the device: tokens [N] (or embeds [N, D]) at
        positions [N], attention by `attend`; logits for `rows` (None: all). Device work only,
        so a CUDA graph can hold it (model/graphs.py)."""
        x = self._embed(tokens, embeds)
        ropes = self._ropes(positions, x.dtype, 1)      # [N, 1, hd] each
        aux = {} if isinstance(hidden, tuple) else None
        for i, layer in enumerate(self.model.layers[:n_layers]):
            if aux is not None and i in hidden:
                aux[i] = x
            x = layer(x, *ropes[i], i, attend)
        if aux is not None and n_layers in hidden:
            aux[n_layers] = x
        return self._head(x, logits, hidden, rows, aux=_aux(aux, hidden))
