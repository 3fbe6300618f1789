"""Weights that stay in llama.cpp's packed block formats: Q8_0, Q4_0, Q4_1, Q4_K, MXFP4.

A quantized matrix is a uint8 tensor [out_features, row_bytes]: each output row's ggml blocks
exactly as the .gguf file stores them (rows are whole in every ggml format, so rows can be
shuffled and concatenated without decoding them). Block layouts (ggml-common.h):

    Q8_0  32 weights, 34 bytes: d fp16, q int8[32]                    w = d * q
    Q4_0  32 weights, 18 bytes: d fp16, nibbles[16]                   w = d * (q - 8)
    Q4_1  32 weights, 20 bytes: d fp16, m fp16, nibbles[16]           w = d * q + m
    Q4_K 256 weights, 144 bytes: d fp16, dmin fp16, 12 bytes of 6-bit scales and mins for
          8 sub-blocks of 32, nibbles[128]                             w = (d * sc) * q - dmin * mn
    MXFP4 32 weights, 17 bytes: e uint8 (E8M0), nibbles[16]            w = FP4[q] * 2^(e - 127)
          (ggml computes it as (2 FP4[q]) * 2^(e - 128): both exact)

In the 32-weight formats byte j holds weight j (low nibble) and weight j + 16 (high nibble); in
Q4_K each 32-byte group holds two sub-blocks (low nibbles, then high nibbles). The products are
evaluated in the order llama.cpp and gguf-py use, so a dequantized matrix is bit-identical to
theirs (tests/test_gguf.py checks it against gguf-py).

`QuantLinear.forward` asks `kernels.quant_linear` first (CPU kernels for a format, when there
are any) and otherwise runs the PyTorch reference below, whose sums do not depend on how many
rows are multiplied together: verification of K drafts scores each token exactly as plain
decoding would, so greedy speculative output equals plain output bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels
from ..kernels import qformats

# qtype -> (weights per block, bytes per block)
BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "MXFP4": (32, 17)}
QTYPES = tuple(BLOCKS)


def row_bytes(qtype: str, in_features: int) -> int:
    per_block, nbytes = BLOCKS[qtype]
    if in_features % per_block:
        raise ValueError(f"{qtype} rows hold multiples of {per_block} weights, got {in_features}")
    return in_features // per_block * nbytes


def _f16(b: Tensor) -> Tensor:
    """[..., 2] uint8 little-endian halves -> [...] fp32."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _nibbles(qs: Tensor) -> Tensor:
    """[..., 16] uint8 -> [..., 32]: the low nibbles (weights 0..15), then the high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q8_0(blocks: Tensor) -> Tensor:
    d = _f16(blocks[:, :2])[:, None]
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return q * d


def _q4_0(blocks: Tensor) -> Tensor:
    d = _f16(blocks[:, :2])[:, None]
    q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return d * q.float()


def _q4_1(blocks: Tensor) -> Tensor:
    d, m = _f16(blocks[:, :2])[:, None], _f16(blocks[:, 2:4])[:, None]
    return d * _nibbles(blocks[:, 4:]).float() + m


def q4_k_scales(packed: Tensor) -> tuple[Tensor, Tensor]:
    """[n, 12] uint8 -> (scales [n, 8], mins [n, 8]) as uint8: 6 bits each; sub-blocks 0..3 keep
    theirs in the low 6 bits of bytes 0..3 (scales) and 4..7 (mins), sub-blocks 4..7 split
    theirs between a nibble of bytes 8..11 and the top 2 bits of bytes 0..7."""
    lo, mid, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], dim=1)
    mn = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], dim=1)
    return sc, mn


def _q4_k(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2])[:, None], _f16(blocks[:, 2:4])[:, None]
    sc, mn = q4_k_scales(blocks[:, 4:16])
    scale = (d * sc.float())[:, :, None]                     # [n, 8, 1]
    offset = (dmin * mn.float())[:, :, None]
    qs = blocks[:, 16:].reshape(n, 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32).float()
    return (scale * q - offset).reshape(n, 256)


# ggml's kvalues_mxfp4: the FP4 E2M1 values doubled
_MXFP4_VALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


def e8m0_half(e: Tensor) -> Tensor:
    """E8M0 exponent bytes -> 2^(e - 128) fp32, exactly (subnormal below e = 2: ggml's e8m0_to_fp32_half)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(blocks: Tensor) -> Tensor:
    return _MXFP4_VALUES[_nibbles(blocks[:, 1:]).long()] * e8m0_half(blocks[:, 0])[:, None]


_DEQUANT = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "MXFP4": _mxfp4}


