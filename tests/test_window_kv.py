"""KV blocks behind a sliding window are given back (vLLM frees them too): when every cache
sharing the pool is windowed (Mistral's or Phi-3's every layer), a sequence holds about its
window and a step's slots, whatever its length, so a pool that holds one max_model_len sequence
runs several long ones at once, and a long prompt joins with its first chunk's blocks only.
Outputs stay transformers' (the windows of 8 tokens are crossed many times); with `trim`
switched off the same load preempts, which shows the test depends on the blocks coming back."""

from __future__ import annotations

import pytest
import torch

from conftest import make_checkpoint, noisy_head_copy
from specdec import LLM, SamplingParams
from specdec.model import BlockManager, KVCache
from arch_checks import reference

WINDOW, BS, MAX_LEN = 8, 4, 128
# 2 layers x 2 KV heads x 16 dims, fp32 keys and values: 512 bytes a slot; one max_model_len
# sequence (plus the drafts' lookahead) is what the pool holds
SLOT_BYTES = KVCache.bytes_per_slot(2, 2, 16, torch.float32)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    root = tmp_path_factory.mktemp("window-kv")
    hf = make_checkpoint(root / "hf", arch="mistral", sliding_window=WINDOW)
    return hf, noisy_head_copy(hf, root / "near")


def prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(length)
    return [torch.randint(2, 200, (length + i,), generator=g).tolist() for i in range(n)]


def transformers_greedy(hf, ids: list[int], n: int) -> list[int]:
    """n argmax tokens of transformers' forward over the whole sequence (EOS is a token like any
    other here, as with ignore_eos)."""
    model, seq = reference(hf), list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def test_trim_gives_back_the_blocks_behind_every_window():
    blocks = BlockManager(40, BS, 2, 32)
    assert blocks.window is None
    full, win = blocks.register_cache(None), blocks.register_cache(6)
    blocks.add("a")
    blocks.ensure("a", 60)
    blocks.set_length("a", full, 60)
    blocks.set_length("a", win, 60)
    assert blocks.window is None and blocks.trim("a") == 0      # one cache reads every slot

    blocks = BlockManager(40, BS, 2, 32)
    target, draft = blocks.register_cache(WINDOW), blocks.register_cache(6)
    assert blocks.window == WINDOW
    blocks.prefix_caching = True
    seq = list(range(100, 160))
    assert blocks.admit("a", seq[:-1], 60) == 0
    blocks.set_length("a", target, 30)
    blocks.set_length("a", draft, 28)                            # the draft lags: its next slot is 28
    blocks.register("a", seq, 28)
    before = blocks.num_free_blocks
    # a token at 28 sees slots 21..28: blocks 0..4 (slots 0..19) are behind every window
    assert blocks.trim("a") == 5 and blocks.num_free_blocks == before + 5
    assert blocks.trim("a") == 0                                 # nothing new behind the window
    assert len(blocks.cached_prefix(seq)) == 7                   # given back, still findable
    blocks.set_length("a", draft, 30)
    assert blocks.trim("a") == 0                                 # 30 - 8 + 1 = 23: block 5 still read
    blocks.set_length("a", target, 31)
    blocks.set_length("a", draft, 31)
    assert blocks.trim("a") == 1
    blocks.remove("a")                                           # the rest, each block once
    assert blocks.num_free_blocks == 40


def test_long_sequences_share_a_pool_of_one(mistral):
    """4 requests of ~106 slots in a pool of 128 (+ lookahead) slots: no preemption, outputs
    equal transformers' and those of each request alone."""
    hf, _ = mistral
    ps, n = prompts(4, 6), 100
    kw = dict(model=hf, dtype="float32", max_model_len=MAX_LEN, block_size=BS, max_num_seqs=4,
              kv_cache_memory=SLOT_BYTES * (MAX_LEN + BS), num_speculative_tokens=0)
    llm = LLM(**kw)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]
    assert llm.engine.num_preemptions == 0
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks     # every block back
    assert outs == [transformers_greedy(hf, p, n) for p in ps]


