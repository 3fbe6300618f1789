"""Does suffix decoding's datastore gain from more of the target's answers? An offline replay:
SmolLM2's greedy answers to Spec-Bench first turns (plain decoding, generated once), then every
step's draft by the default method's lookup (the request's own context first, then the
datastore) against datastores built from random fractions of the bundled one's documents, and
the tokens a greedy verification keeps. Reports tau (tokens per target forward) per datastore
size at chains of up to 2 (the default K) and 3. Timing plays no part.

    python scripts/suffix_datastore_size.py --questions 80 --fractions 0,0.125,0.25,0.5,1
"""
from __future__ import annotations

import argparse
import math
import random

import numpy as np
import torch

from specdec.defaults import MODELS_DIR
from specdec.proposers.ngram import match
from specdec.proposers.suffix import load_datastore
from specdec.proposers.suffix_index import SEP, SuffixIndex
from suffix_trees import greedy_answers      # scripts/: the same answers as the trees' replay

MIN_PROB, SPEC_FACTOR = 0.2, 0.5        # the default model's suffix settings


def documents(index: SuffixIndex) -> list[np.ndarray]:
    """The datastore's documents (token ids) back from its text."""
    text = index.fwd[:index.n].astype(np.int64)
    cuts = np.flatnonzero(text == SEP)
    return [text[a + 1:b] - 1 for a, b in zip(cuts[:-1], cuts[1:]) if b > a + 1]


def tau(index: SuffixIndex | None, prompts: list[list[int]], answers: list[list[int]], depth: int) -> float:
    steps = emitted = 0
    for prompt, out in zip(prompts, answers):
        t = 0
        while t < len(out):
            seq = np.asarray(prompt + out[:t], dtype=np.int64)
            own, n = match(seq, depth, 4, 2)
            if n:
                chain = own.tolist()
            elif index is None:             # no datastore: the request's own context only
                chain = []
            else:
                lo, hi, m = index.match(seq[-24:])
                chain = index.continue_chain(lo, hi, m, min(depth, max(1, math.floor(SPEC_FACTOR * m))),
                                             MIN_PROB)[0] if m else []
            kept = 0
            while kept < len(chain) and t + kept < len(out) and chain[kept] == out[t + kept]:
                kept += 1
            e = min(kept + 1, len(out) - t)
            steps, emitted, t = steps + 1, emitted + e, t + e
    return emitted / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=80, help="Spec-Bench questions (shuffled with seed 0)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--fractions", default="0,0.125,0.25,0.5,1",
                    help="shares of the datastore's documents (0: none, the request's own context only)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts, answers = greedy_answers(args.questions, args.max_tokens)
    store = load_datastore(MODELS_DIR / "smollm2-suffix")
    docs = documents(store)
    print(f"{len(answers)} answers, {sum(map(len, answers))} tokens (SmolLM2 greedy); "
          f"datastore: {len(docs)} documents, {sum(map(len, docs))} tokens")
    print("| share of the documents | tokens | tau, chains of <= 2 | chains of <= 3 |\n|---|---|---|---|")
    rng = random.Random(1)
    for frac in (float(x) for x in args.fractions.split(",")):
        sub = docs if frac >= 1 else rng.sample(docs, int(len(docs) * frac))
        index = store if frac >= 1 else SuffixIndex.build(sub, store.depth) if sub else None
        print(f"| {frac:g} | {sum(map(len, sub))} | {tau(index, prompts, answers, 2):.3f} | "
              f"{tau(index, prompts, answers, 3):.3f} |", flush=True)


if __name__ == "__main__":
    main()
