"""A partial rotary (Phi-4-mini: partial_rotary_factor 0.75, RoPE on each head's first 96 of 128
dims, the rest passed through), here 12 of 16, with Phi-3's longrope short factors over the
rotated dims: as a Hugging Face folder and a GGUF file (phi3.rope.dimension_count = the rotated
dims), on the PyTorch and the C forward, against transformers, and every speculative method
against plain decoding. Other families refuse the factor (their transformers code rotates whole
heads)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_checkpoint, noisy_head_copy
from gguf_helpers import write_gguf
from specdec.model import ModelConfig, load_model, save_model
from test_heads import _heads_dirs
from arch_checks import (IDS, cached_logits, reference,  # noqa: F401 (run here)
                         test_f32_gguf_equals_the_checkpoint, test_greedy_output_equals_transformers_generate,
                         test_logits_match_transformers, test_speculative_greedy_equals_plain)

SHORT = [1.0, 1.1, 1.3, 1.7, 2.2, 3.0]        # 12 rotated dims: 6 frequencies


@pytest.fixture(scope="module", params=["default", "longrope"])
def files(request, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp(f"partial-{request.param}")
    kw = {"partial_rotary_factor": 0.75}
    if request.param == "longrope":
        kw.update(original_max_position_embeddings=128,
                  rope_scaling={"rope_type": "longrope", "short_factor": SHORT, "long_factor": [f * 2 for f in SHORT]})
    hf = make_checkpoint(root / "hf", arch="phi3", **kw)
    extra = {}
    if request.param == "longrope":    # llama.cpp's converter: the factors as tensors
        import numpy as np
        extra = {"rope_factors_short.weight": np.array(SHORT, dtype=np.float32),
                 "rope_factors_long.weight": np.array([f * 2 for f in SHORT], dtype=np.float32)}
    return {"kind": request.param, "hf": hf, "near": noisy_head_copy(hf, root / "near"),
            "f32": write_gguf(hf, root / "f32.gguf", extra_tensors=extra,
                              metadata={"phi3.rope.scaling.original_context_length": 128} if extra else None),
            **_heads_dirs(hf, root)}


def test_the_rotated_dims_are_read_saved_and_matter(files, tmp_path):
    model = load_model(files["hf"], "float32")
    assert (model.config.head_dim, model.config.rotary_dim) == (16, 12)
    assert (load_model(files["f32"]).config.head_dim, load_model(files["f32"]).config.rotary_dim) == (16, 12)
    assert model.inv_freq.shape == (6,)
    save_model(model, tmp_path / "saved", torch.float32)
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["partial_rotary_factor"] == 0.75
    tokens = torch.randint(0, 200, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = reference(files["hf"])(tokens[None]).logits[0]
        torch.testing.assert_close(reference(tmp_path / "saved")(tokens[None]).logits[0], ref)
        if files["kind"] == "longrope":      # its factors cover the rotated dims only
            return
        whole = load_model(files["hf"], "float32")
        cfg = whole.config.replace(rotary_dim=None)
        whole.config = whole.local_config = cfg
        whole.reset_rope("cpu")
        assert (cached_logits(whole, tokens, [(0, 17), (17, 40)]) - ref).abs().max() > 1e-3


def test_other_families_refuse_a_partial_rotary():
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5 is not supported for llama"):
        ModelConfig.from_hf(base)


def test_an_odd_rotated_width_rotates_every_frequency_pair(tmp_path):
    """int(24 * 0.3) = 7 rotated dims: transformers rotates 8 (4 frequencies, cos/sin twice as
    wide); the C forward had rotated 6, pairing the wrong dims."""
    hf = make_checkpoint(tmp_path / "odd", arch="phi3", seed=3, hidden=64, layers=2, partial_rotary_factor=0.3,
                         head_dim=24, num_attention_heads=2, num_key_value_heads=1)
    model = load_model(hf, "float32")
    assert model.config.rotary_dim == 7 and model.inv_freq.shape == (4,)
    tokens = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = reference(hf)(tokens[None]).logits[0]
        assert (cached_logits(model, tokens, [(0, 20), (20, 40)]) - ref).abs().max() < 1e-4
