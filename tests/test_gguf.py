"""GGUF checkpoints: exact dequantization, the rotary un-permutation, agreement with transformers'
own GGUF loading, packed (quantized) matrices, and one-line errors for bad files."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf import quants

from conftest import assert_same_greedy
from gguf_helpers import T, encode, write_gguf
from specdec import LLM, SamplingParams, kernels
from specdec.cli import main
from specdec.model import CheckpointError, load_model
from specdec.model.gguf import rotary_unpermutation
from specdec.model.quant import QuantEmbedding, QuantLinear, dequantize

IDS = torch.tensor([[0, 9, 17, 33, 42, 8, 61, 20, 5]])


@pytest.fixture(params=["reference", "kernels"])
def packed_path(request, monkeypatch):
    """How packed matrices are multiplied: "reference" = the exact PyTorch reference (no CPU
    kernel prepared); "kernels" = kernels.quant_linear where it covers the format (int8
    activations per block, as llama.cpp: close to the dequantized model, not equal)."""
    if request.param == "reference":
        monkeypatch.setattr(kernels, "prepare_quant", lambda qweight, qtype: None)
    return request.param


def assert_near(x, y, path):
    """Exact-dequantization paths agree to fp32 rounding; the int8-activation kernels to ~llama.cpp's."""
    if path == "kernels":
        assert ((x - y).norm() / y.norm()).item() < 0.05
        assert (x.argmax(-1) == y.argmax(-1)).float().mean().item() >= 0.8
    else:
        torch.testing.assert_close(x, y, atol=1e-4 * y.abs().max().item(), rtol=1e-4)


