"""CPU kernels compiled on first use (gcc, one build per instruction set) and called through ctypes.

`linear(x, weight, bias)` is F.linear with a fast path for the skinny products of decoding
(see skinny.c), which takes fp32 products of any height too (each row's sums in one order), and
bf16 ones when the CPU has no native bf16 matmul (oneDNN then emulates it at ~9 GFLOP/s on this
project's AVX2 machines; the kernel's fp32 FMAs run ~4x faster). Anything else (GPU tensors,
autograd, bf16 products over MAX_ROWS rows on a CPU with native bf16, odd shapes, no C compiler)
takes F.linear.

`quant_linear` multiplies by GGUF-quantized weights (Q8_0, Q4_0, Q4_1, Q4_K) kept in their
blocks (qgemm.c), after `prepare_quant` repacked them once.

Which build runs is chosen once per process (isa.py: the best variant whose self-test passes
on this CPU; `SPECDEC_ISA` forces one, `SPECDEC_KERNELS=0` turns all off); `describe()` says
which, for benchmark output and bug reports. `SPECDEC_KV_PREFETCH` sets how far ahead attention
prefetches the KV cache's blocks (kv_prefetch).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import isa, qformats

MAX_ROWS = 64   # verification of up to 63 drafts stays on the kernel: same sums as decoding
_libs: dict[str, ctypes.CDLL | None] = {}   # variant name -> loaded library (None: does not run here)
_chosen: list = []                          # [(variant name or None, reason)] once chosen


def _declare(lib: ctypes.CDLL) -> None:
    c_int, c_void_p = ctypes.c_int, ctypes.c_void_p
    lib.skinny_linear.restype = None
    lib.skinny_linear.argtypes = [c_void_p, c_void_p, c_int, c_void_p, c_void_p, c_int, c_int, c_int, c_int]
    lib.quant_linear.restype = c_int
    lib.quant_linear.argtypes = [c_void_p, c_void_p, c_int, c_void_p, c_void_p, c_int, c_int, c_int]
    lib.dequant_row.restype = None
    lib.dequant_row.argtypes = [c_int, c_void_p, c_void_p, c_int]
    lib.sampling_process.restype = c_int
    lib.sampling_process.argtypes = [c_void_p, c_void_p, c_int, c_int, c_void_p, c_void_p, c_void_p]
    lib.sampling_draw.restype = None
    lib.sampling_draw.argtypes = [c_void_p, c_int, c_int, c_void_p, c_void_p]
    lib.sampling_residual.restype = None
    lib.sampling_residual.argtypes = [c_void_p, c_void_p, c_void_p, c_int, c_int, c_void_p, c_void_p]
    c_long, c_double = ctypes.c_long, ctypes.c_double
    lib.ngram_match.restype = c_int
    lib.ngram_match.argtypes = [c_void_p, c_int, c_int, c_int, c_int, ctypes.POINTER(c_int)]
    lib.suffix_match.restype = c_int
    lib.suffix_match.argtypes = [c_void_p, c_void_p, c_long, c_void_p, c_int, c_int, ctypes.POINTER(c_long),
                                 ctypes.POINTER(c_long)]
    lib.suffix_continue.restype = c_int
    lib.suffix_continue.argtypes = [c_void_p, c_void_p, c_long, c_long, c_long, c_int, c_double, c_long, c_void_p,
                                    c_void_p]
    from .cforward import declare
    declare(lib)


def kv_prefetch(vendor: str | None = None, flags: set[str] | None = None) -> int:
    """How many cache blocks ahead attention asks for the keys' and values' rows (0: none):
    SPECDEC_KV_PREFETCH, else none on AMD CPUs with AVX-512 (Zen 4 and later) and two blocks
    ahead elsewhere. It is the machine that decides, not the build: on a Zen 4 the prefetch cost
    with the AVX-512 and the AVX2 builds alike, on a Zen 3 (AVX2) and an AVX-512 Xeon it paid
    (attention.c; scripts/kv_prefetch.py). A hint: the results are the same bits either way."""
    raw = os.environ.get("SPECDEC_KV_PREFETCH", "").strip()
    if not raw:
        vendor = isa.cpu_vendor() if vendor is None else vendor
        flags = isa.cpu_flags() if flags is None else flags
        return 0 if vendor == "AuthenticAMD" and "avx512f" in flags else 2
    if not raw.isdigit() or int(raw) > 64:
        raise ValueError(f"SPECDEC_KV_PREFETCH={raw!r}: cache blocks ahead, an integer in [0, 64] (0: none)")
    return int(raw)


def _open(variant: isa.Variant, path) -> ctypes.CDLL:
    if variant.name not in _libs:
        lib = ctypes.CDLL(str(path))
        _declare(lib)
        ctypes.c_int.in_dll(lib, "specdec_kv_prefetch").value = kv_prefetch()
        _libs[variant.name] = lib
    return _libs[variant.name]


def load(variant: str | None = None):
    """The compiled library of the chosen variant, or of `variant` (a name in isa.VARIANTS) if it
    runs on this CPU; None when kernels are off, no variant runs, or gcc is missing."""
    if variant is not None:
        v = isa.BY_NAME[variant]
        if variant not in _libs:
            path = isa.usable(v) if isa.enabled() else None
            if path is None:
                _libs[variant] = None
                return None
            return _open(v, path)
        return _libs[variant]
    if not _chosen:
        found = isa.choose()
        if found is None:
            _chosen.append((None, "off (SPECDEC_KERNELS=0)" if not isa.enabled() else "no variant runs here"))
        else:
            _open(*found)
            _chosen.append((found[0].name, "forced by SPECDEC_ISA" if isa.requested() else "best that passes its self-test"))
    name = _chosen[0][0]
    return None if name is None else _libs[name]


def chosen() -> str | None:
    """The name of the variant in use (None: PyTorch everywhere)."""
    load()
    return _chosen[0][0]


def set_threads(n: int) -> None:
    """Threads for the kernels' parallel regions started from this thread (torch.set_num_threads
    sets the same when torch's OpenMP runtime is the one the kernels loaded; this makes sure)."""
    lib = load()
    if lib is not None:
        lib.specdec_set_threads(int(n))


