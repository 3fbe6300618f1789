"""Quantized Hugging Face folders: compressed-tensors (llm-compressor's W4A16 / W8A16 / W8A8 /
FP8 / NVFP4 / MXFP4 / MXFP8), GPTQ, AWQ and FP8 (transformers' block FP8, AutoFP8's per-tensor
FP8), as vLLM reads them.

Every integer scheme these formats store is the same arithmetic: per output row n and input
column k, w[n, k] = scale[n, g(k)] * (q[n, k] - zero[n, g(k)]) with integer codes q, and a group
g(k) = k // group_size with the config's group_size (ceil(K / group_size) groups, the last one
short; or a stored g_idx: GPTQ's activation order). Block-wise FP8 scales cover [bo, bi] blocks
of the config's weight_block_size / block_structure ([128, 128] by default), the last short. They differ only in how q,
zero and scale are laid out. `convert` reads each quantized matrix into that one form (`Codes`)
and then either

- keeps it packed, as llama.cpp's block formats that qgemm.c multiplies (model/quant.py), where
  every block of 32 columns has one scale and zero:
    codes in -8..7 (2/3/4-bit), zero 0 -> Q4_0: d = scale, nibble = q + 8          (exact)
    codes in 0..15 unsigned, zeros     -> Q4_1: d = scale, m = -scale * zero       (m as fp16)
    8-bit codes, zero 0                -> Q8_0: d = scale, q                       (exact)
    MXFP4 (E2M1 values, E8M0 scales)   -> MXFP4                                    (exact)
  (the blocks hold scales as fp16: exact for fp16 and bf16 scales in fp16's normal range, as
  GPTQ, AWQ and llm-compressor on a bf16 model store them; fp32 scales round), or
- dequantizes it to a dense matrix in fp32 (the loader casts it to the model's dtype), for every
  other case: FP8 and NVFP4 weights, 8-bit codes with zero points, groups that are not whole
  blocks of 32, GPTQ's act-order, embeddings, `quantization="none"`, and CPUs without the kernels.

Packed products quantize the activations per block of 32 to int8 as llama.cpp does (qgemm.c); a
dense matrix is multiplied in the model's dtype. Activation and KV-cache schemes in the config
(W8A8's dynamic int8, FP8's static input scales, `kv_cache_scheme`) are read past: specdec
computes activations and the KV cache its own way. The fused q/k/v and gate/up matrices stay
packed when their parts share a format; otherwise the parts are dequantized together.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .quant import dequantize

# vLLM's --quantization names for these folders (the _marlin ones are vLLM's GPU kernels' names)
METHODS = {"compressed-tensors": "compressed-tensors", "compressed_tensors": "compressed-tensors",
           "gptq": "gptq", "gptq_marlin": "gptq", "awq": "awq", "awq_marlin": "awq", "fp8": "fp8"}

# tensors beside a quantized weight that carry activation / KV-cache scales: read past
_RUNTIME_SCALES = ("input_scale", "input_zero_point", "input_global_scale", "output_scale", "output_zero_point",
                   "k_scale", "v_scale", "q_scale", "prob_scale")

# bytes per 32 weights of each kept format: the format of a uint8 matrix in a converted state dict
_BLOCK_BYTES = {18: "Q4_0", 20: "Q4_1", 34: "Q8_0", 17: "MXFP4"}


class QuantFormatError(ValueError):
    """A quantized folder specdec cannot read; the message is one line for the user."""


def method(qcfg: dict | None) -> str | None:
    """The folder's quantization method, as `METHODS` names it (None: not quantized; unknown
    methods come back as they are, for the caller's refusal)."""
    if not qcfg:
        return None
    m = str(qcfg.get("quant_method", "")).lower()
    return METHODS.get(m, m or None)


