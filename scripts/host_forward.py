"""Host time of one forward on the PyTorch path (a GPU's: C kernels off, padded attention) where
the arithmetic is negligible: a 30-layer model of SmolLM2's depth with tiny matrices (hidden 64),
one thread, wall clock, the median of --repeats. What is left is what a host-bound GPU pays per
forward: Python and PyTorch dispatch per op (bench/gpu-h100/2026-12-05: 10.4 ms a SmolLM2 step).

    PYTHONPATH=. python scripts/host_forward.py [--shapes 1x1,1x5,8x1,16x1] [--repeats 200]
    PYTHONPATH=. python scripts/host_forward.py --plans --shapes 1x5,16x1,64x1 --context 500

A shape BxT: B sequences feeding T tokens each after --context cached ones (1x5: verifying 4
drafts). --plans times instead the host work that lays a forward out: the eager padded path's
attention plan (AttentionPlan.of) and a CUDA graph's static inputs (model/graphs.py), median us.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["SPECDEC_KERNELS"] = "0"

import torch  # noqa: E402

from specdec.model import BlockManager, ForwardBatch  # noqa: E402
from specdec.model import batch as batch_module  # noqa: E402
from specdec.model.config import ModelConfig  # noqa: E402
from specdec.model.llama import Transformer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1x1,1x5,8x1,16x1")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--context", type=int, default=100)
    p.add_argument("--plans", action="store_true", help="time the host work of laying a forward out, not the forward")
    args = p.parse_args()
    batch_module.PADDED = True
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=30,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    model = Transformer(cfg).eval().requires_grad_(False)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    most = max(b for b, _ in shapes)
    span = args.context + max(t for _, t in shapes)
    per_seq = -(-span // 16)
    blocks = BlockManager(most * per_seq, 16, most, per_seq)
    try:
        kv = model.new_kv(blocks, spare=True)       # the graphs' spare block (--plans)
    except TypeError:                               # an older checkout: no graphs, no spare block
        kv = model.new_kv(blocks)
    seqs = list(range(most))
    for s in seqs:
        blocks.add(s)
        blocks.ensure(s, span)
    if args.plans:
        plans(kv, model, seqs, shapes, args)
        return
    with torch.inference_mode():
        model(torch.randint(0, 512, (most * args.context,)), kv, ForwardBatch.build(kv, seqs, [args.context] * most, [0] * most))
        for B, T in shapes:
            batch = ForwardBatch.build(kv, seqs[:B], [T] * B, [args.context] * B)
            tokens = torch.randint(0, 512, (B * T,))
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                model(tokens, kv, batch)
                times.append(time.perf_counter() - t0)
            print(f"{B} sequences x {T} tokens: {statistics.median(times) * 1e3:.2f} ms a forward", flush=True)


def plans(kv, model, seqs, shapes, args) -> None:
    from specdec.model.batch import AttentionPlan
    try:
        from specdec.model.graphs import CudaGraphs
        graphs = CudaGraphs(model, kv, emulate=True)
    except ImportError:         # an older checkout (PYTHONPATH=a worktree), before the graphs
        graphs = None
    for B, T in shapes:
        batch = ForwardBatch.build(kv, seqs[:B], [T] * B, [args.context] * B)
        tokens = torch.zeros(B * T, dtype=torch.long)
        parts = [("attention plan", lambda: AttentionPlan.of(batch, kv, "cpu", 64, padded=True))]
        if graphs is not None:
            bucket = graphs.key(batch, True, False)[:3]
            parts.append(("graph inputs", lambda: graphs._host_inputs(tokens, batch, *bucket)))
        out = {}
        for name, fn in parts:
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            out[name] = statistics.median(times) * 1e6
        print(f"{B} sequences x {T} tokens: " + ", ".join(f"{k} {v:.0f} us" for k, v in out.items()), flush=True)


if __name__ == "__main__":
    main()
