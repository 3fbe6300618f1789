"""LoRA adapters (specdec/lora): Hugging Face PEFT folders written by the real `peft` package,
served beside the base model. The adapted logits match PEFT's own model, on the C path and the
PyTorch path; requests with different adapters (and none) share batches and each gets its solo
output; speculation stays lossless under an adapter; prefix-cache blocks are keyed by adapter;
max_loras holds the other adapters back; bad adapters give one clear error."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from specdec import LLM, SamplingParams, kernels
from specdec.lora import LoRARequest
from specdec.model import ForwardBatch

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = [0, 9, 17, 33, 42, 8, 61, 20, 5, 77, 130, 2]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def make_adapter(base, folder, seed: int, **config):
    """A PEFT LoRA folder for the checkpoint `base`, with random A and B (init_lora_weights=False:
    the adapter changes the outputs). config: LoraConfig's settings (r, target_modules, ...)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = {"r": 4, "lora_alpha": 8, "target_modules": ALL, "init_lora_weights": False, **config}
    peft.get_peft_model(model, peft.LoraConfig(**config)).save_pretrained(folder)
    return folder


def peft_model(base, folder):
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(model, folder).eval()


@pytest.fixture(scope="module")
def adapters(tiny_pair, tmp_path_factory):
    """Adapters of the tiny target: every projection at rank 4; q and v only at rank 8 (rsLoRA,
    a rank and alpha pattern for v)."""
    target, _ = tiny_pair
    root = tmp_path_factory.mktemp("lora")
    return {
        "all": make_adapter(target, root / "all", 1),
        "qv": make_adapter(target, root / "qv", 2, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                           use_rslora=True, rank_pattern={"v_proj": 2}, alpha_pattern={"v_proj": 3}),
    }


def request(adapters, name: str, lora_id: int | None = None) -> LoRARequest:
    return LoRARequest(name, lora_id or list(adapters).index(name) + 1, str(adapters[name]))


def adapted_logits(llm, lora: LoRARequest | None, ids: list[int]) -> torch.Tensor:
    """The target's logits for ids in one paged forward, with the adapter in a slot."""
    model, manager = llm.target, llm.engine.lora
    slots = None
    if lora is not None:
        adapter = manager.check(lora)
        slots = [manager.activate([adapter])[adapter.uid]]
    cache = model.new_cache(batch=1)
    assert (model.c_view(cache) is not None) == (kernels.load() is not None)     # the path the test names
    return model(torch.tensor(ids), cache, ForwardBatch.build(cache, [0], [len(ids)], [0], lora=slots)).logits


@pytest.mark.parametrize("lora_dtype", ["auto", "bfloat16"])
@pytest.mark.parametrize("c_path", [True, False], ids=["c", "torch"])
def test_adapted_logits_match_peft(tiny_pair, adapters, monkeypatch, c_path, lora_dtype):
    """fp32 slots (auto, beside fp32 weights) within float tolerance of PEFT; bf16 slots (the
    default beside quantized weights) within bf16's rounding of A and B."""
    if c_path and kernels.load() is None:
        pytest.skip("no C kernels here")
    if not c_path:
        monkeypatch.setattr(kernels, "load", lambda *a: None)
    target, _ = tiny_pair
    llm = LLM(str(target), dtype="float32", num_speculative_tokens=0, enable_lora=True, max_loras=2,
              lora_dtype=lora_dtype)
    assert llm.engine.lora.stack.dtype == (torch.float32 if lora_dtype == "auto" else torch.bfloat16)
    tol = 1e-4 if lora_dtype == "auto" else 2e-2
    ids = torch.tensor([IDS])
    base = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = base(ids).logits[0]
    torch.testing.assert_close(adapted_logits(llm, None, IDS), plain, rtol=1e-4, atol=1e-4)
    for name in adapters:
        with torch.no_grad():
            expected = peft_model(target, adapters[name])(ids).logits[0]
        got = adapted_logits(llm, request(adapters, name), IDS)
        assert (expected - plain).abs().max() > 0.1             # the adapter matters
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol * expected.abs().max().item())


