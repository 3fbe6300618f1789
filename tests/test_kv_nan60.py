"""A NaN key or value written to an int8 KV cache: its row's scale is NaN (q zeros), so the
queries that attend to it get NaN outputs, as over an fp32 cache, on the C path (every variant
that runs here) and the PyTorch path alike, with the same bytes stored; every other row and
every other output keeps its exact bits."""

from __future__ import annotations

import pytest
import torch

from conftest import make_checkpoint
from specdec import kernels
from specdec.kernels import cforward
from specdec.model import BlockManager, ForwardBatch, load_model
from specdec.model.batch import AttentionPlan
from specdec.model.kv import quantize_rows
from specdec.model.llama import _TorchAttention

SEQS = {"t": 6, "y": 5}
TOKEN, HEAD = 2, 0               # the NaN: seq "t"'s third token, kv head 0
PATHS = ["pytorch", *kernels.runnable_variants()]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_checkpoint(tmp_path_factory.mktemp("kvnan") / "m", layers=1, hidden=96), "float32")


def _run(model, path: str, dtype, q, k, v):
    """One prefill of both sequences over a fresh cache: (attention output, the cache)."""
    blocks = BlockManager(16, 4, 4, 16)
    kv = model.new_kv(blocks, dtype=dtype)
    for s, n in SEQS.items():
        blocks.add(s)
        blocks.ensure(s, n)
    batch = ForwardBatch.build(kv, list(SEQS), list(SEQS.values()), [0] * len(SEQS))
    if path == "pytorch":
        attend = _TorchAttention(kv, AttentionPlan.of(batch, kv, "cpu", kernels.MAX_ROWS))
    else:
        attend = cforward.CAttention(kernels.load(path), cforward.CView(model, kv, weights=False), batch)
    return attend(0, q, k, v, True), kv


def _stored(kv, s: str, n: int) -> list[torch.Tensor]:
    """Seq s's rows and scales as stored, scales as their bits (NaN compares by bits)."""
    blk, off = kv.slot_index(s, range(n))
    return [kv.k[0][:, blk, off], kv.v[0][:, blk, off],
            kv.k_scale[0][:, blk, off].view(torch.int32), kv.v_scale[0][:, blk, off].view(torch.int32)]


def test_quantize_rows_nan_row_has_nan_scale_and_zeros():
    x = torch.randn(3, 24, generator=torch.Generator().manual_seed(0))
    x[1, 5] = float("nan")
    q, d = quantize_rows(x)
    assert d.isnan().tolist() == [False, True, False] and q[1].eq(0).all()
    q0, d0 = quantize_rows(x[[0, 2]])
    assert torch.equal(q[[0, 2]], q0) and torch.equal(d[[0, 2]], d0)


def _inputs(model, which: str):
    """q, k, v for both sequences, and k, v with one NaN in the key or value of (TOKEN, HEAD)."""
    cfg = model.config
    g = torch.Generator().manual_seed(7)
    N = sum(SEQS.values())
    q = torch.randn(N, cfg.num_attention_heads, cfg.head_dim, generator=g)
    k, v = (torch.randn(N, cfg.num_key_value_heads, cfg.head_dim, generator=g) for _ in range(2))
    bad_k, bad_v = k.clone(), v.clone()
    (bad_k if which == "key" else bad_v)[TOKEN, HEAD, 3] = float("nan")
    return q, k, v, bad_k, bad_v


# PyTorch's attention only: the C attention's softmax drops a NaN score (its max and vexp's
# clamps), and its value pass weighs a masked slot by an exact 0 (0 * NaN is NaN), so there a
# NaN key gives finite outputs and a NaN value reaches earlier queries too, fp32 cache included
CASES = [("pytorch", w) for w in ("key", "value")]


@pytest.mark.parametrize("which", ["key", "value"])
@pytest.mark.parametrize("path", PATHS)
def test_nan_row_is_stored_with_a_nan_scale_and_other_rows_keep_their_bits(model, path, which):
    q, k, v, bad_k, bad_v = _inputs(model, which)
    _, clean_kv = _run(model, path, torch.int8, q, k, v)
    _, kv = _run(model, path, torch.int8, q, bad_k, bad_v)
    kq, vq, ks, vs = _stored(kv, "t", SEQS["t"])
    rows, scales = (kq, ks) if which == "key" else (vq, vs)
    assert scales[HEAD, TOKEN].view(torch.float32).isnan() and rows[HEAD, TOKEN].eq(0).all()
    for s, n in SEQS.items():
        for a, b in zip(_stored(kv, s, n), _stored(clean_kv, s, n)):
            if s == "t":
                a, b = a.clone(), b.clone()
                a[HEAD, TOKEN] = b[HEAD, TOKEN] = 0        # checked above
            assert torch.equal(a, b)


@pytest.mark.parametrize("path,which", CASES)
def test_nan_reaches_exactly_the_queries_that_attend_to_it(model, path, which):
    """NaN in the outputs of seq "t"'s queries from TOKEN on, in the query heads reading kv head
    HEAD (every column: the int8 row reads back all NaN), over an int8 cache as over an fp32 one;
    the other outputs keep the bits they have without the NaN."""
    cfg = model.config
    q, k, v, bad_k, bad_v = _inputs(model, which)
    clean, _ = _run(model, path, torch.int8, q, k, v)
    N, H, G = q.shape[0], cfg.num_attention_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    expect = torch.zeros(N, H, dtype=torch.bool)
    expect[TOKEN:SEQS["t"], HEAD * G:(HEAD + 1) * G] = True
    for dtype in (torch.float32, torch.int8):
        out, _ = _run(model, path, dtype, q, bad_k, bad_v)
        nan = out.view(N, H, -1).isnan()
        assert torch.equal(nan.any(-1), expect)
        if dtype == torch.int8 or which == "key":     # fp32: a NaN value column is NaN in that column only
            assert torch.equal(nan.all(-1), expect)
    assert torch.equal(out[~out.isnan()], clean[~out.isnan()])


@pytest.mark.skipif(len(PATHS) == 1, reason="no C kernels here")
def test_c_and_pytorch_store_the_same_bytes_for_a_nan_row(model):
    cfg = model.config
    g = torch.Generator().manual_seed(8)
    N = sum(SEQS.values())
    q = torch.randn(N, cfg.num_attention_heads, cfg.head_dim, generator=g)
    k, v = (torch.randn(N, cfg.num_key_value_heads, cfg.head_dim, generator=g) for _ in range(2))
    k[TOKEN, HEAD, 0] = v[4, 1 % cfg.num_key_value_heads, 7] = float("nan")
    stored = [[t for s, n in SEQS.items() for t in _stored(_run(model, p, torch.int8, q, k, v)[1], s, n)]
              for p in PATHS]
    for other in stored[1:]:
        assert all(torch.equal(a, b) for a, b in zip(stored[0], other))
