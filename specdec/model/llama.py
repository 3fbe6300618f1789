"""One Llama-family decoder (Llama 1/2/3, Mistral, Qwen2) with a static KV cache.

The cache is allocated once and written by absolute slot, so rejecting draft tokens is
"advance the length less" (`KVCache.rollback`). A forward call feeds T new tokens per row at
slots `start[b] .. start[b]+T-1`; every earlier slot of the row is visible, and among the new
tokens the mask is causal, or the ancestor mask of a token tree (`TreeAttention`).

Module names follow Hugging Face's, except that q/k/v and gate/up are fused into one matmul
each (fewer, larger kernels); `model/checkpoint.py` converts at load and save.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels
from ..kernels import cforward
from .config import ModelConfig


class Linear(nn.Linear):
    """nn.Linear whose inference path takes the skinny CPU kernel (specdec/kernels)."""

    def forward(self, x: Tensor) -> Tensor:
        if self.weight.requires_grad or self.weight.device.type != "cpu" or kernels.load() is None:
            return kernels.linear(x, self.weight, self.bias)
        return kernels.linear(x, self.weight, self.bias, kernels.packed_of(self))


class KVCache:
    """Keys and values of `batch` sequences, `max_len` slots each, one pair of tensors per layer.

    `lengths[b]` is the number of valid slots of row b; it lives on the host (the engine always
    knows it), so reading it costs no device sync.
    """

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str, num_layers: int | None = None):
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        n = num_layers if num_layers is not None else cfg.num_hidden_layers
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
        self.max_len = max_len
        self.lengths = [0] * batch

    @property
    def length(self) -> int:
        """The length of row 0: the single-sequence engine's view."""
        return self.lengths[0]

    def rollback(self, length: int, row: int = 0) -> None:
        """Forget every slot from `length` on; O(1), the stale slots are simply overwritten."""
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"cannot roll back row {row} from {self.lengths[row]} to {length}")
        self.lengths[row] = length

    def move(self, src: Sequence[int], dst_start: int, row: int = 0) -> None:
        """Copy the entries of slots `src` to `dst_start, dst_start+1, ...` in every layer.

        Tree verification writes each node at its own slot; the accepted path is then moved
        to be contiguous after the prefix.
        """
        if list(src) == list(range(dst_start, dst_start + len(src))):
            return
        idx = torch.tensor(list(src), device=self.k[0].device)
        for cache in (self.k, self.v):
            for t in cache:
                t[row, :, dst_start:dst_start + len(src)] = t[row, :, idx]


@dataclass(frozen=True)
class TreeAttention:
    """The attention pattern of the T new tokens of a tree forward.

    depth: [T] int   position offset of each node (root = 0)
    mask:  [T, past + T] bool  over slots start - past .. start + T - 1: mask[i, past + j] =
           new node j is node i itself or one of its ancestors. Slots before start - past are
           visible to every node. past > 0 lets a tree grow over several forwards (EAGLE's
           drafting): earlier nodes stay in the cache and each new node sees its ancestors only.
    """
    depth: Tensor
    mask: Tensor
    past: int = 0

    @classmethod
    def from_parents(cls, parents: Sequence[int], device=None) -> "TreeAttention":
        """The root (the first token) and nodes hanging below parents[i] (-1 = the root)."""
        T = len(parents) + 1
        depth = [0] * T
        mask = torch.eye(T, dtype=torch.bool)
        mask[:, 0] = True
        for i, par in enumerate(parents):
            depth[i + 1] = depth[par + 1] + 1
            mask[i + 1] |= mask[par + 1]
        return cls(torch.tensor(depth, device=device), mask.to(device))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, x.shape[-1:], self.weight.to(x.dtype), self.eps)


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, blended, scaled)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q, kv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.attention_bias)
        self.o_proj = Linear(q, cfg.hidden_size, bias=False)
        self.split = (q, kv, kv)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int,
                cache: KVCache | None, start: Sequence[int] | None, mask: Tensor | None) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is None:  # training / full-sequence scoring
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads)
        else:
            k, v = _write_cache(cache, layer, k, v, start)
            if mask is not None and T <= kernels.MAX_ROWS:
                out = _rowwise_attention(q, k, v, mask, self.n_kv != self.n_heads)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


