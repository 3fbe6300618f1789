"""Writers of quantized Hugging Face folders for tests and benchmarks (tests/test_hf_quant.py,
scripts/quant_folders.py): compressed-tensors folders through the real `compressed_tensors`
package, and GPTQ / AWQ folders in AutoGPTQ's and AutoAWQ's layouts (the writers follow AutoGPTQ
0.7.1's `QuantLinear.pack` and AutoAWQ 0.2.9's `WQLinear_GEMM.from_linear`, which specdec's reader
was checked against), each with the dense "truth" folder its codes mean."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUANTIZED = LINEARS + ("w1", "w2", "w3")        # what the GPTQ / AWQ writers quantize (Mixtral's experts: w1 w3 w2)


def write_compressed_tensors(src, dst, scheme_name: str | dict, group: int | None = None, dtype=torch.float32):
    """dst: src quantized with compressed-tensors' preset scheme (or {targets: scheme}: one config
    group each) with min-max scales (llm-compressor's default observer), compressed and saved the
    way llm-compressor saves it."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    groups = scheme_name if isinstance(scheme_name, dict) else {"Linear": scheme_name}
    schemes = {f"group_{i}": preset_name_to_scheme(name, [target]) for i, (target, name) in enumerate(groups.items())}
    for scheme in schemes.values():
        if group is not None:
            scheme.weights.group_size = group
    apply_quantization_config(model, QuantizationConfig(config_groups=schemes, ignore=["lm_head"]))
    for mod in model.modules():
        if not hasattr(mod, "weight_scale"):
            continue
        args, w = mod.quantization_scheme.weights, mod.weight.data
        if args.strategy in ("group", "tensor_group"):
            g = w.reshape(w.shape[0], -1, args.group_size)
            lo, hi = g.amin(-1), g.amax(-1)
        elif args.strategy == "channel":
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        elif args.strategy == "block":
            bn, bk = args.block_structure
            b = w.reshape(w.shape[0] // bn, bn, w.shape[1] // bk, bk)
            lo, hi = b.amin((1, 3)), b.amax((1, 3))
        else:
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        gscale = None
        if hasattr(mod, "weight_global_scale"):
            from compressed_tensors.quantization.utils import generate_gparam

            gscale = generate_gparam(w.amin(), w.amax())
            mod.weight_global_scale.data = gscale.reshape(mod.weight_global_scale.shape)
        scale, zero = calculate_qparams(lo, hi, args, global_scale=gscale)
        mod.weight_scale.data = scale.to(mod.weight_scale.dtype).reshape(mod.weight_scale.shape)
        if hasattr(mod, "weight_zero_point"):
            mod.weight_zero_point.data = zero.to(mod.weight_zero_point.dtype).reshape(mod.weight_zero_point.shape)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    for f in src.glob("tokenizer*"):
        shutil.copy(f, dst / f.name)
    return dst


def minmax_codes(w: torch.Tensor, bits: int, group: int, sym: bool):
    """Codes [N, K] in 0 .. 2^bits - 1, scales [N, G] (fp16 values) and zeros [N, G] (integers),
    w ~ scale * (code - zero), group -1 = one group per row; column k in group k // group
    (ceil(K / group) groups, the last one short where group does not divide K, as GPTQ's)."""
    N, K = w.shape
    g = K if group == -1 else group
    G = -(-K // g)
    blocks = torch.nn.functional.pad(w, (0, G * g - K)).reshape(N, G, g)    # zero padding moves no min / max
    maxq = 2 ** bits - 1
    if sym:
        scale = (blocks.abs().amax(-1) / (maxq / 2)).clamp_min(1e-6).half().float()
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        lo, hi = blocks.amin(-1).clamp(max=0), blocks.amax(-1).clamp(min=0)
        scale = ((hi - lo) / maxq).clamp_min(1e-6).half().float()
        zero = torch.round(-lo / scale).clamp(1, maxq)           # >= 1: AutoGPTQ stores zero - 1
    codes = torch.round(blocks / scale[..., None] + zero[..., None]).clamp(0, maxq).reshape(N, G * g)[:, :K].long()
    return codes, scale, zero


def pack_fields(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] codes -> int32 [R, C * bits / 32] as AutoGPTQ's word loops pack them: value j of a
    row at bit j * bits, its high bits in the next word where it does not fit (its 3-bit case)."""
    R, C = values.shape
    v = values.long()
    pos = torch.arange(C) * bits
    word, off = pos // 32, pos % 32
    words = torch.zeros(R, C * bits // 32 + 1, dtype=torch.int64)
    words.scatter_add_(1, word.expand(R, C), (v << off) & 0xFFFFFFFF)
    spill = off + bits > 32
    words.scatter_add_(1, (word[spill] + 1).expand(R, -1), v[:, spill] >> (32 - off[spill]))
    words = words[:, :-1]
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def write_gptq(src, dst, bits=4, group=128, sym=True, act_order=False, v2=False, seed=0, g_idx=True, dynamic=None):
    """dst: src's seven projections in AutoGPTQ's layout (qweight [K * bits / 32, N], qzeros
    [G, N * bits / 32] holding zero - 1 (v1) or zero (v2), scales [G, N] fp16, g_idx [K], or no
    g_idx with g_idx=False: desc_act false, as GPTQModel may save); and dst.parent / (dst.name +
    "-truth"): the dense model those codes mean, for transformers. dynamic: GPTQModel's per-module
    overrides ({regex: {"bits": .., "group_size": ..}}, the first re.match of the module name
    wins, "-:regex": left dense), written into the config too."""
    import re

    gen = torch.Generator().manual_seed(seed)
    sd, truth = load_file(src / "model.safetensors"), {}
    out = {n: t for n, t in sd.items() if not any(f".{m}." in n for m in QUANTIZED) or n.endswith(".bias")}
    global_bits, global_group = bits, group
    for name, w in sd.items():
        if not name.endswith(".weight") or not any(f".{m}." in name for m in QUANTIZED):
            continue
        p = name[:-len("weight")]
        bits, group = global_bits, global_group
        for pattern, over in (dynamic or {}).items():
            if re.match(pattern.removeprefix("-:").removeprefix("+:"), p[:-1]):
                bits, group = (None, None) if pattern.startswith("-:") else (over.get("bits", bits),
                                                                             over.get("group_size", group))
                break
        if bits is None:
            out[name] = w
            continue
        N, K = w.shape
        perm = torch.randperm(K, generator=gen) if act_order else torch.arange(K)
        codes, scale, zero = minmax_codes(w[:, perm].float(), bits, group, sym)     # groups over the permuted k
        g = K if group == -1 else group
        gi = torch.empty(K, dtype=torch.int32)
        gi[perm] = (torch.arange(K) // g).to(torch.int32)
        inv = torch.argsort(perm)
        codes = codes[:, inv]                                                         # back to column order
        truth[name] = ((codes.float() - zero[:, gi.long()]) * scale[:, gi.long()]).to(w.dtype)
        out[p + "qweight"] = _pack_k(codes, bits)
        out[p + "qzeros"] = pack_fields(zero.t().long() - (0 if v2 else 1), bits)
        out[p + "scales"] = scale.t().contiguous().half()
        if g_idx or act_order:
            out[p + "g_idx"] = gi
    save_quantized(src, dst, out, {"quant_method": "gptq", "bits": global_bits, "group_size": global_group,
                                   "desc_act": act_order, "sym": sym, **({"checkpoint_format": "gptq_v2"} if v2 else {}),
                                   **({"dynamic": dynamic} if dynamic else {})})
    return dst, save_truth(src, dst, sd, truth)


def _pack_k(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, K] -> qweight [K * bits / 32, N]: packed along k (each column n's k values)."""
    return pack_fields(codes, bits).t().contiguous()


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def write_awq(src, dst, group=128):
    """dst: src's projections in AutoAWQ's GEMM layout: qweight [K, N / 8] and qzeros [G, N / 8],
    word c's nibble i holding column 8 c + AWQ_ORDER[i]; scales [G, N] fp16."""
    sd, truth = load_file(src / "model.safetensors"), {}
    out = {n: t for n, t in sd.items() if not any(f".{m}." in n for m in LINEARS) or n.endswith(".bias")}

    def pack_n(values):                     # [R, C] -> [R, C / 8], AutoAWQ's order inside each word
        R, C = values.shape
        v = values.reshape(R, C // 8, 8)[:, :, AWQ_ORDER].reshape(R, C)
        return pack_fields(v, 4)

    for name, w in sd.items():
        if not name.endswith(".weight") or not any(f".{m}." in name for m in LINEARS):
            continue
        p = name[:-len("weight")]
        codes, scale, zero = minmax_codes(w.float(), 4, group, sym=False)
        g = torch.arange(w.shape[1]) // group
        truth[name] = ((codes.float() - zero[:, g]) * scale[:, g]).to(w.dtype)
        out[p + "qweight"] = pack_n(codes.t())
        out[p + "qzeros"] = pack_n(zero.t().long())
        out[p + "scales"] = scale.t().contiguous().half()
    save_quantized(src, dst, out, {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True})
    return dst, save_truth(src, dst, sd, truth)


def save_quantized(src, dst, tensors, qcfg):
    dst.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in src.glob("tokenizer*"):
        shutil.copy(f, dst / f.name)


def save_truth(src, dst, sd, truth):
    folder = dst.parent / (dst.name + "-truth")
    folder.mkdir()
    save_file({**sd, **truth}, str(folder / "model.safetensors"))
    shutil.copy(src / "config.json", folder / "config.json")
    return folder
