"""Weights replaced in place, as RL code syncs a vLLM engine's weights: model.load_weights with
Hugging Face names through LLM.apply_model / collective_rpc (worker_extension_cls too). After an
update the engine answers exactly as one loaded from a checkpoint of the new weights (kernels' packed
copies rebuilt, prefix cache reset), speculation included."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import make_checkpoint, perturbed_checkpoint
from specdec import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
# longer than a KV block (16 tokens): the prefix cache keeps its blocks between generate() calls
PROMPTS = ["def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x",
           "import os\nimport sys\n"]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A target, a draft, and the target's weights perturbed (Hugging Face names), saved as a second checkpoint."""
    root = tmp_path_factory.mktemp("rl")
    target = make_checkpoint(root / "target", seed=0, layers=2)
    draft = make_checkpoint(root / "draft", seed=1, layers=1, hidden=32, tokenizer_from=target)
    _, new = perturbed_checkpoint(target, root / "updated")
    return target, draft, root / "updated", new


@pytest.mark.parametrize("spec", [{}, {"speculative_model": "draft", "num_speculative_tokens": 3},
                                  {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}])
def test_apply_model_load_weights_equals_the_new_checkpoint(pair, spec):
    target, draft, updated, new = pair
    spec = {k: str(draft) if v == "draft" else v for k, v in spec.items()}
    llm = LLM(model=str(target), dtype="float32", **spec)
    old = _tokens(llm)                                    # fills the prefix cache with the old weights' KV
    loaded = llm.apply_model(lambda model: model.load_weights(new.items()))
    assert len(loaded) == 1 and "model.layers.0.self_attn.qkv_proj.weight" in loaded[0]
    fresh = LLM(model=str(updated), dtype="float32")
    assert _tokens(llm) == _tokens(fresh) != old


def test_a_partial_update_lands_in_the_fused_rows(pair):
    """Only k_proj and up_proj of layer 1: the rest of qkv_proj / gate_up_proj is untouched."""
    target, _, _, new = pair
    llm = LLM(model=str(target), dtype="float32")
    before = {n: p.detach().clone() for n, p in llm.target.named_parameters()}
    part = {n: new[n] for n in ("model.layers.1.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight")}
    (names,) = llm.apply_model(lambda m: m.load_weights(part.items()))
    assert names == {"model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"}
    cfg = llm.target.config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    qkv = llm.target.model.layers[1].self_attn.qkv_proj.weight
    assert torch.equal(qkv[q:q + kv], part["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(qkv[:q], before["model.layers.1.self_attn.qkv_proj.weight"][:q])
    assert torch.equal(qkv[q + kv:], before["model.layers.1.self_attn.qkv_proj.weight"][q + kv:])
    gate_up = llm.target.model.layers[1].mlp.gate_up_proj.weight
    half = gate_up.shape[0] // 2
    assert torch.equal(gate_up[half:], part["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(gate_up[:half], before["model.layers.1.mlp.gate_up_proj.weight"][:half])
    changed = {n for n, p in llm.target.named_parameters() if not torch.equal(p, before[n])}
    assert changed == names


def test_bad_weights_change_nothing(pair):
    target, _, _, new = pair
    llm = LLM(model=str(target), dtype="float32")
    old = _tokens(llm)
    good = ("model.norm.weight", new["model.norm.weight"])
    for bad, message in (((("model.layers.0.self_attn.nope.weight", torch.zeros(3)),), "has no weight named"),
                         ((("model.layers.0.mlp.down_proj.weight", torch.zeros(3, 3)),), r"has shape \(3, 3\)"),
                         ((("model.norm.weight", [1.0]),), "not a tensor")):
        with pytest.raises(ValueError, match=message):
            llm.apply_model(lambda m: m.load_weights([good, *bad]))
    assert _tokens(llm) == old                      # the good weight before the bad one was not written either


def test_collective_rpc_and_worker_extension(pair):
    target, draft, updated, new = pair

    class WeightSync:                                # what RL frameworks pass as worker_extension_cls
        def update_weight(self, name, tensor):
            self.model_runner.model.load_weights(weights=[(name, tensor)])
            return name

        def checksum(self):
            return float(sum(p.double().sum() for p in self.model_runner.model.parameters()))

    llm = LLM(model=str(target), dtype="float32", speculative_model=str(draft), num_speculative_tokens=2,
              worker_extension_cls=WeightSync)
    assert llm.collective_rpc(lambda worker: worker.rank) == [0]
    start = llm.collective_rpc("checksum")[0]
    for name, tensor in new.items():
        assert llm.collective_rpc("update_weight", args=(name, tensor)) == [name]
    assert llm.collective_rpc("checksum")[0] != start
    assert _tokens(llm) == _tokens(LLM(model=str(updated), dtype="float32"))
    with pytest.raises(ValueError, match="no method 'nope'"):
        llm.collective_rpc("nope")
    plain = LLM(model=str(target), dtype="float32")
    assert plain.collective_rpc("load_weights", kwargs={"weights": list(new.items())})[0]
    assert _tokens(plain) == _tokens(LLM(model=str(updated), dtype="float32"))
    with pytest.raises(ValueError, match="worker_extension_cls 'no.such.Class'"):
        LLM(model=str(target), worker_extension_cls="no.such.Class")


def test_quantized_weights_are_refused(gguf_files):
    """A GGUF kept packed (llama_q's Q4_K q/k/v): its matrices cannot take float weights in place."""
    llm = LLM(model=str(gguf_files["llama_q"]))
    from specdec.model.quant import QuantLinear

    if not isinstance(llm.target.model.layers[0].self_attn.qkv_proj, QuantLinear):
        pytest.skip("this GGUF dequantizes on this CPU")
    shape = (llm.target.config.num_attention_heads * llm.target.config.head_dim, llm.target.config.hidden_size)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.qkv_proj is kept quantized"):
        llm.apply_model(lambda m: m.load_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(shape))]))


def _perturbed(target: Path, folder: Path, inmemory: bool = False) -> tuple[Path, dict]:
    """target's weights moved a little, saved by transformers in `folder`; -> (folder, the weights
    by name: the files' names, or the in-memory module's (named_parameters) with inmemory)."""
    import transformers
    from safetensors.torch import load_file

    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    hf.load_state_dict({n: p + 0.05 * torch.randn(p.shape, generator=gen) for n, p in hf.state_dict().items()})
    hf.save_pretrained(folder)
    for f in target.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder / f.name)
    named = {n: p.detach() for n, p in hf.named_parameters()} if inmemory else load_file(str(folder / "model.safetensors"))
    return folder, named


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_latent_attention_rotary_rows_are_reordered_as_at_load(arch, tmp_path):
    """DeepSeek's interleaved rotary rows: the loader reorders them; new weights were written as
    sent (every output differed from a fresh load of the same weights)."""
    target = make_checkpoint(tmp_path / "target", arch=arch, seed=0, layers=2)
    updated, new = _perturbed(target, tmp_path / "updated")
    llm = LLM(model=str(target), dtype="float32")
    llm.apply_model(lambda m: m.load_weights(new.items()))
    fresh = LLM(model=str(updated), dtype="float32")
    ours, theirs = llm.target.state_dict(), fresh.target.state_dict()
    assert [n for n in theirs if not torch.equal(ours[n], theirs[n])] == []
    assert _tokens(llm) == _tokens(fresh)


