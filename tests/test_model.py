"""The runtime against transformers' own implementation, and the KV cache mechanics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from conftest import make_checkpoint
from specdec.model import CheckpointError, ForwardBatch, TreeAttention, load_model

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}

ARCHS = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"rope_scaling": LLAMA3_ROPE}),
    ("llama", {"num_key_value_heads": 4}),          # plain multi-head attention
    ("mistral", {}),
    ("qwen2", {}),                                   # q/k/v bias
]


def run(model, cache, tokens, tree=None, seq=0):
    """Feed tokens ([T] or [1, T]) to one sequence of a cache after its valid slots, as the
    engine does; returns the logits [T, V] and advances the sequence's length."""
    tokens = tokens.reshape(-1)
    start = cache.length(seq)
    out = model(tokens, cache, ForwardBatch.build(cache, [seq], [len(tokens)], [start], [tree]))
    cache.set_length(seq, start + len(tokens))
    return out.logits


@pytest.mark.parametrize("arch,kw", ARCHS, ids=[f"{a}-{'-'.join(k) or 'base'}" for a, k in ARCHS])
def test_logits_match_transformers(tmp_path, arch, kw):
    kw = dict(kw)
    folder = make_checkpoint(tmp_path / "m", arch=arch, **kw)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_model(folder, "float32")
    tokens = torch.randint(0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = ref_model(tokens).logits
        full = ours(tokens).logits
        cache = ours.new_cache(batch=1)
        chunks = [run(ours, cache, tokens[0, a:b]) for a, b in [(0, 17), (17, 18), (18, 40)]]
    assert (full - ref).abs().max() < 1e-4
    assert (torch.cat(chunks) - ref[0]).abs().max() < 1e-4


def test_sharded_checkpoint_and_dtypes(tmp_path):
    folder = make_checkpoint(tmp_path / "m")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    for f in folder.glob("tokenizer*"):
        (tmp_path / "sharded" / f.name).write_bytes(f.read_bytes())
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a, b = load_model(folder, "float32"), load_model(tmp_path / "sharded", "float32")
    x = torch.arange(10)[None]
    assert torch.equal(a(x).logits, b(x).logits)
    for dtype in (torch.bfloat16, torch.float16):
        m = load_model(folder, dtype)
        assert m.lm_head.weight.dtype == dtype and m(x).logits.dtype == m.dtype
        # bf16 on a CPU without native bf16: bf16 weights, fp32 activations; close to fp32
        assert (m(x).logits.float() - a(x).logits).abs().max() < 0.1 * a(x).logits.abs().max()


def test_rollback_then_forward_equals_fresh_prefill(tmp_path):
    model = load_model(make_checkpoint(tmp_path / "m"), "float32")
    seq = torch.randint(0, 90, (1, 30), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache()
    run(model, cache, seq[:, :20])
    run(model, cache, torch.randint(0, 90, (1, 6)))      # rejected drafts
    cache.rollback(0, 20)
    after = run(model, cache, seq[:, 20:])
    fresh = model(seq).logits[0, 20:]
    assert cache.length(0) == 30
    assert (after - fresh).abs().max() < 1e-5
    with pytest.raises(ValueError):
        cache.rollback(0, 31)


def test_batch_rows_with_different_lengths(tmp_path):
    model = load_model(make_checkpoint(tmp_path / "m"), "float32")
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, 90, (1, 12), generator=g), torch.randint(0, 90, (1, 7), generator=g)
    cache = model.new_cache(batch=2)
    for row, seq in ((0, a), (1, b)):   # prefill each row on its own
        single = model.new_cache()
        run(model, single, seq[:, :-3])
        for layer in range(len(cache.k)):      # [n_kv, rows, max_len, head_dim]
            cache.k[layer][:, row] = single.k[layer][:, 0]
            cache.v[layer][:, row] = single.v[layer][:, 0]
        cache.set_length(row, seq.shape[1] - 3)
    # both rows in one flat forward, starts 9 and 4
    batch = ForwardBatch.build(cache, [0, 1], [3, 3])
    out = model(torch.cat([a[0, -3:], b[0, -3:]]), cache, batch).logits
    assert (out[:3] - model(a).logits[0, -3:]).abs().max() < 1e-5
    assert (out[3:] - model(b).logits[0, -3:]).abs().max() < 1e-5


def test_tree_attention_equals_each_branch(tmp_path):
    """A tree root -> {x, y}, x -> {z}: each node's logits equal a plain run of its own path."""
    model = load_model(make_checkpoint(tmp_path / "m"), "float32")
    prefix = torch.randint(0, 90, (1, 10), generator=torch.Generator().manual_seed(3))
    root, x, y, z = 5, 17, 23, 42
    nodes = torch.tensor([[root, x, y, z]])
    parents = [-1, 0, 0, 1]
    mask = torch.zeros(4, 4, dtype=torch.bool)
    depth = torch.zeros(4, dtype=torch.long)
    for i, par in enumerate(parents):
        mask[i, i] = True
        if par >= 0:
            mask[i] |= mask[par]
            depth[i] = depth[par] + 1
    cache = model.new_cache()
    run(model, cache, prefix)
    tree_logits = run(model, cache, nodes, tree=TreeAttention(depth, mask))
    for i, path in enumerate([[root], [root, x], [root, y], [root, x, z]]):
        plain = model(torch.cat([prefix, torch.tensor([path])], 1)).logits[0, -1]
        assert (tree_logits[i] - plain).abs().max() < 1e-5, i
    # move the accepted path root, x, z into place and continue: equals the plain sequence
    cache.move(0, [10, 11, 13], 10)
    cache.rollback(0, 13)
    nxt = run(model, cache, torch.tensor([[7]]))[-1]
    plain = model(torch.cat([prefix, torch.tensor([[root, x, z, 7]])], 1)).logits[0, -1]
    assert (nxt - plain).abs().max() < 1e-5


def test_bad_folders_give_one_line_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path / "empty")
    folder = make_checkpoint(tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        load_model(folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="unsupported architecture"):
        load_model(folder)


def test_skinny_kernel_matches_blas_and_is_row_independent():
    """The CPU decode kernel: F.linear's values, and a row's result independent of its batch."""
    import torch.nn.functional as F
    from specdec import kernels

    if kernels.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(200, 96, generator=g).to(dtype)
        b = torch.randn(200, generator=g).to(dtype)
        x = torch.randn(11, 96, generator=g).to(torch.float32)
        got = kernels.linear(x, w, b, kernels.pack(w))
        ref = F.linear(x, w.float(), b.float())
        assert (got - ref).abs().max() < 1e-4
        for rows in range(1, 12):   # row 0 alone, and among 1..10 others: bit-identical
            assert torch.equal(kernels.linear(x[:rows], w, b, kernels.pack(w))[0], got[0])


BUNDLED = Path(__file__).resolve().parents[1] / "models"


@pytest.mark.parametrize("name", ["target", "draft"])
def test_bundled_models_load_in_transformers_and_match(name):
    folder = BUNDLED / name
    if not (folder / "model.safetensors").is_file():
        pytest.skip(f"{folder} not present")
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_model(folder, "float32")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tok("def parse(text):\n    \"\"\"Split text into words.\"\"\"\n")["input_ids"]])
    with torch.no_grad():
        assert (ref(ids).logits - ours(ids).logits).abs().max() < 1e-4
        cache = ours.new_cache()
        stepwise = torch.cat([run(ours, cache, ids[:, :-3]), run(ours, cache, ids[:, -3:])])
        assert (ref(ids).logits[0] - stepwise).abs().max() < 1e-4