def test_without_trimming_the_same_load_preempts(mistral, monkeypatch):
    hf, _ = mistral
    monkeypatch.setattr(BlockManager, "trim", lambda self, seq: 0)
    llm = LLM(model=hf, dtype="float32", max_model_len=MAX_LEN, block_size=BS, max_num_seqs=4,
              kv_cache_memory=SLOT_BYTES * (MAX_LEN + BS), num_speculative_tokens=0)
    llm.generate([{"prompt_token_ids": p} for p in prompts(4, 6)],
                 SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    assert llm.engine.num_preemptions > 0


def test_long_prompts_join_with_their_first_chunk(mistral):
    """Prompts of ~100 tokens prefilled 40 tokens a step join with their first chunk's blocks
    (not the whole prompt's 25), so after every step each holds at most its window's blocks
    and a partly written one: 3 x 4 of the pool's 33. Outputs are transformers'."""
    hf, _ = mistral
    ps, n = prompts(3, 96), 16
    llm = LLM(model=hf, dtype="float32", max_model_len=MAX_LEN, block_size=BS, max_num_seqs=4,
              max_num_batched_tokens=40, kv_cache_memory=SLOT_BYTES * (MAX_LEN + BS), num_speculative_tokens=0)
    engine, per_seq = llm.engine, (WINDOW - 1) // BS + 2
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in ps]
    seated, least_free = 0, engine.blocks.num_blocks
    while engine.has_unfinished():
        engine.step()
        seated = max(seated, engine.num_running)
        least_free = min(least_free, engine.blocks.num_free_blocks)
    assert seated == 3 and engine.num_preemptions == 0
    assert engine.blocks.num_blocks - least_free <= 3 * per_seq
    assert [r.out for r in reqs] == [transformers_greedy(hf, p, n) for p in ps]


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_speculation_with_windowed_caches_equals_plain(mistral, method):
    """A windowed draft model's cache shares the blocks (trimmed behind both windows); ngram has
    none. Greedy output equals plain decoding, with no preemption in the small pool."""
    hf, near = mistral
    spec = {"method": "draft_model", "model": str(near)} if method == "draft_model" else {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    ps, n = prompts(3, 10), 80
    base = dict(model=hf, dtype="float32", max_model_len=MAX_LEN, block_size=BS, max_num_seqs=4)
    llm = LLM(**base, speculative_config={**spec, "num_speculative_tokens": 3},
              kv_cache_memory=2 * SLOT_BYTES * (MAX_LEN + 2 * BS))
    assert llm.engine.blocks.window == WINDOW
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]
    assert llm.engine.num_preemptions == 0
    assert outs == [transformers_greedy(hf, p, n) for p in ps]


def test_prefix_caching_finds_blocks_given_back(mistral):
    """Blocks given back behind the window stay registered: a later request with the same
    48-token opening takes them from the cache; outputs stay transformers'."""
    hf, _ = mistral
    opening = prompts(1, 48)[0]
    ps = [opening + tail for tail in prompts(3, 5)]
    llm = LLM(model=hf, dtype="float32", max_model_len=MAX_LEN, block_size=BS, max_num_seqs=4,
              kv_cache_memory=SLOT_BYTES * (MAX_LEN + BS), num_speculative_tokens=0, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": ps[0]}], params)[0]
    rest = llm.generate([{"prompt_token_ids": p} for p in ps[1:]], params)
    assert first.num_cached_tokens == 0 and [o.num_cached_tokens for o in rest] == [48, 48]
    assert [o.outputs[0].token_ids for o in [first, *rest]] == [transformers_greedy(hf, p, 40) for p in ps]


@pytest.mark.tp
def test_tensor_parallel_ranks_follow_the_given_back_blocks(mistral):
    """The workers mirror rank 0's tables, whose entries behind the window point at blocks other
    sequences now hold: TP=2 output equals TP=1 with the long load of the small pool."""
    hf, _ = mistral
    kw = dict(model=hf, dtype="float32", max_model_len=MAX_LEN, block_size=BS, max_num_seqs=4,
              kv_cache_memory=SLOT_BYTES * (MAX_LEN + BS), num_speculative_tokens=0)
    ps, params = prompts(4, 6), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    tp1 = LLM(**kw)
    want = [o.outputs[0].token_ids for o in tp1.generate([{"prompt_token_ids": p} for p in ps], params)]
    tp2 = LLM(**kw, tensor_parallel_size=2)
    try:
        got = [o.outputs[0].token_ids for o in tp2.generate([{"prompt_token_ids": p} for p in ps], params)]
        assert got == want and tp2.engine.num_preemptions == 0
    finally:
        tp2.shutdown()


def test_trees_stay_shallower_than_the_window(mistral):
    """Oracle trees of 12 nodes (the true continuation hidden at random sibling positions, so deep
    paths are accepted) on a window of 8: the tree mask lets a node see its whole path, which a
    window shorter than the path would not, so the engine keeps a tree to window - 1 nodes (it
    verified paths 8 deep, whose last node saw the root 8 positions back: output left plain's)."""
    from specdec.engine import Engine
    from test_heads import OracleTree

    hf, _ = mistral
    llm = LLM(model=str(hf), dtype="float32", num_speculative_tokens=0)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = [[0, 9, 17, 33, 42, 8, 61, 20, 5, 77, 30, 2, 14][:n] for n in (3, 8, 13)]
    plain = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ids], params)]
    truth = {tuple(p): out for p, out in zip(ids, plain)}
    for seed in range(6):
        engine = Engine(llm.target, llm.tokenizer, OracleTree(truth, seed), 12, llm.engine.max_model_len, max_k=12)
        assert engine.tree_nodes_cap == WINDOW - 1
        for prompt, want in zip(ids, plain):
            events = list(engine.generate(prompt, params))
            assert [t for e in events for t in e.token_ids] == want, (seed, len(prompt))
