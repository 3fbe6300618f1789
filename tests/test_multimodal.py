"""Multimodal checkpoints run their language model, text in and text out: LLaVA (a llama),
Mistral 3 (Mistral-Small-3.1's layout: a mistral, tied by the top level's tie_word_embeddings),
Qwen2.5-VL and Qwen3-VL (a qwen2 / qwen3 whose multimodal RoPE is plain RoPE for text) and Gemma 3
(tests/test_gemma.py). The folder transformers writes (text_config, the language
model under language_model.*, a vision tower and projector beside it) gives the logits
transformers' multimodal model gives for text alone; the vision weights are not loaded."""

from __future__ import annotations

import pytest
import torch
import transformers

from arch_checks import cached_logits
from conftest import make_checkpoint
from specdec import LLM, SamplingParams
from specdec.model import ModelConfig, load_model

VISION = {
    "llava": (transformers.LlavaConfig, transformers.LlavaForConditionalGeneration, "llama",
              transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, image_size=28, patch_size=14)),
    "mistral3": (transformers.Mistral3Config, transformers.Mistral3ForConditionalGeneration, "mistral",
                 transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                  num_attention_heads=2, image_size=28, patch_size=14)),
    # Qwen2.5-VL: a qwen2 whose multimodal RoPE is plain RoPE for text alone
    "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration, "qwen2",
                   {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                    "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "fullatt_block_indexes": [0]}),
    "qwen3_vl": (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration, "qwen3",
                 {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                  "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "deepstack_visual_indexes": [0]}),
}
TEXT = {"qwen2_5_vl": {"rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}, "rope_theta": 1e6},
        "qwen3_vl": {"rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}}}


@pytest.mark.parametrize("kind", list(VISION))
def test_multimodal_checkpoint_runs_its_language_model(kind, tmp_path):
    config_cls, model_cls, arch, vision = VISION[kind]
    text_dir = make_checkpoint(tmp_path / "text", arch=arch)
    text = transformers.AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    cfg = config_cls(text_config={**text.config.to_dict(), **TEXT.get(kind, {})},
                     vision_config=vision if isinstance(vision, dict) else vision.to_dict(),
                     image_token_index=text.config.vocab_size - 1)
    torch.manual_seed(0)
    mm = model_cls(cfg).eval()
    with torch.no_grad():
        mm.model.language_model.load_state_dict(text.model.state_dict())
        if not cfg.tie_word_embeddings:
            mm.lm_head.weight.copy_(text.lm_head.weight)
    mm.save_pretrained(tmp_path / "mm")
    for f in text_dir.glob("tokenizer*.json"):
        (tmp_path / "mm" / f.name).write_bytes(f.read_bytes())
    model = load_model(tmp_path / "mm", "float32")
    assert model.config.model_type == arch and model.config.tie_word_embeddings == cfg.tie_word_embeddings
    assert model.config.rope_scaling is None
    tokens = torch.randint(0, 200, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = mm(input_ids=tokens[None]).logits[0]
        assert (cached_logits(model, tokens, [(0, 17), (17, 40)]) - ref).abs().max() < 1e-4
    out = LLM(str(tmp_path / "mm"), dtype="float32", num_speculative_tokens=0).generate(
        {"prompt_token_ids": tokens[:10].tolist()}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert out[0].outputs[0].token_ids == mm.generate(tokens[None, :10], max_new_tokens=8, do_sample=False,
                                                      eos_token_id=mm.config.text_config.vocab_size)[0, 10:].tolist()


def test_an_unsupported_language_model_is_one_line():
    cfg = {"architectures": ["LlavaForConditionalGeneration"], "text_config": {"model_type": "opt"}}
    with pytest.raises(ValueError, match="LlavaForConditionalGeneration's language model 'opt' is not supported"):
        ModelConfig.from_hf(cfg)


def test_the_flat_qwen_vl_layout():
    """Qwen2.5-VL folders written before transformers 5 keep the text fields at the top level."""
    flat = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "vocab_size": 64,
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "rope_theta": 1e6, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "vision_config": {"depth": 32}, "tie_word_embeddings": True}
    cfg = ModelConfig.from_hf(flat)
    assert (cfg.model_type, cfg.rope_scaling, cfg.rope_theta, cfg.attention_bias, cfg.tie_word_embeddings) == \
        ("qwen2", None, 1e6, True, True)