@pytest.mark.parametrize("c_kernels", [True, False], ids=["c-forward", "torch"])
def test_tree_grown_over_two_forwards_equals_one_forward(tmp_path, monkeypatch, c_kernels):
    """EAGLE grows its draft tree one depth per forward: nodes of the second forward see the
    prefix and their ancestors among the first forward's nodes (TreeAttention.past), nothing else."""
    from specdec import kernels
    if not c_kernels:
        monkeypatch.setattr(kernels, "load", lambda: None)
    model = load_model(make_checkpoint(tmp_path / "m"), "float32")
    prefix = torch.randint(0, 90, (1, 10), generator=torch.Generator().manual_seed(4))
    # first forward: root a, b (depth 0 after the prefix); second: c below a, d below b, e below a
    first = torch.tensor([[11, 12]])
    second = torch.tensor([[13, 14, 15]])
    cache = model.new_cache()
    run(model, cache, prefix)
    run(model, cache, first, tree=TreeAttention(torch.zeros(2, dtype=torch.long), torch.eye(2, dtype=torch.bool)))
    mask = torch.tensor([[1, 0, 1, 0, 0], [0, 1, 0, 1, 0], [1, 0, 0, 0, 1]], dtype=torch.bool)
    # positions: a, b at 10; c, d, e at 11 = start (12) + offset (-1)
    out = run(model, cache, second, tree=TreeAttention(torch.full((3,), -1), mask, past=2))
    for i, path in enumerate([[11, 13], [12, 14], [11, 15]]):
        plain = model(torch.cat([prefix, torch.tensor([path])], 1)).logits[0, -1]
        assert (out[i] - plain).abs().max() < 1e-5, i


