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
from specdec.model import load_model, save_model
from test_heads import _heads_dirs
from arch_checks import (IDS, reference,  # noqa: F401 (run here)
                         test_f32_gguf_equals_the_checkpoint, test_greedy_output_equals_transformers_generate,
                         test_logits_match_transformers, test_speculative_greedy_equals_plain)

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


