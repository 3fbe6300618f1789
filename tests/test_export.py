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
    """The chat-data pipeline on a GGUF target. The transformers backend answers as the file's
    dequantized model (export.py): its greedy answers and features are specdec's runtime's on the
    dequantized weights (quantization="none"), not those of the packed weights specdec serves
    (int8-rounded activations: on the Q4_1 SmolLM2 4 of 8 greedy answers of 48 tokens are identical;
    the specdec backend's are the served ones, tests/test_chat_train.py). An EAGLE head and a
    vocabulary draft train on them and draft losslessly for the packed file."""
    from specdec.sampling import make_generator
    from specdec.tokenizer import Tokenizer
    from specdec.train.answers import AnswerConfig, answer_batch, chat_ids

    gguf = str(gguf_files["llama_q"])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"id": "{i}", "prompt": "say {w} and {w} again"}}\n'
                               for i, w in enumerate(["one", "two", "three", "four", "five", "six"])))
    common = ["train", "answers", "--target", gguf, "--prompts", str(prompts), "--max-new-tokens", "10",
              "--batch", "3", "--per-shard", "2", "--dtype", "float32", "--device", "cpu"]
    assert main([*common, "--out", str(tmp_path / "hf"), "--backend", "transformers"]) == 0
    hf = load_answer_shards(sorted((tmp_path / "hf").glob("shard_*.pt")))
    a = FlatData.from_answers(hf)
    rows = [i for i in range(a.num_sequences) if hf["greedy"][i]]
    assert rows
    dense = load_model(gguf, "float32", quantization="none")       # the dequantized model, specdec's runtime
    want = answer_batch(dense, [hf["tokens"][int(a.starts[i]):int(a.answer_starts[i])].tolist() for i in rows],
                        [True] * len(rows), AnswerConfig(max_new_tokens=10), set(Tokenizer(gguf).eos_token_ids),
                        make_generator(0, dense.device))
    for i, w in zip(rows, want):
        s, ans, e = int(a.starts[i]), int(a.answer_starts[i]), int(a.ends[i])
        assert hf["tokens"][ans:e].tolist() == w["answer"]
        assert torch.allclose(hf["hidden"][s:e - 1].float(), w["hidden"], atol=2e-2)
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


