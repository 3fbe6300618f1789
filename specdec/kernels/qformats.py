"""GGUF block formats: llama.cpp's byte layouts, the kernels' panel layout, and reference maths.

File layouts (per block, little-endian; ggml-common.h):
  Q8_0  34 B per 32:  f16 d, int8 q[32];                         w = d * q
  Q4_0  18 B per 32:  f16 d, u8 qs[16] (byte j: element j in the low nibble, j + 16 in the high);
                                                                  w = d * (q - 8)
  Q4_1  20 B per 32:  f16 d, f16 m, qs[16] as Q4_0;              w = d * q + m
  Q4_K 144 B per 256: f16 d, f16 dmin, 12 B of 6-bit scales and mins for 8 sub-blocks of 32,
                      qs[128] (32-byte chunk c: sub-block 2c in the low nibbles, 2c + 1 in the high);
                                                                  w = d * sc[j] * q - dmin * m[j]
  MXFP4 17 B per 32:  u8 e (E8M0), qs[16] as Q4_0;              w = FP4[q] * 2^(e - 127)
                      (OCP's microscaling FP4: gpt-oss's experts)

`prepare` repacks [N, row_bytes] file rows into panels of 16 outputs for qgemm.c: per panel and
block, the quants as [quad][16 outputs][4 bytes] (4 consecutive k of one output per 32-bit lane),
then the 16 outputs' scales. The 4-bit formats move whole bytes (a byte keeps both its nibbles),
so a prepared Q4_0/Q4_1/Q8_0 panel has exactly the file's bytes; Q4_K unpacks its 6-bit scales
to bytes (148 B per 256 instead of 144); MXFP4 keeps its bytes, its 16 exponents padded to 32.
"""

from __future__ import annotations

import numpy as np

FORMATS = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q4_K": 3, "MXFP4": 6}     # the codes qgemm.c switches on
DENSE = {torch_name: code for torch_name, code in (("float32", 4), ("bfloat16", 5))}   # kernels.h: F32, BF16
BLOCK = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "MXFP4": (32, 17)}   # (elements, bytes)
QTYPES = tuple(FORMATS)
PANEL = 16


def row_elements(qtype: str, row_bytes: int) -> int | None:
    """K for a row of row_bytes, or None when row_bytes is not whole blocks."""
    n, nbytes = BLOCK[qtype]
    return None if row_bytes % nbytes else row_bytes // nbytes * n


def _panels(blocks: np.ndarray) -> np.ndarray:
    """[N, nb, B] -> [P, 16, nb, B], outputs padded with zero blocks to a multiple of 16."""
    pad = (-blocks.shape[0]) % PANEL
    if pad:
        blocks = np.concatenate([blocks, np.zeros((pad, *blocks.shape[1:]), blocks.dtype)])
    return blocks.reshape(-1, PANEL, *blocks.shape[1:])


def _lanes(a: np.ndarray) -> np.ndarray:
    """[P, 16, nb, ...] field -> [P, nb, 16 * ...] bytes: the 16 outputs side by side."""
    a = np.ascontiguousarray(np.moveaxis(a, 1, 2))
    return a.reshape(*a.shape[:2], -1)


def _quads(qs: np.ndarray, vectors: int) -> np.ndarray:
    """[P, 16, nb, vectors * 4] quant bytes -> [P, nb, vectors * 16 * 4]: vector v holds bytes
    4v .. 4v+3 of each of the 16 outputs."""
    P, _, nb, _ = qs.shape
    q = qs.reshape(P, PANEL, nb, vectors, 4).transpose(0, 2, 3, 1, 4)
    return np.ascontiguousarray(q).reshape(P, nb, -1)


def _by_subblock(a: np.ndarray) -> np.ndarray:
    """[P, 16, ns, 8] per-sub-block bytes -> [P, ns, 8 * 16]: sub-block by sub-block, 16 outputs each."""
    P, _, ns, _ = a.shape
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1)).reshape(P, ns, -1)


def scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes -> 8 scales and 8 mins (6 bits each). Bytes 0-3 hold scales 0-3 in their
    low 6 bits, bytes 4-7 mins 0-3; scales and mins 4-7 keep their low 4 bits in bytes 8-11
    (scale low nibble, min high nibble) and their top 2 bits in the top bits of bytes 0-3 / 4-7."""
    b = packed.astype(np.uint8)
    lo_sc, lo_mn, mix = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = np.concatenate([lo_sc & 63, (mix & 15) | ((lo_sc >> 6) << 4)], -1)
    mn = np.concatenate([lo_mn & 63, (mix >> 4) | ((lo_mn >> 6) << 4)], -1)
    return sc, mn


def prepare(qweight: np.ndarray, qtype: str) -> np.ndarray:
    """[N, row_bytes] uint8 file rows -> the flat panel layout qgemm.c reads."""
    n, nbytes = BLOCK[qtype]
    N, row_bytes = qweight.shape
    blocks = _panels(qweight.reshape(N, row_bytes // nbytes, nbytes))
    if qtype == "Q8_0":
        parts = [_quads(blocks[..., 2:], 8), _lanes(blocks[..., :2])]
    elif qtype == "Q4_0":
        parts = [_quads(blocks[..., 2:], 4), _lanes(blocks[..., :2])]
    elif qtype == "Q4_1":
        parts = [_quads(blocks[..., 4:], 4), _lanes(blocks[..., :2]), _lanes(blocks[..., 2:4])]
    elif qtype == "MXFP4":
        e = _lanes(blocks[..., :1])
        parts = [_quads(blocks[..., 1:], 4), e, np.zeros_like(e)]
    else:
        sc, mn = scales_mins(blocks[..., 4:16])          # [P, 16, ns, 8] each
        parts = [_quads(blocks[..., 16:], 32), _lanes(blocks[..., 0:2]), _lanes(blocks[..., 2:4]),
                 _by_subblock(sc), _by_subblock(mn)]
    return np.ascontiguousarray(np.concatenate(parts, -1)).reshape(-1)


def _part_sizes(qtype: str) -> list[tuple[str, int]]:
    """The parts `prepare` lays side by side per panel and unit: (kind, bytes)."""
    return {"Q8_0": [("quads", 512), ("lanes", 32)], "Q4_0": [("quads", 256), ("lanes", 32)],
            "Q4_1": [("quads", 256), ("lanes", 32), ("lanes", 32)],
            "MXFP4": [("quads", 256), ("lanes", 16), ("pad", 16)],
            "Q4_K": [("quads", 2048), ("lanes", 32), ("lanes", 32), ("sub", 128), ("sub", 128)]}[qtype]


def unprepare(data: np.ndarray, qtype: str, n: int, k: int) -> np.ndarray:
    """The inverse of `prepare`: the panels of an [n, k] matrix -> its [n, row_bytes] file rows
    (a module keeps only the panels; the rows are rebuilt when a reference path needs them)."""
    per, nbytes = BLOCK[qtype]
    units = k // per
    sizes = _part_sizes(qtype)
    flat = data.reshape(-1, units, sum(b for _, b in sizes))
    P = flat.shape[0]
    fields, at = [], 0
    for kind, b in sizes:
        part = flat[..., at:at + b]
        at += b
        if kind == "quads":       # [P, u, vectors, 16, 4] -> [P, 16, u, vectors * 4]
            fields.append(part.reshape(P, units, b // 64, PANEL, 4).transpose(0, 3, 1, 2, 4).reshape(P, PANEL, units, -1))
        elif kind == "lanes":     # [P, u, 16, f] -> [P, 16, u, f]
            fields.append(np.moveaxis(part.reshape(P, units, PANEL, -1), 2, 1))
        elif kind == "pad":
            continue
        else:                     # [P, u, 8, 16] -> [P, 16, u, 8]
            fields.append(part.reshape(P, units, 8, PANEL).transpose(0, 3, 1, 2))
    if qtype == "Q8_0":
        blocks = [fields[1], fields[0]]
    elif qtype == "Q4_0":
        blocks = [fields[1], fields[0]]
    elif qtype == "Q4_1":
        blocks = [fields[1], fields[2], fields[0]]
    elif qtype == "MXFP4":
        blocks = [fields[1], fields[0]]
    else:
        sc, mn = fields[3], fields[4]
        packed = np.concatenate([(sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
                                 (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6),
                                 (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], -1).astype(np.uint8)
        blocks = [fields[1], fields[2], packed, fields[0]]
    rows = np.concatenate(blocks, -1).reshape(P * PANEL, units * nbytes)
    return np.ascontiguousarray(rows[:n])


# ---- references (tests, benchmarks) ----

def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What qgemm.c does to x [M, K] fp32: per row and block of 32, d = max|x| / 127 and
    q = round-to-even(x * (1 / d)), all in fp32. Returns (q [M, K] int8, d [M, K / 32] fp32)."""
    M, K = x.shape
    xb = x.astype(np.float32).reshape(M, K // 32, 32)
    d = np.abs(xb).max(-1) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.clip(np.rint(xb * inv[..., None]), -127, 127).astype(np.int8)
    return q.reshape(M, K), d


def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """[N, K] fp32 -> [N, row_bytes] uint8 file rows (gguf-py's quantizers; Q4_K a plain one of
    ours: gguf-py has none). For tests and benchmarks, not for making release files."""
    import gguf

    if qtype != "Q4_K":
        return gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType[qtype])
    N, K = w.shape
    sub = w.astype(np.float32).reshape(N, K // 256, 8, 32)
    lo = np.minimum(sub.min(-1), 0)                               # w = scale * q - min, min >= 0
    scale = (sub.max(-1) - lo) / 15
    d, dmin = scale.max(-1) / 63, -lo.min(-1) / 63
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    safe = lambda a, b: np.divide(a, b, out=np.zeros_like(a), where=b != 0)   # noqa: E731
    sc = np.clip(np.rint(safe(scale, d16.astype(np.float32)[..., None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(safe(-lo, dmin16.astype(np.float32)[..., None])), 0, 63).astype(np.uint8)
    step = d16.astype(np.float32)[..., None] * sc
    q = np.clip(np.rint(safe(sub + (dmin16.astype(np.float32)[..., None] * mn)[..., None], step[..., None])), 0, 15)
    q = q.astype(np.uint8).reshape(N, K // 256, 4, 2, 32)
    qs = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(N, K // 256, 128)
    packed = np.concatenate([(sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6), (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], -1).astype(np.uint8)
    head = np.stack([d16, dmin16], -1).view(np.uint8).reshape(N, K // 256, 4)
    return np.concatenate([head, packed, qs], -1).reshape(N, -1)


def dequantize(qweight: np.ndarray, qtype: str) -> np.ndarray:
    """[N, row_bytes] -> [N, K] fp32 with gguf-py's reference dequantizer."""
    import gguf

    return gguf.quants.dequantize(qweight, gguf.GGMLQuantizationType[qtype]).astype(np.float32)