def hf_gguf_model(path):
    """transformers' own GGUF loading: every tensor dequantized with gguf-py, fp32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def mapped_file(address: int) -> str | None:
    """The file mapped at `address` in this process (/proc/self/maps), or None."""
    for line in open("/proc/self/maps"):
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return fields[5] if len(fields) > 5 else None
    return None


def logits(model, ids=IDS):
    with torch.inference_mode():
        return model(ids).logits[0]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_dequantize_is_bit_identical_to_gguf_py(qtype):
    w = np.random.default_rng(1).standard_normal((6, 512)).astype(np.float32) * 0.3
    blocks = encode(w, T[qtype])
    ours = dequantize(torch.from_numpy(blocks), qtype, 512).numpy()
    theirs = quants.dequantize(blocks, T[qtype]).reshape(6, 512)
    assert ours.view(np.uint32).tolist() == theirs.view(np.uint32).tolist()
    assert np.abs(ours - w).max() < 0.2 * np.abs(w).max()      # and the encoders are sane


def test_rotary_unpermutation_inverts_llama_cpp_permutation():
    from gguf_helpers import permute_rotary

    w = np.arange(24 * 3).reshape(24, 3)
    stored = permute_rotary(w, 3)
    assert not np.array_equal(stored, w)
    assert np.array_equal(stored[rotary_unpermutation(24, 3).numpy()], w)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_f32_gguf_equals_the_checkpoint_it_came_from(arch, tmp_path):
    """Exact weights: only the layout conventions (permuted q/k, fused q/k/v) can go wrong."""
    from transformers import AutoModelForCausalLM

    from conftest import make_checkpoint

    hf = make_checkpoint(tmp_path / "hf", arch=arch, layers=2)
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ours = load_model(write_gguf(hf, tmp_path / "m.gguf"))
    with torch.inference_mode():
        torch.testing.assert_close(logits(ours), ref(IDS).logits[0], atol=1e-4, rtol=1e-4)
    assert ours.config.attention_bias == (arch == "qwen2")


@pytest.mark.parametrize("name", ["llama_q", "llama_mixed", "qwen2_q"])
def test_logits_equal_transformers_gguf_loading(gguf_files, name):
    path = gguf_files[name]
    with torch.inference_mode():
        expected = hf_gguf_model(path)(IDS).logits[0]
    assert_near(logits(load_model(path, quantization="none")), expected, "dense")


@pytest.mark.parametrize("name", ["llama_q", "llama_mixed", "qwen2_q"])
def test_packed_logits_near_transformers_gguf_loading(gguf_files, name, packed_path):
    path = gguf_files[name]
    with torch.inference_mode():
        expected = hf_gguf_model(path)(IDS).logits[0]
    assert_near(logits(load_model(path, quantization="gguf")), expected, packed_path)


# every format a layer of the low-bit file holds (llama.cpp's Q2_K / Q3_K presets, the i-quants,
# ternary and MXFP4), a different one per matrix
LOWBIT = {0: {"attn_q": T.Q2_K, "attn_k": T.Q3_K, "attn_v": T.IQ1_S, "attn_output": T.IQ1_M, "ffn_gate": T.IQ2_XXS,
              "ffn_up": T.IQ2_XS, "ffn_down": T.IQ4_NL},
          1: {"attn_q": T.IQ2_S, "attn_k": T.IQ3_XXS, "attn_v": T.IQ3_S, "attn_output": T.IQ4_XS, "ffn_gate": T.TQ1_0,
              "ffn_up": T.TQ2_0, "ffn_down": T.MXFP4}}


@pytest.fixture(scope="module")
def lowbit(gguf_files, tmp_path_factory):
    def pick(name: str, ndim: int):
        if name == "output.weight":
            return T.Q3_K
        parts = name.split(".")
        return LOWBIT[int(parts[1])][parts[2]] if parts[0] == "blk" and parts[2] in LOWBIT[0] else T.F32
    return write_gguf(gguf_files["llama_mixed_hf"], tmp_path_factory.mktemp("lowbit") / "lowbit.gguf", pick)


@pytest.mark.parametrize("quantization", ["none", "gguf", None])
def test_low_bit_formats_load_as_transformers_loads_them(lowbit, quantization):
    """Q2_K, Q3_K, IQ1_S .. IQ4_XS, TQ1_0, TQ2_0 (random blocks with sane scales: gguf-py cannot
    encode them) and MXFP4 matrices are dequantized at load, as transformers does with gguf-py."""
    with torch.inference_mode():
        expected = hf_gguf_model(lowbit)(IDS).logits[0]
    assert_near(logits(load_model(lowbit, quantization=quantization)), expected, "dense")


def test_greedy_output_equals_transformers(gguf_files, monkeypatch):
    path = gguf_files["llama_q"]
    ref = hf_gguf_model(path)
    prompt = IDS[0].tolist()
    with torch.inference_mode():
        expected = ref.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=16, do_sample=False,
                                min_new_tokens=16)[0, len(prompt):].tolist()
    monkeypatch.setattr(kernels, "prepare_quant", lambda qweight, qtype: None)    # exact products
    for quantization in ("none", "gguf"):
        llm = LLM(str(path), quantization=quantization)
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        assert out[0].outputs[0].token_ids == expected


def test_packed_layout_shares_the_tied_embedding(gguf_files):
    m = load_model(gguf_files["llama_q"], quantization="gguf")
    attn, mlp = m.model.layers[0].self_attn, m.model.layers[0].mlp
    assert [type(x).__name__ for x in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)] == ["QuantLinear"] * 4
    assert (attn.qkv_proj.qtype, attn.o_proj.qtype, mlp.gate_up_proj.qtype) == ("Q4_K", "Q4_0", "Q4_1")
    assert isinstance(m.model.embed_tokens, QuantEmbedding) and isinstance(m.lm_head, QuantLinear)
    head, emb = m.lm_head, m.model.embed_tokens
    assert torch.equal(head.qweight, emb.qweight)
    quant = [q for q in m.modules() if isinstance(q, QuantLinear)]
    if kernels.load() is not None:
        # one copy of the weights: matrices keep only their kernel panels; the embedding reads
        # the file's mapped rows
        assert all(q.rows is None and q.prepared is not None for q in quant)
        assert mapped_file(emb.qweight.data_ptr()) == str(gguf_files["llama_q"])    # not a copy
    else:
        assert head.rows.data_ptr() == emb.qweight.data_ptr()
    mixed = load_model(gguf_files["llama_mixed"], quantization="gguf")
    layer = mixed.model.layers[0]
    # q/k/v of different types, and types that are never kept packed, are dequantized
    assert not isinstance(layer.self_attn.qkv_proj, QuantLinear) and isinstance(layer.mlp.down_proj, QuantLinear)
    dense = load_model(gguf_files["llama_q"], quantization="none")
    assert not any(isinstance(x, (QuantLinear, QuantEmbedding)) for x in dense.modules())


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_packed_rows_do_not_depend_on_how_many_are_multiplied(qtype, packed_path):
    rng = np.random.default_rng(2)
    lin = QuantLinear(torch.from_numpy(encode(rng.standard_normal((40, 512)).astype(np.float32), T[qtype])), qtype, 512,
                      torch.randn(40))
    x = torch.randn(9, 512)
    together = lin(x)
    for i in range(9):
        assert torch.equal(lin(x[i:i + 1])[0], together[i])
    assert_near(together, x @ lin.dequantize().T + lin.bias, packed_path)


PROMPTS = [[0, 9, 17, 9, 17, 9, 17, 9], [0, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [0, 30, 31, 32, 33, 34, 35]]


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
                                  {"method": "draft_model", "num_speculative_tokens": 3}])
def test_packed_speculative_greedy_equals_plain(gguf_files, spec, packed_path):
    path = str(gguf_files["llama_q"])
    if spec["method"] == "draft_model":
        spec = {**spec, "model": str(gguf_files["draft"].parent)}      # a folder holding one .gguf
    plain = LLM(path, quantization="gguf")
    fast = LLM(path, quantization="gguf", speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert assert_same_greedy(plain, fast, PROMPTS, params) > 0     # verification scored several rows at once, and they agreed
    # kernels: the whole forward runs in C (forward.c over the prepared panels); reference: PyTorch
    assert (fast.target.c_view(fast.engine.kv) is not None) == (packed_path == "kernels" and kernels.load() is not None)


def test_packed_logits_close_to_dequantized(gguf_files, packed_path):
    a = load_model(gguf_files["llama_q"], quantization="gguf")
    b = load_model(gguf_files["llama_q"], quantization="none")
    assert_near(logits(a), logits(b), packed_path)


def test_auto_keeps_packed_what_a_kernel_covers(gguf_files, monkeypatch):
    auto = load_model(gguf_files["llama_q"])
    packed = isinstance(auto.lm_head, QuantLinear)
    assert packed == (kernels.quant_linear(torch.zeros(1, 256), torch.zeros(16, 34 * 8, dtype=torch.uint8), "Q8_0",
                                           None, kernels.prepare_quant(torch.zeros(16, 34 * 8, dtype=torch.uint8), "Q8_0"))
                      is not None)
    monkeypatch.setattr(kernels, "quant_linear", lambda *a, **k: None)          # a CPU without kernels
    assert not any(isinstance(m, QuantLinear) for m in load_model(gguf_files["llama_q"]).modules())


def test_folder_with_one_gguf_and_with_two(gguf_files, tmp_path):
    folder = gguf_files["llama_q"].parent
    assert load_model(folder).config.hidden_size == 256
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(gguf_files["draft"], two / name)
    with pytest.raises(CheckpointError, match="holds 2 .gguf files"):
        load_model(two)


# --- bad input: one line naming the file, exit status 2, nothing half-loaded ----------------

def _truncated(src, dst):
    data = src.read_bytes()
    dst.write_bytes(data[: len(data) * 2 // 3])


def _bad_magic(src, dst):
    data = bytearray(src.read_bytes())
    data[:4] = b"GGUX"
    dst.write_bytes(bytes(data))


def _garbage_header(src, dst):
    data = bytearray(src.read_bytes())
    data[24:64] = bytes([0xFF]) * 40        # inside the first metadata key: absurd lengths
    dst.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,message", [(_truncated, "not a readable GGUF"), (_bad_magic, "not a readable GGUF"),
                                            (_garbage_header, "not a readable GGUF")])
def test_damaged_file(gguf_files, tmp_path, capsys, damage, message):
    bad = tmp_path / "bad.gguf"
    damage(gguf_files["draft"], bad)
    code = main(["generate", "--model", str(bad), "hello"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err and str(bad) in err


def _hf(gguf_files):
    return gguf_files["draft_hf"]


@pytest.mark.parametrize("case,message", [
    ("arch", "unsupported architecture 'gpt2'"),
    ("type", "type Q8_1, which specdec cannot load"),
    ("missing", "tensor blk.0.ffn_down.weight is missing"),
    ("extra", "unexpected tensor blk.0.mystery.weight"),
])
def test_unusable_file(gguf_files, tmp_path, capsys, case, message):
    hf, out = _hf(gguf_files), tmp_path / f"{case}.gguf"
    if case == "arch":
        write_gguf(hf, out, arch="gpt2")
    elif case == "type":
        write_gguf(hf, out, lambda name, ndim: T.Q8_1 if "ffn_up" in name else T.F32)     # ggml's internal format
    elif case == "missing":
        write_gguf(hf, out, skip={"blk.0.ffn_down.weight"})
    else:
        write_gguf(hf, out, extra_tensors={"blk.0.mystery.weight": np.zeros((4, 4), np.float32)})
    code = main(["generate", "--model", str(out), "hello"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err and str(out) in err


def test_draft_vocabulary_mismatch(gguf_files, tmp_path, capsys):
    from gguf_helpers import byte_level_vocab

    vocab = byte_level_vocab(_hf(gguf_files))
    vocab["tokens"][40], vocab["tokens"][41] = vocab["tokens"][41], vocab["tokens"][40]
    bad = write_gguf(_hf(gguf_files), tmp_path / "other.gguf", vocab=vocab)
    code = main(["generate", "--model", str(gguf_files["llama_q"]), "--speculative-model", str(bad), "hello"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "token id 40" in err and str(bad) in err
    assert main(["serve", "--model", str(tmp_path / "missing.gguf"), "--port", "0"]) == 2
    assert capsys.readouterr().err == f"specdec: error: {tmp_path / 'missing.gguf'}: no such file\n"
    assert main(["serve", "--model", str(gguf_files["llama_q"]), "--speculative-model", str(bad), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"specdec: error: {bad}: the draft's vocabulary differs from the "
                                                   f"target's at token id 40"), err


def test_quantization_flag_needs_a_gguf(tiny_pair, capsys):
    code = main(["generate", "--model", str(tiny_pair[0]), "--quantization", "gguf", "hello"])
    assert code == 2 and "needs a .gguf" in capsys.readouterr().err


def test_llama3_rope_frequencies(tmp_path):
    """llama.cpp stores llama3 rope scaling as per-frequency divisors (rope_freqs.weight)."""
    from transformers import AutoModelForCausalLM

    from conftest import make_checkpoint
    from specdec.model.config import ModelConfig
    from specdec.model.llama import rope_inv_freq

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    hf = make_checkpoint(tmp_path / "hf", layers=1, rope_scaling=scaling)
    cfg = ModelConfig.from_hf({**__import__("json").loads((hf / "config.json").read_text())})
    base = rope_inv_freq(cfg.replace(rope_scaling=None))
    factors = (base / rope_inv_freq(cfg)).numpy().astype(np.float32)
    assert not np.allclose(factors, 1)
    ours = load_model(write_gguf(hf, tmp_path / "m.gguf", extra_tensors={"rope_freqs.weight": factors}))
    ids = torch.arange(40)[None] % 90
    with torch.inference_mode():
        ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()(ids).logits[0]
    torch.testing.assert_close(logits(ours, ids), ref, atol=1e-4, rtol=1e-4)


def test_smollm2_packed_and_dequantized(smollm2):
    packed, dense = load_model(smollm2, quantization="gguf"), load_model(smollm2, quantization="none")
    assert packed.config.num_hidden_layers == 30 and packed.config.tie_word_embeddings
    assert packed.model.layers[0].mlp.gate_up_proj.qtype == "Q4_1" and packed.lm_head.qtype == "Q8_0"
    ids = torch.tensor([[1, 4093, 198, 19556, 28, 638, 359, 346, 47, 2, 198, 1, 520, 9531, 198]])
    assert_near(logits(packed, ids), logits(dense, ids), "kernels")


@pytest.mark.parametrize("c_path", [True, False], ids=["c-forward", "torch"])
def test_a_token_scores_alike_alone_or_among_drafts(gguf_files, packed_path, c_path, monkeypatch):
    """Packed models through forward.c (kernels) or PyTorch (the reference, or the kernels a
    matrix at a time): a chain or tree verification must give each token the logits decoding
    gives it, bit for bit (model/llama.py: _paged_attention's per-token attention)."""
    from specdec.kernels import cforward
    from specdec.model import ForwardBatch, TreeAttention

    if not c_path:
        monkeypatch.setattr(cforward, "supported", lambda model, kv: False)
    m = load_model(gguf_files["llama_q"], quantization="gguf")
    prompt, last = [0, 9, 17, 33, 42], 8

    def run(cache, tokens, tree=None):
        start = cache.length(0)
        out = m(torch.tensor(tokens), cache, ForwardBatch.build(cache, [0], [len(tokens)], [start], [tree])).logits
        cache.set_length(0, start + len(tokens))
        return out

    def decoded(path: list[int]) -> torch.Tensor:
        """Logits after feeding `last` then `path` one token at a time: [1 + len(path), V]."""
        cache = m.new_cache(1, 64)
        run(cache, prompt)
        return torch.cat([run(cache, [t]) for t in [last, *path]])

    with torch.inference_mode():
        cache = m.new_cache(1, 64)
        run(cache, prompt)
        chain = run(cache, [last, 61, 20, 5])
        assert torch.equal(chain, decoded([61, 20, 5]))
        cache = m.new_cache(1, 64)
        run(cache, prompt)
        # nodes 61 <- 20 under the root, and 5 under the root: 5 sees the prefix, `last` and itself
        tree = run(cache, [last, 61, 20, 5], TreeAttention.from_parents([-1, 0, -1]))
        assert torch.equal(tree[:3], decoded([61, 20]))
        assert torch.equal(tree[3], decoded([5])[1])



# --- metadata read as llama.cpp reads it (load_hparams) -------------------------------------

def rewritten(src, dst, drop=(), over=None):
    """A copy of the GGUF `src` with metadata keys dropped, or replaced by `over`'s values
    (lists become arrays; bools bool, ints uint32, floats float32)."""
    from gguf import GGUFReader, GGUFValueType as V, GGUFWriter

    r, over = GGUFReader(str(src)), over or {}
    w = GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    kind = lambda x: (V.BOOL if isinstance(x, bool) else V.UINT32 if isinstance(x, int)  # noqa: E731
                      else V.FLOAT32 if isinstance(x, float) else V.STRING)
    for key, f in r.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture" and key not in drop and key not in over:
            w.add_key_value(key, f.contents(), f.types[0], f.types[-1] if f.types[0] == V.ARRAY else None)
    for key, value in over.items():
        w.add_key_value(key, value, *((V.ARRAY, kind(value[0])) if isinstance(value, list) else (kind(value),)))
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def one_line_error(path, capsys) -> str:
    code = main(["generate", "--model", str(path), "--max-tokens", "1", "hello"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and str(path) in err, err
    return err


def test_per_layer_arrays_of_one_value_load_and_differing_ones_are_refused(gguf_files, tmp_path, capsys):
    """llama.cpp reads head_count / head_count_kv / feed_forward_length (get_key_or_arr) as one
    value or one per layer: equal per-layer values are that value; differing ones, a list where
    one value is read, and a list of differing EOS ids are one line naming the file, not a
    traceback."""
    from specdec.model.gguf import GGUFFile

    src = gguf_files["llama_mixed"]
    g = GGUFFile(src)
    per_layer = {f"llama.{k}": [g.get(f"llama.{k}")] * 2 for k in
                 ("attention.head_count", "attention.head_count_kv", "feed_forward_length", "rope.freq_base")}
    same = rewritten(src, tmp_path / "same.gguf", over={**per_layer, "tokenizer.ggml.eos_token_id": [1, 1]})
    assert GGUFFile(same).config() == g.config()
    torch.testing.assert_close(logits(load_model(same)), logits(load_model(src)), atol=0, rtol=0)
    for key, values, message in [("llama.attention.head_count_kv", [4, 2], "per-layer values are not supported"),
                                 ("llama.rope.freq_base", [1e4, 1e6], "per-layer values are not supported"),
                                 ("llama.feed_forward_length", [g.get("llama.feed_forward_length")] * 3,
                                  "has 3 per-layer values for 2 layers"),
                                 ("tokenizer.ggml.eos_token_id", [1, 2], "one id expected"),
                                 ("llama.block_count", [2, 2], "is a list [2, 2], one value expected")]:
        err = one_line_error(rewritten(src, tmp_path / "bad.gguf", over={key: values}), capsys)
        assert key in err and message in err, err


def test_gemma2_without_softcap_or_window_keys_gets_llamacpp_defaults(tmp_path):
    """Gemma-2 files converted before llama.cpp wrote the keys: soft-caps 50 / 30 and a 4096 window
    in the even layers, as llama.cpp's LLM_ARCH_GEMMA2 defaults (and Gemma2Config's)."""
    from conftest import make_checkpoint

    hf = make_checkpoint(tmp_path / "hf", arch="gemma2", layers=2)
    bare = load_model(write_gguf(hf, tmp_path / "bare.gguf"))
    given = load_model(write_gguf(hf, tmp_path / "given.gguf", metadata={
        "gemma2.attn_logit_softcapping": 50.0, "gemma2.final_logit_softcapping": 30.0,
        "gemma2.attention.sliding_window": 4096}))
    cfg = bare.config
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.sliding_window, cfg.sliding_layers) == (50.0, 30.0, 4096, (0,))
    assert cfg == given.config
    torch.testing.assert_close(logits(bare), logits(given), atol=0, rtol=0)


@pytest.mark.parametrize("keys", [{"llama.rope.scale_linear": 4.0}, {"llama.rope.scaling.factor": 4.0}],
                         ids=["old-key", "factor-without-type"])
def test_linear_rope_from_a_factor_alone(tmp_path, keys):
    """llama.cpp's rope.scaling.type defaults to linear, and its factor falls back on the old
    key rope.scale_linear: the model is transformers' with linear scaling x4."""
    from transformers import AutoModelForCausalLM

    from conftest import make_checkpoint

    hf = make_checkpoint(tmp_path / "hf", layers=2, rope_scaling={"rope_type": "linear", "factor": 4.0})
    ours = load_model(write_gguf(hf, tmp_path / "m.gguf", metadata=keys))
    assert ours.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    ids = torch.arange(40)[None] % 90
    with torch.inference_mode():
        ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()(ids).logits[0]
    torch.testing.assert_close(logits(ours, ids), ref, atol=1e-4, rtol=1e-4)
    assert load_model(write_gguf(hf, tmp_path / "none.gguf")).config.rope_scaling is None


@pytest.mark.parametrize("drop,over,message", [
    ({"llama.context_length"}, None, "metadata lacks llama.context_length"),
    ({"llama.attention.layer_norm_rms_epsilon"}, None, "metadata lacks llama.attention.layer_norm_rms_epsilon"),
    ((), {"llama.context_length": 0}, "metadata llama.context_length is 0"),
    ((), {"llama.rope.freq_base": 0.0}, "rope.freq_base) must be a positive number, got 0.0"),
], ids=["no-context-length", "no-rms-eps", "context-length-0", "freq-base-0"])
def test_keys_llamacpp_requires(gguf_files, tmp_path, capsys, drop, over, message):
    """llama.cpp refuses a file without context_length or the RMS norm's epsilon (no default),
    and a zero context is no model: one line naming the file and the key."""
    err = one_line_error(rewritten(gguf_files["draft"], tmp_path / "bad.gguf", drop, over), capsys)
    assert message in err, err
