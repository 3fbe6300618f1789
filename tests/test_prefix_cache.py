"""Prefix caching (vLLM's --enable-prefix-caching): a prompt's leading full KV blocks come from
earlier requests that held the same tokens, and nothing changes in what is generated.

The block manager's bookkeeping (hash chain, reference counts, least-recently-freed eviction)
against hand-made sequences; then the engine: greedy and seeded sampled outputs with the cache
equal those without it, for plain decoding and ngram, on a multi-turn conversation (each turn's
prompt is the previous prompt and answer plus a question), repeated prompts, a prompt cached
to its last token, and a pool so small that cached blocks are evicted and requests preempted;
the hits are counted, and methods that cannot start from a cached prefix are refused.
"""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.model import BlockManager

from test_engine import PROMPTS

BS = 4


def _manager(num_blocks=8) -> BlockManager:
    m = BlockManager(num_blocks, BS, max_seqs=4, max_blocks_per_seq=8)
    m.register_cache()
    m.prefix_caching = True
    return m


def test_full_blocks_are_found_by_their_tokens_and_everything_before_them():
    m = _manager()
    tokens = list(range(10))                       # blocks [0..3], [4..7], partial [8, 9]
    assert m.admit("a", tokens, 11) == 0
    m.register("a", tokens, 10)                    # two full blocks registered
    assert m.cached_prefix(tokens) == m.blocks("a")[:2]
    assert m.cached_prefix([0, 1, 2, 3, 9, 9, 9, 9]) == m.blocks("a")[:1]     # same first block only
    assert m.cached_prefix([9, 1, 2, 3, 4, 5, 6, 7]) == []                  # a block depends on its past
    # b shares a's two blocks (held twice), gets its own third one
    assert m.admit("b", tokens[:8] + [42], 10) == 8
    assert m.blocks("b")[:2] == m.blocks("a")[:2] and m.blocks("b")[2] != m.blocks("a")[2]
    assert m.length("b", 0) == 8
    assert m.prefix_queries == 10 + 9 and m.prefix_hits == 8


def test_freed_blocks_stay_findable_until_the_pool_needs_them_least_recent_first():
    m = _manager(num_blocks=4)
    one, two = [1] * 8, [2] * 8
    m.admit("a", one, 8)
    m.register("a", one, 8)
    m.remove("a")
    m.admit("b", two, 8)
    m.register("b", two, 8)
    m.remove("b")
    assert m.num_free_blocks == 4                 # idle cached blocks count as free
    assert len(m.cached_prefix(one)) == 2 and len(m.cached_prefix(two)) == 2
    m.admit("c", [3] * 5, 5)                      # 2 blocks: a's (freed first) are evicted
    assert m.cached_prefix(one) == [] and len(m.cached_prefix(two)) == 2
    # a sequence holding cached blocks keeps them: d takes b's, and e cannot evict them
    assert m.admit("d", two, 8) == 8 and m.num_free_blocks == 0
    assert m.admit("e", [4] * 3, 3) is None
    m.remove("c")
    assert m.admit("e", [4] * 3, 3) == 0 and len(m.cached_prefix(two)) == 2


def test_a_block_computed_twice_at_once_stays_private():
    m = _manager()
    tokens = [7] * 8
    m.admit("a", tokens, 8)
    m.admit("b", tokens, 8)                       # nothing cached yet: both compute it
    m.register("a", tokens, 8)
    m.register("b", tokens, 8)
    assert m.cached_prefix(tokens) == m.blocks("a")
    m.remove("b")                                 # b's copy is not registered: plainly free
    assert m.num_free_blocks == 8 - 2 and m.cached_prefix(tokens) == m.blocks("a")


def _conversation(llm: LLM, turns: int, params: SamplingParams) -> list[list[int]]:
    """Each turn's prompt: the previous prompt, its answer and the next question."""
    prompt, outs = llm.tokenizer.encode(PROMPTS[0]), []
    for t in range(turns):
        out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
        outs.append(list(out))
        prompt = prompt + list(out) + llm.tokenizer.encode(PROMPTS[t + 1])
    return outs


