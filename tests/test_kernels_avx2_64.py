"""The C kernels at the shapes whose tails the AVX2 path's 8-lane halves, 16-output panels,
6-row (dense) and 8-row (GGUF) register tiles, 32/256-element blocks, 8-slot score groups and
6-query attention blocks leave over, on every variant this CPU runs (an AVX-512 machine runs
the avx2 build too), with one and two threads, against PyTorch references (float64 products,
SDPA, the PyTorch sampler and forward), plus page-guarded buffers that fault on any read or
write past either end. Sizes: K and N not multiples of 8 or 16, N = 1, 1-9 rows (decoding and
verification of up to 8 drafts), more than a register tile and more than a 64-row chunk; head
dims 8, 24 (16 + 8) and 40, GQA, cache blocks of 4 and 16 slots, spans crossing 8, 16 and 32,
sliding windows, soft-capping and draft-tree masks; vocabularies of 1 to 257 tokens."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import make_checkpoint
from specdec import kernels
from specdec.kernels import qformats

VARIANTS = kernels.runnable_variants()
needs_kernels = pytest.mark.skipif(not VARIANTS, reason="no kernel variant runs here (no gcc or no AVX2)")
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 65]     # decoding, verification of 1..8 drafts, past a tile, past a chunk
ROOT = Path(__file__).resolve().parents[1]


def _threads(n: int, body) -> None:
    """body() with n kernel threads: n > 1 on a thread of its own (its own OpenMP team; the
    suite's thread keeps one), its exceptions raised here."""
    if n == 1:
        body()
        return
    failed = []

    def run():
        try:
            torch.set_num_threads(n)
            kernels.set_threads(n)
            body()
        except BaseException as e:      # noqa: BLE001 (re-raised on the test's thread)
            failed.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(300)
    torch.set_num_threads(1)
    assert not t.is_alive(), "the kernels did not finish"
    if failed:
        raise failed[0]


def _use(monkeypatch, lib) -> None:
    """Every kernels.load() (forward, sampling, products) returns lib (None: PyTorch)."""
    monkeypatch.setattr(kernels, "load", lambda variant=None: lib)


# ---- which build runs ----

@pytest.mark.skipif("avx2" not in VARIANTS, reason="this CPU does not run the avx2 build")
def test_forcing_avx2_is_reported_and_its_products_match_torch():
    """SPECDEC_ISA=avx2 (how the AVX2 path is tried on an AVX-512 machine) loads that build and
    says so; without it, the best variant that runs is reported as chosen."""
    code = ("import torch, torch.nn.functional as F; from specdec import kernels; print(kernels.describe()); "
            "x, w = torch.randn(3, 19), torch.randn(21, 19); "
            "print(torch.allclose(kernels.linear(x, w, None, kernels.pack(w)), F.linear(x, w), rtol=1e-5, atol=1e-5))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECDEC_ISA": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line, ok = out.stdout.strip().splitlines()[-2:]
    assert line.startswith("avx2 (forced by SPECDEC_ISA); KV prefetch ") and ok == "True", out.stdout
    if not os.environ.get("SPECDEC_ISA"):
        assert kernels.describe().startswith(f"{VARIANTS[0]} (best that passes its self-test)")


# ---- matrix products ----

@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("variant", VARIANTS)
def test_dense_products_at_odd_shapes_match_torch(variant, threads):
    """skinny.c: K of 1 and not a multiple of 8, N of 1 and ragged last panels (and panel groups),
    fp32 and bf16 weights, a bias, fp32 and bf16 outputs; every row as it is alone."""
    lib = kernels.load(variant)
    g = torch.Generator().manual_seed(threads)

    def body():
        for dtype in (torch.float32, torch.bfloat16):
            for N, K in ((1, 1), (1, 37), (17, 3), (33, 9), (71, 100), (129, 17)):
                w = (torch.randn(N, K, generator=g) * 0.3).to(dtype)
                x, b, packed = torch.randn(max(ROWS), K, generator=g), torch.randn(N, generator=g), kernels.pack(w)
                ref = x.double() @ w.double().T + b.double()
                scale = x.double().abs() @ w.double().abs().T + b.double().abs()
                for out_dtype in (torch.float32, torch.bfloat16):
                    full = None
                    for m in sorted(ROWS, reverse=True):
                        out = torch.full((m, N), float("nan"), dtype=out_dtype)
                        lib.skinny_linear(x[:m].contiguous().data_ptr(), packed.data_ptr(), int(dtype == torch.bfloat16),
                                          b.data_ptr(), out.data_ptr(), int(out_dtype == torch.bfloat16), m, N, K)
                        if full is None:
                            full = out
                            err = (out.double() - ref).abs()
                            tol = 1e-5 * scale + (2.0 ** -8 * ref.abs() if out_dtype == torch.bfloat16 else 0)
                            assert bool((err <= tol).all()), (variant, dtype, out_dtype, N, K, err.max())
                        assert torch.equal(out, full[:m]), (variant, dtype, out_dtype, N, K, m)

    _threads(threads, body)


def _int8_reference(x: np.ndarray, dq: np.ndarray) -> np.ndarray:
    """x [M, K] quantized as qgemm.c does (int8 per block of 32, llama.cpp's Q8_0), times
    dq [N, K], in float64: the kernel's maths exactly, up to its fp32 sums."""
    q, d = qformats.quantize_activations(x)
    return (q.reshape(*d.shape, 32).astype(np.float64) * d[..., None]).reshape(x.shape) @ dq.astype(np.float64).T


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("qtype", qformats.QTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_quantized_products_at_odd_shapes_match_torch(variant, qtype, threads):
    """qgemm.c: one output and ragged panels (1, 17, 33 outputs), one and three blocks, a bias;
    against gguf-py's dequantized weights times the kernel's int8 activations, and loosely
    against F.linear on the dequantized weights; every row as it is alone."""
    lib = kernels.load(variant)
    rng = np.random.default_rng(len(qtype) + threads)
    per = qformats.BLOCK[qtype][0]

    def body():
        for N in (1, 17, 33):
            for K in (per, 3 * per):
                w = rng.standard_normal((N, K)).astype(np.float32) * 0.05
                qw = torch.from_numpy(qformats.quantize(w, qtype))
                dq = qformats.dequantize(qw.numpy(), qtype)
                x = rng.standard_normal((max(ROWS), K)).astype(np.float32)
                x[2, :32] = 0.0                                    # an all-zero block: scale 0
                bias = torch.from_numpy(rng.standard_normal(N).astype(np.float32))
                prepared = kernels.prepare_quant(qw, qtype)
                xt = torch.from_numpy(x)
                full = kernels.quant_linear(xt, qw, qtype, bias, prepared, lib=lib)
                exact = _int8_reference(x, dq) + bias.double().numpy()
                scale = np.abs(x).astype(np.float64) @ np.abs(dq).astype(np.float64).T + 1.0
                assert np.all(np.abs(full.numpy() - exact) <= 1e-5 * scale), (variant, qtype, N, K)
                true = F.linear(xt.double(), torch.from_numpy(dq).double(), bias.double()).numpy()
                assert np.linalg.norm(full.numpy() - true) <= 2e-2 * np.linalg.norm(true), (variant, qtype, N, K)
                for m in ROWS:
                    assert torch.equal(kernels.quant_linear(xt[:m], qw, qtype, bias, prepared, lib=lib), full[:m]), \
                        (variant, qtype, N, K, m)

    _threads(threads, body)


# ---- no read or write past a buffer ----

GUARDED = r'''
import ctypes, mmap, sys
import numpy as np, torch
from specdec import kernels
from specdec.kernels import qformats

libc = ctypes.CDLL(None)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PAGE, held = mmap.PAGESIZE, []


def guarded(t, at_start):
    """A copy of t between two pages that fault on any access, touching one of them."""
    t = t.contiguous()
    n = t.numel() * t.element_size()
    body = (n + PAGE - 1) // PAGE * PAGE
    mm = mmap.mmap(-1, body + 2 * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    assert libc.mprotect(base, PAGE, 0) == 0 and libc.mprotect(base + PAGE + body, PAGE, 0) == 0
    out = torch.frombuffer(mm, dtype=t.dtype, count=t.numel(), offset=PAGE if at_start else PAGE + body - n)
    held.append(mm)
    return out.view(t.shape).copy_(t)


rng = np.random.default_rng(0)
real_load = kernels.load
for variant in kernels.runnable_variants():
    lib = real_load(variant)
    kernels.load = lambda v=None: lib
    for at_start in (False, True):
        G = lambda t: guarded(t, at_start)
        for dtype in (torch.float32, torch.bfloat16):
            for N, K in ((1, 1), (17, 3), (33, 7), (16, 9)):
                w = (torch.randn(N, K) * 0.3).to(dtype)
                p = G(kernels.pack(w))
                for M in (1, 2, 3, 5, 6, 7, 9, 13):
                    x, b = G(torch.randn(M, K)), G(torch.randn(N))
                    for ob in (0, 1):
                        out = G(torch.zeros(M, N, dtype=torch.bfloat16 if ob else torch.float32))
                        lib.skinny_linear(x.data_ptr(), p.data_ptr(), int(dtype == torch.bfloat16), b.data_ptr(),
                                          out.data_ptr(), ob, M, N, K)
                        ref = x.double() @ w.double().T + b.double()
                        assert torch.allclose(out.double(), ref, rtol=1e-2, atol=1e-2), (variant, N, K, M)
        for qtype in qformats.QTYPES:
            per = qformats.BLOCK[qtype][0]
            for N in (1, 17):
                qw = torch.from_numpy(qformats.quantize(rng.standard_normal((N, per)).astype(np.float32) * 0.1, qtype))
                dq = torch.from_numpy(qformats.dequantize(qw.numpy(), qtype))
                prep = kernels.prepare_quant(qw, qtype)
                prep = kernels.PreparedQuant(G(prep.data), prep.qtype, prep.n, prep.k)
                for M in (1, 2, 3, 9, 65):
                    x, b = G(torch.randn(M, per)), G(torch.randn(N))
                    y = kernels.quant_linear(x, qw, qtype, b, prep)
                    qx, d = qformats.quantize_activations(x.numpy())      # the kernel's int8 activations
                    xd = torch.from_numpy((qx.reshape(*d.shape, 32).astype(np.float64) * d[..., None]).reshape(M, per))
                    err = (y - (xd @ dq.double().T + b.double())).abs()
                    assert bool((err <= 1e-5 * (x.double().abs() @ dq.double().abs().T + 1)).all()), (variant, qtype, N, M)
                assert torch.equal(kernels.dequant_rows(G(qw[-1:].clone()), qtype, per), dq[-1:])
        for V in (1, 3, 7, 9, 15, 17, 255, 257):
            for temp, top_p, min_p in ((1.0, 1.0, 0.0), (0.7, 0.9, 0.1), (1.3, 0.5, 0.0)):
                probs = kernels.processed_probs(G(torch.randn(3, V) * 3), G(torch.full((3,), temp)),
                                                G(torch.full((3,), top_p)), G(torch.full((3,), min_p)))
                assert torch.allclose(probs.sum(-1), torch.ones(3), atol=1e-5)
                drawn = kernels.draw(G(probs), G(torch.rand(3, dtype=torch.float64)))
                assert bool((probs.gather(1, drawn[:, None]) > 0).all())
            p, q = G((torch.randn(3, V) * 2).softmax(-1)), G((torch.randn(2, V) * 2).softmax(-1))
            draft = G(torch.randint(0, V, (2,)))
            kernels.rejection_rows(draft, q, p)
            kernels.rejection_rows(draft, None, p)
    print("guarded", variant, flush=True)
'''


@needs_kernels
def test_tails_neither_read_nor_write_past_their_buffers():
    """Every product, dequantized row and sampling row with its first or its last byte against a
    page that faults when touched (a vector load or store of a tail's missing lanes, a row tile
    reading rows that are not there): run in a child, so a fault fails this test alone."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", GUARDED], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, f"exit {out.returncode} (-11: a guard page was touched)\n{out.stdout}{out.stderr[-3000:]}"
    assert out.stdout.split() == [w for v in VARIANTS for w in ("guarded", v)]


# ---- attention ----

# (arch, query heads, kv heads, head_dim, extra config): GQA 3:1 and 7:1, head dims 24 and 40
# (AVX2: a 16-wide pass and an 8-wide one; AVX-512: 16 + 8) and 8, windows of 5 and 7 slots,
# Gemma 2's soft-cap
ATTENTION = {
    "gqa-hd24": ("llama", 6, 2, 24, {}),
    "window-hd40": ("mistral", 7, 1, 40, {"sliding_window": 5}),
    "softcap-hd8": ("gemma2", 2, 2, 8, {"sliding_window": 7, "attn_logit_softcapping": 3.0, "query_pre_attn_scalar": 8}),
}


@pytest.fixture(scope="module")
def attention_models(tmp_path_factory):
    from specdec.model import load_model

    root = tmp_path_factory.mktemp("avx2attn")
    return {name: load_model(make_checkpoint(root / name, arch, layers=2, hidden=8 * H, num_attention_heads=H,
                                             num_key_value_heads=KV, head_dim=hd, **extra), "float32")
            for name, (arch, H, KV, hd, extra) in ATTENTION.items()}


def _reference_attention(q, keys, vals, seen, scale: float, softcap: float) -> torch.Tensor:
    """One token's heads q [H, hd] over its seen slots of keys / values [KV, S, hd] in float64:
    SDPA (grouped), or its eager form with Gemma 2's cap tanh(s / cap) on the scores."""
    idx = torch.tensor(seen)
    k, v = keys[:, idx].double(), vals[:, idx].double()
    q = q.double()[:, None]                                           # [H, 1, hd]
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)[:, 0]
    G = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(G, 0), v.repeat_interleave(G, 0)
    s = (q @ k.transpose(-1, -2)) * scale
    return (torch.softmax(softcap * torch.tanh(s / softcap), -1) @ v)[:, 0]


def _as_stored(x: torch.Tensor, dtype) -> torch.Tensor:
    """What the cache gives back for x: itself (fp32, or bf16 input), or its int8 rows (the
    PyTorch path's quantizer) times their scales."""
    if dtype != torch.int8:
        return x
    from specdec.model.kv import quantize_rows

    q, d = quantize_rows(x)
    return q.double() * d.double()[..., None]


@needs_kernels
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=["f32", "bf16", "i8"])
@pytest.mark.parametrize("config", list(ATTENTION))
@pytest.mark.parametrize("variant", VARIANTS)
def test_paged_attention_matches_sdpa(attention_models, variant, config, kv_dtype):
    """attention.c through CAttention: two sequences prefilled causally (37 and 9 tokens: 6-query
    blocks, 8-slot groups and cache blocks of 4 and 16 all end short), then a draft tree of 10
    nodes beside 3 more causal tokens; each token's heads against SDPA over exactly the slots it
    sees, from the keys and values as the cache stores them. Both layers: Gemma 2's first slides."""
    from specdec.kernels import cforward
    from specdec.model import BlockManager, ForwardBatch
    from specdec.model.batch import TreeAttention

    model = attention_models[config]
    _, H, KV, hd, extra = ATTENTION[config]
    softcap = extra.get("attn_logit_softcapping", 0.0)
    windows = [layer.self_attn.window for layer in model.model.layers]
    assert (softcap != 0) == (model.config.attn_softcap != 0) and ("sliding_window" in extra) == any(windows)
    lib = kernels.load(variant)
    tol = 2e-2 if kv_dtype == torch.bfloat16 else 2e-5            # bf16: the output is rounded to bf16
    for bs, threads in ((4, 1), (16, 2)):
        g = torch.Generator().manual_seed(bs)
        blocks = BlockManager(48, bs, 2, 48)
        kv = model.new_kv(blocks, dtype=kv_dtype)
        for s in ("a", "b"):
            blocks.add(s)
            blocks.ensure(s, 60)
        view = cforward.CView(model, kv, weights=False)
        scale = view.struct.attn_scale or 1 / math.sqrt(hd)
        tree = TreeAttention.from_parents([-1, 0, 0, 1, -1, 4, 5, 2, 6])
        fed = {"a": [], "b": []}                                      # (q, k, v) per token, in slot order
        for starts, counts, trees in (([0, 0], [37, 9], None), ([37, 9], [10, 3], [tree, None])):
            batch = ForwardBatch.build(kv, ["a", "b"], counts, starts, trees)
            N = sum(counts)
            dt = torch.bfloat16 if kv_dtype == torch.bfloat16 else torch.float32
            q, k, v = (torch.randn(N, h, hd, generator=g).to(dt) for h in (H, KV, KV))
            outs = []
            _threads(threads, lambda: outs.extend(cforward.CAttention(lib, view, batch)(layer, q, k, v, True)
                                                  for layer in range(2)))
            n0 = 0
            for i, s in enumerate(("a", "b")):
                fed[s] += [(q[n0 + t], k[n0 + t], v[n0 + t]) for t in range(counts[i])]
                keys = _as_stored(torch.stack([f[1] for f in fed[s]], 1), kv_dtype)   # [KV, span, hd]
                vals = _as_stored(torch.stack([f[2] for f in fed[s]], 1), kv_dtype)
                for t in range(counts[i]):
                    tr = trees[i] if trees else None
                    pos = starts[i] + (int(tr.depth[t]) if tr is not None else t)
                    for layer, win in enumerate(windows):
                        past = [x for x in range(starts[i] if tr is not None else pos + 1) if win is None or x > pos - win]
                        own = [starts[i] + j for j in range(counts[i]) if tr is not None and tr.mask[t, j]]
                        want = _reference_attention(q[n0 + t], keys, vals, past + own, scale, softcap)
                        got = outs[layer][n0 + t].view(H, hd).double()
                        err = (got - want).abs().max().item()
                        assert err <= tol, (variant, config, kv_dtype, bs, s, t, layer, err)
                n0 += counts[i]


# ---- sampling ----

@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("variant", VARIANTS)
def test_sampling_of_small_vocabularies_matches_pytorch(variant, threads, monkeypatch):
    """sampling.c on rows shorter than a vector and with every tail length (V = 1..17, 31, 33,
    255, 257), 27 rows (shared over the team from 8 on): the processed distributions (temperature,
    top-k, min-p, top-p) have the PyTorch sampler's support and probabilities, each row is the one
    it gets alone, the draws are the running sum's, and the rejection plan is PyTorch's."""
    import dataclasses

    from specdec.config import SamplingParams
    from specdec.sampling import process_rows, sample_with
    from specdec.verify import rejection_plan, rejection_plan_torch

    _use(monkeypatch, kernels.load(variant))
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
              for t in (0.5, 1.7) for k in (0, 1, 3) for p, m in ((1.0, 0.0), (0.9, 0.1), (0.3, 0.0))][:27]
    params += [dataclasses.replace(params[0], temperature=1.0)] * (27 - len(params))

    def body():
        for V in [*range(1, 18), 31, 33, 255, 257]:
            g = torch.Generator().manual_seed(V)
            logits = torch.randn(len(params), V, generator=g) * 3
            if V > 2:
                logits[::4, V // 2:] = float("-inf")                   # a mask over the row's tail
            got = process_rows(logits, params)
            want = process_rows(logits, params, kernel=False)
            assert torch.equal(got > 0, want > 0), (variant, V)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-8)
            for i in (0, 13, len(params) - 1):
                assert torch.equal(process_rows(logits[i:i + 1], [params[i]]), got[i:i + 1]), (variant, V, i)
            u = torch.rand(len(params), 1, generator=g, dtype=torch.float64)
            assert torch.equal(kernels.draw(got, u[:, 0]), sample_with(got, u)), (variant, V)
            p = (torch.randn(4, V, generator=g) * 3).softmax(-1)
            draft = torch.randint(0, V, (3,), generator=g)
            for q in ((torch.randn(3, V, generator=g) * 3).softmax(-1), None):
                accept, cand = rejection_plan(draft, q, p)
                ref_accept, ref_cand = rejection_plan_torch(draft, q, p)
                torch.testing.assert_close(accept, ref_accept, rtol=1e-6, atol=0)
                torch.testing.assert_close(cand, ref_cand, rtol=1e-5, atol=1e-9)
                assert torch.equal(cand > 0, ref_cand > 0), (variant, V)

    _threads(threads, body)