def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime this process runs (torch's libgomp, which the kernels' parallel regions
    bind to as well), or None where it cannot be found (not Linux, another runtime)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)          # already loaded: the same handle, the same runtime
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_set_num_threads.argtypes = [ctypes.c_int]
            return lib
        except (OSError, AttributeError):
            continue
    return None


def release_threads() -> bool:
    """Give up the calling thread's OpenMP team before another thread takes over the compute
    (the server's engine thread): this thread's later parallel regions run alone, and the
    team's idle workers exit.

    libgomp keeps one team per thread that starts parallel regions. Once a process holds more of
    its threads than CPUs, every team spins only ~1000 times at a barrier before sleeping on a
    futex; a forward crosses ~150 barriers, and where a wake-up is slow (seen on an AMD EPYC
    VM) a SmolLM2 token took 28 ms on a thread started after the model loaded on the main
    thread, instead of 4 ms. Returns whether the team was released."""
    gomp = _openmp()
    if gomp is None:
        return False
    gomp.omp_set_num_threads(1)
    return gomp.omp_pause_resource_all(1) == 0        # omp_pause_soft


def runnable_variants() -> list[str]:
    """Every variant this CPU claims, builds and passes the self-test of, best first."""
    return [v.name for v in isa.claimed() if load(v.name) is not None] if isa.enabled() else []


def describe() -> str:
    """One line for benchmark output and bug reports."""
    name = chosen()
    flags = sorted(f for f in isa.cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))
    prefetch = f"; KV prefetch {ctypes.c_int.in_dll(load(), 'specdec_kv_prefetch').value} blocks ahead" if name else ""
    return (f"{name or 'PyTorch'} ({_chosen[0][1]}){prefetch}; runnable: {', '.join(runnable_variants()) or 'none'}; "
            f"cpu flags: {' '.join(flags)}")


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32)
            and x.dtype in (torch.bfloat16, torch.float32)
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


_native_bf16 = None


def _tall_to_onednn(weight: torch.Tensor) -> bool:
    """A bf16 weight on a CPU with native bf16, whose tall products oneDNN runs faster. Tall fp32
    products stay on the kernel: as fast as MKL's here (Zen 4, 128-2048 rows, 1 and 2 threads),
    and a row's result then does not depend on the rows beside it (how a prompt was chunked)."""
    global _native_bf16
    if weight.dtype != torch.bfloat16:
        return False
    if _native_bf16 is None:
        _native_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return _native_bf16


PANEL = 16   # outputs per packed panel (skinny.c)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K, 16]: panel p holds rows 16p..16p+15 interleaved along k."""
    N, K = weight.shape
    pad = (-N) % PANEL
    if pad:
        weight = torch.cat([weight, weight.new_zeros(pad, K)])
    return weight.reshape(-1, PANEL, K).transpose(1, 2).contiguous()


def weight_key(w: torch.Tensor) -> tuple:
    """What identifies a weight's values for its packed copy: storage, version (bumped by every
    in-place change) and dtype. Inference tensors (made under torch.inference_mode) have no
    version counter; they change in place only inside inference mode, which specdec never does
    to weights."""
    return (w.data_ptr(), None if w.is_inference() else w._version, w.dtype)


