"""Would suffix decoding gain from drafting trees (SuffixDecoding's speculation trees) rather than
chains? An offline replay: SmolLM2's greedy answers to Spec-Bench first turns (plain decoding,
generated once), then for every step the drafts the default method's lookup would make (its own
context first, then the bundled datastore), as a chain of up to `depth` tokens or as a tree of
up to `nodes` nodes grown best first by path frequency, and the tokens a greedy verification of
that draft would emit. Reports tau (tokens per target forward) and the mean drafted nodes per
step: what a verification forward costs grows with the nodes. Timing plays no part.

    python scripts/suffix_trees.py --questions 80
"""
from __future__ import annotations

import argparse
import heapq
import math
import random

import numpy as np
import torch

from specdec import LLM, SamplingParams
from specdec.bench.spec_bench import chat_prompt, read_questions
from specdec.defaults import MODELS_DIR, smollm2_gguf
from specdec.proposers.ngram import match
from specdec.proposers.suffix import load_datastore
from specdec.proposers.suffix_index import SEP, SuffixIndex


def tree(index: SuffixIndex, lo: int, hi: int, nodes: int, depth: int, min_prob: float,
         max_occurrences: int = 4096) -> tuple[list[int], list[int]]:
    """Up to `nodes` continuations of the occurrences sa[lo:hi], best first by their share of the
    occurrences (>= min_prob), at most `depth` deep: (tokens, parents)."""
    ids = np.arange(lo, hi)
    if len(ids) > max_occurrences:
        ids = ids[np.linspace(0, len(ids) - 1, max_occurrences).astype(np.int64)]
    pos = (index.n - 1 - index.sa[ids]).astype(np.int64)
    total, tokens, parents, heap, count = len(pos), [], [], [], 0

    def push(parent: int, at: np.ndarray, d: int) -> None:
        nonlocal count
        if d >= depth:
            return
        nxt = index.fwd[at + d + 1]
        vals, counts = np.unique(nxt[nxt != SEP], return_counts=True)
        for v, c in zip(vals, counts):
            if c / total >= min_prob:
                count += 1
                heapq.heappush(heap, (-c / total, int(v), count, parent, at[nxt == v], d))

    push(-1, pos, 0)
    while heap and len(tokens) < nodes:
        _, v, _, parent, at, d = heapq.heappop(heap)
        tokens.append(v - 1)
        parents.append(parent)
        push(len(tokens) - 1, at, d + 1)
    return tokens, parents


def accepted(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """The longest path of the draft that greedy verification keeps against the target's tokens."""
    depth, best = {}, 0
    for i, (t, p) in enumerate(zip(tokens, parents)):
        d = 0 if p == -1 else depth.get(p, -1)
        depth[i] = d + 1 if d >= 0 and d < len(truth) and truth[d] == t else -1
        best = max(best, depth[i])
    return best


def greedy_answers(questions: int, max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, answers): SmolLM2's greedy answers to the first `questions` Spec-Bench first turns
    (shuffled with seed 0) through its chat template, as token ids."""
    qs = read_questions()
    random.Random(0).shuffle(qs)
    llm = LLM(model=str(smollm2_gguf()), enable_prefix_caching=False)
    prompts = [chat_prompt(llm.tokenizer, q["prompt"]) for q in qs[:questions]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=max_tokens))
    return prompts, [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=80, help="Spec-Bench questions (shuffled with seed 0)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts, answers = greedy_answers(args.questions, args.max_tokens)
    store = load_datastore(MODELS_DIR / "smollm2-suffix")
    print(f"{len(answers)} answers, {sum(map(len, answers))} tokens (SmolLM2 greedy)")

    def draft(seq: list[int], depth: int, nodes: int, factor: float, min_prob: float):
        arr = np.asarray(seq, dtype=np.int64)
        own, n = match(arr, depth, 4, 2)
        if n:
            return own.tolist(), list(range(-1, len(own) - 1))
        lo, hi, m = store.match(arr[-24:])
        if not m:
            return [], []
        limit = min(depth, max(1, math.floor(factor * m)))
        if nodes == 0:
            chain = store.continue_chain(lo, hi, m, limit, min_prob)[0]
            return chain, list(range(-1, len(chain) - 1))
        return tree(store, lo, hi, nodes, limit, min_prob)

    for depth, nodes in ((2, 0), (3, 0), (4, 0), (2, 2), (2, 4), (2, 6), (3, 4), (3, 6), (4, 8)):
        for min_prob in (0.2, 0.1):
            for factor in (0.5, 1.0):
                steps = emitted = drafted = 0
                for prompt, out in zip(prompts, answers):
                    t = 0
                    while t < len(out):
                        tokens, parents = draft(prompt + out[:t], depth, nodes, factor, min_prob)
                        e = min(accepted(tokens, parents, out[t:]) + 1, len(out) - t)
                        steps, emitted, drafted, t = steps + 1, emitted + e, drafted + len(tokens), t + e
                shape = f"chain of <= {depth}" if nodes == 0 else f"tree of <= {nodes} nodes, depth <= {depth}"
                print(f"{shape:32s} min_prob {min_prob}  spec_factor {factor}:  tau {emitted / steps:.3f}  "
                      f"mean drafted {drafted / steps:.2f}", flush=True)


if __name__ == "__main__":
    main()
