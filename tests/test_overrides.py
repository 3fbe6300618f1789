"""vLLM's --hf-overrides (config.json fields replaced, for a GGUF's config too; a yarn or linear
rope_scaling extends the context to original x factor) and --disable-sliding-window (full
attention, the context capped at the window), through LLM and the command line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from arch_checks import cached_logits
from conftest import make_checkpoint
from gguf_helpers import write_gguf
from specdec import LLM, SamplingParams
from specdec.cli import build_parser, llm_from_args, main
from specdec.model import load_model

YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    root = tmp_path_factory.mktemp("overrides")
    hf = make_checkpoint(root / "hf", arch="qwen3")
    edited = root / "edited"            # the same checkpoint with the scaling written into config.json
    shutil.copytree(hf, edited)
    cfg = json.loads((edited / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    (edited / "config.json").write_text(json.dumps({**cfg, "rope_scaling": YARN, "rope_theta": 10000.0,
                                                    "max_position_embeddings": 512}))
    return {"hf": hf, "edited": edited, "gguf": write_gguf(hf, root / "m.gguf")}


def test_a_yarn_override_equals_the_edited_config(qwen3):
    """The override extends the context to 256 x 2 and gives the same logits, bit for bit, as the
    checkpoint whose config.json says so (tests/test_rope_scaling.py checks those against
    transformers), from the folder and from the GGUF."""
    edited = load_model(qwen3["edited"], "float32")
    tokens = torch.randint(0, 200, (300,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = cached_logits(edited, tokens, [(0, 280), (280, 300)])
        for path in (qwen3["hf"], qwen3["gguf"]):
            model = load_model(path, "float32", hf_overrides={"rope_scaling": YARN})
            assert model.config.max_position_embeddings == 512 and model.config.rope_scaling["rope_type"] == "yarn"
            torch.testing.assert_close(cached_logits(model, tokens, [(0, 280), (280, 300)]), ref, rtol=1e-5, atol=1e-5)
        plain = load_model(qwen3["hf"], "float32")
        assert plain.config.max_position_embeddings == 256
        # transformers 5's name for it, over a config that names a scaling of its own
        from specdec.model.config import ModelConfig, apply_hf_overrides
        raw = {**plain.config.to_hf(), "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
        cfg = ModelConfig.from_hf(apply_hf_overrides(raw, {"rope_parameters": {**YARN, "rope_theta": 10000.0}}))
        assert (cfg.rope_scaling["rope_type"], cfg.configured().max_position_embeddings) == ("yarn", 512)


@pytest.mark.parametrize("scaling", [{"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256},
                                     {"type": "yarn", "factor": 2.0}, {"type": "linear", "factor": 2.0}])
def test_a_scaled_config_serves_the_derived_length(qwen3, tmp_path, scaling):
    """A config.json that carries the scaling (Qwen's YaRN recipe: add rope_scaling to it) serves
    vLLM's derived length, the original length times the factor, by default and when asked (it
    kept max_position_embeddings and refused a longer --max-model-len); the export of a linear
    model writes the length it was trained at, so a reload does not double it."""
    from specdec.model.export import _trained_length

    folder = shutil.copytree(qwen3["hf"], tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(rope_scaling=scaling, rope_theta=10000.0)
    (folder / "config.json").write_text(json.dumps(cfg))
    assert cfg["max_position_embeddings"] == 256
    assert LLM(str(folder), dtype="float32", num_speculative_tokens=0).engine.max_model_len == 512
    llm = LLM(str(folder), dtype="float32", num_speculative_tokens=0, max_model_len=500)
    assert llm.engine.max_model_len == 500 and _trained_length(llm.target.config) == (256 if "linear" in
                                                                                      scaling.values() else 512)
    with pytest.raises(ValueError, match=r"max_model_len must be in \[2, 512\]"):
        LLM(str(folder), dtype="float32", num_speculative_tokens=0, max_model_len=513)


def test_overrides_through_llm_and_the_command_line(qwen3, capsys):
    llm = LLM(str(qwen3["hf"]), dtype="float32", num_speculative_tokens=0, hf_overrides={"max_position_embeddings": 128})
    assert llm.target.config.max_position_embeddings == 128
    with pytest.raises(ValueError, match="prompt is too long"):
        llm.generate({"prompt_token_ids": [5] * 128}, SamplingParams(max_tokens=1))
    args = build_parser().parse_args(["generate", "--model", str(qwen3["gguf"]), "--hf-overrides",
                                      '{"max_position_embeddings": 64}', "--num-speculative-tokens", "0", "hi"])
    assert llm_from_args(args).target.config.max_position_embeddings == 64
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(qwen3["hf"]), "--hf-overrides", "[1]", "hi"])
    assert e.value.code == 2 and "must be a JSON object" in capsys.readouterr().err
    assert main(["generate", "--model", str(qwen3["hf"]), "--hf-overrides", '{"num_hidden_layers": 3}', "hi"]) != 0
    assert "weight" in capsys.readouterr().err          # the checkpoint has 2 layers: one clear line


def test_disable_sliding_window_caps_the_context(tmp_path):
    hf = make_checkpoint(tmp_path / "hf", arch="mistral", sliding_window=8)
    windowed = load_model(hf, "float32")
    assert windowed.config.sliding_window == 8
    for path in (hf, write_gguf(hf, tmp_path / "m.gguf", metadata={"mistral.attention.sliding_window": 8})):
        full = load_model(path, "float32", disable_sliding_window=True)
        cfg = full.config
        assert (cfg.sliding_window, cfg.sliding_layers, cfg.max_position_embeddings) == (None, (), 8)
        assert all(layer.self_attn.window is None for layer in full.model.layers)
        tokens = torch.arange(3, 11)
        with torch.no_grad():            # within the window, full attention is windowed attention
            torch.testing.assert_close(cached_logits(full, tokens, [(0, 8)]), cached_logits(windowed, tokens, [(0, 8)]),
                                       rtol=1e-5, atol=1e-5)
    llm = LLM(str(hf), dtype="float32", num_speculative_tokens=0, disable_sliding_window=True)
    with pytest.raises(ValueError, match="prompt is too long"):
        llm.generate({"prompt_token_ids": [5] * 8}, SamplingParams(max_tokens=1))


def test_gemma3_scaling_is_its_length_already(tmp_path):
    """Gemma 3's config stores the scaled length (131072 with linear x8 on its global layers):
    vLLM derives no longer one from the factor, nor does specdec (it served 8 x the context)."""
    folder = tmp_path / "g3"
    make_checkpoint(folder, arch="gemma3_text", rope_scaling={"rope_type": "linear", "factor": 8.0},
                    max_position_embeddings=256)
    assert LLM(str(folder), num_speculative_tokens=0).engine.max_model_len == 256