def packed_of(module) -> torch.Tensor:
    """The module's weight packed for the kernel; repacked whenever the weight changes."""
    w = module.weight
    key = weight_key(w)
    if getattr(module, "_packed_key", None) != key:
        module._packed, module._packed_key = pack(w.detach()), key
    return module._packed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, lib=None, row_invariant: bool = False) -> torch.Tensor:
    """F.linear(x, weight, bias); given packed = pack(weight), the kernel where it fits (lib: a
    variant's library from load(name), default the chosen one). Past MAX_ROWS rows of bf16
    weights on a CPU with native bf16, oneDNN's GEMM (faster for tall inputs, but a row's bf16
    output depends on how many rows there are), unless row_invariant: then the kernel, whose
    rows never depend on each other."""
    rows = x.numel() // x.shape[-1]
    lib = lib or load()
    if packed is None or lib is None or not _fits(x, weight) or \
            (rows > MAX_ROWS and not row_invariant and _tall_to_onednn(weight)):
        if x.dtype != weight.dtype:     # fp32 activations against bf16 weights (the bias: either)
            y = F.linear(x.to(weight.dtype), weight).to(x.dtype)
            return y if bias is None else y + bias.to(x.dtype)
        return F.linear(x, weight, bias)
    N, K = weight.shape
    xf = x.reshape(rows, K).to(torch.float32).contiguous()
    out = torch.empty(*x.shape[:-1], N, dtype=x.dtype)
    b = bias.to(torch.float32).contiguous() if bias is not None else None
    lib.skinny_linear(xf.data_ptr(), packed.data_ptr(), int(weight.dtype == torch.bfloat16),
                      b.data_ptr() if b is not None else None, out.data_ptr(),
                      int(out.dtype == torch.bfloat16), rows, N, K)
    return out


