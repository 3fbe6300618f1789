"""CPU time of one batched decode step (B sequences, one new token each) against the context
length, for each KV cache dtype, interleaved: the step is memory-bound on the keys and values.

    python scripts/kv_step_cost.py --batch 16 --contexts 16,256,512,1024 --dtypes bfloat16,int8

The cached slots hold random keys and values (a step's cost does not depend on their values),
written straight into the pool instead of prefilled, so long contexts cost no prefill. Each
repeat times every (context, dtype) once in turn; the median of the CPU times
(time.process_time: every thread's time, so run it alone or with --threads 1) is reported.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def filled_cache(model, dtype: torch.dtype, batch: int, context: int):
    """A pool of `batch` sequences with `context` random cached slots each (+1 for the step)."""
    from specdec.model import BlockManager

    per_seq = (context + 1 + 15) // 16
    blocks = BlockManager(batch * per_seq, 16, batch, per_seq)
    kv = model.new_kv(blocks, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    for rows in (kv.k, kv.v):
        for t in rows:
            t.copy_(torch.randint(-127, 128, t.shape, generator=g) if dtype == torch.int8 else torch.randn(t.shape, generator=g))
    for scales in (kv.k_scale or [], kv.v_scale or []):
        for t in scales:
            t.copy_(torch.rand(t.shape, generator=g) / 64)
    for b in range(batch):
        blocks.add(b)
        blocks.ensure(b, context + 1)
        kv.set_length(b, context)
    return kv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="default: the default model (SmolLM2-135M Q4_1 when installed)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--contexts", default="16,256,512,1024")
    ap.add_argument("--dtypes", default="bfloat16,int8")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from specdec import LLM
    from specdec.engine import kv_cache_dtype_of
    from specdec.kernels import describe
    from specdec.model import ForwardBatch

    llm = LLM(model=args.model, num_speculative_tokens=0, max_num_seqs=1, enable_prefix_caching=False)
    model = llm.target
    contexts = [int(c) for c in args.contexts.split(",")]
    dtypes = args.dtypes.split(",")
    runs = {}
    for L in contexts:
        for name in dtypes:
            kv = filled_cache(model, kv_cache_dtype_of(model, name), args.batch, L)
            seqs = list(range(args.batch))
            batch = ForwardBatch.build(kv, seqs, [1] * args.batch)
            tokens = torch.randint(1000, 20000, (args.batch,), generator=torch.Generator().manual_seed(L))
            runs[L, name] = (kv, batch, tokens, [])
    with torch.inference_mode():
        for _ in range(args.repeats + 1):          # the first round warms up
            for (L, name), (kv, batch, tokens, times) in runs.items():
                t0 = time.process_time()
                model(tokens, kv, batch)
                times.append(time.process_time() - t0)
    print(f"kernels: {describe()}; {args.threads} thread(s), batch {args.batch}, median of {args.repeats} (CPU ms)")
    print("| context | " + " | ".join(f"{n} ms" for n in dtypes) + " | " +
          " | ".join(f"{dtypes[0]} / {n}" for n in dtypes[1:]) + " |")
    print("|---|" + "---|" * (2 * len(dtypes) - 1))
    for L in contexts:
        ms = [statistics.median(runs[L, n][3][1:]) * 1000 for n in dtypes]
        print(f"| {L} | " + " | ".join(f"{m:.1f}" for m in ms) + " | " + " | ".join(f"{ms[0] / m:.2f}x" for m in ms[1:]) + " |")


if __name__ == "__main__":
    main()