def test_mixed_batch_equals_solo_and_peft_generate(tiny_pair, adapters):
    """Base, adapter 1 and adapter 2 in one batch (adapter 1 twice): each greedy output is its
    solo one, and the adapters' are transformers + PEFT's own generate; seeded sampling too
    gives each request its solo output."""
    target, _ = tiny_pair
    llm = LLM(str(target), dtype="float32", num_speculative_tokens=0, enable_lora=True, max_loras=2)
    prompts = [{"prompt_token_ids": IDS[:n]} for n in (12, 5, 9, 7)]
    loras = [None, request(adapters, "all"), request(adapters, "qv"), request(adapters, "all")]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, lora_request=loras)]
    solo = [llm.generate(p, GREEDY, lora_request=lora)[0].outputs[0].token_ids for p, lora in zip(prompts, loras)]
    assert together == solo
    for p, lora, out in zip(prompts, loras, together):
        if lora is None:
            continue
        model = peft_model(target, lora.lora_path)
        ids = torch.tensor([p["prompt_token_ids"]])
        with torch.no_grad():   # an EOS id no token has: never stops
            ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                 do_sample=False, eos_token_id=model.config.vocab_size, pad_token_id=0)
        assert out == ref[0, ids.shape[1]:].tolist()
    assert together[0] != llm.generate(prompts[0], GREEDY, lora_request=loras[1])[0].outputs[0].token_ids
    seeded = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, ignore_eos=True, seed=11)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, seeded, lora_request=loras)]
    assert together == [llm.generate(p, seeded, lora_request=lora)[0].outputs[0].token_ids
                        for p, lora in zip(prompts, loras)]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_under_an_adapter_is_lossless(tiny_pair, near_draft, adapters, method):
    """The drafter proposes without the adapter; the adapted target verifies: greedy outputs are
    plain decoding's with the adapter, alone and batched with other adapters."""
    target, _ = tiny_pair
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1} if method == "ngram" else \
        {"method": "draft_model", "model": str(near_draft), "num_speculative_tokens": 3}
    plain = LLM(str(target), dtype="float32", num_speculative_tokens=0, enable_lora=True, max_loras=2)
    fast = LLM(str(target), dtype="float32", speculative_config=spec, enable_lora=True, max_loras=2)
    prompts = [{"prompt_token_ids": IDS[:n] * 2} for n in (12, 6, 9)]
    loras = [request(adapters, "all"), None, request(adapters, "qv")]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, lora_request=loras)]
    assert [o.outputs[0].token_ids for o in fast.generate(prompts, params, lora_request=loras)] == expected
    out = fast.generate(prompts[0], params, lora_request=loras[0])[0]
    assert out.outputs[0].token_ids == expected[0]


def test_max_loras_holds_other_adapters_back(tiny_pair, adapters):
    """max_loras=1: never two adapters in the running batch; every request still finishes with
    its solo output (base requests run beside any adapter)."""
    target, _ = tiny_pair
    llm = LLM(str(target), dtype="float32", num_speculative_tokens=0, enable_lora=True, max_loras=1)
    loras = [request(adapters, "all"), request(adapters, "qv"), None, request(adapters, "all"), None]
    engine = llm.engine
    reqs = [engine.add_request(IDS[:n], GREEDY, request_id=str(i), lora_request=lora)
            for i, (n, lora) in enumerate(zip((12, 5, 9, 7, 4), loras))]
    # one copy of each adapter while requests hold it, though only max_cpu_loras = 1 stays loaded
    assert reqs[0].lora is reqs[3].lora and len(engine.lora.loaded()) == 1
    seen_together = set()
    while engine.has_unfinished():
        engine.step()
        running = {r.lora.id for r in engine.scheduler.running if r.lora is not None}
        assert len(running) <= 1
        seen_together.add(frozenset(r.request_id for r in engine.scheduler.running))
    assert any({"0", "2"} <= s for s in seen_together)        # base beside an adapter
    solo = [llm.generate({"prompt_token_ids": IDS[:n]}, GREEDY, lora_request=lora)[0].outputs[0].token_ids
            for n, lora in zip((12, 5, 9, 7, 4), loras)]
    assert [r.out[:16] for r in reqs] == solo


