"""Two-turn chats with and without prefix caching: MT-bench's questions (Spec-Bench's file), the
second turn sent with the first turn and its answer as history, the way a chat client resends a
conversation. Prints the second turns' prefill time and TTFT with the cache off and on, and
checks that the answers are the same (and, with a speculative method, what it drafted and kept).

    python scripts/prefix_cache.py --questions 16 --threads 2
    python scripts/prefix_cache.py --questions 12 --speculative-config '{"method": "eagle", "topk": 1, "num_speculative_tokens": 2}'
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specdec import LLM, SamplingParams
from specdec.bench.spec_bench import MT_BENCH, QUESTIONS


def conversations(n: int) -> list[list[str]]:
    rows = [json.loads(line) for line in QUESTIONS.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r["turns"][:2] for r in rows if r["category"] in MT_BENCH and len(r["turns"]) >= 2][:n]


def run(llm: LLM, chats: list[list[str]], params: SamplingParams) -> tuple[list, float, float]:
    """Answers of both turns (with their drafted and accepted counts), and the second turns'
    summed prefill and time to first token."""
    answers, prefill, ttft = [], 0.0, 0.0
    for first, second in chats:
        history = [{"role": "user", "content": first}]
        one = llm.chat([history], params)[0].outputs[0]
        history += [{"role": "assistant", "content": one.text}, {"role": "user", "content": second}]
        t = time.perf_counter()
        out = llm.chat([history], params)[0]
        stats = out.stats
        prefill += stats.prefill_time_s
        ttft += stats.time_to_first_token_s or (time.perf_counter() - t)
        answers.append((list(one.token_ids) + list(out.outputs[0].token_ids), stats.draft_tokens, stats.accepted_tokens))
    return answers, prefill, ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="default: the default model")
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--speculative-config", default=None,
                    help="vLLM's JSON (a method the default model bundles needs no model); default: plain decoding")
    args = ap.parse_args()
    spec = {"speculative_config": json.loads(args.speculative_config)} if args.speculative_config else \
        {"num_speculative_tokens": 0}
    torch.set_num_threads(args.threads)
    chats = conversations(args.questions)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    results = {}
    for caching in (False, True, False, True):         # interleaved: the machine drifts
        llm = LLM(model=args.model, enable_prefix_caching=caching, **spec)
        answers, prefill, ttft = run(llm, chats, params)
        results.setdefault(caching, []).append((prefill, ttft))
        results.setdefault(("answers", caching), answers)
        if caching:
            e = llm.engine
            hit = f", {e.prefix_cache_hits} of {e.prefix_cache_queries} prompt tokens found cached"
        print(f"prefix caching {'on ' if caching else 'off'}: second turns' prefill {prefill:.2f} s, "
              f"TTFT {ttft:.2f} s{hit if caching else ''}")
    same = results[("answers", True)] == results[("answers", False)]
    best = {c: min(results[c]) for c in (False, True)}
    drafted, kept = (sum(a[i] for a in results[("answers", True)]) for i in (1, 2))
    if args.speculative_config:
        print(f"second turns with the cache: {kept} of {drafted} drafted tokens accepted")
    print(f"{len(chats)} two-turn chats: second-turn prefill {best[False][0] / best[True][0]:.2f}x faster, "
          f"TTFT {best[False][1] / best[True][1]:.2f}x lower with the cache; answers identical: {same}")


if __name__ == "__main__":
    main()
