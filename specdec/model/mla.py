"""Multi-head latent attention (MLA; DeepSeek-V2, Liu et al. 2024), as DeepSeek-V2 / V3, Kimi K2 and
Moonlight run it, with the latent cache vLLM keeps.

Per token, kv_a_proj_with_mqa gives a latent c (kv_lora_rank, RMS-normed) and one key part k_r
(qk_rope_head_dim) with RoPE, shared by every head. kv_b_proj expands c per head h into the
head's key dims W_UK[h] c (qk_nope_head_dim) and value W_UV[h] c (v_head_dim). A query head is
[q_nope ; q_r] (from q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj), so its score against a
token is q_nope . W_UK[h] c + q_r . k_r = [W_UK[h]^T q_nope ; q_r] . [c ; k_r]: the query is
"absorbed" into the latent space and every head attends over the same cached [c ; k_r] rows.
That is one KV head of kv_lora_rank + qk_rope_head_dim dims (576 in DeepSeek-V3, against 128
heads x (192 + 128) expanded), and the engine's paged attention runs it as grouped-query
attention unchanged. The attention's output per head is a weighted sum of latents; W_UV[h]
turns it into the head's value, then o_proj. Values are the same cached rows (the first
kv_lora_rank dims are read).

RoPE: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... of the rotary dims. The loader
reorders those rows of q and kv_a's weights to evens then odds (`deinterleave_rope`), so the
usual rotate-half RoPE computes the same rotation (and the same products); saving reorders them back.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor, nn

from .. import kernels
from .config import ModelConfig
from .llama import Linear, RMSNorm, apply_rope, sdpa


LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        """cfg: ModelConfig's MLA fields (kv_lora_rank > 0); head_dim is the cache row's width."""
        super().__init__()
        D, H = cfg.hidden_size, cfg.num_attention_heads
        self.n_heads, self.n_kv, self.head_dim = H, 1, cfg.head_dim
        self.nope, self.rope, self.v_dim, self.latent = cfg.qk_nope_head_dim, cfg.rotary_dim, cfg.v_head_dim, cfg.kv_lora_rank
        qk = self.nope + self.rope
        # the low-rank norms take 1e-6 whatever rms_norm_eps says, as DeepSeek's code and transformers
        # build them (GLM-4.7-Flash's rms_norm_eps is 1e-5)
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(D, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, H * qk, bias=False)
            self.q_proj = None
        else:
            self.q_proj = Linear(D, H * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(D, self.latent + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.latent, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.latent, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(H * self.v_dim, D, bias=False)
        self.scale = cfg.attention_multiplier          # (nope + rope) ** -0.5, x YaRN's mscale_all_dim ** 2
        self.use_rope, self.window, self.local_rope = True, None, False    # what Backbone sets on attention
        # True (a TP shard, which runs this PyTorch path on the CPU): the absorbed per-head products
        # take the kernel, whose rows never depend on each other, as forward.c's do at TP=1
        self.row_invariant = False
        self._heads: tuple | None = None       # (weight key, per-head W_UK^T and W_UV with their packs)

    def _queries(self, x: Tensor) -> Tensor:
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(*x.shape[:-1], self.n_heads, self.nope + self.rope)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int, attend) -> Tensor:
        """x [B, T, D] with cos/sin [B, 1, T, rope] (no cache), or x [N, D] with cos/sin [N, 1, rope]."""
        lead, H = x.shape[:-1], self.n_heads
        q_nope, q_r = self._queries(x).split([self.nope, self.rope], dim=-1)
        c, k_r = self.kv_a_proj_with_mqa(x).split([self.latent, self.rope], dim=-1)
        c = self.kv_a_layernorm(c)
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.latent)
        w = w if w.dtype == x.dtype else w.to(x.dtype)
        per_head = self._per_head(w) if self.row_invariant and x.device.type == "cpu" else None
        if per_head is None:
            q_lat = torch.einsum("...hd,hdc->...hc", q_nope, w[:, :self.nope])       # W_UK[h]^T q_nope
        else:
            q_lat = torch.stack([kernels.linear(q_nope[..., h, :], *uk) for h, (uk, _) in enumerate(per_head)], -2)
        if attend is None:      # training / full-sequence scoring: [B, H, T, .]
            q = torch.cat([q_lat.transpose(1, 2), apply_rope(q_r.transpose(1, 2), cos, sin)], -1)
            k = torch.cat([c[:, None], apply_rope(k_r[:, None], cos, sin)], -1)
            out = sdpa(q, k, k, None, True, self.scale, 0.0, True).transpose(1, 2)
        else:
            q = torch.cat([q_lat, apply_rope(q_r, cos, sin)], -1)
            k = torch.cat([c[:, None], apply_rope(k_r[:, None], cos, sin)], -1)
            out = attend(layer, q, k, k, True).view(*lead, H, self.head_dim)
        if per_head is None:
            values = torch.einsum("...hc,hvc->...hv", out[..., :self.latent], w[:, self.nope:])
        else:
            values = torch.stack([kernels.linear(out[..., h, :self.latent], *uv) for h, (_, uv) in enumerate(per_head)], -2)
        return self.o_proj(values.reshape(*lead, H * self.v_dim))

    def _per_head(self, w: Tensor) -> list | None:
        """[(W_UK[h]^T, None, its pack), (W_UV[h], None, its pack)] per head as kernels.linear's
        arguments, repacked whenever kv_b_proj's weight changes; None where the kernels do not run."""
        if kernels.load() is None or w.dtype not in (torch.float32, torch.bfloat16):
            return None
        key = (kernels.weight_key(self.kv_b_proj.weight), w.dtype)
        if self._heads is None or self._heads[0] != key:
            uk = [w[h, :self.nope].t() for h in range(self.n_heads)]    # views: the kernel reads the packs
            uv = [w[h, self.nope:] for h in range(self.n_heads)]
            self._heads = key, [((k, None, kernels.pack(k)), (v, None, kernels.pack(v))) for k, v in zip(uk, uv)]
        return self._heads[1]


