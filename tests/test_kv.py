"""The paged KV pool and the flat-batch forward: per-sequence bookkeeping, the C path's
bit-identical rows whatever the batch and chunking, and the PyTorch path against it."""

from __future__ import annotations

import pytest
import torch

from conftest import make_checkpoint
from specdec import kernels
from specdec.kernels import cforward
from specdec.model import BlockManager, ForwardBatch, TreeAttention, load_model
from specdec.model.quant import QuantLinear


@pytest.fixture(scope="module", params=["dense", "gguf", "qwen3"])
def model(request, tmp_path_factory):
    """A float32 checkpoint, a GGUF one whose matrices stay packed (Q4_K, Q4_0, Q4_1, Q8_0
    and a tied Q8_0 embedding: forward.c's quantized kernels and its C embedding lookup), and a
    float32 Qwen3 (per-head q/k norms before RoPE; head_dim 32 with hidden 64)."""
    if request.param == "gguf":
        return load_model(request.getfixturevalue("gguf_files")["llama_q"], quantization="gguf")
    if request.param == "qwen3":
        return load_model(make_checkpoint(tmp_path_factory.mktemp("kv") / "q3", arch="qwen3", head_dim=32), "float32")
    return load_model(make_checkpoint(tmp_path_factory.mktemp("kv") / "m", layers=2), "float32")


KV_DTYPES = pytest.mark.parametrize("kv_dtype", [None, torch.bfloat16, torch.int8], ids=["kv-fp32", "kv-bf16", "kv-int8"])


def _pool(model, num_blocks=32, block_size=4, max_seqs=8, max_blocks=32, dtype=None):
    blocks = BlockManager(num_blocks, block_size, max_seqs, max_blocks)
    return blocks, model.new_kv(blocks, dtype=dtype)


def test_blocks_are_per_sequence_and_return_to_the_pool():
    blocks = BlockManager(6, 4, 3, 8)
    blocks.add("a")
    blocks.add("b")
    assert blocks.ensure("a", 4) and blocks.ensure("b", 4) and blocks.ensure("a", 8)   # a: 2 blocks, b: 1
    assert blocks.blocks("a") == [0, 2] and blocks.blocks("b") == [1]
    assert blocks.table[blocks.row("a"), :2].tolist() == [0, 2]
    assert not blocks.ensure("b", 20) and blocks.blocks("b") == [1]    # 4 more do not fit: none taken
    assert blocks.num_free_blocks == 3
    blocks.remove("a")
    assert blocks.num_free_blocks == 5 and "a" not in blocks
    with pytest.raises(ValueError, match="exceed"):
        blocks.ensure("b", 33)


@KV_DTYPES
def test_rollback_and_move_touch_one_sequence_only(model, kv_dtype):
    """(int8: the rows' scales move with them.)"""
    blocks, kv = _pool(model, dtype=kv_dtype)
    for s in ("a", "b"):
        blocks.add(s)
        blocks.ensure(s, 12)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 90, (20,), generator=g)
    model(tokens, kv, ForwardBatch.build(kv, ["a", "b"], [10, 10], [0, 0]), logits=False)
    kv.set_length("a", 10)
    kv.set_length("b", 10)
    before_b = [kv.entries("b", range(10), layer) for layer in range(len(kv.k))]
    want = kv.entries("a", [7, 8, 9], 0)
    kv.move("a", [7, 8, 9], 3)                 # an accepted tree path moved next to a prefix of 3
    got = kv.entries("a", [3, 4, 5], 0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(kv.entries("b", range(10), layer)[0], before_b[layer][0]) for layer in range(len(kv.k)))
    kv.rollback("a", 6)
    assert kv.length("a") == 6 and kv.length("b") == 10
    with pytest.raises(ValueError, match="cannot roll back"):
        kv.rollback("b", 11)


def _mixed_batch(kv, blocks, tokens):
    """Sequence "x" decodes 3 tokens after 11 cached ones, "t" verifies a tree, "p" prefills a
    chunk of 7, "y" decodes 1; every sequence's earlier slots were written by earlier forwards."""
    tree = TreeAttention.from_parents([-1, -1, 0, 1])
    return ForwardBatch.build(kv, ["t", "x", "p", "y"], [5, 3, 7, 1], [6, 11, 0, 9], [tree, None, None, None])


