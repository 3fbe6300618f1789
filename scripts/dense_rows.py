"""The dense products of one SmolLM2-135M forward for M = 1, 5, 9 rows: specdec's skinny kernel
(fp32 or bf16 weights, fp32 activations, every row bit-identical whatever M) against torch's
F.linear on the same weights (fp32; bf16 with bf16 activations, oneDNN), one thread, CPU time.

Each pass runs the 30 layers' four products (q/k/v and gate/up fused, as the runtime does) and
the LM head, each layer its own weight copy, so the weights stream from memory as in a forward
(~296 MB bf16, ~592 MB fp32); ms is the minimum over interleaved repeats.

    nice -n 19 python scripts/dense_rows.py --repeats 7
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from specdec import kernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # qkv, o, gate_up, down [N, K]
HEAD = (49152, 576)


def methods(dtype: torch.dtype, variants: list[str]) -> dict:
    """name -> (one pass over the products for x [M, 1536] fp32)."""
    dims = [s for _ in range(30) for s in SHAPES] + [HEAD]
    weights = [torch.randn(n, k).to(dtype) * 0.02 for n, k in dims]
    packed = [kernels.pack(w) for w in weights]
    out: dict = {}
    for v in variants:
        lib = kernels.load(v)
        out[f"specdec {v}"] = lambda x, lib=lib: [kernels.linear(x[:, :w.shape[1]], w, None, p, lib=lib)
                                                  for w, p in zip(weights, packed)]
    if dtype == torch.bfloat16:
        out["torch bf16 (x in bf16)"] = lambda x: [F.linear(x[:, :w.shape[1]].to(torch.bfloat16), w) for w in weights]
    else:
        out["torch fp32"] = lambda x: [F.linear(x[:, :w.shape[1]], w) for w in weights]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--variants", default="avx512_vnni,avx2", help="specdec kernel variants that run here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    kernels.set_threads(1)
    variants = [v for v in args.variants.split(",") if kernels.load(v) is not None]
    rows = (1, 5, 9)
    print("| weights | method | M=1 ms | M=5 ms | M=9 ms | 5/1 | 9/1 |")
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        ms = methods(dtype, variants)
        best = {(n, m): float("inf") for n in ms for m in rows}
        xs = {m: torch.randn(m, 1536) for m in rows}
        with torch.inference_mode():
            for name, f in ms.items():
                f(xs[1])                                      # warm-up (oneDNN primitives, pages)
            for _ in range(args.repeats):
                for m in rows:
                    for name, f in ms.items():
                        t0 = time.process_time()
                        f(xs[m])
                        best[name, m] = min(best[name, m], time.process_time() - t0)
        for name in ms:
            t = [best[name, m] * 1e3 for m in rows]
            print(f"| {str(dtype).removeprefix('torch.')} | {name} | {t[0]:.2f} | {t[1]:.2f} | {t[2]:.2f} "
                  f"| {t[1] / t[0]:.2f} | {t[2] / t[0]:.2f} |", flush=True)
        del ms


if __name__ == "__main__":
    main()
