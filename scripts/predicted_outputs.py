"""Target forwards per reply with and without OpenAI's Predicted Outputs (specdec/prediction.py):
the same greedy reply decoded plainly, speculatively, and speculatively with a prediction that is
the reply itself, the reply with a few tokens edited, and random tokens.

    python scripts/predicted_outputs.py --model models/target --method ngram --k 4 --max-tokens 60
"""
from __future__ import annotations

import argparse

import numpy as np

from specdec import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/target")
    ap.add_argument("--method", default="ngram")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=60)
    ap.add_argument("--prompt", default="def add(a, b):")
    args = ap.parse_args()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    plain = LLM(args.model).engine
    spec = LLM(args.model, speculative_config={"method": args.method, "num_speculative_tokens": args.k}).engine
    prompt = plain.tokenizer.encode(args.prompt)

    def run(engine, prediction=None):
        r = engine.add_request(prompt, params, prediction=prediction)
        while engine.has_unfinished():
            engine.step()
        return r

    base = run(plain)
    out = list(base.out)
    rng = np.random.default_rng(0)
    cut = len(out) // 3
    rows = [("plain decoding", base), (f"{args.method} K={args.k}", run(spec)),
            ("+ prediction: the reply", run(spec, out)),
            ("+ prediction: the reply, 3 tokens edited", run(spec, out[:cut] + [3, 4, 5] + out[cut + 3:])),
            ("+ prediction: random tokens", run(spec, rng.integers(0, len(plain.tokenizer), len(out)).tolist()))]
    print(f"{args.model}, {len(out)}-token greedy reply to {args.prompt!r}")
    print("| run | target forwards | accepted prediction tokens | reply identical |\n|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r.stats.target_forward_passes} | {r.stats.accepted_prediction_tokens} | {r.out == out} |")


if __name__ == "__main__":
    main()
