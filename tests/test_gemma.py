"""Gemma 1, 2 and 3 (text): GeGLU, embeddings x sqrt(hidden), RMSNorm scaling by (1 + w); Gemma 2
and 3 add sandwich norms, a query scale from query_pre_attn_scalar and sliding-window attention
in some layers; Gemma 2 soft-caps its scores and logits with tanh; Gemma 3 norms q and k per
head and gives its sliding layers their own RoPE base. Each as a Hugging Face folder and as a
GGUF file (llama.cpp's names and keys, norms stored as 1 + w), on the PyTorch and the C forward,
against transformers, and every speculative method against plain decoding (windows of 8
tokens, so that prompts and drafts cross them)."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.model import ModelConfig, load_model, save_model
from arch_checks import (IDS, arch_files, cached_logits, check_rows_bit_identical, reference,  # noqa: F401 (run here)
                         test_f32_gguf_equals_the_checkpoint, test_greedy_output_equals_transformers_generate,
                         test_logits_match_transformers, test_speculative_greedy_equals_plain,
                         test_speculative_greedy_equals_plain_padded_attention)

WINDOW = 8
CONFIGS = {
    "gemma": {},
    "gemma2": {"sliding_window": WINDOW, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 0.5,
               "final_logit_softcapping": 3.0},
    # two layers: 0 slides (local RoPE base 100), 1 is global (base 1e6, linear scaling x2)
    "gemma3_text": {"sliding_window": WINDOW, "query_pre_attn_scalar": 24, "sliding_window_pattern": 2,
                    "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}},
}
# llama.cpp's keys for the same settings (its converter leaves query_pre_attn_scalar out: the scale is given)
GGUF_KEYS = {
    "gemma": {},
    "gemma2": {"gemma2.attention.sliding_window": WINDOW, "gemma2.attention.scale": 24 ** -0.5,
               "gemma2.attn_logit_softcapping": 0.5, "gemma2.final_logit_softcapping": 3.0},
    "gemma3_text": {"gemma3.attention.sliding_window": WINDOW, "gemma3.attention.scale": 24 ** -0.5,
                    "gemma3.attention.sliding_window_pattern": 2, "gemma3.rope.freq_base_swa": 100.0,
                    "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 2.0},
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def files(request, tmp_path_factory) -> dict:
    arch = request.param
    return arch_files(tmp_path_factory.mktemp(arch), arch, CONFIGS[arch], GGUF_KEYS[arch])


def test_config_reads_and_writes_gemma(files, tmp_path):
    """Both formats give the same settings; a saved folder loads in transformers as the original."""
    model = load_model(files["hf"], "float32")
    cfg, g = model.config, load_model(files["f32"]).config
    fields = ("hidden_act", "embedding_multiplier", "sandwich_norms", "attn_softcap", "final_softcap",
              "sliding_window", "sliding_layers", "local_rope_theta", "rope_theta", "qk_norm",
              "tie_word_embeddings", "model_type")
    floats = [f for f in fields if isinstance(getattr(cfg, f), float)]     # approx: flat numbers only
    assert {f: getattr(g, f) for f in fields if f not in floats} == {f: getattr(cfg, f) for f in fields if f not in floats}
    assert [getattr(g, f) for f in floats] == pytest.approx([getattr(cfg, f) for f in floats])
    assert g.rope_scaling == cfg.rope_scaling == ({"rope_type": "linear", "factor": 2.0}
                                                  if files["arch"] == "gemma3_text" else None)
    assert (g.attention_multiplier or 0.25) == pytest.approx(cfg.attention_multiplier or 0.25, rel=1e-6)
    assert cfg.hidden_act == "gelu_tanh" and cfg.embedding_multiplier == 8.0 and cfg.tie_word_embeddings
    if files["arch"] != "gemma":
        assert cfg.sliding_window == WINDOW and cfg.sliding_layers == (0,) and cfg.attention_multiplier == 24 ** -0.5
    assert (cfg.local_rope_theta, cfg.rope_theta) == ((100.0, 1e6) if files["arch"] == "gemma3_text" else (None, 10000.0))
    save_model(model, tmp_path / "saved", torch.float32)
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["model_type"] == files["arch"]
    with torch.no_grad():
        torch.testing.assert_close(reference(tmp_path / "saved")(IDS).logits, reference(files["hf"])(IDS).logits)


def test_each_gemma_feature_matters(files, monkeypatch):
    """With a window, a soft-cap or the local RoPE base turned off, the logits leave
    transformers' (the shared test checks that they match as loaded, on both paths)."""
    tokens = torch.randint(0, 200, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = reference(files["hf"])(tokens[None]).logits[0]
    changes = {"norm (1 + w)": lambda m: [layer.input_layernorm.weight.sub_(1) for layer in m.model.layers]}
    if files["arch"] != "gemma":
        changes["window"] = lambda m: [setattr(layer.self_attn, "window", None) for layer in m.model.layers]
    if files["arch"] == "gemma2":
        changes["soft-cap"] = lambda m: setattr(m, "local_config", m.config.replace(attn_softcap=0.0))
    if files["arch"] == "gemma3_text":
        changes["local RoPE"] = lambda m: [setattr(layer.self_attn, "local_rope", False) for layer in m.model.layers]
    for name, change in changes.items():
        ours = load_model(files["hf"], "float32")
        with torch.no_grad():
            assert (cached_logits(ours, tokens, [(0, 17), (17, 18), (18, 40)]) - ref).abs().max() < 1e-4
            change(ours)
            assert (cached_logits(ours, tokens, [(0, 17), (17, 18), (18, 40)]) - ref).abs().max() > 1e-3, name


def test_bf16_checkpoint_keeps_gemma_norms_in_fp32(files, tmp_path):
    """1 + w in bf16 would round the small w's away: the norms load as fp32 whatever the dtype."""
    model = load_model(files["hf"], "bfloat16")
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert norms and all(p.dtype == torch.float32 for p in norms)
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("bad, message", [
    ({"hidden_activation": "relu"}, "hidden_activation 'relu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries for 2 layers"),
])
def test_unsupported_gemma_settings_are_refused(bad, message):
    cfg = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 64, "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 16}
    assert ModelConfig.from_hf(cfg).sliding_layers == (0,)       # transformers' default: every other layer
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**cfg, **bad})