# ---- the whole forward ----

def _logits(model, ids: torch.Tensor, kv_dtype, tree_tokens: torch.Tensor) -> torch.Tensor:
    """A prompt in one chunk, then a draft tree after it, over a paged cache of 4-slot blocks:
    every row's logits."""
    from specdec.model import BlockManager, ForwardBatch
    from specdec.model.batch import TreeAttention

    blocks = BlockManager(32, 4, 1, 32)
    kv = model.new_kv(blocks, dtype=kv_dtype)
    blocks.add(0)
    blocks.ensure(0, len(ids) + len(tree_tokens))
    tree = TreeAttention.from_parents([-1, 0, 0, 1, -1, 4][:len(tree_tokens) - 1])
    with torch.inference_mode():
        a = model(ids, kv, ForwardBatch.build(kv, [0], [len(ids)], [0])).logits
        b = model(tree_tokens, kv, ForwardBatch.build(kv, [0], [len(tree_tokens)], [len(ids)], [tree])).logits
    return torch.cat([a, b])


@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_c_forward_at_odd_sizes_matches_pytorch(variant, tmp_path, monkeypatch):
    """forward.c on llamas whose widths leave tails everywhere (hidden 33, 42, 75; MLP 66, 84, 150;
    head dims 40, 8, 24; GQA), fp32, bf16 and int8 caches, a prompt and a draft tree: logits
    within fp32 rounding of the PyTorch forward's (SPECDEC_KERNELS=0's path), same argmax."""
    from specdec.kernels import cforward
    from specdec.model import load_model

    lib = kernels.load(variant)
    for i, (hidden, heads, kv_heads, hd) in enumerate(((33, 3, 1, 40), (42, 6, 2, 8), (75, 3, 3, 24))):
        model = load_model(make_checkpoint(tmp_path / f"m{i}", layers=2, hidden=hidden, num_attention_heads=heads,
                                           num_key_value_heads=kv_heads, head_dim=hd), "float32")
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, model.config.vocab_size, (23,), generator=g)
        tree_tokens = torch.randint(0, model.config.vocab_size, (7,), generator=g)
        for kv_dtype in (torch.float32, torch.bfloat16, torch.int8):
            _use(monkeypatch, lib)
            assert cforward.supported(model, _cache(model, kv_dtype))
            c = _logits(model, ids, kv_dtype, tree_tokens)
            _use(monkeypatch, None)
            ref = _logits(model, ids, kv_dtype, tree_tokens)
            tol = 1e-4 * max(1.0, ref.abs().max().item())
            assert (c - ref).abs().max().item() <= tol, (variant, hidden, kv_dtype, (c - ref).abs().max().item())
            assert torch.equal(c.argmax(-1), ref.argmax(-1)), (variant, hidden, kv_dtype)


