"""Would suffix decoding accept more at temperature > 0 if it drew its drafts from the datastore's
counts instead of proposing their most frequent token? An offline answer, on SmolLM2 and the
bundled datastore (models/smollm2-suffix), for the first drafted token.

Suffix decoding drafts deterministically (a point-mass q on the most frequent continuation), so
a draft x is accepted with probability p(x) when sampling. Drawing x from a distribution q (the
continuation counts at the matched node, possibly sharpened: counts^(1/tau)) is accepted with
probability sum_x min(p(x), q(x)) (Leviathan et al.). For each Spec-Bench question (first turn,
chat template), the target answers at T = 0.7 / top-p 0.95 (seeded, 128 tokens); at each answer
position the proposer's own first-token draft is computed as `suffix` computes it (the request's
own context first, then the datastore's longest match of the tail, min_token_prob 0.1), and p is
the target's processed distribution there (the dequantized weights, teacher-forced). Prints the
mean acceptance of the first draft per q, overall and by match length and occurrence count.

    python scripts/suffix_sampled_q.py --questions 16
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from specdec import LLM, SamplingParams
from specdec.bench.machine import cpu_model
from specdec.config import SamplingParams as Params
from specdec.defaults import smollm2_gguf
from specdec.model import load_model
from specdec.proposers.ngram import match
from specdec.proposers.suffix import load_datastore
from specdec.proposers.suffix_index import SEP
from specdec.sampling import process
from specdec.tokenizer import Tokenizer
from specdec.train.answers import chat_ids
from specdec.train.chatdata import SPEC_BENCH

SHARPEN = {"counts": 1.0, "counts^(1/0.7)": 0.7, "counts^2": 0.5, "counts^(1/0.35)": 0.35}


def first_draft(ds, seq: np.ndarray, depth: int = 24, min_prob: float = 0.1):
    """("own", token) from the request's own context, ("ds", (tokens, counts, match length)) from
    the datastore, or None: what `suffix` would draft first here."""
    own, n = match(seq, 1, 4, 2)
    if n:
        return "own", int(own[0])
    lo, hi, m = ds.match(seq[-depth:])
    if not m:
        return None
    idx = np.arange(lo, hi)
    if len(idx) > 4096:          # the proposer's spread of a very frequent short match
        idx = idx[np.linspace(0, len(idx) - 1, 4096).astype(np.int64)]
    nxt = ds.fwd[(ds.n - 1 - ds.sa[idx]).astype(np.int64) + 1]
    vals, counts = np.unique(nxt[nxt != SEP], return_counts=True)
    if not len(vals) or counts.max() / len(idx) < min_prob:
        return None
    return "ds", (torch.from_numpy(vals - 1), torch.from_numpy(counts).double(), int(m), len(idx))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=16, help="an even spread of Spec-Bench's questions")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    gguf = str(smollm2_gguf())
    tok, ds = Tokenizer(gguf), load_datastore("models/smollm2-suffix")
    qs = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines()]
    qs = qs[::max(1, len(qs) // args.questions)][:args.questions]
    llm, dense = LLM(gguf, enable_prefix_caching=False), load_model(gguf, "float32", quantization="none")
    params = Params(temperature=args.temperature, top_p=args.top_p)
    own, rows, none = [], [], 0
    for i, q in enumerate(qs):
        ids = chat_ids(tok, q["turns"][0])
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                                                     max_tokens=args.max_tokens, seed=i))[0]
        full = ids + list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = dense(torch.tensor([full])).logits[0]
        for t in range(len(ids), len(full)):
            d = first_draft(ds, np.asarray(full[:t], dtype=np.int64))
            if d is None:
                none += 1
                continue
            p = process(logits[t - 1][None].float(), params)[0]
            if d[0] == "own":
                own.append(float(p[d[1]]))
                continue
            toks, counts, m, occ = d[1]
            r = {"m": m, "occ": occ, "point mass (today)": float(p[toks[int(counts.argmax())]])}
            for name, tau in SHARPEN.items():
                w = counts ** (1 / tau)
                r[name] = float(torch.minimum(p[toks], (w / w.sum()).float()).sum())
            rows.append(r)
    keys = ["point mass (today)", *SHARPEN]
    print(f"{cpu_model()}; {len(qs)} Spec-Bench questions, T={args.temperature}, top-p {args.top_p}, "
          f"{args.max_tokens} tokens; first drafts: {len(own)} from the request's own context (acceptance "
          f"{np.mean(own):.3f}), {len(rows)} from the datastore, {none} positions without a draft\n")
    print("| datastore drafts | n | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    span = lambda a, b: f"{a}+" if b is None else f"{a}-{b - 1}"  # noqa: E731
    groups = [("all", rows)] + [(f"match {span(a, b)}", [r for r in rows if a <= r["m"] < (b or 1 << 30)])
                                for a, b in ((1, 2), (2, 4), (4, 8), (8, None))]
    groups += [(f"{span(a, b)} occurrences", [r for r in rows if a <= r["occ"] < (b or 1 << 30)])
               for a, b in ((1, 4), (4, 16), (16, None))]
    for name, sel in groups:
        if sel:
            print(f"| {name} | {len(sel)} | " + " | ".join(f"{np.mean([r[k] for r in sel]):.3f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
