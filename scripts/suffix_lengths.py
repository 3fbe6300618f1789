"""How long should suffix decoding's drafts be? An offline replay on Spec-Bench (greedy): the
target's plain outputs are computed once, then each drafting rule is replayed against them
(a greedy step keeps the longest agreeing prefix plus one token), so rules compare on the same
text without timing noise. A step's cost is a forward over its fed tokens, from
`--costs` (1 + K tokens relative to one, e.g. `scripts/forward_cost.py --rows 1,2,...,9` on this
machine) plus `--overhead` for drafting and verifying; "est." = emitted tokens / summed cost.

    python scripts/suffix_lengths.py --questions 80 --costs 1.17,1.21,1.28,1.42,1.60,1.75,1.85,1.97

Rules: fixed K (own-context lookup first, then the datastore, as SuffixProposer drafts), variants
of the lookup settings, and an upper bound for confidence-aware lengths: each draft position's
chance of being kept, calibrated on these same outputs (in-sample, so optimistic) by source,
match length, occurrence count and path share, and the length that maximises expected tokens per
cost chosen per step. Timing plays no part; nothing is tuned here.
"""
from __future__ import annotations

import argparse
import collections
import math
import random

import numpy as np
import torch

from specdec import LLM, SamplingParams, kernels
from specdec.bench.spec_bench import chat_prompt, read_questions
from specdec.defaults import MODELS_DIR, SMOLLM2_SPECULATIVE
from specdec.proposers.ngram import match as own_match
from specdec.proposers.suffix import load_datastore

KMAX = 8


def references(n: int, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy output ids) of n Spec-Bench first turns (shuffled with seed 1)."""
    qs = read_questions()
    random.Random(1).shuffle(qs)
    llm = LLM(num_speculative_tokens=0, enable_prefix_caching=False)
    prompts = [chat_prompt(llm.tokenizer, q["prompt"]) for q in qs[:n]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=max_tokens))
    llm.shutdown()
    return [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]


def _bucket(v: float, edges: list[float]) -> int:
    return next(i for i, e in enumerate(edges + [math.inf]) if v <= e)


class Drafts:
    def __init__(self, depth: int):
        self.ds, self.depth = load_datastore(MODELS_DIR / "smollm2-suffix"), depth

    def draft(self, seq, k, n_min=2, n_max=4, min_prob=0.2, factor=0.5):
        """SuffixProposer's rule: (tokens, a calibration key per token)."""
        arr = np.asarray(seq, dtype=np.int64)
        own, n = own_match(arr, k, n_max, n_min)
        if n:
            return own.tolist(), [("own", n, j) for j in range(len(own))]
        lo, hi, m = self.ds.match(arr[-self.depth:])
        if not m:
            return [], []
        tokens, probs = self.ds.continue_chain(lo, hi, m, min(k, max(1, math.floor(factor * m))), min_prob)
        count = _bucket(hi - lo, [1, 3, 9, 30])
        return tokens, [("ds", _bucket(m, [1, 2, 3, 5, 9]), count, _bucket(p, [.2, .4, .6, .8, .95]), j)
                        for j, p in enumerate(probs)]


def kept(tokens, out, t) -> int:
    a = 0
    while a < len(tokens) and t + a < len(out) and tokens[a] == out[t + a]:
        a += 1
    return a


def replay(refs, rule, cost) -> tuple[float, float]:
    """(tokens per step, tokens per unit of cost) of a drafting rule over the references."""
    steps = emitted = 0
    spent = 0.0
    for prompt, out in refs:
        t = 1                                  # the first token comes from the prefill
        while t < len(out):
            tokens = rule(prompt + out[:t])
            e = min(kept(tokens, out, t) + 1, len(out) - t)
            steps, emitted, spent, t = steps + 1, emitted + e, spent + cost(1 + len(tokens)), t + e
    return emitted / steps, emitted / spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=80)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--costs", required=True, help="cost of 2, 3, ... fed tokens relative to 1")
    ap.add_argument("--overhead", type=float, default=0.04, help="a drafting step's extra cost, relative")
    args = ap.parse_args()
    torch.set_num_threads(1)
    kernels.set_threads(1)
    table = [0.0, 1.0] + [float(c) for c in args.costs.split(",")]

    def cost(n: int) -> float:
        return table[min(n, len(table) - 1)] + (args.overhead if n > 1 else 0.0)

    refs = references(args.questions, args.max_tokens)
    d = Drafts(SMOLLM2_SPECULATIVE.get("suffix_decoding_max_tree_depth", 24))
    print(f"{len(refs)} Spec-Bench questions, {sum(len(o) for _, o in refs)} greedy tokens; costs {table[1:]}")
    print("| rule | tau | est. speedup over plain |\n|---|---|---|")
    rules = {f"K={k}": dict(k=k) for k in (1, 2, 3, 4, 6)}
    rules.update({"K=3, own lookup n >= 3": dict(k=3, n_min=3), "K=3, own lookup n <= 8": dict(k=3, n_max=8),
                  "K=3, max_spec_factor 1": dict(k=3, factor=1.0), "K=3, min_token_prob 0.3": dict(k=3, min_prob=0.3)})
    for name, kw in rules.items():
        tau, speed = replay(refs, lambda seq, kw=kw: d.draft(seq, **kw)[0], cost)
        print(f"| {name} | {tau:.3f} | {speed:.3f}x |", flush=True)
    # calibrated lengths: P(kept through position j | key), in-sample
    seen = collections.defaultdict(lambda: [0, 0])
    for prompt, out in refs:
        for t in range(1, len(out) - 1):
            tokens, keys = d.draft(prompt + out[:t], KMAX, min_prob=0.0, factor=64)
            a = kept(tokens, out, t)
            for j, key in enumerate(keys[:len(out) - t]):
                seen[key][0] += j < a
                seen[key][1] += 1
    p_kept = {key: (ok + 0.5) / (n + 1) for key, (ok, n) in seen.items()}

    def calibrated(seq, cap):
        tokens, keys = d.draft(seq, cap, min_prob=0.0, factor=64)
        best, length, expected = 1.0 / cost(1), 0, 1.0
        for j, key in enumerate(keys):
            expected += p_kept[key]
            if expected / cost(j + 2) > best:
                best, length = expected / cost(j + 2), j + 1
        return tokens[:length]

    for cap in (2, 3, 4, 8):
        tau, speed = replay(refs, lambda seq, cap=cap: calibrated(seq, cap), cost)
        print(f"| calibrated lengths up to {cap} (in-sample bound) | {tau:.3f} | {speed:.3f}x |", flush=True)


if __name__ == "__main__":
    main()
