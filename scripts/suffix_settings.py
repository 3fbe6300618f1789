"""Choose suffix decoding's settings for SmolLM2 on held-out validation prompts (not Spec-Bench).

The prompts are the greedy ones of the answers folder's validation shard (shard 0, left out of
the datastore and of the learned drafters' training); each runs alone, 128 new tokens with EOS
ignored, timed by the process's CPU clock on one thread, against plain decoding and ngram K = 4:

    python scripts/suffix_settings.py --data runs/chat/answers --prompts 24
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from specdec import LLM, SamplingParams, kernels
from specdec.bench.machine import cpu_model
from specdec.train.answers import load_answer_shards


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="answers folder from `specdec train answers`")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    kernels.set_threads(1)
    shards = sorted(Path(args.data).glob("shard_*.pt"))
    if not shards:
        raise SystemExit(f"{args.data}: no answer shards")
    d = load_answer_shards(shards[:1], hidden=False)
    offs, plens, greedy = d["offsets"].tolist(), d["prompt_lens"].tolist(), d["greedy"].tolist()
    prompts = [{"prompt_token_ids": d["tokens"][offs[i]:offs[i] + plens[i]].tolist()}
               for i in range(len(plens)) if greedy[i]][:args.prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    def timed(llm):
        t = time.process_time()
        outs = [llm.generate([p], params)[0] for p in prompts]
        return time.process_time() - t, outs

    plain = LLM(num_speculative_tokens=0, enable_prefix_caching=False)
    t_plain, ref = timed(plain)
    variants = [("ngram K=4", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4})]
    for k in (2, 3, 4, "auto"):
        for p, f in ((0.2, 0.5), (0.1, 1.0)):
            variants.append((f"suffix K={k} min_token_prob={p} max_spec_factor={f}",
                             {"method": "suffix", "num_speculative_tokens": k, "suffix_decoding_max_cached_requests": 0,
                              "suffix_decoding_min_token_prob": p, "suffix_decoding_max_spec_factor": f}))
    print(f"{len(prompts)} validation prompts, {args.max_tokens} tokens each, one thread, CPU clock, {cpu_model()}")
    print("| variant | speedup over plain | tau | greedy = plain |\n|---|---|---|---|")
    for name, cfg in variants:
        t, outs = timed(LLM(speculative_config=cfg, enable_prefix_caching=False))
        tok = sum(o.stats.output_tokens for o in outs)
        steps = sum(o.stats.target_forward_passes for o in outs)
        same = all(o.outputs[0].token_ids == r.outputs[0].token_ids for o, r in zip(outs, ref))
        print(f"| {name} | {t_plain / t:.3f}x | {tok / steps:.3f} | {'yes' if same else 'NO'} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
