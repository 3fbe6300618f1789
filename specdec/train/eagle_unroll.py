"""EAGLE trained on its own drafts' features: the head's chain, unrolled over a training window.

Teacher forcing alone trains the head on the target's true features at every pair, but a chain
drafts its second and later tokens from the head's own predicted features. On SmolLM2-135M the
predicted features miss the true ones by ~57% (relative L2), so drafts past the first collapsed
(acceptance by position 0.52 0.15 0.05 on validation prompts, conditional 0.29 at depth 2).
As EAGLE-3's "training-time test" (and HASS), `unrolled` runs the chain the way the engine
serves it and trains every depth:

- depth 0 is the ordinary teacher-forced pass: row t holds (feature t, token t + 1);
- depth s >= 1, row t holds (the head's depth s - 1 prediction for the feature of token t,
  token t + 1) at position t, and attends to what the serving chain's slot would see: the
  depth-0 keys of rows <= t - s (true features, committed), the depth-r key of row t - s + r
  for 1 <= r < s (the chain's earlier drafts), and its own key. Its logits predict token t + 2
  like depth 0's row t: the label is the same token, drafted s positions later in the chain.
  Rows t < s have no committed context and are left out of the loss.

Tokens stay the true ones (a chain whose earlier draft was wrong is cut at verification
anyway), so depth s measures the conditional acceptance the engine sees at position s + 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..model.heads import EagleHead
from ..model.llama import rotate_half


def chain_mask(width: int, depth: int, device=None) -> Tensor:
    """[W, (depth + 1) * W] bool: which keys row t of `depth` sees, the keys of depths 0..depth
    laid side by side (see the module docstring)."""
    t = torch.arange(width, device=device)[:, None]
    j = torch.arange(width, device=device)[None]
    parts = [j <= t - depth]
    parts += [j == t - depth + r for r in range(1, depth + 1)]
    return torch.cat(parts, 1)


def _qkv(attn, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x [B, W, D] -> q [B, H, W, hd], k and v [B, KV, W, hd], rotary applied."""
    q, k, v = (t.transpose(1, 2) for t in attn.heads(x))
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


def unrolled(head: EagleHead, feats: Tensor, embeds: Tensor, depths: int) -> list[tuple[Tensor, Tensor]]:
    """feats [B, W, D]: the target's features of tokens t; embeds [B, W, D]: embeddings of tokens
    t + 1. Returns per depth (logits [B, W, V'] for tokens t + 2, predicted features [B, W, D]
    of tokens t + 1). Depth 0 equals head(feats, embeds) without a cache."""
    dec = head.decoder
    layer = dec.model.layers[0]
    attn = layer.self_attn
    W = feats.shape[1]
    cos, sin = dec._rope(torch.arange(W, device=feats.device), feats.dtype)     # [W, hd]
    keys, vals, out = [], [], []
    prev = None         # depth s > 0 reads depth s - 1's output
    f = feats
    for s in range(depths):
        if s > 0:   # row t reads the previous depth's prediction for token t (made at row t - 1)
            f = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], 1)
        x = head.fc(torch.cat([f, embeds], -1).to(dec.dtype))
        q, k, v = _qkv(attn, layer.input_layernorm(x), cos.to(x.dtype), sin.to(x.dtype))
        keys.append(k)
        vals.append(v)
        mask = chain_mask(W, s, x.device)
        a = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(vals, 2), attn_mask=mask, scale=attn.scale,
                                           enable_gqa=attn.n_kv != attn.n_heads)
        h = x + attn.o_proj(a.transpose(1, 2).reshape(*x.shape[:2], -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        prev = dec.model.norm(h)
        out.append((dec.lm_head(prev), prev))
    return out
