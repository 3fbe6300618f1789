"""What every architecture's test module checks on its own `files` fixture (hf: a transformers
checkpoint of that architecture; f32: its F32 GGUF; near: a draft that agrees often; eagle: an
untrained EAGLE head), and the helpers for it. A module imports the test functions below
(`from arch_checks import test_...`) and pytest runs them there, on that module's fixture."""

from __future__ import annotations

import pytest
import torch
import transformers

from specdec import LLM, SamplingParams, kernels
from specdec.model import ForwardBatch, load_model

IDS = torch.tensor([[0, 9, 17, 33, 42, 8, 61, 20, 5, 77, 130, 2]])
PROMPTS = ["def add(a, b):", "class Point:\n    def __init__(self, x, y):\n", "for i in range(10):\n    print(i)",
           "import os\n"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
NO_KERNELS = pytest.mark.skipif(kernels.load() is None, reason="no C compiler or no AVX2/FMA here")


def arch_files(root, arch: str, config: dict | None = None, metadata: dict | None = None, **gguf_files) -> dict:
    """A module's `files`: a transformers checkpoint of `arch` (config: its settings), a draft
    that agrees often (near), its F32 GGUF (metadata: llama.cpp's keys the writer does not
    derive) and untrained heads; gguf_files: name -> qtypes for more GGUFs of the checkpoint."""
    from conftest import make_checkpoint, noisy_head_copy
    from gguf_helpers import write_gguf
    from test_heads import _heads_dirs

    hf = make_checkpoint(root / "hf", arch=arch, **(config or {}))
    return {"arch": arch, "hf": hf, "near": noisy_head_copy(hf, root / "near"),
            "f32": write_gguf(hf, root / "f32.gguf", metadata=metadata),
            **{name: write_gguf(hf, root / f"{name}.gguf", metadata=metadata, qtypes=q) for name, q in gguf_files.items()},
            **_heads_dirs(hf, root)}


def check_rows_bit_identical(model, length: int, kv_dtype=None) -> torch.Tensor:
    """The C forward's invariant on `model` (blocks of 4 slots): each of `length` tokens' logits
    are the same bits in one chunk, token by token or in uneven chunks, alone or beside another
    sequence. Returns the one-chunk logits."""
    from specdec.model import BlockManager

    tokens, other = (torch.randint(0, 200, (length,), generator=torch.Generator().manual_seed(s)) for s in (1, 2))

    def run(chunks, beside: bool) -> torch.Tensor:
        blocks = BlockManager(2 * (length // 4 + 1), 4, 2, length // 4 + 1)
        kv = model.new_kv(blocks, dtype=kv_dtype)
        for s in ("x", "y"):
            blocks.add(s)
            blocks.ensure(s, length)
        out = []
        for a, b in chunks:
            seqs, feed = (["y", "x"], [other[a:b], tokens[a:b]]) if beside else (["x"], [tokens[a:b]])
            logits = model(torch.cat(feed), kv, ForwardBatch.build(kv, seqs, [b - a] * len(seqs), [a] * len(seqs))).logits
            out.append(logits[-(b - a):])
            for s in seqs:
                kv.set_length(s, b)
        return torch.cat(out)

    whole = run([(0, length)], False)
    for chunks in ([(i, i + 1) for i in range(length)], [(0, 5), (5, 6), (6, length // 2), (length // 2, length)]):
        for beside in (False, True):
            assert torch.equal(run(chunks, beside), whole), (chunks[:2], beside)
    return whole


def check_packed_batch_equals_solo(path) -> None:
    """A GGUF kept packed: greedy output four at once, with speculation, equals plain decoding
    one at a time."""
    prompts = [{"prompt_token_ids": IDS[0, :n].tolist()} for n in (3, 12, 7, 9)]
    solo = LLM(str(path), quantization="gguf", num_speculative_tokens=0, max_num_seqs=1)
    plain = [o.outputs[0].token_ids for o in solo.generate(prompts, GREEDY)]
    llm = LLM(str(path), quantization="gguf", speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
              max_num_seqs=4, max_num_batched_tokens=8)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == plain


def reference(folder, **replace) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, value in replace.items():
            model.get_parameter(name).copy_(value)
    return model


def cached_logits(model, ids: torch.Tensor, chunks) -> torch.Tensor:
    """ids [T] fed in chunks through the paged cache (the engine's path) -> logits [T, V]."""
    cache = model.new_cache(batch=1)
    out = []
    for a, b in chunks:
        out.append(model(ids[a:b], cache, ForwardBatch.build(cache, [0], [b - a], [a])).logits)
        cache.set_length(0, b)
    return torch.cat(out)


def without_kernels(monkeypatch, c_path: bool) -> None:
    if not c_path:     # the PyTorch path (what SPECDEC_KERNELS=0 runs)
        monkeypatch.setattr(kernels, "load", lambda *a: None)


def check_tensor_parallel_equals_tp1(hf) -> None:
    """LLM(tensor_parallel_size=2) on the checkpoint `hf`: logits within float tolerance of TP=1
    (the ranks' partial sums add in another order), greedy output identical."""
    kw = dict(model=hf, dtype="float32", num_speculative_tokens=0, max_model_len=96)
    tp1, tp2 = LLM(**kw), LLM(**kw, tensor_parallel_size=2)
    try:
        ids = IDS[0].tolist()
        a, b = (cached_logits(m.target, torch.tensor(ids), [(0, len(ids))]) for m in (tp1, tp2))
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4 * a.abs().max().item())
        prompts = [{"prompt_token_ids": IDS[0, :n].tolist()} for n in (3, 12, 7)]
        assert [o.outputs[0].token_ids for o in tp2.generate(prompts, GREEDY)] == \
            [o.outputs[0].token_ids for o in tp1.generate(prompts, GREEDY)]
    finally:
        tp2.shutdown()


def check_greedy_equals_transformers_generate(hf, path) -> None:
    """16 greedy tokens of `path` (the folder hf, or a GGUF of it) == transformers' generate on hf."""
    prompt = IDS[0].tolist()
    model = reference(hf)
    with torch.no_grad():    # an EOS id no token has: never stops, never masked (as min_new_tokens would)
        expected = model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=16, do_sample=False,
                                  eos_token_id=model.config.vocab_size, pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(str(path), dtype="float32", num_speculative_tokens=0)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected


SPECS = {
    "ngram": lambda f: {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
    "draft_model": lambda f: {"method": "draft_model", "model": str(f["near"]), "num_speculative_tokens": 3},
    "self-draft": lambda f: {"method": "draft_model", "model": str(f["hf"]), "num_speculative_tokens": 4},
    "layer_skip": lambda f: {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 2},
    "eagle-tree": lambda f: {"method": "eagle", "model": str(f["eagle"]), "num_speculative_tokens": 4},
    "eagle-chain": lambda f: {"method": "eagle", "model": str(f["eagle"]), "num_speculative_tokens": 3, "topk": 1},
}


def check_speculative_greedy_equals_plain(files, monkeypatch, c_path: bool, padded: bool = False) -> None:
    """Every method (files: hf, near, eagle, medusa), one request at a time and four at once
    (prompts of different lengths, prefilled in chunks of 8): the tokens plain decoding gives alone.
    padded: on the PyTorch path with a GPU's padded attention (model/batch.py: PaddedAttention)."""
    if c_path and kernels.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    without_kernels(monkeypatch, c_path)
    if padded:
        from specdec.model import batch

        monkeypatch.setattr(batch, "PADDED", True)
    solo = LLM(model=files["hf"], dtype="float32", num_speculative_tokens=0, max_num_seqs=1)
    plain = [o.outputs[0].token_ids for o in solo.generate(PROMPTS, GREEDY)]
    assert len({tuple(p) for p in plain}) > 1
    for name, spec in SPECS.items():
        for seqs in (1, 4):
            llm = LLM(model=files["hf"], dtype="float32", speculative_config=spec(files), max_num_seqs=seqs,
                      max_num_batched_tokens=8)
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain, (name, seqs)


@pytest.mark.parametrize("c_path", [True, False], ids=["c", "pytorch"])
def test_logits_match_transformers(files, monkeypatch, c_path):
    """Whole sequences and the paged cache fed in chunks, on the C and the PyTorch forward (or,
    where files["c_forward"] is false, the PyTorch forward with forward.c's paged attention)."""
    if c_path and kernels.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    without_kernels(monkeypatch, c_path)
    ours = load_model(files["hf"], "float32")
    assert (ours.c_view(ours.new_cache(1, 8)) is not None) == (c_path and files.get("c_forward", True))
    tokens = torch.randint(0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = reference(files["hf"])(tokens).logits
        tol = 1e-4 * max(1.0, ref.abs().max().item())
        assert (ours(tokens).logits - ref).abs().max() < tol
        assert (cached_logits(ours, tokens[0], [(0, 17), (17, 18), (18, 40)]) - ref[0]).abs().max() < tol


def test_f32_gguf_equals_the_checkpoint(files):
    """The same parameters as the folder's (llama.cpp's names, layouts and q/k permutations
    undone: a wrong permutation moves tiny models' logits by little), and the same logits."""
    ours, theirs = dict(load_model(files["hf"], "float32").named_parameters()), dict(load_model(files["f32"]).named_parameters())
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        torch.testing.assert_close(theirs[name], value, atol=1e-6, rtol=1e-6, msg=name)
    with torch.no_grad():
        expected = reference(files["hf"])(IDS).logits[0]
        torch.testing.assert_close(load_model(files["f32"])(IDS).logits[0], expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cached_logits(load_model(files["f32"]), IDS[0], [(0, 5), (5, 12)]), expected,
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", ["hf", "f32"])
def test_greedy_output_equals_transformers_generate(files, path):
    check_greedy_equals_transformers_generate(files["hf"], files[path])


@pytest.mark.parametrize("c_path", [True, False], ids=["c", "pytorch"])
def test_speculative_greedy_equals_plain(files, monkeypatch, c_path):
    """ngram, draft model, self-draft, layer skip, EAGLE tree and chain, alone and four at once."""
    check_speculative_greedy_equals_plain(files, monkeypatch, c_path)


def test_speculative_greedy_equals_plain_padded_attention(files, monkeypatch):
    """The same on the PyTorch path with a GPU's padded attention: imported by the modules whose
    attention has its own parts (latent, sliding windows, soft-caps, sinks)."""
    check_speculative_greedy_equals_plain(files, monkeypatch, False, padded=True)


def check_grouped_routing_matches_transformers(hf, layer: int = 1, group: int = 4) -> None:
    """DeepSeek-style routers (GLM-4.5, DeepSeek-V2 / V3): each of 500 random tokens' experts and
    weights from MoE.route equal transformers' router's (in any order), and both experts of a
    token lie in one group of `group` (topk_group 1)."""
    ref = reference(hf)
    ours = load_model(hf, "float32").model.layers[layer].mlp
    x = torch.randn(500, ref.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, w_ref, ids_ref = ref.model.layers[layer].mlp.gate(x)
        w, ids = ours.route(x)
    order, order_ref = ids.argsort(-1), ids_ref.argsort(-1)
    assert torch.equal(ids.gather(1, order), ids_ref.gather(1, order_ref))
    torch.testing.assert_close(w.gather(1, order), w_ref.gather(1, order_ref))
    assert torch.equal(ids[:, 0] // group, ids[:, 1] // group)