def test_names_that_collide_are_refused_not_dropped(tmp_path):
    """GraniteMoeShared's in-memory names (what a trainer's named_parameters() gives) differ from its
    files': the router and the experts' gate/up landed on the same weights as down_proj and were
    silently lost; now a ValueError before anything is written."""
    target = make_checkpoint(tmp_path / "target", arch="granitemoeshared", seed=0, layers=2)
    _, new = _perturbed(target, tmp_path / "updated", inmemory=True)
    llm = LLM(model=str(target), dtype="float32")
    before = {n: p.clone() for n, p in llm.target.state_dict().items()}
    with pytest.raises(ValueError, match="both land on"):
        llm.apply_model(lambda m: m.load_weights(new.items()))
    assert all(torch.equal(p, before[n]) for n, p in llm.target.state_dict().items())


def test_the_worker_keeps_its_state_and_vllm_paths_reach_the_model(pair):
    """TRL's init_communicator -> update_named_param keeps a communicator on the worker between
    calls (a new worker per call lost it); verl and others reach the model through vLLM's paths."""
    target, _, _, new = pair

    class Sync:
        def init_communicator(self):
            self.group = "communicator"

        def update_named_param(self, name, tensor):
            assert self.group == "communicator"
            return self.model_runner.get_model().load_weights([(name, tensor)])

    llm = LLM(model=str(target), dtype="float32", worker_extension_cls=Sync)
    llm.collective_rpc("init_communicator")
    assert llm.collective_rpc("update_named_param", args=("model.norm.weight", new["model.norm.weight"])) == \
        [{"model.norm.weight"}]
    executor = llm.llm_engine.model_executor
    assert executor.driver_worker.worker.model_runner.model is llm.target
    assert executor.driver_worker.model_runner.model is llm.target
    assert executor.collective_rpc(lambda w: w.group) == ["communicator"]
