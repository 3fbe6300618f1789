""""auto" speculation where every forward costs a fixed time whatever it feeds: a GPU's host-bound
regime (bench/gpu-h100/2026-12-05: SmolLM2's 30-layer forward took 10.4 ms on an H100 at batch 1
for one token or five), emulated on the CPU by a pause added to each call of the target and of
the EAGLE head, with the real model's weights and so its real acceptance.

Each call of the target waits --target-ms on top of its own time, each head call --head-ms; the
EAGLE chain is drafted one head call per token as on a GPU (forward.c's one-call chain is turned
off). One client at a time, Spec-Bench questions, greedy: tokens/s of plain decoding, of fixed K
and of "auto", and each one's greedy output against plain's.

    PYTHONPATH=. python scripts/hostbound_auto.py --target-ms 10 --head-ms 1.5 --prompts 8
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specdec import LLM, SamplingParams
from specdec.bench.spec_bench import chat_prompt, read_questions
from specdec.defaults import smollm2_gguf
from specdec.proposers import eagle as eagle_module


def slowed(module: torch.nn.Module, ms: float, calls: list) -> None:
    """module's forward waits `ms` more per call (counted in calls[0])."""
    forward = module.forward

    def slow(*a, **k):
        calls[0] += 1
        end = time.perf_counter() + ms / 1000
        out = forward(*a, **k)
        while time.perf_counter() < end:     # a busy wait: sleep's wake-up lag would add noise
            pass
        return out

    module.forward = slow


def run(name: str, spec: dict | None, prompts: list[list[int]], args) -> dict:
    llm = LLM(args.model, speculative_config=spec, num_speculative_tokens=0 if spec is None else None,
              max_num_seqs=1, enable_prefix_caching=False)
    target_calls, head_calls = [0], [0]
    slowed(llm.target, args.target_ms, target_calls)
    proposer = llm.engine.proposer
    if proposer is not None and hasattr(proposer, "head"):
        slowed(proposer.head, args.head_ms, head_calls)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.generate([{"prompt_token_ids": prompts[-1]}], SamplingParams(temperature=0, max_tokens=8))    # warm-up
    outs, t0 = [], time.perf_counter()
    for p in prompts:                       # one client
        outs.append(llm.generate([{"prompt_token_ids": p}], greedy)[0])
    wall = time.perf_counter() - t0
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    passes = sum(o.stats.target_forward_passes for o in outs)
    row = {"method": name, "tok_per_s": round(toks / wall, 1), "tokens": toks, "passes": passes,
           "tokens_per_pass": round(toks / passes, 3), "draft_tokens": sum(o.stats.draft_tokens for o in outs),
           "head_calls": head_calls[0], "ms_per_pass": round(1000 * wall / passes, 2),
           "outputs": [list(o.outputs[0].token_ids) for o in outs]}
    policy = getattr(llm.engine.policy, "goodput", None) or getattr(llm.engine.policy, "policy", None)
    if policy is not None and hasattr(policy, "target"):
        row["fit"] = {"target_w": [round(float(x) * 1000, 3) for x in policy.target.w],
                      "draft_w": [round(float(x) * 1000, 3) for x in policy.draft.w]}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--target-ms", type=float, default=10.0)
    p.add_argument("--head-ms", type=float, default=1.5)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--methods", default="plain,eagle1,eagle2,eagle4,eagle_auto,suffix_auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    args.model = args.model or str(smollm2_gguf())
    eagle_module.EagleProposer._c_chain_ok = lambda self: None       # one head call per draft token, as on a GPU
    llm = LLM(args.model, num_speculative_tokens=0, enable_prefix_caching=False)
    qs = read_questions(limit_per_category=1)
    prompts = [chat_prompt(llm.tokenizer, q["prompt"]) for q in qs][:args.prompts]
    del llm
    specs = {"plain": None, "suffix_auto": {"method": "suffix", "num_speculative_tokens": "auto"},
             "eagle_auto": {"method": "eagle", "num_speculative_tokens": "auto"}}
    for k in (1, 2, 3, 4, 6):
        specs[f"eagle{k}"] = {"method": "eagle", "num_speculative_tokens": k}
        specs[f"suffix{k}"] = {"method": "suffix", "num_speculative_tokens": k}
    rows, plain = [], None
    for name in args.methods.split(","):
        row = run(name, specs[name], prompts, args)
        plain = plain if plain is not None else row
        row["x_plain"] = round(row["tok_per_s"] / plain["tok_per_s"], 3)
        row["identical"] = row["outputs"] == plain["outputs"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "outputs"}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]}, f,
                      indent=1)


if __name__ == "__main__":
    main()