def _rowwise_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, gqa: bool) -> Tensor:
    """q [B, H, T, hd]; k, v [B, Hkv, span, hd]; mask [B, 1, T, span] bool -> [B, H, T, hd].

    The few rows of a verification (or a short prefill) attend one at a time, each over exactly
    the keys it sees, with no mask: the same operation, on the same values, as when that token
    is decoded alone. A masked attention over all rows sums in another order, and a difference
    in the last bit can flip a near-tie in greedy decoding (quantized activations amplify it),
    so speculative output would stop equalling plain output. The C forward (forward.c) has the
    same property by construction; this is the PyTorch path's (packed GGUF models, native bf16)."""
    B, T, span = q.shape[0], q.shape[2], mask.shape[-1]
    rows = mask[:, 0]                                                        # [B, T, span]
    seen = rows.sum(-1)                                                      # [B, T]
    prefix = (rows == (torch.arange(span, device=q.device) < seen[..., None])).all(-1)
    seen, prefix = seen.tolist(), prefix.tolist()                            # one sync per layer
    out = torch.empty_like(q)
    for b in range(B):
        for i in range(T):
            if prefix[b][i]:      # a chain: the first seen[b][i] slots, a view as in decoding
                kk, vv = k[b:b + 1, :, :seen[b][i]], v[b:b + 1, :, :seen[b][i]]
            else:                 # a tree node: the prefix and its ancestors
                idx = rows[b, i].nonzero().squeeze(1)
                kk, vv = k[b:b + 1, :, idx], v[b:b + 1, :, idx]
            out[b:b + 1, :, i:i + 1] = F.scaled_dot_product_attention(q[b:b + 1, :, i:i + 1], kk, vv, enable_gqa=gqa)
    return out


