"""Does a bigger suffix datastore pay? tau of suffix decoding (the default method's settings)
on Spec-Bench first turns, greedy, with a fraction of the bundled datastore's documents (the
first ones, re-indexed) against all of it.

    python scripts/suffix_size.py --fractions 0.25,0.5,1 --questions 40

tau here = output tokens / target forwards over the decode (each request's prefill forward
counts too, the same for every fraction). Timing plays no part.
"""
from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import numpy as np
import torch

from specdec import LLM, SamplingParams
from specdec.bench.spec_bench import chat_prompt, read_questions
from specdec.defaults import MODELS_DIR, SMOLLM2_SPECULATIVE
from specdec.proposers.suffix import load_datastore, save_datastore
from specdec.proposers.suffix_index import SuffixIndex


def documents(index: SuffixIndex) -> list[np.ndarray]:
    """The indexed documents back as token ids (the corpus stores ids + 1, 0 before each)."""
    fwd = index.fwd[:index.n]
    seps = np.flatnonzero(fwd == 0)
    ends = list(seps[1:]) + [len(fwd)]
    return [fwd[a + 1:b] - 1 for a, b in zip(seps, ends) if b > a + 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fractions", default="0.25,0.5,1")
    ap.add_argument("--questions", type=int, default=40, help="Spec-Bench questions (shuffled with seed 0)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bundled = MODELS_DIR / "smollm2-suffix"
    full = load_datastore(bundled)
    docs = documents(full)
    print(f"bundled datastore: {len(docs)} documents, {sum(map(len, docs))} tokens", flush=True)
    qs = read_questions()
    random.Random(0).shuffle(qs)
    with tempfile.TemporaryDirectory() as tmp:
        for frac in (float(f) for f in args.fractions.split(",")):
            sub = docs[: int(len(docs) * frac)]
            path = bundled
            if frac < 1:
                path = Path(tmp) / f"suffix_{frac}"
                save_datastore(SuffixIndex.build(sub, full.depth), path)
            llm = LLM(model=None, speculative_config={**SMOLLM2_SPECULATIVE, "model": str(path)}, enable_prefix_caching=False)
            prompts = [{"prompt_token_ids": chat_prompt(llm.tokenizer, q["prompt"])} for q in qs[:args.questions]]
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens))
            tokens = sum(o.stats.output_tokens for o in outs)
            forwards = sum(o.stats.target_forward_passes for o in outs)
            print(f"fraction {frac}: {sum(map(len, sub))} tokens, tau {tokens / forwards:.3f} "
                  f"({tokens} output tokens / {forwards} target forwards)", flush=True)
            llm.shutdown()


if __name__ == "__main__":
    main()
