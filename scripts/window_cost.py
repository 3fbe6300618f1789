"""What a sliding window saves a decoding step: one token's forward at several context lengths,
for a model with Gemma 3's layout (5 sliding layers in 6) and the same model with the windows
taken away (full attention everywhere), random weights, one thread, the process's CPU clock,
the two timed in turn.

The C attention skips the cache blocks before each token's window (kernels/attention.c), so the
windowed layers' cost stops growing once the context passes the window; the full-attention
layers' keeps growing. Prints a markdown table (ms per step, median of --repeats) and the CPU.

    python scripts/window_cost.py --contexts 512,2048,6000 --window 512
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="512,2048,6000")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    from conftest import make_checkpoint
    from specdec import kernels
    from specdec.bench.machine import machine_info
    from specdec.model import BlockManager, ForwardBatch, load_model

    torch.set_num_threads(1)
    kernels.set_threads(1)
    contexts = [int(c) for c in args.contexts.split(",")]
    longest = max(contexts) + 1
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_checkpoint(Path(tmp) / "m", arch="gemma3_text", hidden=args.hidden, layers=args.layers,
                             sliding_window=args.window, num_attention_heads=4, num_key_value_heads=1,
                             max_position_embeddings=longest + 16)
        models, caches = {}, {}
        for name in ("windowed", "full"):
            model = models[name] = load_model(hf, "float32")
            if name == "full":
                for layer in model.model.layers:
                    layer.self_attn.window = None
            blocks = BlockManager(longest // 16 + 2, 16, 1, longest // 16 + 2)
            caches[name] = model.new_kv(blocks)
            blocks.add(0)
            blocks.ensure(0, longest)
        tokens = torch.randint(0, 200, (longest,))
        rows, done = {}, 0
        for ctx in contexts:
            for name, model in models.items():        # prefill both up to this context, in chunks
                kv, at = caches[name], done
                while at < ctx:
                    n = min(512, ctx - at)
                    model(tokens[at:at + n], kv, ForwardBatch.build(kv, [0], [n], [at]), logits=False)
                    at += n
                    kv.set_length(0, at)
            done = ctx
            times = {name: [] for name in models}
            for _ in range(args.repeats):                # the two interleaved
                for name, model in models.items():
                    kv = caches[name]
                    t0 = time.process_time()
                    model(tokens[ctx:ctx + 1], kv, ForwardBatch.build(kv, [0], [1], [ctx]))
                    times[name].append(time.process_time() - t0)
            rows[ctx] = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    info = machine_info()
    print(f"CPU: {info['cpu']} (kernels: {info['kernels']}); one thread; {args.layers} layers of hidden {args.hidden}, "
          f"window {args.window} in 5 layers of 6; `python scripts/window_cost.py --contexts {args.contexts} "
          f"--window {args.window}`\n")
    print("| context | windowed (ms/step) | full attention | full / windowed |\n|---|---|---|---|")
    for ctx, r in rows.items():
        print(f"| {ctx} | {r['windowed']:.2f} | {r['full']:.2f} | {r['full'] / r['windowed']:.2f}x |")


if __name__ == "__main__":
    main()
