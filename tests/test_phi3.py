"""Phi-3 (dense): a llama-shaped model whose checkpoints store q/k/v and gate/up fused
(qkv_proj, gate_up_proj; GGUF attn_qkv, and ffn_up holding gate rows then up rows), rotary
pairs unpermuted in GGUF, and a sliding window that caps the context.

A tiny Phi3ForCausalLM written by transformers, as a Hugging Face folder and as GGUF files (F32,
and Q8_0 everywhere), against transformers' forward and generate, speculation against plain
decoding on both forward paths, a batch against solo runs, and save -> load."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors import safe_open

from conftest import make_checkpoint, noisy_head_copy
from gguf_helpers import T, write_gguf
from specdec import LLM, SamplingParams, kernels
from specdec.model import load_model, save_model
from test_heads import _heads_dirs
from arch_checks import (GREEDY, IDS, NO_KERNELS, cached_logits, check_packed_batch_equals_solo,  # noqa: F401 (run here)
                         reference, without_kernels,
                         test_f32_gguf_equals_the_checkpoint, test_greedy_output_equals_transformers_generate,
                         test_logits_match_transformers, test_speculative_greedy_equals_plain)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("phi3")
    hf = make_checkpoint(root / "hf", arch="phi3")
    return {"hf": hf, "near": noisy_head_copy(hf, root / "near"), "f32": write_gguf(hf, root / "f32.gguf"),
            "q8_0": write_gguf(hf, root / "q8" / "model.gguf", lambda name, ndim: T.Q8_0), **_heads_dirs(hf, root)}


def test_the_checkpoint_is_fused_and_loads_as_phi3(files, tmp_path):
    with safe_open(str(files["hf"] / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any(".qkv_proj." in k for k in keys) and any(".gate_up_proj." in k for k in keys)
    model = load_model(files["hf"], "float32")
    assert model.config.model_type == "phi3" and load_model(files["f32"]).config.model_type == "phi3"
    save_model(model, tmp_path / "saved", torch.float32)         # fused again, a Phi3ForCausalLM folder
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["architectures"] == ["Phi3ForCausalLM"]
    again = reference(tmp_path / "saved")
    with torch.no_grad():
        torch.testing.assert_close(again(IDS).logits, reference(files["hf"])(IDS).logits)


def test_q8_0_gguf_packed_is_close_to_the_checkpoint(files):
    """The fused attn_qkv / ffn_up tensors kept packed: close (int8 activations). (F32: the
    shared test_f32_gguf_equals_the_checkpoint.)"""
    with torch.no_grad():
        expected = reference(files["hf"])(IDS).logits[0]
        packed = load_model(files["q8_0"], quantization="gguf")(IDS).logits[0]
    assert ((packed - expected).norm() / expected.norm()).item() < 0.05


@NO_KERNELS
def test_packed_q8_0_batch_equals_solo(files):
    check_packed_batch_equals_solo(files["q8_0"])


def test_sliding_window_is_computed_not_capped(files, tmp_path):
    """Phi-3-mini-4k names a 2047-token window: kept in every layer (HF and GGUF), and a prompt
    longer than the window runs (tests/test_sliding_window.py checks the logits)."""
    folder = make_checkpoint(tmp_path / "sw", arch="phi3", tokenizer_from=files["hf"], sliding_window=100)
    cfg = load_model(folder, "float32").config
    assert (cfg.max_position_embeddings, cfg.sliding_window, cfg.sliding_layers) == (256, 100, (0, 1))
    gguf = write_gguf(folder, tmp_path / "sw.gguf", metadata={"phi3.attention.sliding_window": 100})
    g = load_model(gguf).config
    assert (g.max_position_embeddings, g.sliding_window, g.sliding_layers) == (256, 100, (0, 1))
    out = LLM(str(folder), dtype="float32", num_speculative_tokens=0).generate({"prompt_token_ids": [5] * 120}, GREEDY)
    assert len(out[0].outputs[0].token_ids) == GREEDY.max_tokens


SHORT = [1.0, 1.05, 1.1, 1.3, 1.6, 2.0, 2.6, 3.1]          # head_dim 16: 8 frequencies
LONG = [1.0, 1.2, 1.9, 3.5, 6.0, 9.0, 12.0, 16.0]


@pytest.fixture(scope="module")
def longrope(files, tmp_path_factory):
    """Phi-3-mini-128k's layout: max_position_embeddings 4x original_max_position_embeddings."""
    return make_checkpoint(tmp_path_factory.mktemp("longrope") / "hf", arch="phi3", tokenizer_from=files["hf"],
                           original_max_position_embeddings=64,
                           rope_scaling={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG})


