"""Logits processing shared by the target (p) and every draft (q).

Both distributions go through the same temperature -> top-k -> top-p -> min-p chain (Hugging
Face's warper order), so rejection sampling reproduces exactly the *processed* target
distribution.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from .config import SamplingParams


def process(logits: Tensor, params: SamplingParams) -> Tensor:
    """logits [N, V] -> probabilities [N, V] (float32) after temperature, top-k, top-p, min-p."""
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p          # mass of strictly more likely tokens
        drop_sorted = before >= params.top_p
        drop_sorted[..., 0] = False                      # the most likely token always stays
        drop = torch.empty_like(drop_sorted).scatter_(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
    if params.top_p < 1.0 or params.min_p > 0.0:
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator: seeded runs reproduce, unseeded ones draw fresh OS entropy."""
    g = torch.Generator(device=device)
    g.manual_seed(seed % 2**64 if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return g


def sample(probs: Tensor, generator: torch.Generator) -> Tensor:
    """probs [N, V] -> token ids [N]."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
