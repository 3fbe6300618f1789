"""A GGUF target as a transformers model (model/export.py), and the drafter pipeline run on one:
`specdec train answers --target x.gguf` and `specdec train eagle --target x.gguf`."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.model import load_model
from specdec.model.export import ExportError, llama_state_dict, save_transformers, to_transformers
from specdec.train.answers import load_answer_shards
from specdec.train.headdata import FlatData

IDS = [0, 9, 17, 41, 5, 77, 130, 9, 17, 41, 200, 3]


def logits_of(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("key", ["llama_q", "llama_mixed", "qwen2_q"])
def test_a_gguf_target_converts_to_transformers_with_the_same_logits(gguf_files, key):
    """Tied Q8_0 embeddings with packed Q4_K / Q4_0 / Q4_1 matrices, an untied mixed-type file, and
    Qwen2's q/k/v biases: transformers gives specdec's logits on the dequantized weights."""
    ours = load_model(gguf_files[key], "float32", quantization="none")
    hf = to_transformers(ours)
    assert type(hf).__name__ == ("Qwen2ForCausalLM" if key == "qwen2_q" else "LlamaForCausalLM")
    assert (hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()) == ours.config.tie_word_embeddings
    want = ours(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(logits_of(hf), want, atol=2e-4, rtol=0)
    # the fused matrices were split, not copied: the runtime's rows are the folder's
    sd = llama_state_dict(ours)
    q = ours.config.num_attention_heads * ours.config.head_dim
    qkv = ours.model.layers[1].self_attn.qkv_proj.weight
    assert sd["model.layers.1.self_attn.q_proj.weight"].data_ptr() == qkv.data_ptr()
    assert torch.equal(sd["model.layers.1.self_attn.k_proj.weight"], qkv[q:q + ours.config.num_key_value_heads * ours.config.head_dim])


def test_a_saved_folder_loads_back_in_transformers_and_specdec(gguf_files, tmp_path):
    ours = load_model(gguf_files["llama_q"], "float32", quantization="none")
    save_transformers(ours, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    want = ours(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(logits_of(hf), want, atol=2e-4, rtol=0)
    again = load_model(tmp_path / "hf", "float32")
    torch.testing.assert_close(again(torch.tensor([IDS])).logits[0], want, atol=2e-4, rtol=0)
    bf16 = to_transformers(ours, torch.bfloat16)
    assert bf16.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16


def test_layouts_that_do_not_convert_are_refused_in_one_line(gguf_files, tiny_pair):
    packed = load_model(gguf_files["llama_q"], "float32", quantization="gguf")
    with pytest.raises(ExportError, match="packed .* quantization='none'"):
        to_transformers(packed)
    target = load_model(tiny_pair[0], "float32")
    for change, word in ((dict(qk_norm=True), "q/k norms"), (dict(final_softcap=30.0), "soft-capping"),
                         (dict(sliding_window=64, sliding_layers=(0,)), "sliding windows"),
                         (dict(hidden_act="gelu_pytorch_tanh"), "activation")):
        target.config = dataclasses.replace(load_model(tiny_pair[0], "float32").config, **change)
        with pytest.raises(ExportError, match=word):
            to_transformers(target)


def test_answers_and_drafters_from_a_gguf_target(gguf_files, tmp_path):
    """The chat-data pipeline on a GGUF target: transformers' answers (the target converted)
    equal specdec's own runtime's on greedy rows, and an EAGLE head and a vocabulary draft train on them and draft
    losslessly for the packed file."""
    from specdec.train.answers import chat_ids
    from specdec.tokenizer import Tokenizer

    gguf = str(gguf_files["llama_q"])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"id": "{i}", "prompt": "say {w} and {w} again"}}\n'
                               for i, w in enumerate(["one", "two", "three", "four", "five", "six"])))
    common = ["train", "answers", "--target", gguf, "--prompts", str(prompts), "--max-new-tokens", "10",
              "--batch", "3", "--per-shard", "2", "--dtype", "float32", "--device", "cpu"]
    assert main([*common, "--out", str(tmp_path / "hf"), "--backend", "transformers"]) == 0
    assert main([*common, "--out", str(tmp_path / "ours"), "--backend", "specdec"]) == 0
    hf = load_answer_shards(sorted((tmp_path / "hf").glob("shard_*.pt")))
    ours = load_answer_shards(sorted((tmp_path / "ours").glob("shard_*.pt")))
    a, b = FlatData.from_answers(hf), FlatData.from_answers(ours)
    assert ours["greedy"].any() and torch.equal(hf["greedy"], ours["greedy"])
    for i in range(b.num_sequences):
        if ours["greedy"][i]:
            x, y = slice(int(a.starts[i]), int(a.ends[i])), slice(int(b.starts[i]), int(b.ends[i]))
            assert torch.equal(hf["tokens"][x], ours["tokens"][y])
            assert torch.allclose(hf["hidden"][x], ours["hidden"][y], atol=2e-2)
    out = tmp_path / "eagle"
    assert main(["train", "eagle", "--target", gguf, "--data", str(tmp_path / "hf"), "--data-kind", "chat",
                 "--val-shards", "1", "--draft-vocab", "64", "--window", "8", "--batch", "2", "--steps", "3",
                 "--report-prompts", "0", "--out", str(out), "--work", str(tmp_path / "w"), "--device", "cpu"]) == 0
    assert " CPU, 1 thread(s)" in (out / "README.md").read_text()      # the card names where it trained
    assert main(["train", "vocab-draft", "--target", gguf, "--data", str(tmp_path / "hf"), "--layers", "1",
                 "--draft-vocab", "64", "--steps", "2", "--batch", "2", "--window", "16", "--val-shards", "1",
                 "--precision", "fp32", "--report-prompts", "0", "--out", str(tmp_path / "draft"),
                 "--work", str(tmp_path / "wd")]) == 0
    plain = LLM(gguf, quantization="gguf")
    fast = LLM(gguf, quantization="gguf", speculative_config={"method": "eagle", "model": str(out),
                                                             "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tok = Tokenizer(gguf)
    draft = LLM(gguf, quantization="gguf", speculative_config={"method": "draft_model", "model": str(tmp_path / "draft"),
                                                              "num_speculative_tokens": 3})
    for text in ("say seven", "say eight and nine"):
        ids = {"prompt_token_ids": chat_ids(tok, text)}
        want = plain.generate(ids, params)[0].outputs[0].token_ids
        for llm in (fast, draft):
            got = llm.generate(ids, params)[0]
            assert got.outputs[0].token_ids == want and got.stats.draft_tokens > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
@pytest.mark.parametrize("cmd", ["eagle", "answers"])
def test_a_cuda_device_without_cuda_is_one_line(cmd, gguf_files, tmp_path, capsys):
    args = (["--data", str(tmp_path), "--data-kind", "chat"] if cmd == "eagle"
            else ["--prompts", str(tmp_path / "p.jsonl")])
    assert main(["train", cmd, "--target", str(gguf_files["llama_q"]), "--out", str(tmp_path / "o"), *args,
                 "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cuda" in err[0] and "no CUDA" in err[0]


@pytest.mark.parametrize("rope_scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}])
def test_rope_scaling_carries_over(rope_scaling, tmp_path):
    """Llama 3's, linear and YaRN scaling: positions past the original context give specdec's logits."""
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   rope_scaling=rope_scaling)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    ours = load_model(tmp_path, "float32")
    ids = (IDS * 12)[:140]
    torch.testing.assert_close(logits_of(to_transformers(ours), ids), ours(torch.tensor([ids])).logits[0],
                               atol=2e-4, rtol=0)