@pytest.mark.parametrize("c_path", [True, False], ids=["c", "pytorch"])
def test_longrope_short_factors_match_transformers_within_the_original_context(longrope, monkeypatch, c_path):
    """transformers uses the short factors (and the attention factor sqrt(1 + ln 4 / ln 64)) while
    a sequence stays within original_max_position_embeddings: the context is capped there."""
    if c_path and kernels.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    without_kernels(monkeypatch, c_path)
    ours = load_model(longrope, "float32")
    assert ours.config.max_position_embeddings == 64 and ours.config.rope_scaling["rope_type"] == "longrope"
    assert abs(ours.rope_attention - (1 + math.log(4) / math.log(64)) ** 0.5) < 1e-12
    tokens = torch.randint(0, ours.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = reference(longrope)(tokens).logits[0]
        assert (ours(tokens).logits[0] - ref).abs().max() < 1e-4
        assert (cached_logits(ours, tokens[0], [(0, 30), (30, 31), (31, 64)]) - ref).abs().max() < 1e-4


def test_longrope_gguf_as_llama_cpp_writes_it(longrope, tmp_path):
    """rope_factors_short / rope_factors_long tensors, rope.scaling.attn_factor and
    rope.scaling.original_context_length (Phi-3's converter)."""
    attn = (1 + math.log(4) / math.log(64)) ** 0.5
    path = write_gguf(longrope, tmp_path / "longrope.gguf",
                      extra_tensors={"rope_factors_short.weight": np.array(SHORT, np.float32),
                                     "rope_factors_long.weight": np.array(LONG, np.float32)},
                      metadata={"phi3.rope.scaling.original_context_length": 64, "phi3.rope.scaling.attn_factor": attn})
    ours = load_model(path)
    assert ours.config.max_position_embeddings == 64
    tokens = torch.randint(0, ours.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens).logits[0], reference(longrope)(tokens).logits[0], atol=1e-4, rtol=1e-4)


def long_reference(path, tokens):
    """transformers over a sequence longer than the original context, in one forward: the long
    factors at every position (what ModelConfig.configured picks for such a max_model_len)."""
    assert tokens.shape[1] > 64
    return reference(path)(tokens).logits[0]


@pytest.mark.parametrize("c_path", [True, False], ids=["c", "pytorch"])
def test_longrope_long_factors_when_max_model_len_asks_past_the_original_context(longrope, monkeypatch, c_path):
    """max_model_len past original_max_position_embeddings: the long factors for every
    position (vLLM's choice at start-up), through one forward and through the paged cache."""
    if c_path and kernels.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    without_kernels(monkeypatch, c_path)
    ours = load_model(longrope, "float32", max_model_len=200)
    assert ours.config.long_rope and ours.config.max_position_embeddings == 256
    assert abs(ours.rope_attention - (1 + math.log(4) / math.log(64)) ** 0.5) < 1e-12
    tokens = torch.randint(0, ours.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = long_reference(longrope, tokens)
        assert (ours(tokens).logits[0] - ref).abs().max() < 1e-4
        assert (cached_logits(ours, tokens[0], [(0, 40), (40, 41), (41, 150)]) - ref).abs().max() < 1e-4
    short = load_model(longrope, "float32", max_model_len=64)
    assert not short.config.long_rope and short.config.max_position_embeddings == 64
    assert not torch.equal(short.inv_freq, ours.inv_freq)


def test_longrope_gguf_long_factors(longrope, tmp_path):
    """The GGUF's rope_factors_long tensor, chosen by max_model_len as for the folder."""
    attn = (1 + math.log(4) / math.log(64)) ** 0.5
    path = write_gguf(longrope, tmp_path / "longrope.gguf",
                      extra_tensors={"rope_factors_short.weight": np.array(SHORT, np.float32),
                                     "rope_factors_long.weight": np.array(LONG, np.float32)},
                      metadata={"phi3.rope.scaling.original_context_length": 64, "phi3.rope.scaling.attn_factor": attn})
    ours = load_model(path, max_model_len=256)
    assert ours.config.long_rope and ours.config.max_position_embeddings == 256
    tokens = torch.randint(0, ours.config.vocab_size, (1, 100), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens).logits[0], long_reference(longrope, tokens), atol=1e-4, rtol=1e-4)


def test_llm_max_model_len_past_the_original_context(longrope):
    """LLM(max_model_len=...) past the original context: the long factors, answers as long as
    asked, speculation (a draft model that is the target's copy) identical to plain; by default
    and within the original context, the short factors and that context; past
    max_position_embeddings, a clear error."""
    default = LLM(model=longrope, dtype="float32", num_speculative_tokens=0)
    assert default.engine.max_model_len == 64 and not default.target.config.long_rope
    long = LLM(model=longrope, dtype="float32", num_speculative_tokens=0, max_model_len=200)
    assert long.engine.max_model_len == 200 and long.target.config.long_rope
    ids = long.tokenizer.encode("a b c d e f g h " * 8)[:60]
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    plain = long.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids
    assert len(plain) == 120
    spec = LLM(model=longrope, dtype="float32", speculative_model=str(longrope), num_speculative_tokens=3,
               max_model_len=200)
    assert spec.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids == plain
    with torch.no_grad():       # the greedy tokens are the argmax of one long forward
        full = torch.tensor([ids + plain[:-1]])
        assert long_reference(longrope, full)[len(ids) - 1:].argmax(-1).tolist() == plain
    with pytest.raises(ValueError, match=r"max_model_len must be in \[2, 256\], got 300"):
        LLM(model=longrope, dtype="float32", num_speculative_tokens=0, max_model_len=300)


@pytest.mark.tp
def test_longrope_long_factors_under_tensor_parallelism(longrope):
    """Each rank loads with the same max_model_len, so every rank rotates by the long factors."""
    kw = dict(model=longrope, dtype="float32", num_speculative_tokens=0, max_model_len=200)
    tp1, tp2 = LLM(**kw), LLM(**kw, tensor_parallel_size=2)
    try:
        ids = torch.randint(0, tp1.target.config.vocab_size, (150,), generator=torch.Generator().manual_seed(7))
        a, b = (cached_logits(m.target, ids, [(0, 150)]) for m in (tp1, tp2))
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4 * a.abs().max().item())
    finally:
        del tp2