@pytest.mark.parametrize("method", [None, "ngram"])
@pytest.mark.parametrize("greedy", [True, False])
def test_multi_turn_outputs_are_unchanged_and_the_history_is_not_recomputed(tiny_pair, method, greedy):
    target = tiny_pair[0]
    params = SamplingParams(temperature=0 if greedy else 1.0, top_k=0 if greedy else 8, max_tokens=12,
                            seed=None if greedy else 3, ignore_eos=True)
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}} if method else \
        {"num_speculative_tokens": 0}
    runs = {}
    for caching in (False, True):
        llm = LLM(model=target, dtype="float32", max_num_batched_tokens=16, enable_prefix_caching=caching, **spec)
        runs[caching] = _conversation(llm, 4, params)
        engine = llm.engine
    assert runs[True] == runs[False]
    assert engine.prefix_cache_hits > 0.5 * engine.prefix_cache_queries > 0


def test_gguf_packed_target_multi_turn(gguf_files):
    """The quantized C path (int8 activations, bf16 cache) writes the same keys and values for a
    token whatever chunk computed it, so a cached history changes nothing either."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    runs = [_conversation(LLM(gguf_files["llama_q"], quantization="gguf", num_speculative_tokens=0,
                              max_num_batched_tokens=16, enable_prefix_caching=c), 3, params) for c in (False, True)]
    assert runs[0] == runs[1]


def test_repeated_and_fully_cached_prompts_in_a_batch(tiny_pair):
    """Batches of the same prompts twice (the second batch finds the first's blocks, and one
    prompt is cached up to its last token), plus prompts that share only their beginning."""
    target = tiny_pair[0]
    llm = LLM(model=target, dtype="float32", num_speculative_tokens=0, enable_prefix_caching=False)
    tok = llm.tokenizer
    exact = tok.encode(PROMPTS[2])[:4 * 16 + 1]          # 4 full blocks + the last token
    prompts = [{"prompt_token_ids": p} for p in
               [exact, tok.encode(PROMPTS[3]), tok.encode(PROMPTS[3] + PROMPTS[4]), tok.encode(PROMPTS[5])]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    cached = LLM(model=target, dtype="float32", num_speculative_tokens=0, enable_prefix_caching=True)
    for round_ in range(2):
        assert [o.outputs[0].token_ids for o in cached.generate(prompts, params)] == expected, round_
    assert cached.engine.prefix_cache_hits >= len(exact) - 1


def test_a_small_pool_evicts_cached_blocks_and_preempts_without_changing_outputs(tiny_pair):
    target = tiny_pair[0]
    prompts = [p * 3 for p in PROMPTS[:8]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(model=target, dtype="float32", num_speculative_tokens=0, max_num_seqs=4, max_model_len=256,
              kv_cache_memory=_bytes_for(target, slots=4 * 16 * 5))
    expected = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, params)]
    llm = LLM(**kw, enable_prefix_caching=True)
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.num_preemptions > 0 and llm.engine.prefix_cache_hits > 0


def _bytes_for(target, slots: int) -> int:
    probe = LLM(model=target, dtype="float32", num_speculative_tokens=0, max_num_seqs=1, max_model_len=64)
    return slots * probe.engine.target.kv_bytes_per_slot(dtype=probe.engine.kv_dtype)


def test_methods_that_read_every_prompt_token_are_refused(tiny_pair):
    target, draft = tiny_pair
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(model=target, dtype="float32", enable_prefix_caching=True,
            speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})


def test_server_reports_prefix_cache_hits(tiny_pair):
    import httpx
    import openai

    from specdec.server import ServerConfig, build_app
    from test_server import LiveServer, metric

    llm = LLM(tiny_pair[0], dtype="float32", num_speculative_tokens=0, enable_prefix_caching=True)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=60)
        prompt = PROMPTS[1] * 2
        first, second = (client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
                         for _ in range(2))
        assert first.choices[0].text == second.choices[0].text
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert 0 < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
        with httpx.Client(base_url=live.url, timeout=30) as http:
            hits, queries = (metric(http, f"specdec:prefix_cache_{n}_total") for n in ("hits", "queries"))
        assert queries >= hits > 0