def _llama_cpp_divisors(cfg, scaling):
    """llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors): Llama 3's scaling
    as one divisor per rotary frequency, the rope_freqs.weight tensor (float64 maths, float32)."""
    import math

    import numpy as np

    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (cfg["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            s = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, dtype=np.float32)


LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 512}


def test_a_gguf_with_rope_freqs_exports_llama3_scaling_or_is_refused(tmp_path):
    """llama.cpp stores Llama 3's rope scaling as rope_freqs.weight (divisors, no rope_scaling
    metadata): the export recovers transformers' llama3 parameters from them, checked against the
    tensor, and gives specdec's logits past the original context (plain rope did not); divisors no
    llama3 parameters give are refused in one line."""
    import json

    import numpy as np
    from conftest import make_checkpoint, make_tokenizer
    from gguf_helpers import write_gguf

    make_tokenizer(tmp_path / "tok", vocab=320)
    hf_dir = make_checkpoint(tmp_path / "hf", hidden=256, layers=2, tokenizer_from=tmp_path / "tok",
                             rope_theta=500000.0, max_position_embeddings=4096, rope_scaling=dict(LLAMA3))
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["rope_theta"] = 500000.0
    divisors = _llama_cpp_divisors(cfg, LLAMA3)
    assert 1 < len(set(divisors.tolist())) and divisors.max() == 32.0        # a blended band, as Llama 3.x's
    path = write_gguf(hf_dir, tmp_path / "l3.gguf", extra_tensors={"rope_freqs.weight": divisors})
    ours = load_model(path, "float32", quantization="none")
    assert ours.config.rope_scaling is None          # the scaling lives only in the divisors
    hf = to_transformers(ours)
    assert {k: v for k, v in hf.config.rope_parameters.items() if k != "rope_theta"} == LLAMA3
    ids = torch.randint(2, 300, (700,), generator=torch.Generator().manual_seed(0)).tolist()   # past 512
    want = ours(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits_of(hf, ids), want, atol=2e-4, rtol=0)
    save_transformers(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    torch.testing.assert_close(logits_of(back, ids), want, atol=2e-4, rtol=0)
    # divisors that no llama3 parameters give: refused, not exported with plain (or made-up) rope
    odd = np.sort(1 + 7 * np.random.default_rng(0).random(len(divisors))).astype(np.float32)
    path = write_gguf(hf_dir, tmp_path / "odd.gguf", extra_tensors={"rope_freqs.weight": odd})
    with pytest.raises(ExportError, match="rotary frequencies") as e:
        to_transformers(load_model(path, "float32", quantization="none"))
    assert "\n" not in str(e.value)


def test_llama3_parameters_come_back_from_llama_3_1_divisors(tiny_pair):
    """Llama 3.1 / 3.2's own scaling (head_dim 128, theta 5e5, factor 8 or 32, original context
    8192) comes back exactly from llama.cpp's divisors."""
    from specdec.model.export import llama3_from_divisors
    from specdec.model.llama import rope_inv_freq

    base = load_model(tiny_pair[0], "float32").config
    cfg = dataclasses.replace(base, head_dim=128, hidden_size=128 * base.num_attention_heads, rope_theta=500000.0,
                              rope_scaling=None, max_position_embeddings=131072)
    for factor in (8.0, 32.0):
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
        d = torch.from_numpy(_llama_cpp_divisors({"hidden_size": 128, "num_attention_heads": 1, "rope_theta": 500000.0},
                                                 scaling))
        assert llama3_from_divisors(cfg, rope_inv_freq(cfg) / d) == scaling


def test_export_carries_the_stop_ids_and_pad(gguf_files, tmp_path):
    """A GGUF's end-of-generation ids beyond its eos (SmolLM2 stops on [0, 2, 4]) and its pad id go
    into config.json and generation_config.json as transformers reads them."""
    import json

    from gguf_helpers import write_gguf

    from specdec.tokenizer import Tokenizer

    path = write_gguf(gguf_files["llama_q_hf"], tmp_path / "m.gguf", metadata={"tokenizer.ggml.padding_token_id": 2})
    tok = Tokenizer(path)
    assert tok.eos_token_ids == [1, 6] and tok.pad_token_id == 2          # <|eos|>, <|end|>; <|pad|>
    ours = load_model(path, "float32", quantization="none")
    save_transformers(ours, tmp_path / "out", tokenizer=tok)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    for c in (config, generation):
        assert c["eos_token_id"] == [1, 6] and c["pad_token_id"] == 2
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "out").eos_token_id == [1, 6]
    # with tokenizer files beside it (scripts/quant_folders.py copies transformers' reading of the GGUF's), specdec
    # serving the folder stops where it stops on the GGUF
    for f in gguf_files["llama_q_hf"].glob("tokenizer*.json"):
        (tmp_path / "out" / f.name).write_bytes(f.read_bytes())
    assert Tokenizer(tmp_path / "out").eos_token_ids == [1, 6]


def test_export_leaves_the_source_config_alone(tmp_path):
    """transformers standardizes the rope dict it is handed (adds rope_theta): the export hands it a copy."""
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "yarn")
    ours = load_model(tmp_path / "yarn", "float32")
    before = dict(ours.config.rope_scaling)
    to_transformers(ours)
    assert ours.config.rope_scaling == before and "rope_theta" not in ours.config.rope_scaling


def test_backend_help_says_whose_answers_transformers_gives(capsys):
    """On a quantized GGUF the transformers backend answers as the dequantized model, which is not
    the packed one specdec serves: the help says so rather than promising the served answers."""
    with pytest.raises(SystemExit):
        main(["train", "answers", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "the dequantized model's, not the packed weights' as served" in text
    assert "4 of 8 identical on the Q4_1 SmolLM2" in text