def test_prefix_cache_is_keyed_by_adapter(tiny_pair, adapters):
    target, _ = tiny_pair
    llm = LLM(str(target), dtype="float32", num_speculative_tokens=0, enable_lora=True, max_loras=2,
              enable_prefix_caching=True, block_size=4)
    fresh = LLM(str(target), dtype="float32", num_speculative_tokens=0, enable_lora=True, max_loras=2)
    prompt = {"prompt_token_ids": IDS + IDS[:5]}
    lora = request(adapters, "all")
    base = llm.generate(prompt, GREEDY)[0]
    hits = llm.engine.prefix_cache_hits
    first = llm.generate(prompt, GREEDY, lora_request=lora)[0]
    assert llm.engine.prefix_cache_hits == hits                  # the base model's blocks are not its
    assert first.outputs[0].token_ids == fresh.generate(prompt, GREEDY, lora_request=lora)[0].outputs[0].token_ids
    assert first.outputs[0].token_ids != base.outputs[0].token_ids
    again = llm.generate(prompt, GREEDY, lora_request=lora)[0]
    assert llm.engine.prefix_cache_hits > hits and again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.skipif(kernels.load() is None, reason="no C kernels here")
def test_gguf_target_c_and_torch_paths_agree(gguf_files, tmp_path, monkeypatch):
    """A GGUF target (packed Q4_K q/k/v, unpermuted rows) with an adapter of its checkpoint: the C
    path's adapted logits are the PyTorch path's, and move away from the base ones."""
    folder = make_adapter(gguf_files["llama_q_hf"], tmp_path / "a", 3)
    lora = LoRARequest("a", 1, str(folder))
    llm = LLM(str(gguf_files["llama_q"]), num_speculative_tokens=0, enable_lora=True)
    assert llm.engine.lora.stack.dtype == torch.bfloat16        # beside quantized matrices
    c_base, c_lora = adapted_logits(llm, None, IDS), adapted_logits(llm, lora, IDS)
    monkeypatch.setattr(kernels, "load", lambda *a: None)
    llm = LLM(str(gguf_files["llama_q"]), num_speculative_tokens=0, enable_lora=True)
    t_lora = adapted_logits(llm, lora, IDS)
    assert (c_lora - c_base).abs().max() > 0.1
    torch.testing.assert_close(c_lora, t_lora, rtol=2e-2, atol=2e-2 * t_lora.abs().max().item())


