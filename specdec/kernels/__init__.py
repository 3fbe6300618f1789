"""CPU kernels compiled on first use (gcc, cached per source hash) and called through ctypes.

`linear(x, weight, bias)` is F.linear with a fast path for the skinny products of decoding
(see skinny.c). It also takes bf16 products of any height when the CPU has no native bf16
matmul (oneDNN then emulates it at ~9 GFLOP/s on this project's AVX2 machines; the kernel's
fp32 FMAs run ~4x faster). Anything else (GPU tensors, autograd, fp32 products over
MAX_ROWS rows (prefill), odd shapes, no C compiler) takes F.linear.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

MAX_ROWS = 64   # verification of up to 63 drafts stays on the kernel: same sums as decoding
_SOURCES = [Path(__file__).with_name(n) for n in ("skinny.c", "forward.c")]
_lib = None
_tried = False


def _cache_dir() -> Path:
    base = os.environ.get("SPECDEC_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "specdec")
    return Path(base)


def _cpu_ok() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def load():
    """The compiled library, or None (no gcc, no AVX2/FMA, SPECDEC_KERNELS=0, or build failure)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("SPECDEC_KERNELS", "1") == "0" or sys.platform != "linux" or not _cpu_ok():
        return None
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if cc is None:
        return None
    tag = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES)).hexdigest()[:16]
    path = _cache_dir() / f"kernels-{tag}.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cc, "-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared", *map(str, _SOURCES), "-o", str(tmp), "-lm"]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            return None
        os.replace(tmp, path)
    lib = ctypes.CDLL(str(path))
    lib.skinny_linear.restype = None
    lib.skinny_linear.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    from .cforward import declare
    declare(lib)
    _lib = lib
    return lib


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32)
            and x.dtype in (torch.bfloat16, torch.float32)
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


_native_bf16 = None


def _tall_ok(weight: torch.Tensor) -> bool:
    global _native_bf16
    if weight.dtype != torch.bfloat16:
        return False
    if _native_bf16 is None:
        _native_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return not _native_bf16


PANEL = 16   # outputs per packed panel (skinny.c)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K, 16]: panel p holds rows 16p..16p+15 interleaved along k."""
    N, K = weight.shape
    pad = (-N) % PANEL
    if pad:
        weight = torch.cat([weight, weight.new_zeros(pad, K)])
    return weight.reshape(-1, PANEL, K).transpose(1, 2).contiguous()


def packed_of(module) -> torch.Tensor:
    """The module's weight packed for the kernel; repacked whenever the weight changes."""
    w = module.weight
    key = (w.data_ptr(), w._version, w.dtype)
    if getattr(module, "_packed_key", None) != key:
        module._packed, module._packed_key = pack(w.detach()), key
    return module._packed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); given packed = pack(weight), the kernel where it fits."""
    rows = x.numel() // x.shape[-1]
    if packed is None or not _fits(x, weight) or (rows > MAX_ROWS and not _tall_ok(weight)) or load() is None:
        if x.dtype != weight.dtype:     # fp32 activations against bf16 weights
            return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)
        return F.linear(x, weight, bias)
    N, K = weight.shape
    xf = x.reshape(rows, K).to(torch.float32).contiguous()
    out = torch.empty(*x.shape[:-1], N, dtype=x.dtype)
    b = bias.to(torch.float32).contiguous() if bias is not None else None
    _lib.skinny_linear(xf.data_ptr(), packed.data_ptr(), int(weight.dtype == torch.bfloat16),
                       b.data_ptr() if b is not None else None, out.data_ptr(),
                       int(out.dtype == torch.bfloat16), rows, N, K)
    return out


def prepare_quant(qweight: torch.Tensor, qtype: str):
    """Whatever quant_linear wants precomputed for qweight [N, row_bytes] uint8 of ggml blocks
    (a repacked copy, ...), computed once per matrix; None when there is nothing to prepare."""
    return None


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, qtype: str, bias: torch.Tensor | None = None,
                 prepared=None) -> torch.Tensor | None:
    """x [R, K] fp32 @ dequantized(qweight [N, row_bytes])^T + bias -> [R, N] fp32, each row's
    sums independent of R; None when no kernel covers (qtype, this CPU)."""
    return None
