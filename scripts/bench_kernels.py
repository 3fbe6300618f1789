"""Skinny products on SmolLM2-135M's shapes: maintained libraries against specdec's kernels.

For each weight shape and row count M it prints ms per call (the minimum over interleaved
repeats, each repeat a pass over copies of the weights totalling --set-mb, so they stream from
memory as a whole model's do rather than sit in L2), the effective bandwidth in weight bytes,
that as a fraction of the measured copy bandwidth, and
whether row i's output is bit-identical whatever M is ("rows" column: speculative verification
needs it for greedy outputs to equal plain decoding).

    python scripts/bench_kernels.py --threads 2 > bench/kernels/<cpu-kind>/table.md

Library methods that fail to build on this machine are listed as skipped, not hidden.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore")
clock = time.perf_counter
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
ROWS = (1, 2, 4, 9, 16, 64)


def _q8_channel(w: torch.Tensor):
    """Symmetric per-output-channel int8 (what the int8 weight-only paths take)."""
    s = w.abs().amax(1).clamp_min(1e-8) / 127
    return torch.round(w / s[:, None]).to(torch.int8), s


def torch_methods(w: torch.Tensor) -> dict:
    """name -> builder() -> (call(x [M, K] fp32) -> [M, N], weight bytes); each builder call makes
    an independent copy of the weights. w [N, K] fp32."""
    N, K = w.shape
    out = {"torch fp32": lambda: _closure(lambda x, w: F.linear(x, w), w.clone(), nbytes=w.numel() * 4),
           "torch bf16 (x bf16)": lambda: _closure(lambda x, w: F.linear(x.bfloat16(), w), w.bfloat16(), nbytes=w.numel() * 2),
           "torch _weight_int8pack_mm": lambda: _closure(lambda x, q, s: torch._weight_int8pack_mm(x, q, s),
                                                         *_q8_channel(w), nbytes=w.numel())}
    for engine in ("fbgemm", "onednn"):
        out[f"torch.ao dynamic int8 ({engine})"] = lambda engine=engine: (_ao_dynamic(w, engine), w.numel())
    try:
        packed, sz = _int4pack(w)
        out["torch _weight_int4pack_mm_for_cpu (x bf16)"] = lambda: _closure(
            lambda x, p, sz: torch._weight_int4pack_mm_for_cpu(x.bfloat16(), p, 32, sz), *_int4pack(w),
            nbytes=w.numel() // 2 + sz.numel() * 2)
    except RuntimeError as e:
        print(f"skipped _weight_int4pack_mm_for_cpu: {e}", file=sys.stderr)
    try:   # on x86 (no KleidiAI) this packs dequantized fp32 weights
        p = torch._dyn_quant_pack_4bit_weight(torch.randint(0, 16, (N, K), dtype=torch.uint8), torch.rand(N, K // 32),
                                              None, 32, K, N)
        torch._dyn_quant_matmul_4bit(torch.randn(1, K), p, 32, K, N)
        out["torch _dyn_quant_matmul_4bit"] = lambda: _closure(lambda x, p: torch._dyn_quant_matmul_4bit(x, p, 32, K, N),
                                                               p.clone(), nbytes=p.numel() * p.element_size())
    except RuntimeError as e:
        print(f"skipped _dyn_quant_matmul_4bit: {str(e).splitlines()[0]}", file=sys.stderr)
    out.update(torchao_methods(w))
    return out


def _closure(fn, *tensors, nbytes: int):
    return (lambda x: fn(x, *tensors)), nbytes


def _ao_dynamic(w: torch.Tensor, engine: str):
    torch.backends.quantized.engine = engine
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data.copy_(w)
    q = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8)

    def call(x):
        torch.backends.quantized.engine = engine
        return q(x)
    return call


def _int4pack(w: torch.Tensor):
    """Asymmetric 4-bit, groups of 32 along K, in the layout of torch's CPU int4 kernel."""
    N, K = w.shape
    g = w.reshape(N, K // 32, 32)
    lo, hi = g.amin(2), g.amax(2)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(N, K)
    zero = lo + 8 * scale        # the kernel computes (q - 8) * scale + zero
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().bfloat16()   # [K/32, N, 2]
    return torch._convert_weight_to_int4pack_for_cpu(q, 1), sz


def torchao_methods(w: torch.Tensor) -> dict:
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_
    except ImportError:
        print("skipped torchao: not installed", file=sys.stderr)
        return {}
    out = {}
    for name, cfg in (("torchao int8 dynamic act+weight", Int8DynamicActivationInt8WeightConfig()),
                      ("torchao int8 weight-only", Int8WeightOnlyConfig())):
        def build(cfg=cfg):
            lin = torch.nn.Sequential(torch.nn.Linear(w.shape[1], w.shape[0], bias=False))
            lin[0].weight.data.copy_(w)
            quantize_(lin, cfg)
            return lin, w.numel()
        try:
            build()[0](torch.randn(2, w.shape[1]))
        except Exception as e:   # noqa: BLE001 - a library path that does not run here is reported
            print(f"skipped {name}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        out[name] = build
    return out


def specdec_methods(w: torch.Tensor, variants: list[str]) -> dict:
    """specdec's kernels for the given variants (builders, as torch_methods): fp32/bf16 packed
    panels, GGUF blocks."""
    from specdec import kernels
    from specdec.kernels import qformats

    out = {}
    for isa in variants:
        lib = kernels.load(isa)
        for dt in (torch.float32, torch.bfloat16):
            def dense(dt=dt, lib=lib):
                wd = w.to(dt).clone()
                return _closure(lambda x, wd, p: kernels.linear(x, wd, None, p, lib=lib), wd, kernels.pack(wd),
                                nbytes=wd.numel() * wd.element_size())
            out[f"specdec {isa} {str(dt)[6:]}"] = dense
        for qtype in qformats.QTYPES:
            if w.shape[1] % qformats.BLOCK[qtype][0]:
                continue      # Q4_K needs K % 256 == 0 (llama.cpp picks another type for such tensors)
            qw = torch.from_numpy(qformats.quantize(w.numpy(), qtype))

            def quant(qw=qw, qtype=qtype, lib=lib):
                prep = kernels.prepare_quant(qw, qtype)
                return (lambda x: kernels.quant_linear(x, qw, qtype, None, prep, lib=lib)), qw.numel()
            out[f"specdec {isa} {qtype}"] = quant
    return out


def row_independent(call, x: torch.Tensor, m: int) -> bool:
    """Rows 0 and m-1 of an m-row product equal the same rows computed alone, bit for bit."""
    y = call(x[:m]).float()
    return all(torch.equal(y[i], call(x[i:i + 1]).float()[0]) for i in {0, m - 1})


def bench_shape(name: str, N: int, K: int, args, bw: float, variants: list[str]) -> None:
    """Each method cycles through copies of its weights totalling >= --set-mb, so the weights
    stream from memory (or the last-level cache, as a whole model's would) rather than sit in L2."""
    torch.manual_seed(0)
    w = torch.randn(N, K) * 0.02
    builders = {} if args.only_specdec else torch_methods(w)
    builders.update(specdec_methods(w, variants))
    methods = {}
    for k, build in builders.items():
        first = build()
        copies = max(1, min(64, -(-args.set_mb * 2**20 // first[1])))
        methods[k] = ([first] + [build() for _ in range(copies - 1)], first[1])
    # rows of very different magnitudes: a per-tensor activation scale would show
    x = torch.randn(max(ROWS), K) * torch.logspace(-1, 1, max(ROWS))[:, None]
    print(f"\n### {name}: [{N}, {K}] weights\n")
    print("| method | weight MB | " + " | ".join(f"M={m} ms" for m in ROWS) + " | GB/s (M=1) | % of copy bw | M=9 / M=1 | rows |")
    print("|---" * (len(ROWS) + 6) + "|")
    times = {k: {m: [] for m in ROWS} for k in methods}
    with torch.inference_mode():
        for copies, _ in methods.values():
            for call, _ in copies:
                call(x[:9])
        for _ in range(args.repeats):
            for m in ROWS:
                xm = x[:m].contiguous()
                for k, (copies, _) in methods.items():
                    t = clock()
                    for call, _ in copies:
                        call(xm)
                    times[k][m].append((clock() - t) / len(copies))
        for k, (copies, nbytes) in methods.items():
            best = {m: min(v) for m, v in times[k].items()}   # least disturbed: the cores are shared
            gbs = nbytes / best[1] / 1e9
            indep = all(row_independent(copies[0][0], x, m) for m in ROWS[1:])
            print(f"| {k} | {nbytes / 1e6:.2f} | " + " | ".join(f"{best[m] * 1e3:.3f}" for m in ROWS)
                  + f" | {gbs:.1f} | {gbs * 1e9 / bw:.0%} | {best[9] / best[1]:.2f} | {'yes' if indep else 'no'} |")
        sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this thread's CPU time (with --threads 1), unaffected by other processes' time slices")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--set-mb", type=int, default=256, help="MiB of weight copies each method cycles through")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--no-specdec", action="store_true", help="libraries only")
    ap.add_argument("--only-specdec", action="store_true")
    ap.add_argument("--variants", default="", help="specdec variants, comma-separated (default: all that run here)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        if args.threads != 1:
            raise SystemExit("--clock cpu counts the calling thread's CPU time: use it with --threads 1")
        global clock
        clock = time.thread_time     # time on the core, not waiting for it: robust on shared machines
    from specdec.bench.machine import machine_info, memory_bandwidth
    info = machine_info()
    bw = memory_bandwidth(clock=clock)
    print(f"CPU: {info['cpu']}, {info['cores']} cores, {args.threads} threads; torch {info['torch']}; "
          f"copy bandwidth {bw / 1e9:.1f} GB/s (256 MiB tensor copy, read + write, best of 10); clock: {args.clock}; "
          f"load average {info['load_average']}")
    from specdec import kernels
    print(f"specdec kernels: {kernels.describe()}")
    variants = [] if args.no_specdec else (args.variants.split(",") if args.variants else kernels.runnable_variants())
    for name in args.shapes.split(","):
        bench_shape(name, *SHAPES[name], args, bw, variants)


if __name__ == "__main__":
    main()