@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=["kv-fp32", "kv-int8"])
def test_windowed_rows_are_bit_identical_however_chunked_and_batched(files, kv_dtype):
    """The C forward skips the cache blocks before every query's window (blocks of 4 slots,
    window 8): the rows stay the same bits however chunked and batched."""
    from specdec import kernels

    if kernels.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    whole = check_rows_bit_identical(load_model(files["hf"], "float32"), 48, kv_dtype)
    tokens = torch.randint(0, 200, (48,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = reference(files["hf"])(tokens[None]).logits[0]
    assert (whole - ref).abs().max() < (1e-4 if kv_dtype is None else 0.2)


def test_gemma3_multimodal_checkpoint_runs_its_language_model(files, tmp_path):
    """A Gemma3ForConditionalGeneration folder (gemma-3-4b-it's layout: text_config, the language
    model under language_model.*, a vision tower and projector beside it): text in, text out,
    with the logits transformers' multimodal model gives for text alone."""
    import transformers

    if files["arch"] != "gemma3_text":
        pytest.skip("Gemma 3 only")
    text = transformers.Gemma3TextConfig.from_pretrained(files["hf"])
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                                    image_token_index=text.vocab_size - 1, boi_token_index=text.vocab_size - 3,
                                    eoi_token_index=text.vocab_size - 2)
    torch.manual_seed(0)
    mm = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        mm.model.language_model.load_state_dict(reference(files["hf"]).model.state_dict())
        mm.lm_head.weight.copy_(mm.model.language_model.embed_tokens.weight)
    mm.save_pretrained(tmp_path / "mm")
    for f in files["hf"].glob("tokenizer*.json"):
        (tmp_path / "mm" / f.name).write_bytes(f.read_bytes())
    model = load_model(tmp_path / "mm", "float32")
    assert model.config.model_type == "gemma3_text" and model.config.sliding_layers == (0,)
    tokens = torch.randint(0, 200, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = mm(input_ids=tokens[None]).logits[0]
        assert (cached_logits(model, tokens, [(0, 17), (17, 18), (18, 40)]) - ref).abs().max() < 1e-4
    from specdec import LLM, SamplingParams
    out = LLM(str(tmp_path / "mm"), dtype="float32", num_speculative_tokens=0).generate(
        {"prompt_token_ids": tokens[:10].tolist()}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


def test_gemma3_ignores_attn_logit_softcapping(tmp_path):
    """transformers' Gemma 3 never caps its attention scores, whatever attn_logit_softcapping says
    (Gemma 2 does: test_each_gemma_feature_matters)."""
    from conftest import make_checkpoint

    hf = make_checkpoint(tmp_path / "hf", arch="gemma3_text", sliding_window=WINDOW, sliding_window_pattern=2,
                         attn_logit_softcapping=0.5, final_logit_softcapping=3.0)
    model = load_model(hf, "float32")
    assert (model.config.attn_softcap, model.config.final_softcap) == (0.0, 3.0)
    tokens = torch.randint(0, 90, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = reference(hf)(tokens[None]).logits[0]
        assert (cached_logits(model, tokens, [(0, 17), (17, 18), (18, 40)]) - ref).abs().max() < 1e-4
