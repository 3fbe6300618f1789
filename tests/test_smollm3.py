"""SmolLM3: a llama whose every 4th layer applies no RoPE (NoPE; `no_rope_layers`), as a
Hugging Face folder and a GGUF file (llama.cpp skips RoPE in layers 3, 7, ...), on the PyTorch
and the C forward, against transformers, and speculation against plain decoding."""

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


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("smollm3")
    hf = make_checkpoint(root / "hf", arch="smollm3", layers=5)          # layer 3 is NoPE
    return {"hf": hf, "near": noisy_head_copy(hf, root / "near"), "f32": write_gguf(hf, root / "f32.gguf"),
            **_heads_dirs(hf, root)}


def test_config_reads_the_nope_layers(files, tmp_path):
    assert json.loads((files["hf"] / "config.json").read_text())["no_rope_layers"] == [1, 1, 1, 0, 1]
    model = load_model(files["hf"], "float32")
    assert model.config.nope_layers == (3,) and load_model(files["f32"]).config.nope_layers == (3,)
    assert [layer.self_attn.use_rope for layer in model.model.layers] == [True, True, True, False, True]
    save_model(model, tmp_path / "saved", torch.float32)
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["no_rope_layers"] == [1, 1, 1, 0, 1]
    with torch.no_grad():
        torch.testing.assert_close(reference(tmp_path / "saved")(IDS).logits, reference(files["hf"])(IDS).logits)


def test_the_nope_flag_matters(files):
    """With RoPE forced back on in layer 3 the logits leave transformers' (the shared logits test
    checks they match as loaded, on both paths)."""
    ours = load_model(files["hf"], "float32")
    tokens = torch.randint(0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = reference(files["hf"])(tokens).logits
        assert (ours(tokens).logits - ref).abs().max() < 1e-4
        ours.model.layers[3].self_attn.use_rope = True
        assert (ours(tokens).logits - ref).abs().max() > 1e-3


