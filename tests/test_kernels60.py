"""CPU kernels (tester report kern60): a forced variant this CPU cannot run is an error, not a
silent PyTorch path; a NaN activation gives NaN outputs in the GGUF kernels wherever it sits in
its block; a model whose head_dim is not a multiple of 8 (PyTorch attention) gives the same
bits however its prompt was chunked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_checkpoint

from specdec import LLM, SamplingParams, kernels
from specdec.kernels import isa, qformats

VARIANTS = kernels.runnable_variants()
needs_kernels = pytest.mark.skipif(not VARIANTS, reason="no kernel variant runs here (no gcc or no AVX2)")


def test_forcing_a_variant_the_cpu_cannot_run_is_an_error(monkeypatch):
    monkeypatch.setenv("SPECDEC_KERNELS", "1")
    monkeypatch.setenv("SPECDEC_ISA", "avx_vnni")
    flags = isa.cpu_flags() - {"avx_vnni"}          # a CPU without AVX-VNNI (a Zen 4)
    monkeypatch.setattr(isa, "cpu_flags", lambda: flags)
    if not isa.enabled():
        pytest.skip("kernels are Linux-only")
    with pytest.raises(ValueError, match=r"SPECDEC_ISA='avx_vnni': this CPU cannot run the avx_vnni kernels "
                                         r"\(it lacks avx_vnni\)"):
        isa.choose()
    monkeypatch.setenv("SPECDEC_ISA", "auto")         # the best that runs: no error
    assert isa.choose() is None or isa.choose()[0].name != "avx_vnni"


@needs_kernels
@pytest.mark.parametrize("qtype", qformats.QTYPES)
def test_a_nan_activation_gives_nan_outputs_wherever_it_sits(qtype):
    """maxps drops a NaN in its first operand: the block's scale stayed finite and the NaN became
    -127 d, so a NaN early in a block gave finite outputs. The other rows keep their bits."""
    rng = np.random.default_rng(0)
    K = 512 if qtype == "Q4_K" else 64
    w = rng.standard_normal((20, K)).astype(np.float32)
    qw = torch.from_numpy(qformats.quantize(w, qtype))
    prep = kernels.prepare_quant(qw, qtype)
    x = torch.from_numpy(rng.standard_normal((13, K)).astype(np.float32))
    for name in VARIANTS:
        lib = kernels.load(name)
        clean = kernels.quant_linear(x, qw, qtype, None, prep, lib=lib)
        for pos in (0, 5, 8, 31, K - 1):
            bad = x.clone()
            bad[4, pos] = float("nan")
            y = kernels.quant_linear(bad, qw, qtype, None, prep, lib=lib)
            assert y[4].isnan().all(), (name, pos)
            assert torch.equal(torch.cat([y[:4], y[5:]]), torch.cat([clean[:4], clean[5:]])), (name, pos)


@needs_kernels
def test_tall_fp32_products_do_not_depend_on_their_rows():
    """Past 64 rows fp32 products went to MKL, whose sums for a row depend on the rows beside it."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(768, 256, generator=g), torch.randn(150, 256, generator=g)
    whole = kernels.linear(x, w, None, kernels.pack(w))
    assert torch.equal(whole, torch.cat([kernels.linear(x[i:i + 16], w, None, kernels.pack(w)) for i in range(0, 150, 16)]))


@needs_kernels
def test_head_dim_12_logprobs_do_not_depend_on_prompt_chunking(tmp_path):
    """head_dim 12: no C attention (8-lane vectors), so PyTorch attends; a 150-token prompt
    prefilled whole and in chunks of 16 must give the same bits (README: losslessness)."""
    ck = make_checkpoint(tmp_path / "hd12", hidden=240, num_attention_heads=20, num_key_value_heads=4, head_dim=12,
                         max_position_embeddings=512)
    prompt = {"prompt_token_ids": torch.randint(2, 96, (150,), generator=torch.Generator().manual_seed(0)).tolist()}
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=1, prompt_logprobs=1, ignore_eos=True)
    runs = []
    for budget in (2048, 16):
        llm = LLM(model=str(ck), dtype="float32", num_speculative_tokens=0, max_num_batched_tokens=budget,
                  max_num_seqs=1, enable_prefix_caching=False)
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        runs.append(([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt["prompt_token_ids"][1:])],
                     [d[t].logprob for d, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)],
                     out.outputs[0].token_ids))
        del llm
    assert runs[0] == runs[1]
