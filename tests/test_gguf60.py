"""GGUF files as llama.cpp and vLLM users meet them: vLLM's --hf-config-path, files without the
.gguf suffix (Ollama's blobs), and one-line refusals of big-endian files, removed or unknown
tensor types, misplaced tensor data and a token list longer than token_embd."""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest
import torch
from gguf import GGUFEndian, GGUFReader, GGUFWriter

from conftest import _scale_embeddings, make_checkpoint, make_tokenizer
from gguf_helpers import byte_level_vocab, write_gguf
from specdec import LLM
from specdec.cli import main
from specdec.model import CheckpointError, load_model

IDS = torch.tensor([[0, 9, 17, 33, 42, 8, 61, 20, 5, 100, 120, 7]])
ROPE = {"rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A one-layer llama folder and its F32 GGUF (exact), and a folder with that config's RoPE
    changed (ROPE) beside the same weights, as --hf-config-path names one."""
    root = tmp_path_factory.mktemp("gguf60")
    make_tokenizer(root / "tok", vocab=320)
    hf = make_checkpoint(root / "hf", layers=1, tokenizer_from=root / "tok")
    _scale_embeddings(hf, 8.0)
    other = root / "other"
    shutil.copytree(hf, other)
    (other / "config.json").write_text(json.dumps({**json.loads((hf / "config.json").read_text()), **ROPE}))
    return {"hf": hf, "gguf": write_gguf(hf, root / "m.gguf"), "other": other}


def logits(model, ids=IDS):
    with torch.inference_mode():
        return model(ids).logits[0]


def run(capsys, *argv) -> tuple[int, str]:
    code = main(["generate", *argv, "--max-tokens", "2", "hello"])
    return code, capsys.readouterr().err


def tensor_info_at(path, name: str) -> int:
    """Where tensor `name`'s type id is stored in the file (its offset follows, 4 bytes on)."""
    t = next(t for t in GGUFReader(str(path)).tensors if t.name == name)
    return t.field.offset + 8 + len(t.name.encode()) + 4 + 8 * len(t.shape)


# --- D1: vLLM's hf_config_path ---------------------------------------------------------------

def test_hf_config_path_runs_the_gguf_with_that_config(tiny):
    """The folder's config.json wins over the metadata (vLLM reads the config there): the GGUF
    then computes what transformers computes on that folder."""
    from transformers import AutoModelForCausalLM

    ref = logits(AutoModelForCausalLM.from_pretrained(tiny["other"], dtype=torch.float32).eval())
    ours = load_model(tiny["gguf"], hf_config_path=tiny["other"])
    assert ours.config.rope_theta == 1e6 and ours.config.rope_scaling["factor"] == 4.0
    torch.testing.assert_close(logits(ours), ref, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(logits(load_model(tiny["gguf"])), ref, atol=1e-3)


def test_hf_config_path_with_llama3_scaling(tmp_path):
    """A config.json with llama3 RoPE scaling says it itself: the file's rope_freqs tensor (the
    same scaling, as llama.cpp stores it) is not applied a second time."""
    from transformers import AutoModelForCausalLM

    from specdec.model.config import ModelConfig
    from specdec.model.llama import rope_inv_freq

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    hf = make_checkpoint(tmp_path / "hf", layers=1, rope_scaling=scaling)
    cfg = ModelConfig.from_hf(json.loads((hf / "config.json").read_text()))
    factors = (rope_inv_freq(cfg.replace(rope_scaling=None)) / rope_inv_freq(cfg)).numpy().astype(np.float32)
    path = write_gguf(hf, tmp_path / "m.gguf", extra_tensors={"rope_freqs.weight": factors})
    ids = torch.arange(40)[None] % 90
    ref = logits(AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval(), ids)
    torch.testing.assert_close(logits(load_model(path, hf_config_path=hf), ids), ref, atol=1e-4, rtol=1e-4)


def test_llm_takes_hf_config_path(tiny):
    """LLM(hf_config_path=...) as vLLM's EngineArgs: that folder's config and generation_config.json."""
    gen = tiny["other"] / "generation_config.json"
    gen.write_text(json.dumps({"temperature": 0.25}))
    try:
        llm = LLM(str(tiny["gguf"]), hf_config_path=str(tiny["other"]))
    finally:
        gen.unlink()
    assert llm.target.config.rope_theta == 1e6
    assert llm.get_default_sampling_params().temperature == 0.25
    assert LLM(str(tiny["gguf"])).target.config.rope_theta != 1e6


def test_hf_config_path_flag(tiny, tmp_path, capsys):
    """--hf-config-path is used, not dropped: a config that does not fit the file's tensors is
    one line naming that config.json, a folder without one is one line too."""
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((tiny["hf"] / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": cfg["intermediate_size"] * 2}))
    code, err = run(capsys, "--model", str(tiny["gguf"]), "--hf-config-path", str(bad))
    assert code == 2 and err.count("\n") == 1 and str(bad / "config.json") in err and str(tiny["gguf"]) in err, err
    code, err = run(capsys, "--model", str(tiny["gguf"]), "--hf-config-path", str(tmp_path / "nowhere"))
    assert code == 2 and err.count("\n") == 1 and "hf_config_path" in err, err
    code, err = run(capsys, "--model", str(tiny["gguf"]), "--hf-config-path", str(tiny["other"]), "--temperature", "0")
    assert code == 0 and "ignoring" not in err, err


def test_hf_config_path_on_a_folder(tiny):
    """A Hugging Face folder runs with its own config.json: another folder is refused."""
    with pytest.raises(ValueError, match="reads it for a GGUF model"):
        LLM(str(tiny["hf"]), hf_config_path=str(tiny["other"]))
    with pytest.raises(CheckpointError, match="hf_config_path is read for a GGUF model"):
        load_model(tiny["hf"], hf_config_path=tiny["other"])


# --- D2: a GGUF file without the .gguf suffix --------------------------------------------------

def test_a_gguf_without_the_suffix_loads(tiny, tmp_path, capsys):
    """vLLM's check_gguf_file takes a file that starts with GGUF's magic (Ollama's blobs)."""
    blob = tmp_path / "sha256-0123abcd"
    shutil.copy(tiny["gguf"], blob)
    assert main(["generate", "--model", str(blob), "--max-tokens", "2", "--temperature", "0", "hello"]) == 0
    out = capsys.readouterr().out
    assert main(["generate", "--model", str(tiny["gguf"]), "--max-tokens", "2", "--temperature", "0", "hello"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == out.splitlines()[0]
    code, err = run(capsys, "--model", str(tiny["gguf"]), "--tokenizer", str(blob))
    assert code == 0, err
    text = tmp_path / "notes"
    text.write_text("not a model")
    code, err = run(capsys, "--model", str(text))
    assert code == 2 and "is a file, not a model folder" in err


# --- D3 - D6: one-line refusals ----------------------------------------------------------------

def test_big_endian_file(tmp_path, capsys):
    path = tmp_path / "big.gguf"
    w = GGUFWriter(str(path), "llama", endianess=GGUFEndian.BIG)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32).byteswap())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    code, err = run(capsys, "--model", str(path))
    assert code == 2 and err.count("\n") == 1 and str(path) in err and "big-endian" in err, err


@pytest.mark.parametrize("kind,words", [(31, "type 31 (Q4_0_4_4), which llama.cpp removed"),
                                        (4, "type 4 (Q4_2), which llama.cpp removed"),
                                        (200, "type 200, which is no ggml type")])
def test_removed_or_unknown_tensor_type(tiny, tmp_path, capsys, kind, words):
    data = bytearray(tiny["gguf"].read_bytes())
    struct.pack_into("<I", data, tensor_info_at(tiny["gguf"], "blk.0.ffn_up.weight"), kind)
    path = tmp_path / "t.gguf"
    path.write_bytes(bytes(data))
    code, err = run(capsys, "--model", str(path))
    assert code == 2 and err.count("\n") == 1 and f"{path}: tensor blk.0.ffn_up.weight has {words}" in err, err


@pytest.mark.parametrize("offset", [0, 32])
def test_misplaced_tensor_data(tiny, tmp_path, capsys, offset):
    """llama.cpp requires each tensor's data right after the one before (padded to the alignment)."""
    last = GGUFReader(str(tiny["gguf"])).tensors[-1]
    data = bytearray(tiny["gguf"].read_bytes())
    struct.pack_into("<Q", data, tensor_info_at(tiny["gguf"], last.name) + 4, offset)
    path = tmp_path / "o.gguf"
    path.write_bytes(bytes(data))
    code, err = run(capsys, "--model", str(path))
    assert code == 2 and err.count("\n") == 1, err
    assert f"{path}: tensor {last.name} has data offset {offset}, expected" in err, err


def test_token_list_longer_than_the_embeddings(tiny, tmp_path, capsys):
    vocab = byte_level_vocab(tiny["hf"])
    vocab = {**vocab, "tokens": vocab["tokens"] + [f"<|extra{i}|>" for i in range(10)], "types": vocab["types"] + [3] * 10}
    path = write_gguf(tiny["hf"], tmp_path / "v.gguf", vocab=vocab)
    code, err = run(capsys, "--model", str(path))
    assert code == 2 and err.count("\n") == 1 and str(path) in err, err
    assert "holds 330 tokens (tokenizer.ggml.tokens), token_embd.weight has rows for 320" in err, err
