"""RoPE scaling beyond llama3's: linear (positions divided by factor), YaRN (interpolated
frequencies below beta_slow rotations, extrapolated above beta_fast, and cos / sin scaled by the
attention factor) and dynamic NTK (fixed at start-up by max_model_len), from Hugging Face configs and from GGUF metadata, in the PyTorch and the C
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
    for spec in ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
                 {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 2}):
        llm = LLM(folder, dtype="float32", speculative_config=spec, max_num_seqs=4)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain


@pytest.fixture(scope="module")
def dynamic(folders, tmp_path_factory):
    """Dynamic NTK scaling (factor 2) over a 64-token context."""
    return make_checkpoint(tmp_path_factory.mktemp("dynamic") / "hf", seed=2, hidden=64, layers=2,
                           tokenizer_from=folders["linear"], max_position_embeddings=64,
                           rope_scaling={"rope_type": "dynamic", "factor": 2.0})


@pytest.mark.parametrize("c_path", [True, False], ids=["c", "pytorch"])
def test_dynamic_ntk_fixed_at_start_up(dynamic, monkeypatch, c_path):
    """vLLM's static dynamic-NTK: within max_position_embeddings plain RoPE, as transformers runs
    a sequence that short; --max-model-len past it (up to 2x here) the base transformers uses
    for a 128-token sequence, at every position: logits equal transformers' one forward."""
    if c_path and kernels.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    without_kernels(monkeypatch, c_path)
    short = load_model(dynamic, "float32")
    assert short.config.max_position_embeddings == 64 and short.config.rope_scaling is None
    long = load_model(dynamic, "float32", max_model_len=100)
    assert long.config.max_position_embeddings == 128 and long.config.rope_theta > short.config.rope_theta
    ids = torch.randint(0, short.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref_short, ref_long = reference(dynamic)(ids[:, :64]).logits[0], reference(dynamic)(ids).logits[0]
        assert (short(ids[:, :64]).logits[0] - ref_short).abs().max() < 1e-4
        assert (long(ids).logits[0] - ref_long).abs().max() < 1e-4
        assert (cached_logits(long, ids[0], [(0, 50), (50, 51), (51, 128)]) - ref_long).abs().max() < 1e-4
        assert (ref_long[:64] - ref_short).abs().max() > 1e-2       # the base moved


def test_dynamic_ntk_max_model_len_bounds(dynamic):
    assert LLM(dynamic, dtype="float32", num_speculative_tokens=0).engine.max_model_len == 64
    llm = LLM(dynamic, dtype="float32", num_speculative_tokens=0, max_model_len=128)
    out = llm.generate([{"prompt_token_ids": list(range(2, 62))}], SamplingParams(temperature=0, max_tokens=60,
                                                                               ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 60
    with pytest.raises(ValueError, match=r"max_model_len must be in \[2, 128\], got 129"):
        LLM(dynamic, dtype="float32", num_speculative_tokens=0, max_model_len=129)


def test_other_scalings_are_refused(tmp_path):
    folder = make_checkpoint(tmp_path / "dyn", hidden=64, layers=1, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {**config["rope_parameters"], "rope_type": "ntk-by-parts"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'ntk-by-parts' "
                                         "\\(supported: llama3, linear, yarn, longrope, dynamic\\)"):
        load_model(folder, "float32")