_ROPE_ROWS = re.compile(r"\.self_attn\.(q_proj|q_b_proj|kv_a_proj_with_mqa)\.weight$")


def rope_row_order(cfg: ModelConfig, rows: int, latent: bool, inverse: bool = False) -> Tensor:
    """[rows] index reordering a weight's rotary rows from DeepSeek's interleaved pairs to evens
    then odds (inverse: back): kv_a_proj_with_mqa's last qk_rope_head_dim rows (latent), else
    the last qk_rope_head_dim rows of each query head."""
    r = cfg.rotary_dim
    order = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)])
    if inverse:
        order = order.argsort()
    if latent:
        return torch.cat([torch.arange(cfg.kv_lora_rank), cfg.kv_lora_rank + order])
    per = cfg.qk_nope_head_dim + r
    head = torch.cat([torch.arange(cfg.qk_nope_head_dim), cfg.qk_nope_head_dim + order])
    return (torch.arange(rows // per)[:, None] * per + head).reshape(-1)


def deinterleave_rope(sd: dict[str, Tensor], cfg: ModelConfig, inverse: bool = False) -> dict[str, Tensor]:
    """The rotary rows of q (each head's last qk_rope_head_dim) and of kv_a_proj_with_mqa (its
    last qk_rope_head_dim) reordered from DeepSeek's interleaved pairs to evens then odds
    (inverse: back). Other weights are returned as they are."""
    out = dict(sd)
    for name, t in sd.items():
        m = _ROPE_ROWS.search(name)
        if m is not None:
            out[name] = t[rope_row_order(cfg, t.shape[0], m.group(1) == "kv_a_proj_with_mqa", inverse)]
    return out


def rope_interleaved(raw: dict) -> bool:
    """Whether a DeepSeek config.json's rotary weights are in interleaved pairs (V2 always; V3
    unless rope_interleave is false)."""
    return raw.get("model_type") == "deepseek_v2" or bool(raw.get("rope_interleave", True))