def processed_probs(logits: torch.Tensor, temp: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor | None:
    """sampling.c's processed distributions of logits [R, V] (float32, CPU; top-k already
    applied as -inf) with per-row temp, top_p, min_p [R] (float32), or None where the kernels
    do not run (the caller's PyTorch path)."""
    lib = load()
    if lib is None or logits.device.type != "cpu":
        return None
    x = logits.to(torch.float32).contiguous()
    R, V = x.shape
    probs = torch.empty_like(x)
    temp, top_p, min_p = (t.to(torch.float32).contiguous() for t in (temp, top_p, min_p))
    if lib.sampling_process(x.data_ptr(), probs.data_ptr(), R, V, temp.data_ptr(), top_p.data_ptr(), min_p.data_ptr()):
        raise MemoryError("sampling_process: out of memory")
    return probs


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """sampling.c's inverse-CDF draws from probs [R, V] with uniforms u [R] (float64), or None
    where the kernels do not run."""
    lib = load()
    if lib is None or probs.device.type != "cpu":
        return None
    p = probs.to(torch.float32).contiguous()
    u = u.to(torch.float64).contiguous()
    out = torch.empty(p.shape[0], dtype=torch.long)
    lib.sampling_draw(p.data_ptr(), p.shape[0], p.shape[1], u.data_ptr(), out.data_ptr())
    return out


def rejection_rows(draft: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """sampling.c's rejection plan of a chain (verify.rejection_plan's shapes and meaning:
    accept_prob [K], candidates [K + 1, V]), or None where the kernels do not run."""
    lib = load()
    if lib is None or p.device.type != "cpu" or (q is not None and q.device.type != "cpu"):
        return None
    K, V = draft.shape[0], p.shape[-1]
    pf = p.to(torch.float32).contiguous()
    qf = q.to(torch.float32).contiguous() if q is not None else None
    d = draft.to(torch.long).contiguous()
    accept, cand = torch.empty(K), torch.empty(K + 1, V)
    lib.sampling_residual(pf.data_ptr(), qf.data_ptr() if qf is not None else None, d.data_ptr(), K, V,
                          accept.data_ptr(), cand.data_ptr())
    return accept, cand


NGRAM_MAX = 64   # lookup.c: the longest n-gram the kernel matches


def ngram_match(seq, k: int, n_max: int, n_min: int) -> tuple[int, int] | None:
    """lookup.c's (start, n) for proposers/ngram.match (seq: int64, contiguous), or None where
    the kernels do not run."""
    lib = load()
    if lib is None or n_max > NGRAM_MAX:
        return None
    start = ctypes.c_int()
    n = lib.ngram_match(seq.ctypes.data, len(seq), k, n_max, n_min, ctypes.byref(start))
    return start.value, n


def suffix_match(rev, sa, tail, limit: int) -> tuple[int, int, int] | None:
    """lookup.c's (lo, hi, m) for SuffixIndex.match (int32 rev and sa, int64 tail; all
    contiguous NumPy arrays), or None where the kernels do not run."""
    lib = load()
    if lib is None:
        return None
    lo, hi = ctypes.c_long(), ctypes.c_long()
    m = lib.suffix_match(rev.ctypes.data, sa.ctypes.data, len(sa), tail.ctypes.data, len(tail), limit,
                         ctypes.byref(lo), ctypes.byref(hi))
    return lo.value, hi.value, m


def suffix_continue(fwd, sa, n: int, lo: int, hi: int, k: int, min_prob: float,
                    max_occurrences: int) -> tuple[list[int], list[float]] | None:
    """lookup.c's SuffixIndex.continue_chain (int32 fwd and sa), or None where the kernels do
    not run."""
    lib = load()
    if lib is None:
        return None
    import numpy as np

    tokens, probs = np.empty(max(k, 0), np.int64), np.empty(max(k, 0), np.float64)
    made = lib.suffix_continue(fwd.ctypes.data, sa.ctypes.data, n, lo, hi, k, min_prob, max_occurrences,
                               tokens.ctypes.data, probs.ctypes.data)
    if made < 0:
        raise MemoryError("suffix_continue: out of memory")
    return tokens[:made].tolist(), probs[:made].tolist()


@dataclass(frozen=True)
class PreparedQuant:
    """GGUF rows repacked for qgemm.c (qformats.prepare): kept by the module that owns them."""
    data: torch.Tensor    # [bytes] uint8, panels of 16 outputs
    qtype: str
    n: int                # outputs
    k: int                # inputs


def prepare_quant(qweight: torch.Tensor, qtype: str) -> PreparedQuant | None:
    """qweight [N, row_bytes] uint8 GGUF rows -> their kernel layout, or None when no kernel
    covers them here (kernels off, another format, rows not whole blocks)."""
    if qtype not in qformats.FORMATS or load() is None or qweight.dim() != 2 or qweight.dtype != torch.uint8:
        return None
    K = qformats.row_elements(qtype, qweight.shape[1])
    if K is None or K % qformats.BLOCK[qtype][0]:
        return None
    data = qformats.prepare(qweight.detach().cpu().contiguous().numpy(), qtype)
    return PreparedQuant(torch.from_numpy(data), qtype, qweight.shape[0], K)


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, qtype: str, bias: torch.Tensor | None = None,
                 prepared: PreparedQuant | None = None, lib=None) -> torch.Tensor | None:
    """x [M, K] fp32 @ dequant(qweight [N, row_bytes])^T + bias [N] -> [M, N] fp32, or None
    where the kernel does not cover it (the caller's PyTorch reference then runs). Activations
    are quantized to int8 per row and block of 32 (as llama.cpp does); a row's result does not
    depend on the other rows."""
    lib = lib or load()
    if (prepared is None or lib is None or x.device.type != "cpu" or x.shape[-1] != prepared.k
            or (torch.is_grad_enabled() and x.requires_grad)):
        return None
    rows = x.numel() // prepared.k
    out = torch.empty(*x.shape[:-1], prepared.n, dtype=torch.float32)
    if rows == 0:
        return out
    xf = x.reshape(rows, prepared.k).to(torch.float32).contiguous()
    b = bias.to(torch.float32).contiguous() if bias is not None else None
    rc = lib.quant_linear(xf.data_ptr(), prepared.data.data_ptr(), qformats.FORMATS[prepared.qtype],
                          b.data_ptr() if b is not None else None, out.data_ptr(), rows, prepared.n, prepared.k)
    return out if rc == 0 else None


def dequant_rows(rows: torch.Tensor, qtype: str, k: int) -> torch.Tensor | None:
    """rows [n, row_bytes] uint8 GGUF rows (as the file stores them) -> [n, k] fp32, with the
    operations of model/quant.py's dequantize (bit-identical: forward.c looks embeddings up with
    the same C code); None where no kernel runs here."""
    lib = load()
    if lib is None or qtype not in qformats.FORMATS or rows.device.type != "cpu" or rows.dtype != torch.uint8:
        return None
    rows = rows.contiguous()
    out = torch.empty(rows.shape[0], k, dtype=torch.float32)
    for i in range(rows.shape[0]):
        lib.dequant_row(qformats.FORMATS[qtype], rows[i].data_ptr(), out[i].data_ptr(), k)
    return out
