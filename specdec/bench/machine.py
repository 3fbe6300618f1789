"""The machine a benchmark ran on, its memory bandwidth, and the plain-decoding roofline.

Decoding one token at batch 1 reads every weight the step uses once, so tokens/s cannot beat
(memory bandwidth / bytes of weights read per step). The input embedding is not read whole
(one row per token), so it is left out unless it is tied to the LM head.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from .. import kernels

BANDWIDTH_BYTES = 256 * 2**20


def cpu_model() -> str:
    """The CPU's model name, with its family and model numbers (VMs often show only "AMD EPYC":
    family 25 model 1 is a Zen 3, model 17 a Zen 4)."""
    try:
        fields = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if not key.strip():
                break                                   # the first processor's block is enough
            fields.setdefault(key.strip(), value.strip())
        if "model name" in fields:
            numbered = "cpu family" in fields and "model" in fields
            return fields["model name"] + (f" (family {fields['cpu family']} model {fields['model']})"
                                           if numbered else "")
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit(repo: Path) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=5, check=False)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict:
    try:
        import transformers
        hf = transformers.__version__
    except ImportError:
        hf = None
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem_gib = None
    return {
        "cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "memory_gib": None if mem_gib is None else round(mem_gib, 1),
        "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": hf,
        "specdec_commit": _git_commit(Path(__file__).resolve().parent),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "kernels": kernels.describe(),
        "gpu": _gpu(),
    }


def _gpu() -> str | None:
    """The first CUDA device, its name, memory and driver's CUDA version (None without one)."""
    if not torch.cuda.is_available():
        return None
    p = torch.cuda.get_device_properties(0)
    return f"{p.name} ({p.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda})"


def cpu_kind() -> str:
    """A short name for this kind of machine, for result folders: the CPU line and the kernel
    variant that runs here, e.g. "xeon-avx512vnni", "epyc-avx2", "cpu-pytorch"."""
    model = cpu_model().lower()
    line = next((n for n in ("xeon", "epyc", "ryzen", "core", "graviton", "apple") if n in model), "cpu")
    return f"{line}-{(kernels.chosen() or 'pytorch').replace('_', '')}"


def describe(info: dict, roof: dict | None) -> str:
    """The machine in a few lines (benchmark output)."""
    lines = [f"machine: {info['cpu']} ({cpu_kind()}), {info['cores']} cores, load average {info['load_average']}",
             f"kernels: {info['kernels']}"] + ([f"gpu: {info['gpu']}"] if info.get("gpu") else [])
    if roof:
        lines.append(f"roofline: {roof['weight_bytes_per_step'] / 1e6:.1f} MB of {roof['dtype']} weights per token at "
                     f"{roof['memory_bandwidth_gb_s']} GB/s copy bandwidth = {roof['roofline_tokens_per_second']} tokens/s")
    return "\n".join(lines)


def add_roofline_fractions(summary: dict, roof: dict | None) -> None:
    """Each method's tokens/s over the plain-decoding roofline (speculation can pass 1: it reads
    the weights once for several tokens)."""
    for m in summary["methods"]:
        m["roofline_fraction"] = (round(m["tokens_per_second"]["median"] / roof["roofline_tokens_per_second"], 4)
                                  if roof else None)


def busy(info: dict) -> bool:
    """Other work holds at least half the cores (1-minute load average): timings will be skewed."""
    load, cores = info.get("load_average"), info.get("cores")
    return bool(load and cores and load[0] >= 0.5 * cores)


def memory_bandwidth(nbytes: int = BANDWIDTH_BYTES, tries: int = 10, clock=time.perf_counter) -> float:
    """Bytes/s of a large tensor copy (read + write), best of `tries`, with torch's threads
    (clock=time.thread_time: the calling thread's CPU time, with one torch thread)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)                       # fault the pages in before timing
    best = float("inf")
    for _ in range(tries):
        t0 = clock()
        dst.copy_(src)
        best = min(best, clock() - t0)
    return 2 * nbytes / best


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights a batch-1 decoding step reads: every matrix and vector but the input
    embedding (one row per token) unless the LM head is that same tensor; packed GGUF matrices
    (model/quant.py) at the size their kernel reads."""
    from ..model.quant import QuantLinear

    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    skip = {id(p) for p in embed.parameters()} if embed is not None else set()
    if head is not None and not isinstance(head, QuantLinear) and getattr(head, "weight", None) is getattr(embed, "weight", 0):
        skip = set()                               # a tied dense head reads the whole table
    dense = {id(p): p for p in model.parameters() if id(p) not in skip}
    packed = {id(m): m.nbytes for m in model.modules() if isinstance(m, QuantLinear)}
    return sum(p.numel() * p.element_size() for p in dense.values()) + sum(packed.values())


def weights_kind(model: torch.nn.Module) -> str:
    """The weights' dtype, or their ggml formats when packed ("Q4_1+Q8_0")."""
    from ..model.quant import QuantLinear

    packed = sorted({m.qtype for m in model.modules() if isinstance(m, QuantLinear)})
    dense = next((p.dtype for n, p in model.named_parameters() if n.endswith("proj.weight")), None)
    kinds = packed + ([str(dense).replace("torch.", "")] if dense is not None else [])
    return "+".join(kinds) or str(next(model.parameters()).dtype).replace("torch.", "")


def roofline(model: torch.nn.Module, bandwidth: float) -> dict:
    nbytes = weight_bytes_per_step(model)
    return {"weight_bytes_per_step": nbytes, "dtype": weights_kind(model),
            "memory_bandwidth_gb_s": round(bandwidth / 1e9, 2),
            "roofline_tokens_per_second": round(bandwidth / nbytes, 1)}
