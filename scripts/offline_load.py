"""Where a loaded server's time goes, without the server: Spec-Bench requests through
LLM.generate at a given concurrency (prefill and decode mixed, as the server runs them), and
the cost of prefill alone against the prompt's length.

    python scripts/offline_load.py --batch 16 --num-prompts 64 --prefill 128,512,1024,2000
    python scripts/offline_load.py --num-prompts 0 --threads 1 --clock cpu --prefill 128,512,1024 --prefill-repeats 2
    python scripts/offline_load.py --batch 16 --num-prompts 32 --prefill '' --clock cpu \
        --kv-cache-dtype bfloat16,int8 --rounds 2

Several --kv-cache-dtype values run in turn, --rounds times (interleaved: a shared machine's
load changes between runs). --clock cpu times with time.process_time (every thread's CPU time).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from specdec import LLM, SamplingParams
from specdec.bench.spec_bench import chat_prompt, read_questions


def spec_bench_requests(llm: LLM, n: int, max_prompt: int) -> list[list[int]]:
    qs = read_questions()
    random.Random(0).shuffle(qs)
    prompts = [chat_prompt(llm.tokenizer, q["prompt"]) for q in qs]
    return [p for p in prompts if len(p) <= max_prompt][:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="default: the default model")
    ap.add_argument("--batch", type=int, default=16, help="sequences decoded together (max_num_seqs)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prefill", default="128,512,1024,2000", help="prompt lengths timed alone ('' = none)")
    ap.add_argument("--prefill-repeats", type=int, default=1, help="timed prefills per length (the best is printed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-dtype", default="auto", help="comma-separated: each runs the load in turn")
    ap.add_argument("--rounds", type=int, default=1, help="times each --kv-cache-dtype runs (interleaved)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    dtypes = args.kv_cache_dtype.split(",")
    llms = {dt: LLM(model=args.model, num_speculative_tokens=0, max_num_seqs=args.batch, kv_cache_dtype=dt, enable_prefix_caching=False) for dt in dtypes}
    llm = llms[dtypes[0]]
    prompts = spec_bench_requests(llm, args.num_prompts, llm.engine.max_model_len - args.max_tokens)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for r in range(args.rounds if prompts else 0):      # --num-prompts 0: prefill timings only
        for kv_dtype in dtypes:
            t = clock()
            outs = llms[kv_dtype].generate([{"prompt_token_ids": p} for p in prompts], params)
            dt = clock() - t
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            print(f"[round {r}, KV {kv_dtype}] {len(prompts)} Spec-Bench requests at {args.batch} sequences: "
                  f"{sum(map(len, prompts))} prompt tokens (mean {sum(map(len, prompts)) / len(prompts):.0f}), "
                  f"{n} output tokens in {dt:.1f} {args.clock} s = {n / dt:.1f} output tokens/s", flush=True)
    one = SamplingParams(temperature=0, max_tokens=1)
    for L in [int(x) for x in args.prefill.split(",") if x]:
        ids = [random.Random(L).randrange(1000, 40000) for _ in range(L)]
        llm.generate([{"prompt_token_ids": ids}], one)          # warm-up
        dt = float("inf")
        for _ in range(args.prefill_repeats):
            t = clock()
            llm.generate([{"prompt_token_ids": ids}], one)
            dt = min(dt, clock() - t)
        print(f"prefill of {L} tokens: {dt * 1000:.0f} {args.clock} ms = {L / dt:.0f} tokens/s "
              f"(best of {args.prefill_repeats})", flush=True)


if __name__ == "__main__":
    main()
