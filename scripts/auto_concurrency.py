"""Speculative methods under "auto" against plain decoding by concurrency, offline (the batch
engine, no server), on Spec-Bench questions through SmolLM2's chat template: output tokens/s,
tokens per target forward, the proposer's share of the time, greedy output against plain's.
Variants take turns within each round (a drifting host hits them alike); the best round is kept.

    PYTHONPATH=. python scripts/auto_concurrency.py --concurrency 1,16 --methods plain,eagle_auto,suffix_auto
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

from specdec import LLM, SamplingParams
from specdec.bench.spec_bench import chat_prompt, read_questions
from specdec.defaults import smollm2_gguf

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # noqa: E402  (its closed loop)

SPECS = {"plain": None,
         "suffix_auto": {"method": "suffix", "num_speculative_tokens": "auto"},
         "eagle_auto": {"method": "eagle", "num_speculative_tokens": "auto"},
         "eagle2": {"method": "eagle", "num_speculative_tokens": 2},
         "ngram_auto": {"method": "ngram", "num_speculative_tokens": "auto", "prompt_lookup_min": 1, "prompt_lookup_max": 4},
         # speculation off from 2 running requests on (vLLM refuses disable_by_batch_size < 2; before
         # that rule this was 1: off at every concurrency)
         "eagle_off": {"method": "eagle", "num_speculative_tokens": 2, "disable_by_batch_size": 2}}


def closed_loop(llm: LLM, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> dict:
    """At most `concurrency` requests in the engine at once (a new one joins as one finishes)."""
    out = gpu_bench.closed_loop(llm, prompts, params, concurrency)
    toks = sum(len(t) for t in out["tokens"])
    return {"tok_per_s": toks / out["wall_s"], "tokens": toks, "tokens_per_pass": toks / max(out["passes"], 1),
            "outputs": out["tokens"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--methods", default="plain,eagle_auto,suffix_auto")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency (4 at concurrency 1)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model or str(smollm2_gguf())
    methods = args.methods.split(",")
    llms = {m: LLM(model, speculative_config=SPECS[m], num_speculative_tokens=0 if SPECS[m] is None else None,
                   max_num_seqs=max(int(c) for c in args.concurrency.split(",")), enable_prefix_caching=False) for m in methods}
    qs = read_questions()
    random.Random(0).shuffle(qs)
    tok = llms[methods[0]].tokenizer
    prompts = [x for x in (chat_prompt(tok, q["prompt"]) for q in qs) if len(x) <= 768]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for llm in llms.values():                       # warm-up
        llm.generate([{"prompt_token_ids": prompts[-1]}], SamplingParams(temperature=0, max_tokens=8))
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        n = 4 if c == 1 else args.requests
        best: dict[str, dict] = {}
        same = {m: True for m in methods}
        for r in range(args.rounds):
            batch = prompts[r * n:(r + 1) * n]
            ref = None
            for m in methods:
                res = closed_loop(llms[m], batch, params, c)
                ref = res["outputs"] if ref is None else ref      # the first method's (plain's) outputs
                same[m] &= res["outputs"] == ref
                if m not in best or res["tok_per_s"] > best[m]["tok_per_s"]:
                    best[m] = res
        plain = best[methods[0]]["tok_per_s"]
        for m in methods:
            b = best[m]
            row = {"concurrency": c, "method": m, "tok_per_s": round(b["tok_per_s"], 1), "x_plain": round(b["tok_per_s"] / plain, 3),
                   "tokens_per_pass": round(b["tokens_per_pass"], 3), "greedy_identical": same[m]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