def _write_cache(cache: KVCache, layer: int, k: Tensor, v: Tensor, start: Sequence[int]):
    """Write k, v [B, n_kv, T, hd] at slots start[b]..start[b]+T-1; return the visible span."""
    T = k.shape[2]
    span = max(start) + T
    kc, vc = cache.k[layer], cache.v[layer]
    if len(start) == 1:
        kc[:, :, start[0]:span] = k
        vc[:, :, start[0]:span] = v
    else:
        for b, s in enumerate(start):
            kc[b, :, s:s + T] = k[b]
            vc[b, :, s:s + T] = v[b]
    return kc[:, :, :span], vc[:, :, :span]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, layer, cache, start, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, cache, start, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        # activations and KV cache dtype; None = the weights' dtype (see use_fp32_activations)
        self.compute_dtype: torch.dtype | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of activations, logits and the KV cache."""
        return self.compute_dtype or self.lm_head.weight.dtype

    def use_fp32_activations(self) -> "Transformer":
        """bf16 weights, fp32 activations: for CPUs without native bf16 arithmetic, where
        bf16 elementwise ops and attention are emulated (slow) while the weights, read from
        memory, stay half the bytes (the skinny kernel widens them in registers)."""
        self.compute_dtype = torch.float32
        for mod in self.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.data = mod.weight.data.float()
            if isinstance(mod, Linear) and mod.bias is not None:   # Qwen2's q/k/v bias
                mod.bias.data = mod.bias.data.float()
        return self

    @property
    def device(self) -> torch.device:
        return self.inv_freq.device     # every model has it; a packed LM head has no `weight`

    def new_cache(self, batch: int = 1, max_len: int | None = None, num_layers: int | None = None) -> KVCache:
        return KVCache(self.config, batch, max_len or self.config.max_position_embeddings,
                       self.dtype, self.device, num_layers)

    def forward(
        self,
        tokens: Tensor | None,                # [B, T] int64 (None: embeds instead)
        cache: KVCache | None = None,
        start: Sequence[int] | None = None,   # [B] host ints: first slot of the new tokens
        tree: TreeAttention | None = None,
        exit_layer: int | None = None,        # run only the first `exit_layer` layers
        logits: bool | slice = True,          # False: skip the LM head; a slice: only those positions
        hidden: bool = False,                 # also return the final-norm hidden states
        embeds: Tensor | None = None,         # [B, T, D] input vectors instead of token embeddings
    ):
        B, T = embeds.shape[:2] if embeds is not None else tokens.shape
        if cache is not None and start is None:
            start = list(cache.lengths)
        if cache is not None and self._c_path(cache, logits):
            return self._forward_c(tokens, cache, start[0], tree, exit_layer, logits, hidden, embeds)
        device = self.device
        positions, mask = self._positions_and_mask(B, T, cache, start, tree, device)
        freqs = positions[..., None].float() * self.inv_freq       # [B, T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]            # [B, 1, T, hd]
        x = (self.model.embed_tokens(tokens) if embeds is None else embeds).to(self.dtype)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        layers = self.model.layers if exit_layer is None else self.model.layers[:exit_layer]
        for i, layer in enumerate(layers):
            x = layer(x, cos, sin, i, cache, start, mask)
        if cache is not None:
            for b, s in enumerate(start):
                cache.lengths[b] = s + T
        h = self.model.norm(x)
        out = None
        if logits is not False:
            out = self.lm_head(h if logits is True else h[:, logits])
        return (out, h) if hidden else out

    def _c_path(self, cache: KVCache, logits) -> bool:
        """One CPU sequence at inference: the whole forward in one C call (kernels/forward.c)."""
        if self.model.norm.weight.requires_grad or kernels.load() is None:
            return False
        if isinstance(logits, slice) and (logits.stop is not None or logits.step is not None):
            return False
        return cforward.supported(self, cache)

    def _forward_c(self, tokens, cache, start, tree, exit_layer, logits, hidden, embeds=None):
        T = tokens.shape[1] if embeds is None else embeds.shape[1]
        offsets = tree.depth if tree is not None else torch.arange(T)
        if logits is False:
            logit_from = None
        else:
            first = 0 if logits is True else (logits.start or 0)
            logit_from = max(0, first + T) if first < 0 else first
        out, h = cforward.forward(kernels.load(), self, tokens[0] if embeds is None else None, cache, start,
                                  offsets + start, tree.mask if tree is not None else None,
                                  exit_layer or self.config.num_hidden_layers, logit_from, hidden,
                                  embeds[0] if embeds is not None else None, tree.past if tree is not None else 0)
        cache.lengths[0] = start + T
        out = out[None] if out is not None else None
        return (out, h[None]) if hidden else out

    def _positions_and_mask(self, B, T, cache, start, tree, device):
        if cache is None:
            return torch.arange(T, device=device).expand(B, T), None
        offsets = tree.depth if tree is not None else torch.arange(T, device=device)
        starts = torch.tensor(start, device=device)
        positions = starts[:, None] + offsets[None, :]              # [B, T]
        if tree is None and T == 1 and len(set(start)) == 1:
            return positions, None                                   # decode: see every slot
        span = max(start) + T
        past = tree.past if tree is not None else 0
        slot = torch.arange(span, device=device)
        rel = slot[None, :] - starts[:, None] + past                 # [B, span] column of the mask
        new = tree.mask if tree is not None else torch.ones(T, T, dtype=torch.bool, device=device).tril()
        rel_idx = rel.clamp(0, past + T - 1)
        visible_new = new[:, rel_idx].permute(1, 0, 2)               # [B, T, span]
        in_new = (rel >= 0) & (rel < past + T)
        mask = torch.where(in_new[:, None, :], visible_new, (rel < 0)[:, None, :])
        return positions, mask[:, None]                              # [B, 1, T, span]