def _cache(model, kv_dtype):
    from specdec.model import BlockManager

    return model.new_kv(BlockManager(2, 4, 1, 2), dtype=kv_dtype)


def _greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens after prompt (prefill, then one token a step) and the prompt's logits."""
    from specdec.model import ForwardBatch

    cache = model.new_cache(1, len(prompt) + n)
    out, first = [], None
    with torch.inference_mode():
        tokens, start = torch.tensor(prompt), 0
        for _ in range(n):
            logits = model(tokens, cache, ForwardBatch.build(cache, [0], [len(tokens)], [start])).logits
            first = logits if first is None else first
            start += len(tokens)
            cache.set_length(0, start)
            out.append(int(logits[-1].argmax()))
            tokens = torch.tensor(out[-1:])
    return out, first


SYSTEM = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2,
          198, 1, 4093, 198]     # <|im_start|>system ... <|im_start|>user
SMOLLM2_PROMPTS = [SYSTEM + user + [2, 198, 1, 520, 9531, 198] for user in (   # ... <|im_start|>assistant
    [1780, 314, 260, 3575, 282, 4649, 47],                                      # What is the capital of France?
    [19161, 253, 5905, 1517, 338, 7845, 827, 2966, 30],                         # Write a Python function that adds two numbers.
    [6106, 1296, 4683, 30])]                                                    # List three colors.


@pytest.fixture(scope="module")
def smollm2_dense(smollm2):
    from specdec.model import load_model

    return load_model(smollm2, quantization="none")


@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_smollm2_c_forward_greedy_equals_pytorch(smollm2_dense, variant, monkeypatch):
    """The real SmolLM2 (its GGUF dequantized to fp32, so both paths multiply the same weights):
    forward.c's greedy tokens equal the PyTorch forward's over three chat prompts, the prompt
    logits within 1e-3 of them. (Kept packed, the C forward quantizes activations to int8 as
    llama.cpp does, so its answers may differ from PyTorch's dequantized ones: README.)"""
    from specdec.kernels import cforward

    lib = kernels.load(variant)
    assert cforward.supported(smollm2_dense, smollm2_dense.new_cache(1, 8))
    for prompt in SMOLLM2_PROMPTS:
        _use(monkeypatch, lib)
        c_ids, c_logits = _greedy(smollm2_dense, prompt, 16)
        _use(monkeypatch, None)
        ids, logits = _greedy(smollm2_dense, prompt, 16)
        assert c_ids == ids, (variant, prompt)
        assert (c_logits - logits).abs().max().item() <= 1e-3, (variant, (c_logits - logits).abs().max().item())