def test_bad_adapters_and_settings_give_one_clear_error(tiny_pair, adapters, tmp_path):
    target, _ = tiny_pair
    plain = LLM(str(target), dtype="float32", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.generate({"prompt_token_ids": IDS}, GREEDY, lora_request=request(adapters, "all"))
    llm = LLM(str(target), dtype="float32", num_speculative_tokens=0, enable_lora=True, max_lora_rank=4)
    p = {"prompt_token_ids": IDS}
    with pytest.raises(ValueError, match="rank 8 is above max_lora_rank 4"):
        llm.generate(p, GREEDY, lora_request=request(adapters, "qv"))
    with pytest.raises(ValueError, match="missing: does not exist"):          # vLLM: "No adapter found for"
        llm.generate(p, GREEDY, lora_request=LoRARequest("x", 3, str(tmp_path / "missing")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate(p, GREEDY, lora_request=LoRARequest("x", 3, str(tmp_path / "empty")))
    head = make_adapter(target, tmp_path / "head", 4, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="adapts lm_head"):
        llm.generate(p, GREEDY, lora_request=LoRARequest("head", 4, str(head)))
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA is not supported"):
        llm.generate(p, GREEDY, lora_request=LoRARequest("dora", 5, str(dora)))
    llm.generate(p, GREEDY, lora_request=request(adapters, "all"))
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter 'all'"):
        llm.generate(p, GREEDY, lora_request=LoRARequest("other", 1, str(adapters["qv"])))
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, "/x")
    with pytest.raises(ValueError, match="lora_request must be one per prompt"):
        llm.generate([p, p], GREEDY, lora_request=[None])
    with pytest.raises(ValueError, match="max_cpu_loras must be an integer >= max_loras"):
        LLM(str(target), dtype="float32", num_speculative_tokens=0, enable_lora=True, max_loras=2, max_cpu_loras=1)
    assert llm.generate(p, GREEDY)[0].outputs[0].token_ids == plain.generate(p, GREEDY)[0].outputs[0].token_ids


def test_mixture_of_experts_is_refused(tmp_path):
    from conftest import make_checkpoint

    moe = make_checkpoint(tmp_path / "moe", arch="mixtral", hidden=32, layers=1)
    with pytest.raises(ValueError, match="dense models"):
        LLM(str(moe), dtype="float32", num_speculative_tokens=0, enable_lora=True)


def test_real_model_adapter_with_its_default_speculation_is_lossless(smollm2, tmp_path):
    """SmolLM2-135M-Instruct (Q4_1 GGUF) with a rank-8 adapter written by PEFT on transformers'
    loading of that file: its default speculative method under the adapter gives plain decoding's
    greedy output under the adapter, which differs from the base model's."""
    from pathlib import Path

    path = Path(smollm2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    torch.manual_seed(0)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=8, lora_alpha=8, target_modules=ALL, init_lora_weights=False))
    with torch.no_grad():
        for name, t in model.named_parameters():
            if "lora_B" in name:
                t.mul_(0.05)
    model.save_pretrained(tmp_path / "a")
    lora = LoRARequest("a", 1, str(tmp_path / "a"))
    fast = LLM(enable_lora=True)                                   # the default model and speculation
    plain = LLM(num_speculative_tokens=0, enable_lora=True)
    assert fast.engine.proposer is not None
    chats = [[{"role": "user", "content": q}] for q in
             ("What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.")]
    params = SamplingParams(temperature=0, max_tokens=48)
    adapted = [o.outputs[0].token_ids for o in plain.chat(chats, params, lora_request=lora)]
    assert [o.outputs[0].token_ids for o in fast.chat(chats, params, lora_request=lora)] == adapted
    assert adapted != [o.outputs[0].token_ids for o in plain.chat(chats, params)]


def test_fused_projections_of_phi3(tmp_path):
    """Phi-3 checkpoints fuse q/k/v (qkv_proj) and gate/up (gate_up_proj): PEFT adapts the fused
    modules with one A each; served logits match PEFT's model."""
    from conftest import make_checkpoint

    phi3 = make_checkpoint(tmp_path / "phi3", arch="phi3", hidden=64, layers=2)
    folder = make_adapter(phi3, tmp_path / "a", 5, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    llm = LLM(str(phi3), dtype="float32", num_speculative_tokens=0, enable_lora=True)
    ids = torch.tensor([IDS])
    with torch.no_grad():
        expected = peft_model(phi3, folder)(ids).logits[0]
        plain = transformers.AutoModelForCausalLM.from_pretrained(phi3, dtype=torch.float32)(ids).logits[0]
    got = adapted_logits(llm, LoRARequest("a", 1, str(folder)), IDS)
    assert (expected - plain).abs().max() > 0.1
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def write_gguf_lora(peft_dir, out, heads: int, kv_heads: int, arch: str = "llama"):
    """A llama.cpp LoRA file of a PEFT folder, the way convert_lora_to_gguf.py writes one:
    general.type "adapter", adapter.type "lora", adapter.lora.alpha; `blk.N.<tensor>.weight.lora_a`
    [r, in] and `.lora_b` [out, r], B's rows of attn_q / attn_k interleaved as llama.cpp's
    converter does for llama."""
    from gguf import GGUFType, GGUFWriter, Keys
    from gguf_helpers import permute_rotary
    from safetensors.numpy import load_file

    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    alpha = json.loads((peft_dir / "adapter_config.json").read_text())["lora_alpha"]
    w = GGUFWriter(str(out), arch)
    w.add_type(GGUFType.ADAPTER)
    w.add_string(Keys.Adapter.TYPE, "lora")
    w.add_float32(Keys.Adapter.LORA_ALPHA, float(alpha))
    for key, value in sorted(load_file(str(peft_dir / "adapter_model.safetensors")).items()):
        parts = key.split(".")
        i, module, ab = int(parts[parts.index("layers") + 1]), parts[-3], parts[-2][-1].lower()
        if ab == "b" and module in ("q_proj", "k_proj"):
            value = permute_rotary(value, kv_heads if module == "k_proj" else heads)
        w.add_tensor(f"blk.{i}.{names[module]}.weight.lora_{ab}", value.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_llama_cpp_gguf_lora_file_matches_its_peft_folder(tiny_pair, adapters, tmp_path, gguf_files):
    """llama.cpp's `--lora` file format: the same adapter read from a GGUF LoRA file (q/k rows
    permuted as llama.cpp's converter does) gives PEFT's logits, beside an HF or a GGUF target;
    a model GGUF given as an adapter is refused in one line."""
    target, _ = tiny_pair
    cfg = json.loads((Path(target) / "config.json").read_text())
    gguf_lora = write_gguf_lora(adapters["all"], tmp_path / "all.gguf", cfg["num_attention_heads"],
                                cfg["num_key_value_heads"])
    llm = LLM(str(target), dtype="float32", num_speculative_tokens=0, enable_lora=True, max_loras=2)
    from_gguf = adapted_logits(llm, LoRARequest("g", 7, str(gguf_lora)), IDS)
    from_peft = adapted_logits(llm, request(adapters, "all"), IDS)
    torch.testing.assert_close(from_gguf, from_peft, rtol=1e-5, atol=1e-5 * from_peft.abs().max().item())
    with pytest.raises(ValueError, match="not a LoRA adapter"):
        llm.generate({"prompt_token_ids": IDS}, GREEDY, lora_request=LoRARequest("m", 8, str(gguf_files["draft"])))
    # beside a quantized GGUF target of a llama checkpoint (its own q/k rows unpermuted at load)
    hf = gguf_files["llama_q_hf"]
    hcfg = json.loads((Path(hf) / "config.json").read_text())
    folder = make_adapter(hf, tmp_path / "q", 6)
    q_lora = write_gguf_lora(folder, tmp_path / "q.gguf", hcfg["num_attention_heads"], hcfg["num_key_value_heads"])
    llm = LLM(str(gguf_files["llama_q"]), num_speculative_tokens=0, enable_lora=True, max_loras=2)
    a = adapted_logits(llm, LoRARequest("peft", 1, str(folder)), IDS)
    b = adapted_logits(llm, LoRARequest("gguf", 2, str(q_lora)), IDS)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * a.abs().max().item())


def test_a_waiting_adapter_is_not_starved(tiny_pair, adapters):
    """max_loras=1, adapter "all" running and more of its requests arriving behind one for "qv":
    those wait behind it (base requests still join), so "all" drains and "qv" gets the slot
    before the later "all" requests."""
    target, _ = tiny_pair
    llm = LLM(str(target), dtype="float32", num_speculative_tokens=0, enable_lora=True, max_loras=1)
    engine, a, q = llm.engine, request(adapters, "all"), request(adapters, "qv")
    first = engine.add_request(IDS[:6], GREEDY, request_id="a0", lora_request=a)
    engine.step()
    waiting = engine.add_request(IDS[:5], GREEDY, request_id="q", lora_request=q)
    later = [engine.add_request(IDS[:4], GREEDY, request_id=f"a{i}", lora_request=a) for i in (1, 2)]
    base = engine.add_request(IDS[:3], GREEDY, request_id="base")
    engine.step()
    running = {r.request_id for r in engine.scheduler.running}
    assert "base" in running and not running & {"q", "a1", "a2"}
    order = []
    while engine.has_unfinished():
        engine.step()
        order += [r.request_id for r in engine.scheduler.running if r.request_id not in order]
    assert order.index("q") < order.index("a1") and all(r.finished for r in (first, waiting, base, *later))


def test_an_id_given_again_after_removal_runs_the_new_adapter(tiny_pair, adapters, tmp_path):
    """vLLM's remove_lora / add again under the same id (retrain in place, remove, add): the new
    adapter's weights run, not the slot's old ones, and no prefix-cache block of the old one is
    reused (a slot matched by id alone had kept serving the removed adapter)."""
    target, _ = tiny_pair
    llm = LLM(str(target), dtype="float32", num_speculative_tokens=0, enable_lora=True, max_loras=1,
              enable_prefix_caching=True)
    engine = llm.llm_engine
    p = {"prompt_token_ids": IDS}
    first = LoRARequest("a", 1, str(adapters["all"]))
    old = llm.generate(p, GREEDY, lora_request=first)[0].outputs[0].token_ids
    assert engine.remove_lora(1) and engine.list_loras() == set()
    folder = tmp_path / "same-place"
    make_adapter(target, folder, 11)
    again = llm.generate(p, GREEDY, lora_request=LoRARequest("b", 1, str(folder)))[0]
    fresh = LLM(str(target), dtype="float32", num_speculative_tokens=0, enable_lora=True).generate(
        p, GREEDY, lora_request=LoRARequest("b", 1, str(folder)))[0].outputs[0].token_ids
    assert again.outputs[0].token_ids == fresh != old
    assert again.lora_request == LoRARequest("b", 1, str(folder)) and llm.generate(p, GREEDY)[0].lora_request is None
    # the same folder rewritten in place, removed and added again: a fresh reading, its own cached blocks
    make_adapter(target, folder, 12)
    assert engine.remove_lora(1)
    rewritten = llm.generate(p, GREEDY, lora_request=LoRARequest("b", 1, str(folder)))[0]
    assert rewritten.stats.cached_tokens == 0
    assert rewritten.outputs[0].token_ids == LLM(str(target), dtype="float32", num_speculative_tokens=0,
                                                 enable_lora=True).generate(
        p, GREEDY, lora_request=LoRARequest("b", 1, str(folder)))[0].outputs[0].token_ids


def test_llm_engine_lora_calls_and_vllms_request_fields(tiny_pair, adapters):
    """vLLM's LLMEngine add_lora / list_loras / pin_lora / remove_lora; LoRARequest's
    base_model_name, a Path for the folder, equality and hashing by name."""
    target, _ = tiny_pair
    llm = LLM(str(target), dtype="float32", num_speculative_tokens=0, enable_lora=True, max_loras=1, max_cpu_loras=2)
    engine = llm.llm_engine
    a = LoRARequest("all", 1, Path(adapters["all"]), base_model_name="m")
    assert a.lora_path == str(adapters["all"]) and a.base_model_name == "m"
    assert a == LoRARequest("all", 9, "/elsewhere") and len({a, LoRARequest("all", 2, "/x")}) == 1
    assert engine.add_lora(a) and engine.list_loras() == {1}
    assert engine.pin_lora(1) and not engine.pin_lora(5)
    engine.add_lora(LoRARequest("qv", 2, str(adapters["qv"])))
    engine.add_lora(LoRARequest("again", 3, str(adapters["all"])))   # past max_cpu_loras: the pinned one stays
    assert engine.list_loras() == {1, 3}
    assert engine.remove_lora(1) and engine.list_loras() == {3}


@pytest.mark.parametrize("config, message", [
    ({"lora_alpha": None}, "lora_alpha must be a positive number, got None"),
    ({"r": "4"}, "r must be a positive integer, got '4'"),
    ({"rank_pattern": ["x"]}, "rank_pattern must be an object of module patterns"),
    ({"alpha_pattern": {"q_proj(": 2}}, "alpha_pattern key 'q_proj\\(' is not a regular expression"),
    ({"lora_bias": True}, "lora_bias: adapters whose lora_B has a trained bias are not supported"),
])
def test_bad_config_values_are_one_clear_error(tiny_pair, adapters, tmp_path, config, message):
    """Values of the wrong type in adapter_config.json were a TypeError, AttributeError or re.error
    deep in the loader (a 500 from /v1/load_lora_adapter, a traceback at serve's start)."""
    import shutil

    folder = shutil.copytree(adapters["all"], tmp_path / "bad")
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    llm = LLM(str(tiny_pair[0]), dtype="float32", num_speculative_tokens=0, enable_lora=True)
    with pytest.raises(ValueError, match=message):
        llm.generate({"prompt_token_ids": IDS}, GREEDY, lora_request=LoRARequest("bad", 1, str(folder)))


def test_a_running_request_keeps_its_adapter_when_its_id_is_given_again(tiny_pair, adapters):
    """A request of adapter X (id 1) still running when id 1 is removed and added again as adapter
    Y: both run in the same steps, each with its own weights (slots were keyed by id, so both got
    one slot); remove_lora(id) removes that id alone, not others of its name."""
    target, _ = tiny_pair
    llm = LLM(str(target), dtype="float32", num_speculative_tokens=0, enable_lora=True, max_loras=2)
    engine = llm.llm_engine
    x, y = LoRARequest("x", 1, str(adapters["all"])), LoRARequest("y", 1, str(adapters["qv"]))
    alone = {}
    for rid, lora in (("A", x), ("B", y)):
        alone[rid] = llm.generate({"prompt_token_ids": IDS}, GREEDY, lora_request=lora)[0].outputs[0].token_ids
        assert engine.remove_lora(1)
    engine.add_request("A", {"prompt_token_ids": IDS}, GREEDY, lora_request=x)
    for _ in range(3):
        engine.step()
    assert engine.remove_lora(1)
    engine.add_request("B", {"prompt_token_ids": IDS}, GREEDY, lora_request=y)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    assert final == alone and alone["A"] != alone["B"]
    engine.add_lora(LoRARequest("shared", 3, str(adapters["all"])))
    engine.add_lora(LoRARequest("shared", 4, str(adapters["qv"])))
    assert engine.remove_lora(3) and 4 in engine.list_loras() and 3 not in engine.list_loras()


def test_an_evicted_adapter_read_again_keeps_its_cached_prefix(tiny_pair, adapters):
    """max_cpu_loras 1: b's request evicts a, whose unchanged folder is read again; its blocks are
    still its own (vLLM keys them by the adapter): the prompt is found in the cache, and the
    output is the same. A rewritten folder is a new reading that shares none."""
    target, _ = tiny_pair
    llm = LLM(str(target), dtype="float32", num_speculative_tokens=0, enable_lora=True, max_loras=1,
              max_cpu_loras=1, enable_prefix_caching=True, block_size=4)
    prompt = {"prompt_token_ids": IDS * 3}
    a, b = request(adapters, "all"), request(adapters, "qv")
    first = llm.generate(prompt, GREEDY, lora_request=a)[0]
    llm.generate(prompt, GREEDY, lora_request=b)
    assert [x.id for x in llm.engine.lora.loaded()] == [2]               # a was evicted
    again = llm.generate(prompt, GREEDY, lora_request=a)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    llm.generate(prompt, GREEDY, lora_request=b)
    weights = Path(adapters["all"]) / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes())                           # the same bytes, a new write
    assert llm.generate(prompt, GREEDY, lora_request=a)[0].num_cached_tokens == 0
