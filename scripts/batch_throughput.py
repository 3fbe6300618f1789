"""Decode-phase throughput of the batch engine at several concurrencies, and where a step's time goes.

For each method (plain, and a speculative config if given) and each concurrency B it starts B
greedy requests, waits until every one has its first token (prefill done), then times the rest
of their decoding: tokens per wall second and per CPU second of this process (the second is
less sensitive to other jobs on a shared machine). Methods and concurrencies are interleaved
in one process and the best of --repeats is kept, so ratios come from one run.

    python scripts/batch_throughput.py --model models/target --dtype bfloat16 --batch 1,4,16 \\
        --speculative-model models/draft --num-speculative-tokens 4 --repeats 4
    python scripts/batch_throughput.py --model SmolLM2-135M-Instruct.Q4_1.gguf --breakdown 16

--breakdown B instead times one plain step at concurrency B by component (timers around the
model's matrices, the LM head, norms, attention, and the engine's phases).
"""
from __future__ import annotations

import argparse
import collections
import json
import time

import torch

from specdec import LLM, SamplingParams

PROMPTS = [f"def function_{i}(x, y):\n    \"\"\"Return the {i}th combination of x and y.\"\"\"\n" for i in range(64)]


def decode_rates(llm, n: int, max_tokens: int) -> tuple[float, float]:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [engine.add_request(llm.tokenizer.encode(p), params) for p in PROMPTS[:n]]
    while not all(r.out for r in reqs):
        engine.step()
    t, c, start = time.perf_counter(), time.process_time(), sum(len(r.out) for r in reqs)
    while engine.has_unfinished():
        engine.step()
    done = sum(len(r.out) for r in reqs) - start
    return done / (time.perf_counter() - t), done / (time.process_time() - c)


def breakdown(llm, B: int, steps: int = 30) -> dict:
    from specdec import engine as engine_mod
    from specdec.kernels import cforward
    from specdec.model import llama, quant

    spent = collections.Counter()

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            spent[name] += time.perf_counter() - t
            return out
        return wrapper

    head = llm.target.lm_head
    for mod in llm.target.modules():
        if isinstance(mod, (llama.Linear, quant.QuantLinear)):
            mod.forward = timed("lm_head" if mod is head else "matrices (layers)", mod.forward)
        elif isinstance(mod, llama.RMSNorm):
            mod.forward = timed("norms", mod.forward)
    cforward.CAttention.__call__ = timed("attention (forward.c)", cforward.CAttention.__call__)
    cforward.forward = timed("whole forward in C", cforward.forward)
    engine = llm.engine
    engine._forward = timed("engine: target forward", engine._forward)
    engine._propose = timed("engine: propose", engine._propose)
    engine_mod.verify_batch = timed("engine: verify", engine_mod.verify_batch)
    params = SamplingParams(temperature=0, max_tokens=steps + 40, ignore_eos=True)
    reqs = [engine.add_request(llm.tokenizer.encode(p), params) for p in PROMPTS[:B]]
    while not all(len(r.out) > 3 for r in reqs):
        engine.step()
    spent.clear()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step = (time.perf_counter() - t) / steps
    ms = {k: round(v / steps * 1e3, 2) for k, v in spent.items()}
    inside = sum(v for k, v in ms.items() if not k.startswith("engine") and k != "whole forward in C")
    ms["forward: the rest (embedding, RoPE, residuals, SiLU, Python)"] = round(
        ms["engine: target forward"] - inside - ms.get("whole forward in C", 0.0), 2)
    return {"B": B, "step_ms": round(step * 1e3, 2), "tokens_per_s": round(B / step, 1), "ms_per_step": ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/target")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--speculative-model")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--batch", default="1,4,16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--breakdown", type=int, help="time one plain step at this concurrency by component")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ns = [int(x) for x in args.batch.split(",")]
    common = dict(model=args.model, dtype=args.dtype, max_num_seqs=max(ns + [args.breakdown or 1]), max_model_len=512)
    if args.breakdown:
        print(json.dumps(breakdown(LLM(num_speculative_tokens=0, **common), args.breakdown)))
        return
    llms = {"plain": LLM(num_speculative_tokens=0, **common)}
    if args.speculative_model:
        llms[f"draft_model K={args.num_speculative_tokens}"] = LLM(
            speculative_model=args.speculative_model, num_speculative_tokens=args.num_speculative_tokens, **common)
    for llm in llms.values():
        llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    wall, cpu = collections.defaultdict(list), collections.defaultdict(list)
    for _ in range(args.repeats):
        for name, llm in llms.items():
            for n in ns:
                w, c = decode_rates(llm, n, args.max_tokens)
                wall[name, n].append(w)
                cpu[name, n].append(c)
    for name in llms:
        base_w, base_c = max(wall[name, ns[0]]), max(cpu[name, ns[0]])
        row = {f"B={n}": {"tokens_per_s": round(max(wall[name, n]), 1), "x_wall": round(max(wall[name, n]) / base_w, 2),
                          "per_cpu_s": round(max(cpu[name, n]), 1), "x_cpu": round(max(cpu[name, n]) / base_c, 2)}
               for n in ns}
        print(json.dumps({"method": name, **row}))


if __name__ == "__main__":
    main()
