"""KV memory as vLLM's (tester kv58): kv_cache_memory_bytes and vLLM's scheduler keywords in
LLM(...); reset_prefix_cache(reset_running_requests); offline beam_search keeps a prompt's
cache_salt; requests admitted together share the prefix blocks one of them computes (n > 1
siblings, a burst with one system prompt) with outputs unchanged."""

from __future__ import annotations

import logging
import random

import pytest

from specdec import LLM, SamplingParams
from specdec.sampling_params import BeamSearchParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 90) for _ in range(n)]


def _llm(tiny_pair, **kw) -> LLM:
    return LLM(str(tiny_pair[0]), num_speculative_tokens=0, max_model_len=256, **kw)


def _tokens(outs) -> list:
    return [[c.token_ids for c in o.outputs] for o in outs]


def _metered(llm: LLM) -> dict:
    """The engine's peak blocks held and tokens fed, read after every step."""
    e, seen = llm.engine, {"blocks": 0, "fed": 0}
    step = e.step

    def metered():
        events = step()
        seen["blocks"] = max(seen["blocks"], e.blocks.num_blocks - e.blocks.num_free_blocks)
        seen["fed"] += e.last_step_tokens
        return events
    e.step = metered
    return seen


# -- 1. vLLM's offline names ----------------------------------------------------------------------

def test_kv_cache_memory_bytes_is_vllms_name_for_the_pool(tiny_pair):
    by_ours = _llm(tiny_pair, kv_cache_memory=3 << 19)
    by_vllm = _llm(tiny_pair, kv_cache_memory_bytes=3 << 19)
    assert by_vllm.engine.blocks.num_blocks == by_ours.engine.blocks.num_blocks != _llm(tiny_pair).engine.blocks.num_blocks
    assert _llm(tiny_pair, kv_cache_memory="1.5M", kv_cache_memory_bytes=3 << 19).engine.blocks.num_blocks \
        == by_ours.engine.blocks.num_blocks
    with pytest.raises(ValueError, match="disagree"):
        _llm(tiny_pair, kv_cache_memory="1M", kv_cache_memory_bytes=3 << 19)


def test_vllm_scheduler_keywords_accepted_and_ignored_with_a_warning(tiny_pair, caplog):
    with caplog.at_level(logging.WARNING, logger="specdec"):
        llm = _llm(tiny_pair, long_prefill_token_threshold=64, max_num_partial_prefills=2, max_long_partial_prefills=1,
                   preemption_mode="swap", prefix_caching_hash_algo="xxhash")
    said = caplog.text
    for name in ("long_prefill_token_threshold=64", "max_num_partial_prefills=2", "preemption_mode='swap'",
                 "prefix_caching_hash_algo='xxhash'"):
        assert name in said
    assert "max_long_partial_prefills" not in said            # vLLM's default: nothing to say
    assert llm.generate({"prompt_token_ids": _ids(20, 1)}, GREEDY)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="max_num_partial_prefills"):
        _llm(tiny_pair, max_num_partial_prefills=0)


# -- 2. reset_prefix_cache(reset_running_requests) ------------------------------------------------

def test_reset_prefix_cache_resets_running_requests_by_keyword_and_position(tiny_pair):
    llm = _llm(tiny_pair)
    prompt = {"prompt_token_ids": _ids(55, 2)}
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    solo = llm.generate(prompt, params)[0].outputs[0].token_ids
    assert llm.reset_prefix_cache() is True
    eng = llm.llm_engine
    for reset in (lambda: llm.reset_prefix_cache(reset_running_requests=True), lambda: llm.reset_prefix_cache(True),
                  lambda: eng.reset_prefix_cache(reset_running_requests=True), lambda: eng.reset_prefix_cache(True)):
        eng.add_request("a", prompt, params)
        eng.step(), eng.step()
        assert llm.reset_prefix_cache() is False and eng.reset_prefix_cache(False) is False   # a request holds blocks
        preempted = llm.engine.num_preemptions
        assert reset() is True
        assert (llm.engine.num_running, llm.engine.num_waiting) == (0, 1)
        assert llm.engine.num_preemptions == preempted + 1
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step()
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == solo     # recomputed, same tokens


def test_reset_prefix_cache_refuses_a_device_for_the_flag(tiny_pair):
    llm = _llm(tiny_pair)
    with pytest.raises(TypeError, match="reset_running_requests must be a bool"):
        llm.reset_prefix_cache("cuda")          # vLLM's old first argument, not True
    with pytest.raises(TypeError, match="reset_connector"):
        llm.llm_engine.reset_prefix_cache(False, None)


# -- 4. offline beam search keeps cache_salt -------------------------------------------------------

def test_offline_beam_search_keeps_the_prompts_cache_salt(tiny_pair):
    llm = _llm(tiny_pair)
    e = llm.engine
    ids = _ids(70, 3)
    llm.generate({"prompt_token_ids": ids}, GREEDY)            # unsalted: warms the cache
    params = BeamSearchParams(beam_width=2, max_tokens=1)      # one step: one request on the prompt
    h0 = e.prefix_cache_hits
    salted = llm.beam_search([{"prompt_token_ids": ids, "cache_salt": "tenant-c"}], params)
    assert e.prefix_cache_hits == h0                           # the unsalted blocks are not the tenant's
    again = llm.beam_search([{"prompt_token_ids": ids, "cache_salt": "tenant-c"}], params)
    assert e.prefix_cache_hits == h0 + 64                      # its own salt's blocks are
    plain = llm.beam_search([{"prompt_token_ids": ids}], params)
    assert [s.tokens for s in salted[0].sequences] == [s.tokens for s in again[0].sequences] \
        == [s.tokens for s in plain[0].sequences]


