"""A PEFT adapter of a vision-language checkpoint (q_proj / v_proj adapt its vision tower too,
whose keys hold `layers.N` as well): the tower's tensors are ignored, as vLLM ignores them, and
the language model's are applied. They had overwritten the decoder's own (a silent wrong output
when the shapes agree, a false refusal when they do not)."""

from __future__ import annotations

import shutil

import peft
import pytest
import torch
import transformers

from specdec import LLM, SamplingParams
from specdec.lora import LoRARequest

IDS = [[0, 5, 17, 300, 42], [0, 900, 77, 120, 5, 6, 7, 8]]
N = 10


@pytest.mark.parametrize("tower_width", [64, 48])        # 64: the tower's projections have the decoder's shapes
def test_a_vision_language_adapter_applies_to_the_language_model(tmp_path, tower_width):
    torch.manual_seed(0)
    text = transformers.LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                    max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
                                    tie_word_embeddings=False)
    vision = transformers.CLIPVisionConfig(hidden_size=tower_width, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=32, patch_size=16,
                                           projection_dim=64)
    model = transformers.LlavaForConditionalGeneration(
        transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=1000))
    folder, adapter = tmp_path / "llava", tmp_path / "qv"
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(f"models/target/{name}", folder / name)
    tuned = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                       init_lora_weights=False))
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_B" in name:
                p.mul_(3)
    tuned.save_pretrained(adapter)
    tuned.eval()
    expected = []
    with torch.no_grad():
        for ids in IDS:
            out = tuned.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0)
            expected.append(out[0, len(ids):].tolist())
    llm = LLM(str(folder), enable_lora=True, max_lora_rank=8, dtype="float32")
    outs = llm.generate([{"prompt_token_ids": ids} for ids in IDS],
                        SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),
                        lora_request=LoRARequest("qv", 1, str(adapter)), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