def test_config_refuses_what_the_runtime_does_not_compute(tmp_path):
    """A config whose model the runtime would compute differently is one clear error, never a
    silently different model; a sliding window is kept, in the layers transformers applies it to."""
    from specdec.model.config import ModelConfig

    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 512}
    for extra, message in (({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
                           ({"mlp_bias": True}, "mlp_bias=true is not supported"),
                           ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported")):
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_hf({**base, **extra})
    mistral = {**base, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "num_hidden_layers": 2}
    window = lambda cfg: (cfg.max_position_embeddings, cfg.sliding_window, cfg.sliding_layers)  # noqa: E731
    assert window(ModelConfig.from_hf({**mistral, "sliding_window": 128})) == (512, 128, (0, 1))
    assert window(ModelConfig.from_hf({**mistral, "sliding_window": None})) == (512, None, ())
    assert window(ModelConfig.from_hf({**mistral, "sliding_window": 4096})) == (512, None, ())   # never hides a slot
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "sliding_window": 64,
            "num_hidden_layers": 3, "max_window_layers": 1}
    assert window(ModelConfig.from_hf({**qwen, "use_sliding_window": False})) == (512, None, ())
    assert window(ModelConfig.from_hf({**qwen, "use_sliding_window": True})) == (512, 64, (1, 2))
    folder = tmp_path / "gelu"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**base, "hidden_act": "gelu"}))
    with pytest.raises(Exception, match="hidden_act 'gelu'"):
        load_model(folder, "float32")


@pytest.mark.parametrize("rot", [16, 8])
def test_rope_by_roll_is_rotate_half_bit_for_bit(rot):
    """apply_rope (one roll against a sin whose first half is negated) gives the bits of the
    textbook x * cos + rotate_half(x) * sin, over whole heads and a partial rotary; q and k rotated
    in one call as in Attention.heads give what each gives alone."""
    from specdec.model.llama import apply_rope, rotate_half, signed_sin

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 7, 16, generator=g).to(dtype)
        ang = torch.randn(5, 1, rot // 2, generator=g) * 30
        cos, sin = torch.cat([ang, ang], -1).cos().to(dtype), torch.cat([ang, ang], -1).sin().to(dtype)
        xr = x[..., :rot]
        want = torch.cat([xr * cos + rotate_half(xr) * sin, x[..., rot:]], -1)
        got = apply_rope(x, cos, signed_sin(sin))
        assert got.dtype == dtype and torch.equal(got, want)
        assert torch.equal(torch.cat([apply_rope(x[:, :4], cos, signed_sin(sin)), apply_rope(x[:, 4:], cos, signed_sin(sin))], 1), got)


def test_loading_and_running_inside_inference_mode():
    """User code often wraps everything in torch.inference_mode(): weights made there have no
    version counter, which the kernels' packed-weight cache read (a RuntimeError before)."""
    from specdec import LLM, SamplingParams
    from specdec.defaults import BUNDLED_DRAFT, BUNDLED_TARGET

    sp = SamplingParams(temperature=0, max_tokens=12)
    ref = LLM(BUNDLED_TARGET, num_speculative_tokens=0, max_model_len=64).generate(["def f(x):"], sp)[0]
    with torch.inference_mode():
        llm = LLM(BUNDLED_TARGET, speculative_model=str(BUNDLED_DRAFT), num_speculative_tokens=3, max_model_len=64)
        inside = llm.generate(["def f(x):"], sp)[0]
        model = load_model(BUNDLED_TARGET)
    outside = llm.generate(["def f(x):"], sp)[0]
    assert inside.outputs[0].token_ids == outside.outputs[0].token_ids == ref.outputs[0].token_ids
    assert model(torch.tensor([[1, 2, 3]])).logits.shape[:2] == (1, 3)
