"""Self-distillation data for Medusa and EAGLE heads: the target's own generations and features.

A shard is a batch of B rows: `prompt_len` tokens cut from a corpus split, then `gen_len`
tokens the target generated after them (greedy rows, or sampled at `temperature`), and the
target's final-norm hidden state at every position. Heads trained on it learn to predict what
the target itself would say next, which is what verification checks.

shard_00012.pt = {"tokens": [B, L] int32, "hidden": [B, L, D] float16, "greedy": [B] bool}
Shards are written one by one and skipped when present, so an interrupted run resumes.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch

from ..model import ForwardBatch, Transformer
from ..sampling import make_generator


@torch.inference_mode()
def generate_batch(model: Transformer, prompts: torch.Tensor, gen_len: int, temperature: float,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """prompts [B, P] int64 -> (tokens [B, P + gen_len] int64, hidden [B, P + gen_len, D] float32).

    temperature 0 = greedy. hidden[:, t] is the target's final-norm state after token t.
    """
    B, P = prompts.shape
    cache = model.new_cache(B, P + gen_len)
    rows = list(range(B))

    def forward(x, start):   # x [B, T] at slots start.. of every row; the last row's logits
        T = x.shape[1]
        out = model(x.flatten(), cache, ForwardBatch.build(cache, rows, [T] * B, [start] * B, logits=[1] * B),
                    hidden=True)
        return out.logits, out.hidden.view(B, T, -1)

    logits, h = forward(prompts, 0)
    tokens, hidden = [prompts], [h]
    for t in range(gen_len):
        last = logits.float()
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(last / temperature, -1), 1, generator=generator)
        else:
            nxt = last.argmax(-1, keepdim=True)
        tokens.append(nxt)
        logits, h = forward(nxt, P + t)
        hidden.append(h)
    return torch.cat(tokens, 1), torch.cat(hidden, 1)


def make_shards(model: Transformer, stream: np.ndarray, out: Path, num_shards: int, batch: int = 32,
                prompt_len: int = 64, gen_len: int = 192, temperature: float = 0.8,
                greedy_fraction: float = 0.5, seed: int = 0, log=print) -> list[Path]:
    """Write shards 0..num_shards-1 under `out` (skipping those present); return their paths.

    Shard i takes its prompts at offsets drawn from default_rng((seed, i)); the first
    ceil(greedy_fraction * num_shards) shards are greedy (one of one: a single validation shard
    has greedy rows to measure on), the rest sampled.
    """
    out.mkdir(parents=True, exist_ok=True)
    n_greedy = math.ceil(greedy_fraction * num_shards - 1e-9)
    paths = []
    for i in range(num_shards):
        path = out / f"shard_{i:05d}.pt"
        paths.append(path)
        if path.is_file():
            continue
        rng = np.random.default_rng((seed, i))
        starts = rng.integers(0, len(stream) - prompt_len, size=batch)
        prompts = torch.from_numpy(np.stack([stream[s:s + prompt_len] for s in starts]).astype(np.int64))
        greedy = i < n_greedy
        t0 = time.perf_counter()
        tokens, hidden = generate_batch(model, prompts, gen_len, 0.0 if greedy else temperature,
                                        make_generator(seed * 100003 + i, model.device))
        tmp = path.with_suffix(".tmp")
        torch.save({"tokens": tokens.to(torch.int32), "hidden": hidden.to(torch.float16),
                    "greedy": torch.full((batch,), greedy)}, tmp)
        tmp.rename(path)
        log(f"shard {i + 1}/{num_shards} ({'greedy' if greedy else f'T={temperature}'}): "
            f"{tokens.numel()} tokens in {time.perf_counter() - t0:.1f}s")
    return paths


def load_shards(paths: list[Path]) -> dict[str, torch.Tensor]:
    parts = [torch.load(p) for p in paths]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