# -- 3. same-step sharing -----------------------------------------------------------------------

def test_n_siblings_prefill_their_prompt_once(tiny_pair):
    """n=4 on a 160-token prompt (9 full blocks of 16 before its last token): the first child
    computes it, the other three wait one step and take its 9 blocks (vLLM's parallel sampling
    shares the prompt's blocks). Seeded samples are those of a run without prefix caching."""
    prompt = {"prompt_token_ids": _ids(160, 4)}
    params = SamplingParams(n=4, temperature=0.8, seed=1, max_tokens=40, ignore_eos=True)
    ref = _llm(tiny_pair, enable_prefix_caching=False).generate(prompt, params)
    llm = _llm(tiny_pair)
    seen = _metered(llm)
    out = llm.generate(prompt, params)
    assert _tokens(out) == _tokens(ref)
    e = llm.engine
    assert e.prefix_cache_hits == 3 * 144 and e.prefix_cache_queries == 4 * 160
    assert out[0].num_cached_tokens == 144
    assert seen["fed"] == 159 + 3 * 15 + 4 * 40                # was 4 x 159 prompt tokens
    assert seen["blocks"] == 9 + 4 * 4                          # 25 (was 4 x 13 = 52)
    assert e.num_preemptions == 0 and e.kv_cache_usage == 0.0


def test_n_siblings_in_a_small_pool_preempt_less(tiny_pair):
    prompt = {"prompt_token_ids": _ids(160, 4)}
    params = SamplingParams(n=4, temperature=0.8, seed=1, max_tokens=40, ignore_eos=True)
    ref = _llm(tiny_pair, enable_prefix_caching=False).generate(prompt, params)
    llm = _llm(tiny_pair, num_gpu_blocks_override=26)
    assert _tokens(llm.generate(prompt, params)) == _tokens(ref)
    assert llm.engine.num_preemptions == 0           # 25 blocks shared fit; 4 private copies (52) preempted


@pytest.mark.parametrize("budget", [2048, 160, 32])
def test_a_burst_sharing_a_system_prompt_computes_it_once(tiny_pair, budget):
    """8 prompts with one 128-token prefix in one generate call: the 7 after the first hit its
    8 blocks (vLLM: 7 x 128), chunked prefill included; greedy outputs are each prompt's alone."""
    system = _ids(128, 5)
    prompts = [{"prompt_token_ids": system + _ids(20, 10 + i)} for i in range(8)]
    solo = [_llm(tiny_pair, enable_prefix_caching=False).generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]
    llm = _llm(tiny_pair, max_num_batched_tokens=budget)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == solo
    assert [o.num_cached_tokens for o in outs] == [0] + [128] * 7
    assert llm.engine.prefix_cache_hits == 7 * 128


def test_salted_and_unsalted_requests_of_one_step_stay_apart(tiny_pair):
    """A request waits only for blocks it could take: another salt's prefix holds nothing back."""
    system = _ids(64, 6)
    prompts = [{"prompt_token_ids": system + [7, 8]}, {"prompt_token_ids": system + [9, 10], "cache_salt": "b"},
               {"prompt_token_ids": system + [11, 12]}]
    llm = _llm(tiny_pair)
    seen = _metered(llm)
    outs = llm.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 64]
    assert seen["fed"] == 65 + 65 + 1 + 3 * 8                 # the third computed only its own 2 tokens


def test_siblings_share_with_a_draft_model(tiny_pair):
    """Speculative decoding with a draft model: the draft's cache covers the shared blocks too
    (they are registered once both caches hold them), and greedy children equal the plain output."""
    prompt = {"prompt_token_ids": _ids(100, 7)}
    one = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = _llm(tiny_pair, enable_prefix_caching=False).generate(prompt, one)[0].outputs[0].token_ids
    spec = LLM(str(tiny_pair[0]), speculative_model=str(tiny_pair[1]), num_speculative_tokens=3, max_model_len=256)
    out = spec.generate(prompt, SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert [c.token_ids for c in out.outputs] == [plain] * 3
    assert spec.engine.prefix_cache_hits == 2 * 96            # 6 blocks of 16 before the last token


def test_a_short_shared_prefix_is_not_waited_for(tiny_pair):
    """A burst sharing one block of a 10-block prompt (a short system prompt) is admitted at once:
    waiting a step would cost every request its first token's latency for a tenth of its prefill."""
    system = _ids(16, 8)
    prompts = [{"prompt_token_ids": system + _ids(150, 20 + i)} for i in range(4)]
    llm = _llm(tiny_pair)
    outs = llm.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [0] * 4


def test_a_request_waiting_for_shared_blocks_holds_no_one_else_back(tiny_pair):
    """Siblings of one prompt wait a step for its blocks; an unrelated request queued behind them
    is admitted in the first step all the same (the queue had stopped at the first waiter)."""
    llm = _llm(tiny_pair)
    e = llm.engine
    shared, other = _ids(160, 11), _ids(40, 12)
    for i, prompt in enumerate([shared, shared, shared, other]):
        e.add_request(prompt, GREEDY, request_id=f"r{i}")
    e.step()
    running = {r.request_id for r in e.scheduler.running}
    assert running == {"r0", "r3"}, running
    while e.has_unfinished():
        e.step()
    assert e.prefix_cache_hits == 2 * 144