def dequantize(qweight: Tensor, qtype: str, in_features: int) -> Tensor:
    """qweight [N, row_bytes] uint8 -> [N, in_features] fp32."""
    per_block, nbytes = BLOCKS[qtype]
    N = qweight.shape[0]
    blocks = qweight.reshape(N * (in_features // per_block), nbytes)
    return _DEQUANT[qtype](blocks).reshape(N, in_features)


class QuantLinear(nn.Module):
    """y = x W^T + b with W kept packed (see the module docstring).

    The contract with specdec/kernels: `kernels.prepare_quant(qweight, qtype)` runs once here;
    its result `prepared` (None where no kernel covers the format on this CPU) is the only copy
    of the weights the module keeps, and `kernels.quant_linear(x2d, ..., prepared)` multiplies
    by it. Without it the module keeps the file's rows and runs the PyTorch reference. `qweight`
    gives the file's rows either way (rebuilt from the panels: for reference paths and tests).
    """

    def __init__(self, qweight: Tensor, qtype: str, in_features: int, bias: Tensor | None = None):
        super().__init__()
        if qtype not in BLOCKS:
            raise ValueError(f"QuantLinear: unsupported qtype {qtype!r} (supported: {', '.join(QTYPES)})")
        if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] != row_bytes(qtype, in_features):
            raise ValueError(f"QuantLinear: qweight must be uint8 [N, {row_bytes(qtype, in_features)}], "
                             f"got {qweight.dtype} {tuple(qweight.shape)}")
        self.qtype, self.in_features, self.out_features = qtype, in_features, qweight.shape[0]
        self.register_buffer("bias", None if bias is None else bias.to(torch.float32), persistent=False)
        self.prepared = kernels.prepare_quant(qweight, qtype)
        # one copy of the weights: the kernel's panels, or (no kernel here) the file's rows
        self.register_buffer("rows", qweight if self.prepared is None else None, persistent=False)
        self.lora = None        # a LoRA stack's slots beside this matrix (specdec/lora: LoRAMat), or None

    @property
    def qweight(self) -> Tensor:
        """[out_features, row_bytes] uint8: the rows as the .gguf file stores them."""
        if self.rows is not None:
            return self.rows
        return torch.from_numpy(qformats.unprepare(self.prepared.data.numpy(), self.qtype, self.out_features,
                                                   self.in_features))

    @property
    def nbytes(self) -> int:
        """Bytes of weights a product reads (the panels, or the rows)."""
        return (self.rows if self.rows is not None else self.prepared.data).numel()

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, qtype={self.qtype}, bias={self.bias is not None}"

    def dequantize(self) -> Tensor:
        """[out_features, in_features] fp32."""
        return dequantize(self.qweight, self.qtype, self.in_features)

    def forward(self, x: Tensor) -> Tensor:
        """x [..., in_features] fp32 -> [..., out_features] fp32."""
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        out = kernels.quant_linear(x2d, None, self.qtype, self.bias, self.prepared)
        if out is None:
            out = self.reference(x2d)
        if self.lora is not None:
            out = self.lora.add(x2d, out)
        return out.reshape(*lead, self.out_features)

    def reference(self, x2d: Tensor) -> Tensor:
        """x2d [R, K] fp32 -> [R, N] fp32 in PyTorch: dequantize, then one product per row for
        the few rows of decoding and verification (a product's summation order may depend on
        its shape; a [1, K] product's does not depend on R), one product for a long prefill
        (scored the same way by plain and speculative decoding)."""
        w = self.dequantize()
        if x2d.shape[0] > kernels.MAX_ROWS:
            return F.linear(x2d, w, self.bias)
        # each row gets a fresh, aligned buffer: vector code may split a sum differently
        # depending on where its operand starts
        return torch.cat([F.linear(row.clone()[None], w, self.bias) for row in x2d])


class QuantEmbedding(nn.Module):
    """An embedding table kept packed: the looked-up rows are dequantized on the fly. When the
    LM head is tied to it, the head is a QuantLinear over the same `qweight` (no copy)."""

    def __init__(self, qweight: Tensor, qtype: str, embedding_dim: int):
        super().__init__()
        row_bytes(qtype, embedding_dim)
        self.qtype, self.embedding_dim, self.num_embeddings = qtype, embedding_dim, qweight.shape[0]
        self.register_buffer("qweight", qweight, persistent=False)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype}"

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens [...] int64 -> [..., embedding_dim] fp32."""
        rows = self.qweight[tokens.reshape(-1)]
        out = kernels.dequant_rows(rows, self.qtype, self.embedding_dim)
        if out is None:
            out = dequantize(rows, self.qtype, self.embedding_dim)
        return out.reshape(*tokens.shape, self.embedding_dim)


def pack_q8_0(decoder) -> bool:
    """A drafter's Transformer (an EAGLE head's decoder, a vocabulary draft) beside a GGUF target
    kept packed: its LM head and every layer's matrices become Q8_0 panels, the format of the
    target's own LM head, so the C forward runs them with int8 products. Only drafts change (by
    rounding), never what verification emits. Returns False, changing nothing, where the kernels
    do not cover Q8_0 here or a matrix's rows are not whole blocks."""
    layers = [(L.self_attn, n) for L in decoder.model.layers for n in ("qkv_proj", "o_proj")]
    layers += [(L.mlp, n) for L in decoder.model.layers for n in ("gate_up_proj", "down_proj")]
    layers.append((decoder, "lm_head"))
    mods = [getattr(p, n) for p, n in layers]
    if any(isinstance(m, QuantLinear) or getattr(m, "weight", None) is None or m.weight.shape[1] % 32 for m in mods):
        return False
    rows = [torch.from_numpy(qformats.quantize(m.weight.detach().float().cpu().numpy(), "Q8_0")) for m in mods]
    packed = [QuantLinear(r, "Q8_0", m.in_features, getattr(m, "bias", None)) for r, m in zip(rows, mods)]
    if any(q.prepared is None for q in packed):
        return False
    for (parent, name), q in zip(layers, packed):
        setattr(parent, name, q)
    return True
