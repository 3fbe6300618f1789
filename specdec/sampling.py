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


def process_rows(logits: Tensor, params: list[SamplingParams], repeats: list[int] | None = None) -> Tensor:
    """process() over the rows of several requests at once, each with its own parameters.

    logits:  [R, V]
    params:  one SamplingParams per request
    repeats: rows per request (sum = R); None = one row each
    Row r gets exactly process(logits[r:r+1], params of its request): the same operations in
    the same order, the filters only touching the rows that use them.
    """
    dev = logits.device
    repeats = [1] * len(params) if repeats is None else repeats
    rep = torch.tensor(repeats, device=dev)

    def per_row(values, dtype):
        return torch.repeat_interleave(torch.tensor(values, dtype=dtype, device=dev), rep)

    V = logits.shape[-1]
    temp = per_row([p.temperature for p in params], torch.float32)
    logits = logits.float() / temp[:, None]
    top_k = [p.top_k if 0 < p.top_k < V else 0 for p in params]
    if any(top_k):
        k = per_row(top_k, torch.long)
        kth = torch.topk(logits, max(top_k), dim=-1).values.gather(-1, (k - 1).clamp_min(0)[:, None])
        logits = logits.masked_fill((logits < kth) & (k > 0)[:, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    use_p = [p.top_p < 1.0 for p in params]
    if any(use_p):
        top_p = per_row([p.top_p for p in params], torch.float32)
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p
        drop_sorted = (before >= top_p[:, None]) & per_row(use_p, torch.bool)[:, None]
        drop_sorted[..., 0] = False
        probs = probs.masked_fill(torch.empty_like(drop_sorted).scatter_(-1, idx, drop_sorted), 0.0)
    use_min = [p.min_p > 0.0 for p in params]
    if any(use_min):
        min_p = per_row([p.min_p for p in params], torch.float32)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
    renorm = [a or b for a, b in zip(use_p, use_min)]
    if any(renorm):
        probs = torch.where(per_row(renorm, torch.bool)[:, None], probs / probs.sum(-1, keepdim=True), probs)
    return probs


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator: seeded runs reproduce, unseeded ones draw fresh OS entropy."""
    g = torch.Generator(device=device)
    g.manual_seed(seed % 2**64 if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return g


def sample(probs: Tensor, generator: torch.Generator) -> Tensor:
    """probs [N, V] -> token ids [N]."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
