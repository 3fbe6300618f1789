"""RoPE scaling beyond llama3's: linear (positions divided by factor) and YaRN (interpolated
frequencies below beta_slow rotations, extrapolated above beta_fast, and cos / sin scaled by the
attention factor), from Hugging Face configs and from GGUF metadata, in the PyTorch and the C
forward alike: logits equal transformers' past the original context."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_checkpoint
from gguf_helpers import write_gguf
from specdec import LLM, SamplingParams, kernels
from specdec.model import load_model
from arch_checks import cached_logits, reference, without_kernels

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                              "attention_factor": 1.3},
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("rope")
    base = make_checkpoint(root / "base", seed=2, hidden=64, layers=2)
    return {name: make_checkpoint(root / name, seed=2, hidden=64, layers=2, tokenizer_from=base,
                                  rope_scaling=dict(s))
            for name, s in SCALINGS.items()}


@pytest.mark.parametrize("c_path", [True, False], ids=["c", "pytorch"])
@pytest.mark.parametrize("name", list(SCALINGS))
def test_logits_match_transformers_past_the_original_context(folders, monkeypatch, name, c_path):
    if c_path and kernels.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    folder = folders[name]
    assert json.loads((folder / "config.json").read_text()).get("rope_parameters", {}).get("rope_type") \
        == SCALINGS[name]["rope_type"]                         # transformers wrote it (v5: rope_parameters)
    without_kernels(monkeypatch, c_path)
    ours = load_model(folder, "float32")
    assert ours.config.rope_scaling["rope_type"] == SCALINGS[name]["rope_type"]
    tokens = torch.randint(0, ours.config.vocab_size, (1, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = reference(folder)(tokens).logits[0]
        full = ours(tokens).logits[0]
        chunks = cached_logits(ours, tokens[0], [(0, 40), (40, 41), (41, 100)])
        plain = reference(make_checkpoint(folder.parent / f"{name}-none", seed=2, hidden=64, layers=2,
                                          tokenizer_from=folder))(tokens).logits[0]
    assert (full - ref).abs().max() < 1e-4 and (chunks - ref).abs().max() < 1e-4
    assert (ref - plain).abs().max() > 1e-2                    # the scaling changed something


@pytest.mark.parametrize("name", ["linear", "yarn"])
def test_gguf_rope_scaling_metadata_equals_the_checkpoint(folders, tmp_path, name):
    """llama.cpp's {arch}.rope.scaling.type / .factor / .original_context_length keys."""
    s = SCALINGS[name]
    meta = {"llama.rope.scaling.type": name, "llama.rope.scaling.factor": float(s["factor"])}
    if name == "yarn":
        meta["llama.rope.scaling.original_context_length"] = s["original_max_position_embeddings"]
    path = write_gguf(folders[name], tmp_path / f"{name}.gguf", metadata=meta)
    ours = load_model(path)
    assert ours.config.rope_scaling["rope_type"] == name
    tokens = torch.randint(0, ours.config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens).logits[0], reference(folders[name])(tokens).logits[0],
                                   atol=1e-4, rtol=1e-4)


def test_greedy_speculation_equals_plain_under_yarn(folders):
    """Long prompts past the original context, four at once, ngram and self-speculation."""
    folder = folders["yarn"]
    prompts = [{"prompt_token_ids": [(7 * i + j) % 50 + 2 for j in range(60 + 5 * i)]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(folder, dtype="float32", num_speculative_tokens=0).generate(
        prompts, params)]
    for spec in ({"method": "ngram", "num_speculative_tokens": 3},
                 {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 2}):
        llm = LLM(folder, dtype="float32", speculative_config=spec, max_num_seqs=4)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain


def test_other_scalings_are_refused(tmp_path):
    folder = make_checkpoint(tmp_path / "dyn", hidden=64, layers=1, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'dynamic' \\(supported: llama3, linear, yarn, longrope\\)"):
        load_model(folder, "float32")
