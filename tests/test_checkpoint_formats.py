"""Checkpoint folders as vLLM users bring them: attention biases (attention_bias: true) and
PyTorch pickles (pytorch_model.bin, single or sharded), each against transformers' own output."""

from __future__ import annotations

import pytest
import torch
import transformers

from conftest import make_checkpoint
from specdec import LLM, SamplingParams
from specdec.model import load_model

IDS = torch.tensor([[0, 9, 17, 33, 42, 8, 61, 20, 5, 77]])
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def hf_greedy(model, ids=IDS, n: int = 12) -> list[int]:
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def assert_matches_transformers(folder, ref) -> None:
    """Logits (the PyTorch forward) and greedy tokens (LLM: the C forward where it loads) equal
    transformers' on the same folder."""
    ours = load_model(folder, "float32")
    with torch.inference_mode():
        torch.testing.assert_close(ours(IDS).logits, ref(IDS).logits, atol=1e-4, rtol=1e-4)
    out = LLM(str(folder), dtype="float32").generate({"prompt_token_ids": IDS[0].tolist()}, GREEDY)
    assert out[0].outputs[0].token_ids == hf_greedy(ref)


# the families whose transformers code puts attention_bias on q, k, v and o_proj
@pytest.mark.parametrize("arch", ["llama", "granite", "smollm3", "olmoe"])
def test_attention_bias_on_q_k_v_and_o(tmp_path, arch):
    folder = make_checkpoint(tmp_path / "m", arch=arch, attention_bias=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():                 # transformers starts biases at zero: make them count
        for name, p in ref.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0, 0.5 if "o_proj" not in name else 0.1)
    ref.save_pretrained(folder)
    assert_matches_transformers(folder, ref)
    assert load_model(folder).model.layers[0].self_attn.o_proj.bias is not None


def test_families_whose_transformers_code_ignores_attention_bias(tmp_path):
    """Mistral's transformers code has no attention biases whatever its config says."""
    folder = make_checkpoint(tmp_path / "m", arch="mistral")
    cfg = (folder / "config.json").read_text().replace('"attention_bias": false', '"attention_bias": true')
    (folder / "config.json").write_text(cfg if "attention_bias" in cfg else cfg.replace("{", '{"attention_bias": true,', 1))
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_model(folder, "float32")
    assert ours.model.layers[0].self_attn.qkv_proj.bias is None
    with torch.inference_mode():
        torch.testing.assert_close(ours(IDS).logits, ref(IDS).logits, atol=1e-4, rtol=1e-4)


# --- PyTorch pickles: what transformers < 5 wrote with safe_serialization=False ---------------

def as_pytorch_bin(src, folder, shards: int = 1, legacy: bool = False):
    """src's safetensors folder rewritten as transformers 4's save_pretrained(safe_serialization=False)
    writes it (transformers 5 only writes safetensors): pytorch_model.bin, or `shards` files
    pytorch_model-0000i-of-0000n.bin with pytorch_model.bin.index.json; legacy: torch's pre-1.6
    (non-zip) format, which cannot be memory-mapped."""
    import json
    import shutil

    from safetensors.torch import load_file

    folder.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, folder / f.name)
    sd = load_file(str(src / "model.safetensors"))
    save = lambda obj, path: torch.save(obj, path, _use_new_zipfile_serialization=not legacy)  # noqa: E731
    if shards == 1:
        save(sd, folder / "pytorch_model.bin")
        return folder
    names, weight_map = sorted(sd), {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = names[i::shards]
        save({n: sd[n] for n in part}, folder / file)
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in sd.values())
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    return folder


@pytest.fixture(scope="module")
def safetensors_folder(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("st") / "m", seed=5)


@pytest.mark.parametrize("shards,legacy", [(1, False), (3, False), (1, True)], ids=["single", "sharded", "legacy"])
def test_pytorch_model_bin_loads_as_its_safetensors_copy(safetensors_folder, tmp_path, shards, legacy):
    folder = as_pytorch_bin(safetensors_folder, tmp_path / "bin", shards, legacy)
    assert not list(folder.glob("*.safetensors"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert_matches_transformers(folder, ref)
    prompt = {"prompt_token_ids": IDS[0].tolist()}
    same = [LLM(str(f)).generate(prompt, GREEDY)[0].outputs[0].token_ids for f in (folder, safetensors_folder)]
    assert same[0] == same[1]


def test_damaged_pytorch_model_bin_is_one_line(safetensors_folder, tmp_path):
    from specdec.model import CheckpointError

    folder = as_pytorch_bin(safetensors_folder, tmp_path / "bin")
    (folder / "pytorch_model.bin").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="pytorch_model.bin: cannot read"):
        load_model(folder)
    sharded = as_pytorch_bin(safetensors_folder, tmp_path / "sharded", shards=2)
    (sharded / "pytorch_model-00002-of-00002.bin").unlink()
    with pytest.raises(CheckpointError, match="shard listed in the index is missing"):
        load_model(sharded)
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "config.json").write_bytes((safetensors_folder / "config.json").read_bytes())
    with pytest.raises(CheckpointError, match="no model.safetensors or pytorch_model.bin"):
        load_model(tmp_path / "none")