def packed_format(row_bytes: int, in_features: int) -> str | None:
    """The kept format of a converted uint8 matrix [N, row_bytes] with in_features columns."""
    if in_features % 32 or row_bytes % (in_features // 32):
        return None
    return _BLOCK_BYTES.get(row_bytes // (in_features // 32))


@dataclass
class Codes:
    """w[n, k] = scale[n, g(k)] * (q[n, k] - zero[n, g(k)]): q [N, K] signed ints (int16),
    scale [N, G] fp32, zero [N, G] fp32 (integers) or None (all 0); g(k) = k // (K // G), or
    g_idx[k] when given."""
    q: Tensor
    scale: Tensor
    zero: Tensor | None = None
    g_idx: Tensor | None = None
    half: int = 8           # 2^(bits - 1): q + half is the stored unsigned code (Q4_1's nibble)

    def groups(self) -> Tensor:
        K, G = self.q.shape[1], self.scale.shape[1]
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(K) // (K // G)

    def dense(self) -> Tensor:
        g = self.groups()
        q = self.q.float()
        if self.zero is not None:
            q = q - self.zero[:, g]
        return q * self.scale[:, g]

    def blocks_of_32(self) -> tuple[Tensor, Tensor | None] | None:
        """(scale, zero) per block of 32 columns [N, K / 32], or None when a block spans groups."""
        K, G = self.q.shape[1], self.scale.shape[1]
        if K % 32:
            return None
        if K % G or (K // G) % 32:
            return None
        if self.g_idx is not None and not torch.equal(self.g_idx.long(), torch.arange(K) // (K // G)):
            return None
        rep = (K // G) // 32
        zero = None if self.zero is None else self.zero.repeat_interleave(rep, dim=1)
        return self.scale.repeat_interleave(rep, dim=1), zero

    def packed(self) -> tuple[str, Tensor] | None:
        """(format, ggml rows [N, row bytes] uint8) of the kept format that holds these codes
        exactly (Q4_1's m rounded to fp16), or None."""
        rows = self._rows()
        fmt = None if rows is None else packed_format(rows.shape[1], self.q.shape[1])
        return None if fmt is None else (fmt, rows)

    def _rows(self) -> Tensor | None:
        per_block = self.blocks_of_32()
        if per_block is None:
            return None
        scale, zero = per_block
        d16 = scale.to(torch.float16)
        if not torch.isfinite(d16).all():
            return None
        N, K = self.q.shape
        q = self.q.reshape(N, K // 32, 32)
        lo, hi = int(self.q.min()), int(self.q.max())
        zero_free = zero is None or not zero.any()
        if zero_free and -8 <= lo and hi <= 7:                       # Q4_0: w = d * (nibble - 8)
            u = (q + 8).to(torch.uint8)
            return _cat_blocks(_f16_bytes(d16), u[..., :16] | (u[..., 16:] << 4))
        h = self.half if 0 <= lo + self.half and hi + self.half <= 15 else 8
        if zero is not None and 0 <= lo + h and hi + h <= 15:        # Q4_1: w = d * nibble + m
            m16 = (-scale * (h + zero)).to(torch.float16)           # the unsigned zero: the smallest m
            if not torch.isfinite(m16).all():
                return None
            u = (q + h).to(torch.uint8)
            return _cat_blocks(_f16_bytes(d16), _f16_bytes(m16), u[..., :16] | (u[..., 16:] << 4))
        if zero_free and -128 <= lo and hi <= 127:                   # Q8_0: w = d * q
            return _cat_blocks(_f16_bytes(d16), q.to(torch.int8).view(torch.uint8))
        return None


@dataclass
class MXFP4:
    """OCP MXFP4 weights (compressed-tensors' mxfp4-pack-quantized): values [N, K / 2] uint8
    (byte i: E2M1 values 2i and 2i + 1 in its low and high nibbles) and E8M0 exponents
    [N, K / 32]; kept as ggml's MXFP4 rows (exact)."""
    values: Tensor
    exponents: Tensor

    def packed(self) -> tuple[str, Tensor]:
        from .checkpoint import mxfp4_rows

        N = self.values.shape[0]
        return "MXFP4", mxfp4_rows(self.values.reshape(N, -1, 16), self.exponents)

    def dense(self) -> Tensor:
        N, K = self.values.shape[0], self.values.shape[1] * 2
        vals = _FP4[torch.stack([self.values & 0x0F, self.values >> 4], dim=-1).reshape(N, K).long()]
        return vals * torch.exp2(self.exponents.float() - 127).repeat_interleave(32, dim=1)


def _f16_bytes(x: Tensor) -> Tensor:
    """[N, B] fp16 -> [N, B, 2] uint8 (little-endian)."""
    return x.contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _cat_blocks(*fields: Tensor) -> Tensor:
    """Per-block fields [N, B, bytes] side by side -> rows [N, B * block bytes]."""
    out = torch.cat(fields, dim=-1)
    return out.reshape(out.shape[0], -1).contiguous()


def unpack_bits(words: Tensor, bits: int, count: int, dim: int = 1) -> Tensor:
    """int32 words packed along `dim` with `bits`-bit fields, element i at bit i * bits of the
    little-endian stream of its row (compressed-tensors' dense packing; GPTQ's and AWQ's 2/4/8-bit
    words are the same stream) -> [.., count, ..] unsigned codes (int16)."""
    w = words if dim == 1 else words.t()
    rows = w.shape[0]
    if bits in (4, 8):
        b = w.contiguous().view(torch.uint8).reshape(rows, -1)
        if bits == 8:
            out = b.to(torch.int16)
        else:
            out = torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(rows, -1).to(torch.int16)
    else:
        stream = np.unpackbits(w.contiguous().numpy().view(np.uint8).reshape(rows, -1), axis=1, bitorder="little")
        n = stream.shape[1] // bits
        fields = stream[:, :n * bits].reshape(rows, n, bits).astype(np.int16)
        out = torch.from_numpy((fields << np.arange(bits, dtype=np.int16)).sum(-1).astype(np.int16))
    if out.shape[1] < count:
        raise QuantFormatError(f"packed words hold {out.shape[1]} values per row, {count} expected")
    out = out[:, :count]
    return out if dim == 1 else out.t().contiguous()


def _scale_grid(scale: Tensor, N: int, K: int, what: str) -> Tensor:
    """A stored scale (per tensor [] / [1], per channel [N, 1] or per group [N, G]) -> [N, G]
    fp32 with whole groups along k (block scales: _block_scale)."""
    s = scale.float()
    if s.dim() == 0 or s.numel() == 1:
        return s.reshape(1, 1).expand(N, 1).contiguous()
    if s.dim() == 1:
        s = s[:, None]
    if s.dim() != 2 or s.shape[0] != N:
        raise QuantFormatError(f"{what}: scale of shape {tuple(scale.shape)} does not fit a [{N}, {K}] matrix")
    return s


def _full_scale(scale: Tensor, N: int, K: int, what: str) -> Tensor:
    """[N, K] per-element scale from _scale_grid's [N, G] with K / G columns a group."""
    s = _scale_grid(scale, N, K, what)
    if K % s.shape[1]:
        raise QuantFormatError(f"{what}: scale of shape {tuple(scale.shape)} does not fit a [{N}, {K}] matrix")
    return s.repeat_interleave(K // s.shape[1], dim=1)


def _block_scale(scale: Tensor, N: int, K: int, block, what: str) -> Tensor:
    """[N, K] per-element scale from a per-block scale [ceil(N / bo), ceil(K / bi)] with the
    format's block [bo, bi] (FP8's weight_block_size, compressed-tensors' block_structure): block
    (n // bo, k // bi), the last block of a side short where bo or bi does not divide it; a single
    value: per tensor."""
    s = scale.float()
    if s.numel() == 1:
        return s.reshape(1, 1).expand(N, K)
    bo, bi = (int(x) for x in block)
    want = (-(-N // bo), -(-K // bi))
    if tuple(s.shape) != want:
        raise QuantFormatError(f"{what}: block scale of shape {tuple(scale.shape)} does not fit a [{N}, {K}] matrix "
                               f"in [{bo}, {bi}] blocks ({list(want)} expected)")
    return s.repeat_interleave(bo, dim=0)[:N].repeat_interleave(bi, dim=1)[:, :K]


def _ct_group(qcfg: dict, what: str) -> dict:
    """The compressed-tensors config group that targets module `what` (targets: "Linear" / a
    class name: every matrix, "re:<regex>": a match of the name, else the name or its tail); {}
    where none does."""
    found = []
    for group in (qcfg.get("config_groups") or {}).values():
        group = group or {}
        for t in group.get("targets") or ():
            t = str(t)
            if t.startswith("re:"):
                hit = re.match(t[3:], what) is not None
            elif "." in t or t.startswith(("model", "lm_head")):
                hit = what == t or what.endswith("." + t)
            else:                                   # a module class (Linear, ...): every quantized matrix
                hit = None
            if hit:
                return group
            if hit is None:
                found.append(group)
    return found[0] if found else {}


def _ct_weights(qcfg: dict, what: str) -> dict:
    """The `weights` arguments of the config group that targets module `what` ({} where none does)."""
    return _ct_group(qcfg, what).get("weights") or {}


def _ct_block(qcfg: dict, what: str, scale: Tensor, N: int) -> list | None:
    """The [bo, bi] block of a block-strategy compressed-tensors module (its group's
    block_structure, [128, 128] by default as the format defines it), or None."""
    weights = _ct_weights(qcfg, what)
    if str(weights.get("strategy", "")).lower() == "block":
        return weights.get("block_structure") or [128, 128]
    if scale.dim() == 2 and scale.shape[0] != N and scale.numel() > 1:   # block scales, no config group says so
        blocks = [(g or {}).get("weights", {}).get("block_structure")
                  for g in (qcfg.get("config_groups") or {}).values()]
        blocks = [b for b in blocks if b]
        return blocks[0] if blocks else [128, 128]
    return None


# --- the formats ------------------------------------------------------------------------------

def _take(sd: dict, name: str) -> Tensor | None:
    return sd.pop(name, None)


# compressed-tensors' formats (a config group's `format`, else the config's) read here; "mixed-precision":
# each group names its own
_CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized", "mxfp8-quantized",
               "nvfp4-pack-quantized", "mxfp4-pack-quantized", "dense", "mixed-precision")


def _compressed_tensors(sd: dict, prefix: str, qcfg: dict, what: str) -> Codes | Tensor | None:
    """One module of a compressed-tensors folder: pack-quantized (weight_packed int32 with
    weight_shape), int-/naive-quantized (int8 weight), float-quantized (FP8 weight), mxfp8-quantized
    (FP8 weight, E8M0 scales per 32), NVFP4 / MXFP4 pack-quantized (uint8 weight_packed of FP4
    pairs), or dense (llm-compressor's save_compressed=False: the weight as the model computes with
    it, its scales beside it unused, as compressed_tensors' DenseCompressor and transformers load it)."""
    fmt = _ct_group(qcfg, what).get("format") or qcfg.get("format")
    if fmt is not None and fmt not in _CT_FORMATS:
        raise QuantFormatError(f"{what}: compressed-tensors format {fmt!r} is not read (specdec reads "
                               f"{', '.join(_CT_FORMATS[:-1])})")
    scale = _take(sd, prefix + "weight_scale")
    zp = _take(sd, prefix + "weight_zero_point")
    g_idx = _take(sd, prefix + "weight_g_idx")
    gscale = _take(sd, prefix + "weight_global_scale")
    packed = _take(sd, prefix + "weight_packed")
    shape = _take(sd, prefix + "weight_shape")
    if packed is not None and packed.dtype == torch.uint8:              # FP4: two E2M1 values per byte
        if scale is None:
            raise QuantFormatError(f"{what}: FP4 weight_packed without weight_scale")
        N, K = packed.shape[0], packed.shape[1] * 2
        if scale.dtype == torch.uint8:                                   # MXFP4: E8M0 exponents per 32
            if scale.shape != (N, K // 32):
                raise QuantFormatError(f"{what}: uint8 weight_packed {tuple(packed.shape)} with E8M0 scales "
                                       f"{tuple(scale.shape)} is not MXFP4 (two values a byte, a scale per 32)")
            return MXFP4(packed, scale)
        vals = _FP4[torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(N, K).long()]
        s = scale.float() / (gscale.float() if gscale is not None else 1.0)   # NVFP4: FP8 scales per 16 / global
        return vals * _full_scale(s, N, K, what)
    if packed is not None:
        if shape is None or scale is None:
            raise QuantFormatError(f"{what}: weight_packed without weight_shape or weight_scale")
        N, K = (int(x) for x in shape.tolist())
        words = packed.shape[1]
        bits = next((b for b in range(1, 9) if -(-K * b // 32) == words), None)
        if bits is None:
            raise QuantFormatError(f"{what}: weight_packed {tuple(packed.shape)} does not fit weight_shape [{N}, {K}]")
        q = unpack_bits(packed, bits, K) - (1 << (bits - 1))
        zero = None
        if zp is not None:          # group / channel zero points are packed along the rows
            zero = unpack_bits(zp, bits, N, dim=0) - (1 << (bits - 1)) if zp.dtype == torch.int32 else zp
        return _ct_codes(q, scale, zero, g_idx, qcfg, what, 1 << (bits - 1))
    w = _take(sd, prefix + "weight")
    if w is None:
        raise QuantFormatError(f"{what}: quantization scales without a weight")
    if scale is None or fmt == "dense":
        return w
    if w.dtype in (torch.int8, torch.uint8, torch.int32):
        q = w.to(torch.int16) - (128 if w.dtype == torch.uint8 else 0)
        return _ct_codes(q, scale, None if zp is None else zp.float(), g_idx, qcfg, what)
    if scale.dtype == torch.uint8:                                   # MXFP8: E8M0 exponents, 2^(e - 127)
        scale = torch.exp2(scale.float() - 127)
    block = _ct_block(qcfg, what, scale, w.shape[0])
    if block is not None:                                            # FP8_BLOCK
        return w.float() * _block_scale(scale, *w.shape, block, what)
    return w.float() * _full_scale(scale, *w.shape, what)           # FP8 (float-quantized)


def _ct_codes(q: Tensor, scale: Tensor, zero: Tensor | None, g_idx: Tensor | None, qcfg: dict, what: str,
              half: int = 128) -> Codes | Tensor:
    """compressed-tensors' integer codes: the module's config group says the group size (or the
    block of a block strategy: dequantized here)."""
    N, K = q.shape
    block = _ct_block(qcfg, what, scale, N)
    if block is not None:
        w = q.float() if zero is None else q.float() - _block_scale(zero, N, K, block, what)
        return w * _block_scale(scale, N, K, block, what)
    return _codes(q, scale, zero, g_idx, what, half, _ct_weights(qcfg, what).get("group_size"))


def _codes(q: Tensor, scale: Tensor, zero: Tensor | None, g_idx: Tensor | None, what: str,
           half: int = 128, group: int | None = None) -> Codes:
    """Integer codes with their stored scale and zero point (same layout) -> Codes; groups
    g(k) = k // group (the config's group size: ceil(K / group) groups, the last one short where
    it does not divide K), or the stored g_idx."""
    N, K = q.shape
    s = _scale_grid(scale, N, K, what)
    G = s.shape[1]
    if g_idx is None and G > 1:
        if group is None or int(group) <= 0:
            if K % G:
                raise QuantFormatError(f"{what}: {G} groups of scales do not divide {K} columns")
        elif -(-K // int(group)) != G:
            raise QuantFormatError(f"{what}: {G} groups of scales for {K} columns, group_size {group} makes "
                                   f"{-(-K // int(group))}")
        elif K % int(group):
            g_idx = torch.arange(K) // int(group)                         # the last group short
    if g_idx is not None and (g_idx.numel() != K or int(g_idx.min()) < 0 or int(g_idx.max()) >= G):
        raise QuantFormatError(f"{what}: g_idx of {g_idx.numel()} columns (groups up to {int(g_idx.max())}) does not "
                               f"fit {K} columns in {G} groups")
    z = None if zero is None else _scale_grid(zero, N, K, what).expand_as(s).contiguous()
    return Codes(q, s, z, g_idx, half)


def _gptq(sd: dict, prefix: str, qcfg: dict, what: str) -> Codes:
    """AutoGPTQ / GPTQModel: qweight int32 [K * bits / 32, N] (packed along k), qzeros int32
    [G, N * bits / 32] (packed along n), scales [G, N], g_idx [K]; version 1 ("gptq") stores
    each zero minus one, version 2 ("gptq_v2") stores it as is. Without g_idx, column k is in
    group k // group_size (ceil(K / group_size) groups; -1: one). GPTQModel's `dynamic` overrides
    bits / group_size per module (_gptq_override)."""
    override = _gptq_override(qcfg, what)
    if override is False:
        raise QuantFormatError(f"{what}: quantization_config.dynamic excludes it from quantization ('-:'), yet it "
                               "holds a GPTQ qweight")
    bits = int(override.get("bits", qcfg.get("bits", 4)))
    group = int(override.get("group_size", qcfg.get("group_size", -1)))
    qweight, qzeros, scales = sd.pop(prefix + "qweight"), _take(sd, prefix + "qzeros"), _take(sd, prefix + "scales")
    g_idx = _take(sd, prefix + "g_idx")
    if qzeros is None or scales is None:
        raise QuantFormatError(f"{what}: GPTQ qweight without qzeros and scales")
    if bits not in (2, 3, 4, 8):
        raise QuantFormatError(f"{what}: GPTQ with {bits} bits (2, 3, 4 and 8 are read)")
    G, N = scales.shape
    if qweight.dim() != 2 or qweight.shape[1] != N or (qweight.shape[0] * 32) % bits \
            or qzeros.dim() != 2 or tuple(qzeros.shape) != (G, -(-N * bits // 32)):
        raise QuantFormatError(f"{what}: GPTQ tensors qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and "
                               f"scales {tuple(scales.shape)} do not fit {bits}-bit codes (the config's bits)")
    K = qweight.shape[0] * 32 // bits
    if g_idx is not None and g_idx.numel() != K:
        raise QuantFormatError(f"{what}: GPTQ qweight holds {K} columns of {bits} bits, g_idx {g_idx.numel()} (does "
                               "the config's bits match the tensors?)")
    q = unpack_bits(qweight, bits, K, dim=0).t()                         # [N, K] unsigned
    v1 = str(qcfg.get("checkpoint_format", "gptq")).lower() != "gptq_v2"
    zero = unpack_bits(qzeros, bits, N, dim=1).t().float() + (1 if v1 else 0)   # [N, G]
    half = 1 << (bits - 1)
    if g_idx is not None and K % G == 0 and torch.equal(g_idx.long(), torch.arange(K) // (K // G)):
        g_idx, group = None, K // G                                      # the default order: no act-order
    if g_idx is None and group > 0 and -(-K // group) != G:
        raise QuantFormatError(f"{what}: {G} GPTQ groups for {K} columns, group_size {group} makes "
                               f"{-(-K // group)} (does the config's bits / group_size match the tensors?)")
    if g_idx is None and group <= 0 and G != 1:
        raise QuantFormatError(f"{what}: {G} GPTQ groups with group_size {group} (one group)")
    return _codes(q - half, scales.float().t().contiguous(), zero - half, g_idx, what, half, group if group > 0 else None)


def _gptq_override(qcfg: dict, what: str) -> dict | bool:
    """GPTQModel's `dynamic` (vLLM's gptq reads it the same way): {pattern: overrides}, the first
    pattern that re.match-es the module name wins; "-:pattern": the module is not quantized,
    "+:pattern" or a bare one: its keys replace the config's (bits, group_size, ...). {} where
    none matches."""
    for pattern, overrides in (qcfg.get("dynamic") or {}).items():
        pattern = str(pattern)
        if pattern.startswith("-:"):
            if re.match(pattern[2:], what):
                return False
        elif re.match(pattern[2:] if pattern.startswith("+:") else pattern, what):
            return dict(overrides or {})
    return {}


_AWQ_ORDER = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])   # column of each nibble of an AWQ word


def _awq(sd: dict, prefix: str, qcfg: dict, what: str) -> Codes:
    """AutoAWQ's GEMM layout: qweight int32 [K, N / 8] and qzeros [G, N / 8] packed along n with
    nibble i holding column 8 j + _AWQ_ORDER[i]; scales [G, N]; w = scale * (q - zero)."""
    qweight, qzeros, scales = sd.pop(prefix + "qweight"), _take(sd, prefix + "qzeros"), _take(sd, prefix + "scales")
    if qzeros is None or scales is None:
        raise QuantFormatError(f"{what}: AWQ qweight without qzeros and scales")
    if qweight.dim() != 2 or scales.dim() != 2 or scales.shape[1] != 8 * qweight.shape[1] \
            or tuple(qzeros.shape) != (scales.shape[0], qweight.shape[1]):
        raise QuantFormatError(f"{what}: AWQ tensors qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and "
                               f"scales {tuple(scales.shape)} do not fit AutoAWQ's GEMM layout ([K, N / 8], "
                               "[G, N / 8], [G, N]); does the config name the folder's method?")

    def unpack(words: Tensor) -> Tensor:
        r = unpack_bits(words, 4, words.shape[1] * 8)                    # nibbles in stream order
        out = torch.empty_like(r)
        out.view(r.shape[0], -1, 8)[:, :, _AWQ_ORDER] = r.view(r.shape[0], -1, 8)
        return out

    q = unpack(qweight).t().contiguous()                                 # [N, K]
    zero = unpack(qzeros).t().float()                                    # [N, G]
    N, K = q.shape
    if K % scales.shape[0]:
        raise QuantFormatError(f"{what}: {scales.shape[0]} AWQ groups do not divide {K} columns")
    return Codes(q - 8, scales.float().t().contiguous(), zero - 8)


def _fp8(sd: dict, prefix: str, qcfg: dict, what: str) -> Tensor:
    """quant_method "fp8", weight float8_e4m3fn with either transformers' FineGrainedFP8
    weight_scale_inv (Qwen3-FP8, DeepSeek-V3) per weight_block_size block ([128, 128] by default; a
    short last block where it does not divide a side) or per tensor, or vLLM's / AutoFP8's
    weight_scale per tensor (vLLM's Fp8LinearMethod without weight_block_size; its input_scale, the
    static activation scale, is read past as every activation scheme is): w = weight * scale."""
    w = sd.pop(prefix + "weight")
    s = _take(sd, prefix + "weight_scale_inv")
    if s is None:
        return w.float() * _full_scale(sd.pop(prefix + "weight_scale"), *w.shape, what)
    return w.float() * _block_scale(s, *w.shape, qcfg.get("weight_block_size") or [128, 128], what)


_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


# --- the state dict ---------------------------------------------------------------------------

def _quantized_prefixes(sd: dict, kind: str) -> list[str]:
    marker = {"compressed-tensors": ("weight_scale", "weight_packed"), "gptq": ("qweight",),
              "awq": ("qweight",), "fp8": ("weight_scale_inv", "weight_scale")}[kind]
    found = set()
    for name in sd:
        for m in marker:
            if name.endswith("." + m):
                found.add(name[:-len(m)])
    return sorted(found)


# fused in the runtime (checkpoint.hf_to_fused): the parts of one matrix share a format or none
_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))     # w1 / w3: Mixtral's experts


def convert(sd: dict[str, Tensor], kind: str, qcfg: dict, keep_packed,
            dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """The state dict of a quantized folder -> one with a `.weight` for every quantized matrix:
    uint8 ggml rows where it stays packed (`packed_format` names the format from the row length),
    otherwise a dense matrix in `dtype` (computed in fp32). keep_packed(qtype) -> bool: whether to
    keep that format packed (False for all: `quantization="none"`, or no kernels here).
    Activation / KV scales are dropped. One matrix is unpacked at a time (its int16 codes cost
    2 bytes a weight), so loading needs little beyond the folder's own tensors."""
    if kind not in ("compressed-tensors", "gptq", "awq", "fp8"):
        raise QuantFormatError(f"quantization method {kind!r} is not read")
    if kind == "awq":
        version = str(qcfg.get("version", "gemm")).lower()
        if version != "gemm" or int(qcfg.get("w_bit", qcfg.get("bits", 4))) != 4:
            raise QuantFormatError(f"AWQ version {version!r} with {qcfg.get('w_bit', qcfg.get('bits', 4))} bits is "
                                   "not read (specdec reads AutoAWQ's 4-bit GEMM layout)")
    sparsity = (qcfg.get("sparsity_config") or {}).get("format") if kind == "compressed-tensors" else None
    if sparsity not in (None, "dense"):
        raise QuantFormatError(f"compressed-tensors sparsity format {sparsity!r} is not read (dense and quantized "
                               "weights are)")
    sd = dict(sd)
    for name in [n for n in sd if n.rsplit(".", 1)[-1] in _RUNTIME_SCALES]:
        del sd[name]
    prefixes = _quantized_prefixes(sd, kind)
    if not prefixes and kind != "compressed-tensors":    # (a compressed-tensors folder may quantize only its KV cache)
        marker = "weight_scale_inv or weight_scale" if kind == "fp8" else "qweight"
        raise QuantFormatError(f"quantization_config names {kind} but no matrix in the folder has its tensors ({marker})")
    rows: dict[str, tuple[str, Tensor, int]] = {}       # prefix -> (format, rows, in_features)
    for prefix in prefixes:
        what = prefix[:-1]
        try:
            if kind == "compressed-tensors":
                got = _compressed_tensors(sd, prefix, qcfg, what)
            elif kind == "gptq":
                got = _gptq(sd, prefix, qcfg, what)
                if prefix + "bias" in sd:
                    sd[prefix + "bias"] = sd[prefix + "bias"].float()
            elif kind == "awq":
                got = _awq(sd, prefix, qcfg, what)
            else:
                got = _fp8(sd, prefix, qcfg, what)
        except QuantFormatError as e:
            raise e if str(e).startswith(what + ":") else QuantFormatError(f"{what}: {e}") from None
        except (RuntimeError, ValueError, IndexError) as e:      # tensors that do not fit each other
            raise QuantFormatError(f"{what}: {kind} tensors that do not fit together "
                                   f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        if isinstance(got, (Codes, MXFP4)):
            packed = None if prefix.endswith("embed_tokens.") else got.packed()
            if packed is not None and keep_packed(packed[0]):
                k = got.q.shape[1] if isinstance(got, Codes) else got.values.shape[1] * 2
                rows[prefix] = (*packed, k)
                continue
            got = got.dense()
        sd[prefix + "weight"] = got.to(dtype)
    for prefix in list(rows):                   # siblings of a fused matrix: one format for all or none
        for group in _SIBLINGS:
            tail = next((g for g in group if prefix.endswith("." + g + ".")), None)
            if tail is None:
                continue
            base = prefix[:-len(tail) - 1]
            present = [p for p in (base + g + "." for g in group) if p in rows or p + "weight" in sd]
            if len({rows[p][0] if p in rows else None for p in present}) > 1:
                for p in present:               # the packed ones back to dense (Q4_1: with its fp16 m)
                    if p in rows:
                        fmt, r, k = rows.pop(p)
                        sd[p + "weight"] = dequantize(r, fmt, k).to(dtype)
    for prefix, (_, r, _) in rows.items():
        sd[prefix + "weight"] = r
    return sd
