"""Suffix decoding's settings for SmolLM2 again, after vLLM's floor(factor x match) rule (1870d6f).

The default (K = 2, min_token_prob 0.2, max_spec_factor 0.5) was chosen when a 1-token match still
drafted one token (max(1, ...)); with the floor rule it drafts none. This reruns the comparison on
prompts of the training distribution (not Spec-Bench), made fresh by `specdec train prompts`:

    specdec train prompts --out /tmp/valprompts --count 120 --seed 11 --self-instruct 0
    python scripts/suffix_floor_retune.py --prompts /tmp/valprompts/prompts.jsonl --num 30

Each variant answers every prompt alone (chat template, 128 tokens, EOS ignored), timed by the
process's CPU clock on one thread, in rounds with plain decoding in each round.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specdec import LLM, SamplingParams, kernels
from specdec.bench.machine import cpu_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", required=True, help="prompts.jsonl from `specdec train prompts`")
    ap.add_argument("--num", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    kernels.set_threads(1)
    rows = [json.loads(line) for line in open(args.prompts)][:args.num]
    msgs = [[{"role": "user", "content": r["prompt"]}] for r in rows]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)

    def run(llm):
        t = time.process_time()
        outs = [llm.chat(m, params)[0] for m in msgs]
        return time.process_time() - t, outs

    plain = LLM(num_speculative_tokens=0, enable_prefix_caching=False)
    run(plain)                                    # warm-up
    variants = []
    for k, p, f in ((2, 0.2, 0.5), (2, 0.2, 1.0), (2, 0.1, 1.0), (2, 0.2, 0.75), (3, 0.2, 1.0)):
        cfg = {"method": "suffix", "num_speculative_tokens": k, "suffix_decoding_min_token_prob": p,
               "suffix_decoding_max_spec_factor": f, "suffix_decoding_max_cached_requests": 0}
        variants.append((f"K={k} min_token_prob={p} max_spec_factor={f}", LLM(speculative_config=cfg,
                                                                               enable_prefix_caching=False)))
    _, ref = run(plain)
    res = {name: [] for name, _ in variants}
    base = []
    for _ in range(args.rounds):
        base.append(run(plain)[0])
        for name, llm in variants:
            t, outs = run(llm)
            same = all(o.outputs[0].token_ids == r.outputs[0].token_ids for o, r in zip(outs, ref))
            tpf = sum(o.stats.output_tokens for o in outs) / sum(o.stats.target_forward_passes for o in outs)
            res[name].append((t, tpf, same))
    print(f"{len(msgs)} prompts, 128 tokens each, one thread, CPU clock, {args.rounds} rounds, {cpu_model()}")
    print("| variant | speedup over plain, each round | tokens per target forward | greedy = plain |\n|---|---|---|---|")
    for name, v in res.items():
        rounds = " / ".join(f"{b / t:.3f}x" for b, (t, _, _) in zip(base, v))
        print(f"| {name} | {rounds} | {v[0][1]:.3f} | {'yes' if all(s for *_, s in v) else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
