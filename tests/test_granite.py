"""Granite (IBM Granite 3.x dense): a llama with four multipliers -- embeddings x
embedding_multiplier, each block's output x residual_multiplier before its residual add,
attention scores x attention_multiplier (instead of 1 / sqrt(head_dim)), logits / logits_scaling
-- as a Hugging Face folder and a GGUF file (granite.embedding_scale, .residual_scale,
.attention.scale, .logit_scale), on the PyTorch and the C forward, against transformers, and
speculation (EAGLE heads included: their own layer is plain) against plain decoding."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_checkpoint, noisy_head_copy
from gguf_helpers import write_gguf
from specdec import kernels
from specdec.model import load_model, save_model
from test_heads import _heads_dirs
from test_qwen3 import (IDS, cached_logits, check_greedy_equals_transformers_generate,
                        check_speculative_greedy_equals_plain, reference, without_kernels)

MULTIPLIERS = {"embedding_multiplier": 6.0, "residual_multiplier": 0.3, "attention_multiplier": 0.05,
               "logits_scaling": 2.5}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("granite")
    hf = make_checkpoint(root / "hf", arch="granite", **MULTIPLIERS)
    meta = {"granite.embedding_scale": 6.0, "granite.residual_scale": 0.3, "granite.attention.scale": 0.05,
            "granite.logit_scale": 2.5}
    return {"hf": hf, "near": noisy_head_copy(hf, root / "near"), "f32": write_gguf(hf, root / "f32.gguf", metadata=meta),
            **_heads_dirs(hf, root)}


def test_config_reads_and_writes_the_multipliers(files, tmp_path):
    model = load_model(files["hf"], "float32")
    cfg = model.config
    assert {k: getattr(cfg, k) for k in MULTIPLIERS} == pytest.approx(MULTIPLIERS)
    g = load_model(files["f32"]).config
    assert {k: getattr(g, k) for k in MULTIPLIERS} == pytest.approx(MULTIPLIERS)
    save_model(model, tmp_path / "saved", torch.float32)
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["architectures"] == ["GraniteForCausalLM"] and {k: saved[k] for k in MULTIPLIERS} == MULTIPLIERS
    with torch.no_grad():
        torch.testing.assert_close(reference(tmp_path / "saved")(IDS).logits, reference(files["hf"])(IDS).logits)


@pytest.mark.parametrize("c_path", [True, False], ids=["c", "pytorch"])
def test_logits_match_transformers(files, monkeypatch, c_path):
    if c_path and kernels.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    without_kernels(monkeypatch, c_path)
    ours = load_model(files["hf"], "float32")
    assert (ours.c_view(ours.new_cache(1, 8)) is not None) == c_path
    tokens = torch.randint(0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = reference(files["hf"])(tokens).logits
        assert (ours(tokens).logits - ref).abs().max() < 1e-4 * ref.abs().max()
        chunks = cached_logits(ours, tokens[0], [(0, 17), (17, 18), (18, 40)])
        assert (chunks - ref[0]).abs().max() < 1e-4 * ref.abs().max()


def test_f32_gguf_equals_the_checkpoint(files):
    with torch.no_grad():
        expected = reference(files["hf"])(IDS).logits[0]
        torch.testing.assert_close(load_model(files["f32"])(IDS).logits[0], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", ["hf", "f32"])
def test_greedy_output_equals_transformers_generate(files, path):
    check_greedy_equals_transformers_generate(files["hf"], files[path])


@pytest.mark.parametrize("c_path", [True, False], ids=["c", "pytorch"])
def test_speculative_greedy_equals_plain(files, monkeypatch, c_path):
    check_speculative_greedy_equals_plain(files, monkeypatch, c_path)
