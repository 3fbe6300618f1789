"""Decoding step time of a tensor-parallel target against one rank, and where TP's time goes.

For each setting (TP=1 with 1 and with 2 threads; TP=2 with 1 thread per rank) one LLM is
built; repeats run the settings in turn (interleaved, so machine load hits them alike). A
measurement adds B requests, prefills them, then times S plain decoding steps of the batch
engine (each one target forward over the B sequences); the cell is the median step over the
best repeat. For TP=2, rank 0's time inside each collective is summed per kind: the
row-parallel all-reduces (o and down, two per layer), the vocabulary gather of the LM head,
and the command that tells the worker what to run. Time in a collective includes waiting for
the other rank (its compute, its scheduling), which is what a step pays.

    python scripts/tp_step_time.py --model models/target --dtype float32 --batch 1 8 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from specdec import LLM, SamplingParams, kernels

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


def timed(comm, totals: dict) -> None:
    """Wrap rank 0's collectives with timers (this script's own instrumentation)."""
    for name in ("all_reduce", "gather_columns", "send_command"):
        fn = getattr(comm, name)

        def wrapper(*a, _fn=fn, _name=name, **kw):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                totals[_name] += time.perf_counter() - t0
        setattr(comm, name, wrapper)


def measure(llm: LLM, threads: int, batch: int, steps: int, totals: dict | None) -> tuple[float, dict]:
    torch.set_num_threads(threads)
    kernels.set_threads(threads)
    engine = llm.engine
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    reqs = [engine.add_request(ids, params) for _ in range(batch)]
    while any(r.num_cached < len(r.prompt) for r in reqs):       # prefill (and its first token)
        engine.step()
    engine.step()
    times = []
    if totals is not None:
        totals.clear()
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for r in reqs:
        engine.abort(r.request_id)
    shares = {k: v / sum(times) for k, v in (totals or {}).items()}
    return statistics.median(times), shares


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/target")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    kw = dict(model=args.model, dtype=args.dtype, num_speculative_tokens=0, max_model_len=512)
    llms = {"TP=1, 1 thread": (LLM(**kw), 1), "TP=1, 2 threads": None, "TP=2, 1 thread per rank": (LLM(**kw, tensor_parallel_size=2), 1)}
    llms["TP=1, 2 threads"] = (llms["TP=1, 1 thread"][0], 2)
    totals = defaultdict(float)
    timed(llms["TP=2, 1 thread per rank"][0].target.leader.comm, totals)
    best = {}
    for _ in range(args.repeats):
        for b in args.batch:
            for name, (llm, threads) in llms.items():
                t, shares = measure(llm, threads, b, args.steps, totals if "TP=2" in name else None)
                if (name, b) not in best or t < best[(name, b)][0]:
                    best[(name, b)] = (t, shares)
    print(f"model {args.model} ({args.dtype}), plain decoding, median step of {args.steps}, best of {args.repeats} "
          f"interleaved repeats; kernels: {kernels.describe().split(';')[0]}\n")
    print("| setting | batch | step ms | vs TP=1, 1 thread | all-reduce share | vocab gather share | command share |")
    print("|---|---|---|---|---|---|---|")
    for b in args.batch:
        base = best[("TP=1, 1 thread", b)][0]
        for name in llms:
            t, s = best[(name, b)]
            cells = [f"{100 * s[k]:.0f}%" if s else "-" for k in ("all_reduce", "gather_columns", "send_command")]
            print(f"| {name} | {b} | {1000 * t:.2f} | {base / t:.2f}x | {' | '.join(cells)} |")
    llms["TP=2, 1 thread per rank"][0].shutdown()


if __name__ == "__main__":
    main()