@pytest.mark.skipif(kernels.load() is None, reason="no C compiler or no AVX2/FMA here")
@KV_DTYPES
def test_c_rows_are_bit_identical_whatever_the_batch_and_chunking(model, kv_dtype):
    """Sequence x's logits and cache entries: prompt prefilled in one chunk and decoded alone,
    versus prefilled in three chunks and decoded among three other sequences (with an fp32
    cache, and a bf16 one that forward.c writes and reads)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 90, (14,), generator=g)
    blocks, kv = _pool(model, dtype=kv_dtype)
    assert model.c_view(kv) is not None and kv.k[0].dtype == (kv_dtype or torch.float32)
    blocks.add("x")
    blocks.ensure("x", 14)
    model(x[:11], kv, ForwardBatch.build(kv, ["x"], [11], [0]), logits=False)
    alone = model(x[11:], kv, ForwardBatch.build(kv, ["x"], [3], [11])).logits
    alone_k = [kv.entries("x", range(14), layer) for layer in range(len(kv.k))]

    blocks2, kv2 = _pool(model, dtype=kv_dtype)
    others = {"t": 11, "p": 7, "y": 10}
    for s, n in others.items():      # other sequences take blocks first: x's blocks differ too
        blocks2.add(s)
        blocks2.ensure(s, n)
    blocks2.add("x")
    blocks2.ensure("x", 14)
    for a, b in [(0, 4), (4, 5), (5, 11)]:
        model(x[a:b], kv2, ForwardBatch.build(kv2, ["x"], [b - a], [a]), logits=False)
    model(torch.randint(0, 90, (6 + 9,), generator=g), kv2, ForwardBatch.build(kv2, ["t", "y"], [6, 9], [0, 0]),
          logits=False)
    batch = _mixed_batch(kv2, blocks2, None)
    feed = torch.cat([torch.randint(0, 90, (5,), generator=g), x[11:], torch.randint(0, 90, (8,), generator=g)])
    together = model(feed, kv2, batch).logits[5:8]
    assert torch.equal(together, alone)
    for layer, (keys, values) in enumerate(alone_k):
        got = kv2.entries("x", range(14), layer)
        assert torch.equal(got[0], keys) and torch.equal(got[1], values)


@pytest.mark.skipif(kernels.load() is None, reason="no C compiler or no AVX2/FMA here")
def test_c_rows_do_not_depend_on_the_thread_count(model):
    """One parallel region per forward splits rows, panels and heads across threads: which
    thread computes a value must not change it."""
    g = torch.Generator().manual_seed(3)
    history = torch.randint(0, 90, (6 + 11 + 9,), generator=g)
    feed = torch.randint(0, 90, (16,), generator=g)
    outs = []
    try:
        for threads in (1, 2, 3):
            kernels.set_threads(threads)
            blocks, kv = _pool(model)
            for s, n in {"t": 11, "x": 14, "p": 7, "y": 10}.items():
                blocks.add(s)
                blocks.ensure(s, n)
            model(history, kv, ForwardBatch.build(kv, ["t", "x", "y"], [6, 11, 9], [0, 0, 0]), logits=False)
            outs.append(model(feed, kv, _mixed_batch(kv, blocks, None), hidden=True))
    finally:
        kernels.set_threads(torch.get_num_threads())
    assert all(torch.equal(o.logits, outs[0].logits) and torch.equal(o.hidden, outs[0].hidden) for o in outs)


@pytest.mark.skipif(len(kernels.runnable_variants()) < 2, reason="fewer than two kernel variants run here")
@KV_DTYPES
def test_c_forward_is_bit_identical_across_instruction_sets(model, kv_dtype):
    """Every variant (AMX, AVX-512, AVX2, ...) computes the same forward to the bit: products,
    attention, softmax and SiLU (the same vector maths in every build; AVX-512 runs long
    stretches of it in 16 lanes: sequence "l"'s 37 slots take two such stretches and a tail)."""
    g = torch.Generator().manual_seed(5)
    history = torch.randint(0, 90, (6 + 11 + 9 + 35,), generator=g)
    feed, tail = torch.randint(0, 90, (16,), generator=g), torch.randint(0, 90, (2,), generator=g)
    outs = []
    for name in kernels.runnable_variants():
        lib = kernels.load(name)
        blocks, kv = _pool(model, dtype=kv_dtype)
        for s, n in {"t": 11, "x": 14, "p": 7, "y": 10, "l": 37}.items():
            blocks.add(s)
            blocks.ensure(s, n)
        view = cforward.CView(model, kv)
        layers = len(model.model.layers)
        cforward.forward(lib, view, history, None,
                         ForwardBatch.build(kv, ["t", "x", "y", "l"], [6, 11, 9, 35], [0, 0, 0, 0]), layers, False, False)
        mixed = cforward.forward(lib, view, feed, None, _mixed_batch(kv, blocks, None), layers, True, True)
        long = cforward.forward(lib, view, tail, None, ForwardBatch.build(kv, ["l"], [2], [35]), layers, True, True)
        outs.append(mixed + long)
    for name, out in zip(kernels.runnable_variants(), outs):
        assert all(torch.equal(a, b) for a, b in zip(out, outs[0])), name


@pytest.mark.skipif(kernels.load() is None, reason="no C compiler or no AVX2/FMA here")
@KV_DTYPES
def test_pytorch_path_agrees_with_the_c_path(model, monkeypatch, kv_dtype):
    """The same mixed batch (a tree, decoding rows, a prefill chunk) through both paths."""
    g = torch.Generator().manual_seed(2)
    history = torch.randint(0, 90, (6 + 11 + 9,), generator=g)
    feed = torch.randint(0, 90, (16,), generator=g)
    packed = isinstance(model.lm_head, QuantLinear)
    outs = []
    for c_path in (True, False):
        if not c_path and packed:      # the same quantized kernels, called one matrix at a time
            monkeypatch.setattr(cforward, "supported", lambda model, kv: False)
        elif not c_path:
            monkeypatch.setattr(kernels, "load", lambda: None)
        blocks, kv = _pool(model, dtype=kv_dtype)
        for s, n in {"t": 11, "x": 14, "p": 7, "y": 10}.items():
            blocks.add(s)
            blocks.ensure(s, n)
        model(history, kv, ForwardBatch.build(kv, ["t", "x", "y"], [6, 11, 9], [0, 0, 0]), logits=False)
        out = model(feed, kv, _mixed_batch(kv, blocks, None), hidden=True)
        assert (model.c_view(kv) is not None) == c_path
        outs.append((out.logits, out.hidden, kv.entries("t", range(11), 1)[0].float()))
    # a bf16 or int8 cache: the same values rounded alike (both paths quantize with the same
    # operations), but a last-bit difference upstream can round a key to the neighbouring value
    tol = {None: 1e-4, torch.bfloat16: 2e-2, torch.int8: 5e-2}[kv_dtype]
    for a, b in zip(*outs):
        assert (a - b).abs().max() < tol * max(1.0, b.abs().max().item())


@pytest.mark.skipif(kernels.load() is None, reason="no C compiler or no AVX2/FMA here")
@pytest.mark.parametrize("padded", [False, True], ids=["per-token", "padded"])
def test_engine_on_the_pytorch_path_decodes_what_the_c_path_decodes(tiny_pair, monkeypatch, padded):
    """Plain and speculative batches through the PyTorch path (any device; padded: its attention
    as on a GPU) end to end: the same greedy tokens as the C path on this model (no near-ties
    among its logits)."""
    from specdec import LLM, SamplingParams
    from specdec.model import batch as batch_module

    prompts = ["def add(a, b):", "class Point:\n", "for i in range(10):\n    print(i)", "import os\n"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    spec = {"method": "draft_model", "model": str(tiny_pair[0]), "num_speculative_tokens": 3}
    outs = []
    for c_path in (True, False):
        if not c_path:
            monkeypatch.setattr(kernels, "load", lambda: None)
            monkeypatch.setattr(batch_module, "PADDED", padded)
        for config in ({"num_speculative_tokens": 0}, {"speculative_config": spec}):
            llm = LLM(model=tiny_pair[0], dtype="float32", max_num_seqs=4, max_num_batched_tokens=8, **config)
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1] == outs[2] == outs[3]


def test_pytorch_attention_is_per_token_whatever_the_batch(model):
    """The PyTorch path's attention (any device): a sequence's rows come out bit-identical alone
    and among other sequences (a tree, a longer chunk, other lengths)."""
    from specdec.model.batch import AttentionPlan
    from specdec.model.llama import _TorchAttention

    g = torch.Generator().manual_seed(3)
    cfg = model.config
    H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    outs = []
    for others in (False, True):
        blocks, kv = _pool(model)
        if others:
            for s, n in {"t": 11, "p": 7}.items():
                blocks.add(s)
                blocks.ensure(s, n)
        blocks.add("x")
        blocks.ensure("x", 14)
        hist = torch.randn(11, KV, hd, generator=torch.Generator().manual_seed(4))
        plan = AttentionPlan.of(ForwardBatch.build(kv, ["x"], [11], [0]), kv, "cpu", 64)
        _TorchAttention(kv, plan)(0, torch.zeros(11, H, hd), hist, hist, True)
        seqs, counts, starts, trees = ["x"], [3], [11], [None]
        if others:
            seqs, counts, starts = ["t", "x", "p"], [5, 3, 7], [6, 11, 0]
            trees = [TreeAttention.from_parents([-1, -1, 0, 1]), None, None]
        batch = ForwardBatch.build(kv, seqs, counts, starts, trees)
        n = sum(counts)
        q, k = torch.randn(n, H, hd, generator=g), torch.randn(n, KV, hd, generator=g)
        x_rows = slice(5, 8) if others else slice(0, 3)
        q[x_rows] = torch.arange(3 * H * hd, dtype=torch.float32).reshape(3, H, hd).sin()
        k[x_rows] = torch.arange(3 * KV * hd, dtype=torch.float32).reshape(3, KV, hd).cos()
        out = _TorchAttention(kv, AttentionPlan.of(batch, kv, "cpu", 64))(0, q, k, k, True)
        outs.append(out[x_rows])
    assert torch.equal(outs[0], outs[1])


@KV_DTYPES
@pytest.mark.parametrize("variant", ["plain", "window", "softcap+sinks"])
def test_padded_attention_agrees_with_per_token_attention(model, kv_dtype, variant):
    """The PyTorch path's padded attention (a GPU's default: the decoding sequences of a batch in
    one masked call) gives each token what the per-token attention gives, within rounding: a
    tree, decoding sequences of other lengths and counts; a long chunk stays on its own."""
    from specdec.model.batch import AttentionPlan
    from specdec.model.llama import _TorchAttention

    cfg = model.config
    H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator().manual_seed(5)
    blocks, kv = _pool(model, num_blocks=64, max_blocks=32, dtype=kv_dtype)
    lengths = {"t": 6, "x": 11, "p": 0, "y": 9, "z": 1}
    for s, n in lengths.items():
        blocks.add(s)
        blocks.ensure(s, n + (70 if s == "p" else 5))
        if n:           # an earlier forward's keys and values
            hist = torch.randn(n, KV, hd, generator=g)
            plan = AttentionPlan.of(ForwardBatch.build(kv, [s], [n], [0]), kv, "cpu", 64, padded=False)
            _TorchAttention(kv, plan)(0, torch.zeros(n, H, hd), hist, hist, True)
    tree = TreeAttention.from_parents([-1, -1, 0, 1])
    seqs, counts = ["t", "x", "p", "y", "z"], [5, 3, 70, 1, 2]
    batch = ForwardBatch.build(kv, seqs, counts, [lengths[s] for s in seqs], [tree, None, None, None, None])
    # NaN where no token reads: past each span (never written), and behind a window of 4 (blocks
    # given back and reused); the per-token attention never gathers them, the padded one must not mix them in
    poison = {s: list(range(lengths[s] + c, blocks.capacity(s))) for s, c in zip(seqs, counts)}
    if variant == "window":
        poison = {s: p + list(range(max(0, lengths[s] - 4 + 1 - (2 if s == "t" else 0)))) for s, p in poison.items()}
    for s, slots in poison.items():
        blk, off = kv.slot_index(s, slots)
        for t in ((kv.k[0], kv.v[0]) if kv.k_scale is None else (kv.k_scale[0], kv.v_scale[0])):
            t[:, blk, off] = float("nan")
    n = sum(counts)
    q, k, v = torch.randn(n, H, hd, generator=g), torch.randn(n, KV, hd, generator=g), torch.randn(n, KV, hd, generator=g)
    options = {"plain": {}, "window": {"windows": [4]},
               "softcap+sinks": {"softcap": 5.0, "sinks": [torch.randn(H, generator=g)]}}[variant]
    outs = []
    for padded in (False, True):
        state = [(t.clone(), u.clone()) for t, u in zip(kv.k, kv.v)]
        plan = AttentionPlan.of(batch, kv, "cpu", 64, padded=padded)
        if padded:      # the four short sequences in one call, the 70-token chunk on its own
            assert plan.padded.B == 4 and plan.padded.T == 5 and [s.count for s in plan.seqs] == [70]
        outs.append(_TorchAttention(kv, plan, **options)(0, q, k, v, True))
        for (t, u), (t0, u0) in zip(zip(kv.k, kv.v), state):
            t.copy_(t0)
            u.copy_(u0)
    assert torch.isfinite(outs[0]).all() and torch.allclose(outs[0], outs[1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_padded_attention_takes_one_sequence_with_several_rows(model, shape):
    """Under the padded attention (a GPU's) one sequence that feeds several rows (a verified chain
    or tree, a drafter's update) is attended in one call, not one call per row; what each row gets
    agrees with the per-token attention. One row alone stays on the per-token path."""
    from specdec.model.batch import AttentionPlan
    from specdec.model.llama import _TorchAttention

    cfg = model.config
    H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator().manual_seed(6)
    blocks, kv = _pool(model)
    blocks.add("s")
    blocks.ensure("s", 20)
    hist = torch.randn(9, KV, hd, generator=g)
    plan = AttentionPlan.of(ForwardBatch.build(kv, ["s"], [9], [0]), kv, "cpu", 64, padded=False)
    _TorchAttention(kv, plan)(0, torch.zeros(9, H, hd), hist, hist, True)
    tree = TreeAttention.from_parents([-1, 0, 0, 1]) if shape == "tree" else None
    n = tree.mask.shape[0] if tree is not None else 4       # a tree's rows: the last token and its nodes
    batch = ForwardBatch.build(kv, ["s"], [n], [9], [tree])
    q, k, v = torch.randn(n, H, hd, generator=g), torch.randn(n, KV, hd, generator=g), torch.randn(n, KV, hd, generator=g)
    outs = []
    for padded in (False, True):
        state = [(t.clone(), u.clone()) for t, u in zip(kv.k, kv.v)]
        plan = AttentionPlan.of(batch, kv, "cpu", 64, padded=padded)
        assert (plan.padded is not None and plan.padded.B == 1 and plan.padded.T == n and not plan.seqs) == padded
        outs.append(_TorchAttention(kv, plan)(0, q, k, v, True))
        for (t, u), (t0, u0) in zip(zip(kv.k, kv.v), state):
            t.copy_(t0)
            u.copy_(u0)
    assert torch.isfinite(outs[0]).all() and torch.allclose(outs[0], outs[1], atol=1e-5, rtol=1e-4)
    one = AttentionPlan.of(ForwardBatch.build(kv, ["s"], [1], [9]), kv, "cpu", 64, padded=True)
    assert one.padded is None and one.slot is not None


@pytest.mark.parametrize("counts", [[1, 1, 1], [2, 2], [3, 1]])
def test_padded_attention_of_a_decoding_batch_reads_the_flat_rows(model, counts):
    """Sequences that feed the same number of rows fill the padded layout in their flat order
    (decoding a batch): the padded call takes the rows as they are, with no scatter or gather,
    and each row gets what the per-token attention gives it. Unequal counts keep the scatter."""
    from specdec.model.batch import AttentionPlan
    from specdec.model.llama import _TorchAttention

    cfg = model.config
    H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator().manual_seed(7)
    blocks, kv = _pool(model)
    seqs, lengths = ["a", "b", "c"][:len(counts)], [5, 9, 2][:len(counts)]
    for s, n in zip(seqs, lengths):
        blocks.add(s)
        blocks.ensure(s, n + 4)
        hist = torch.randn(n, KV, hd, generator=g)
        plan = AttentionPlan.of(ForwardBatch.build(kv, [s], [n], [0]), kv, "cpu", 64, padded=False)
        _TorchAttention(kv, plan)(0, torch.zeros(n, H, hd), hist, hist, True)
    batch = ForwardBatch.build(kv, seqs, counts, lengths)
    n = sum(counts)
    q, k, v = torch.randn(n, H, hd, generator=g), torch.randn(n, KV, hd, generator=g), torch.randn(n, KV, hd, generator=g)
    outs = []
    for padded in (False, True):
        state = [(t.clone(), u.clone()) for t, u in zip(kv.k, kv.v)]
        plan = AttentionPlan.of(batch, kv, "cpu", 64, padded=padded)
        if padded:
            assert plan.padded.dense == (len(set(counts)) == 1) and not plan.seqs
        outs.append(_TorchAttention(kv, plan)(0, q, k, v, True))
        for (t, u), (t0, u0) in zip(zip(kv.k, kv.v), state):
            t.copy_(t0)
            u.copy_(u0)
    assert torch.isfinite(outs[0]).all() and torch.allclose(outs[0], outs[1], atol=1e-5, rtol=1e-4)
