"""Sliding-window attention as transformers applies it, computed rather than capping the context:
Mistral and Phi-3 in every layer, Qwen2 and Qwen3 (use_sliding_window) from max_window_layers on.
Windows of 8 tokens, so that prompts, decoding and draft trees cross them; each family as a
Hugging Face folder and a GGUF file ({arch}.attention.sliding_window: every layer, as llama.cpp
reads it), on the PyTorch and the C forward, against transformers, and every speculative method
against plain decoding. (Gemma 2 / 3: tests/test_gemma.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_checkpoint
from specdec.model import load_model, save_model
from arch_checks import (arch_files, cached_logits, reference,  # noqa: F401 (run here)
                         test_f32_gguf_equals_the_checkpoint, test_greedy_output_equals_transformers_generate,
                         test_logits_match_transformers, test_speculative_greedy_equals_plain,
                         test_speculative_greedy_equals_plain_padded_attention)

WINDOW = 8
QWEN = {"use_sliding_window": True, "max_window_layers": 0}      # every layer, as a GGUF file says
CONFIGS = {"mistral": {}, "phi3": {}, "qwen2": QWEN, "qwen3": QWEN}


@pytest.fixture(scope="module", params=list(CONFIGS))
def files(request, tmp_path_factory) -> dict:
    arch = request.param
    return arch_files(tmp_path_factory.mktemp(f"sw-{arch}"), arch, {"sliding_window": WINDOW, **CONFIGS[arch]},
                      {f"{arch}.attention.sliding_window": WINDOW})


def test_the_window_is_read_saved_and_matters(files, tmp_path):
    model = load_model(files["hf"], "float32")
    for cfg in (model.config, load_model(files["f32"]).config):
        assert (cfg.sliding_window, cfg.sliding_layers, cfg.max_position_embeddings) == (WINDOW, (0, 1), 256)
    save_model(model, tmp_path / "saved", torch.float32)
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["sliding_window"] == WINDOW
    tokens = torch.randint(0, 200, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = reference(files["hf"])(tokens[None]).logits[0]
        torch.testing.assert_close(reference(tmp_path / "saved")(tokens[None]).logits[0], ref)
        assert (cached_logits(model, tokens, [(0, 17), (17, 18), (18, 40)]) - ref).abs().max() < 1e-4
        for layer in model.model.layers:
            layer.self_attn.window = None
        assert (cached_logits(model, tokens, [(0, 17), (17, 18), (18, 40)]) - ref).abs().max() > 1e-3


def test_qwen_window_starts_at_max_window_layers(files, tmp_path):
    """Qwen's max_window_layers: the layers before it attend in full (transformers' layer_types)."""
    if not files["arch"].startswith("qwen"):
        pytest.skip("Qwen only")
    hf = make_checkpoint(tmp_path / "hf", arch=files["arch"], layers=3, sliding_window=WINDOW,
                         use_sliding_window=True, max_window_layers=2, tokenizer_from=files["hf"])
    model = load_model(hf, "float32")
    assert model.config.sliding_layers == (2,)
    assert [layer.self_attn.window for layer in model.model.layers] == [None, None, WINDOW]
    tokens = torch.randint(0, 200, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = reference(hf)(tokens[None]).logits[0]
        assert (cached_logits(model, tokens, [(0, 17), (17, 18), (18, 40)]) - ref).abs().max() < 1e-4


def _windowed_logits_match(hf, layers) -> None:
    """hf's window in `layers` (and nowhere else), logits within 1e-4 of transformers'."""
    model = load_model(hf, "float32")
    assert model.config.sliding_layers == layers
    assert [layer.self_attn.window for layer in model.model.layers] == \
        [WINDOW if i in layers else None for i in range(len(model.model.layers))]
    tokens = torch.randint(0, 90, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = reference(hf)(tokens[None]).logits[0]
        assert (cached_logits(model, tokens, [(0, 17), (17, 18), (18, 40)]) - ref).abs().max() < 1e-4


@pytest.mark.parametrize("max_window_layers", [1, 28])
def test_qwen3_moe_windows_every_layer(tmp_path, max_window_layers):
    """Qwen3-MoE's attention takes the window in every layer: it reads neither max_window_layers
    nor layer_types (the dense Qwen2 / Qwen3 start at max_window_layers)."""
    hf = make_checkpoint(tmp_path / "hf", arch="qwen3_moe", sliding_window=WINDOW, use_sliding_window=True,
                         max_window_layers=max_window_layers)
    _windowed_logits_match(hf, (0, 1))


@pytest.mark.parametrize("written", [True, False], ids=["layer_types", "legacy"])
def test_qwen2_moe_windows_the_layers_layer_types_marks(tmp_path, written):
    """Qwen2-MoE: the layers layer_types marks; a config without it (legacy): the even layers
    below max_window_layers, as Qwen2MoeConfig derives them."""
    hf = make_checkpoint(tmp_path / "hf", arch="qwen2_moe", layers=4, sliding_window=WINDOW, use_sliding_window=True,
                         max_window_layers=3, shared_expert_intermediate_size=64)
    raw = json.loads((hf / "config.json").read_text())
    assert raw["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    if not written:
        del raw["layer_types"]
        (hf / "config.json").write_text(json.dumps(raw))
    _windowed_logits_match(hf, (0, 2))
