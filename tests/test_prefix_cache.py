"""Prefix caching (vLLM's --enable-prefix-caching): a prompt's leading full KV blocks come from
earlier requests that held the same tokens, and nothing changes in what is generated.

The block manager's bookkeeping (hash chain, reference counts, least-recently-freed eviction)
against hand-made sequences; then the engine: greedy and seeded sampled outputs with the cache
equal those without it, for plain decoding and every speculative method, on a multi-turn conversation (each turn's
prompt is the previous prompt and answer plus a question), repeated prompts, a prompt cached
to its last token, and a pool so small that cached blocks are evicted and requests preempted;
the hits are counted. Every speculative method starts from a cached prefix as it would without
it: a draft model's cache and an EAGLE head's share the target's blocks, a block is registered
only once every cache holds it, and an EAGLE hit computes its last block again.
"""

from __future__ import annotations

import pytest
import torch

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
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}} if method else \
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
    # preempted requests find their own blocks again on their return (vLLM's metrics leave those out)
    assert llm.engine.num_preemptions > 0 and llm.engine.scheduler.blocks.returned_hits > 0


def _bytes_for(target, slots: int) -> int:
    probe = LLM(model=target, dtype="float32", num_speculative_tokens=0, max_num_seqs=1, max_model_len=64)
    return slots * probe.engine.target.kv_bytes_per_slot(dtype=probe.engine.kv_dtype)


@pytest.fixture(scope="module")
def drafters(tiny_pair, near_draft, tmp_path_factory):
    """test_heads' untrained heads, the EAGLE head's fc reading the token as well as the feature
    (there it passes the feature on alone): a head whose cache depends on the next token."""
    from safetensors.torch import load_file, save_file
    from test_heads import _heads_dirs

    dirs = _heads_dirs(tiny_pair[0], tmp_path_factory.mktemp("prefix-heads"))
    path = dirs["eagle"] / "model.safetensors"
    sd = load_file(str(path))
    fc = next(k for k in sd if k.endswith("fc.weight"))
    torch.manual_seed(1)
    half = sd[fc].shape[1] // 2
    sd[fc][:, half:] = torch.randn_like(sd[fc][:, half:]) * 0.05
    save_file(sd, str(path), metadata={"format": "pt"})
    return {"draft": near_draft, **dirs}


METHODS = {
    "draft_model": lambda d: {"method": "draft_model", "model": str(d["draft"]), "num_speculative_tokens": 3},
    "layer_skip": lambda d: {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 3},
    "medusa": lambda d: {"method": "medusa", "model": str(d["medusa"]), "num_speculative_tokens": 4},
    "eagle-tree": lambda d: {"method": "eagle", "model": str(d["eagle"]), "num_speculative_tokens": 4},
    "eagle-chain": lambda d: {"method": "eagle", "model": str(d["eagle"]), "num_speculative_tokens": 3, "topk": 1},
    "ngram+eagle": lambda d: {"method": "ngram+eagle", "model": str(d["eagle"]), "num_speculative_tokens": 3,
                              "topk": 1},
}


def _turns(llm: LLM, turns: int, params: SamplingParams) -> list[tuple[list[int], int, int]]:
    """_conversation, with each turn's accepted and drafted counts: a proposer that starts from a
    cached prefix holds what it would hold without the cache, so it drafts the same tokens."""
    prompt, outs = llm.tokenizer.encode(PROMPTS[0]), []
    for t in range(turns):
        o = llm.generate([{"prompt_token_ids": prompt}], params)[0]
        outs.append((list(o.outputs[0].token_ids), o.stats.accepted_tokens, o.stats.draft_tokens))
        prompt = prompt + list(o.outputs[0].token_ids) + llm.tokenizer.encode(PROMPTS[t + 1])
    return outs


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("greedy", [True, False])
def test_every_speculative_method_drafts_the_same_from_a_cached_prefix(tiny_pair, drafters, method, greedy):
    """Multi-turn: each turn finds the history cached (a draft model's cache, an EAGLE head's,
    the target's features for Medusa come with it or are recomputed). Outputs, and what was
    drafted and accepted at each turn, equal the runs without the cache."""
    params = SamplingParams(temperature=0 if greedy else 1.0, top_k=0 if greedy else 8, max_tokens=12,
                            seed=None if greedy else 5, ignore_eos=True)
    runs = {}
    for caching in (False, True):
        llm = LLM(model=tiny_pair[0], dtype="float32", max_num_batched_tokens=16, enable_prefix_caching=caching,
                  speculative_config=METHODS[method](drafters))
        runs[caching] = _turns(llm, 4, params)
        engine = llm.engine
    assert runs[True] == runs[False]
    assert sum(drafted for _, _, drafted in runs[True]) > 0
    # (the hybrid's head takes prompts at once, its answers when it drafts: answers register as far as that)
    assert engine.prefix_cache_hits > 0.3 * engine.prefix_cache_queries > 0


def _head_kv(engine, request_id, slots: int):
    kv = engine.proposer.learned.kv if hasattr(engine.proposer, "learned") else engine.proposer.kv
    return kv.entries(request_id, list(range(slots)), 0)


@pytest.mark.parametrize("overlap", [1, 0])
def test_an_eagle_block_key_covers_the_token_after_it(tiny_pair, drafters, overlap):
    """EAGLE's slot j holds (feature j, token j + 1): the last slot of a block depends on the
    first token of the next, so EAGLE's block keys cover that token too. Two prompts share two
    full blocks and differ right after them: the second must not take the first's last shared
    block (overlap=0 shows what it would hold then: the first prompt's pair)."""
    spec = {"method": "eagle", "model": str(drafters["eagle"]), "num_speculative_tokens": 3, "topk": 1}
    kw = dict(model=tiny_pair[0], dtype="float32", max_num_batched_tokens=64, speculative_config=spec)
    tok = LLM(**kw).tokenizer
    shared = tok.encode(PROMPTS[2] * 3)[:2 * 16]
    tail = tok.encode(PROMPTS[3])[-8:]
    first, second = shared + tail, shared + tail[1:] + tail[:1]
    assert first[32] != second[32]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    def head_after_prefill(engine):
        req = engine.add_request(second, params)
        while not req.out:
            engine.step()
        return _head_kv(engine, req.request_id, len(second) - 1), req.stats.cached_tokens

    alone, _ = head_after_prefill(LLM(**kw).engine)
    cached = LLM(**kw, enable_prefix_caching=True).engine
    assert cached.blocks.key_overlap == 1 and not cached.blocks.recompute_last_hit    # EAGLE's caps ask for it
    cached.blocks.key_overlap = overlap
    cached.add_request(first, params)
    while cached.has_unfinished():
        cached.step()
    got, hits = head_after_prefill(cached)
    assert hits == (16 if overlap else 32)
    same = all(torch.equal(a, b) for a, b in zip(got, alone))
    assert same == bool(overlap)
    if not overlap:      # the shared prefix's last slot differs (it holds the first prompt's pair)
        differ = {int(j) for a, b in zip(got, alone) for j in (a != b).flatten(1).any(1).nonzero()}
        assert 31 in differ and not differ & set(range(31))


def test_an_eagle_hit_behind_another_sequences_next_block(tiny_pair, drafters):
    """A request answers after two shared blocks; a second prompt shares them and goes on
    otherwise (its own second block stays private: the first's is registered), then a third
    asks the second again. Keyed on their own tokens only, the third found the first's block
    behind the second's third one (the last hit block alone was computed again): its slot 31
    held the first's pair, and seeded samples differed from the run without the cache (found
    by a stress probe, 2026-12-05). Its head cache now equals the one it computes alone."""
    spec = {"method": "eagle", "model": str(drafters["eagle"]), "num_speculative_tokens": 3, "topk": 1}
    kw = dict(model=tiny_pair[0], dtype="float32", max_num_batched_tokens=64, speculative_config=spec)
    tok = LLM(**kw).tokenizer
    shared = tok.encode(PROMPTS[2] * 3)[:2 * 16]
    tail = tok.encode(PROMPTS[3] * 2)[-21:]
    first, second = shared + tail[:5], shared + tail[1:] + tail[:1]
    assert first[32] != second[32]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def head_after_prefill(engine, prompt):
        req = engine.add_request(prompt, params)
        while not req.out:
            engine.step()
        head = _head_kv(engine, req.request_id, len(prompt) - 1)
        while engine.has_unfinished():
            engine.step()
        return head, req.stats.cached_tokens

    alone, _ = head_after_prefill(LLM(**kw).engine, second)
    cached = LLM(**kw, enable_prefix_caching=True).engine
    head_after_prefill(cached, first)
    assert head_after_prefill(cached, second)[1] == 16       # block 1's key covers token 32: not the first's
    got, hits = head_after_prefill(cached, second)
    assert all(torch.equal(a, b) for a, b in zip(got, alone))
    assert hits == 48


def _off(llm):
    """Speculation off from one running request on (the config refuses disable_by_batch_size < 2,
    as vLLM does; the engine's policy takes 1)."""
    llm.engine.policy.disable_by_batch_size = 1
    return llm


def test_blocks_a_trailing_draft_cache_lacks_are_not_registered(tiny_pair, drafters):
    """With speculation off by batch size the draft model's updates are deferred: its cache holds
    the prompt, not the answer. The answer's blocks stay unregistered, so the next turn finds
    only the prompt's, and its draft cache equals the one it computes alone."""
    spec = {"method": "draft_model", "model": str(drafters["draft"]), "num_speculative_tokens": "auto",
            "disable_by_batch_size": 2}
    kw = dict(model=tiny_pair[0], dtype="float32", max_num_batched_tokens=64, speculative_config=spec)
    tok = LLM(**kw).tokenizer
    prompt = tok.encode(PROMPTS[1] * 2)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    llm = _off(LLM(**kw, enable_prefix_caching=True))
    answer = list(llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids)
    follow = prompt + answer + tok.encode(PROMPTS[5])

    def draft_after_prefill(engine):
        req = engine.add_request(follow, params)
        while not req.out:
            engine.step()
        return engine.proposer.kv.entries(req.request_id, list(range(len(follow) - 1)), 0), req.stats.cached_tokens

    got, hits = draft_after_prefill(llm.engine)
    alone, _ = draft_after_prefill(_off(LLM(**kw)).engine)
    assert 0 < hits <= len(prompt) - 1
    assert all(torch.equal(a, b) for a, b in zip(got, alone))


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


@pytest.mark.parametrize("greedy", [True, False])
def test_medusa_hit_up_to_the_last_prompt_token(tiny_pair, drafters, greedy):
    """A prompt of whole blocks plus one token, sent again: a hit up to its last token would leave
    Medusa without the feature it drafts from (the token before the last); the last block is
    computed again, so it drafts and samples exactly as without the cache."""
    spec = METHODS["medusa"](drafters)
    kw = dict(model=tiny_pair[0], dtype="float32", speculative_config=spec)
    params = SamplingParams(temperature=0 if greedy else 1.0, top_k=0 if greedy else 8, max_tokens=16,
                            seed=None if greedy else 9, ignore_eos=True)
    ids = LLM(**kw).tokenizer.encode(PROMPTS[1] * 6)[:4 * 16 + 1]
    def run(llm):
        o = llm.generate([{"prompt_token_ids": ids}], params)[0]
        return list(o.outputs[0].token_ids), o.stats.draft_tokens, o.stats.accepted_tokens
    cold = run(LLM(**kw))
    cached = LLM(**kw, enable_prefix_caching=True)
    assert [run(cached) for _ in range(2)] == [cold, cold]
    assert cached.engine.prefix_cache_hits > 0


def test_on_by_default_as_in_vllm_v1(tiny_pair):
    from specdec.cli import build_parser

    assert LLM(model=tiny_pair[0], dtype="float32").engine.blocks.prefix_caching
    assert not LLM(model=tiny_pair[0], dtype="float32", enable_prefix_caching=False).engine.blocks.prefix_caching
    p = build_parser()
    assert p.parse_args(["generate", "--model", "m", "hi"]).enable_prefix_caching is True
    assert p.parse_args(["generate", "--model", "m", "--no-enable-prefix-caching", "hi"]).enable_prefix_caching is False


@pytest.mark.parametrize("extra", [1, 9])
def test_medusa_keeps_a_hit_that_stops_short_of_the_token_before_the_last(tiny_pair, drafters, extra):
    """The last hit block is recomputed only when it holds the token before the last (a prompt of
    whole blocks plus one): otherwise Medusa finds as many cached tokens as plain decoding, and its
    output is the same as without the cache."""
    spec = METHODS["medusa"](drafters)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = LLM(model=tiny_pair[0]).tokenizer.encode(PROMPTS[1] * 6)[:4 * 16 + extra]
    found = {}
    for name, kw in (("plain", {}), ("medusa", {"speculative_config": spec})):
        llm = LLM(model=tiny_pair[0], dtype="float32", enable_prefix_caching=True, **kw)
        outs = [llm.generate([{"prompt_token_ids": ids}], params)[0] for _ in range(2)]
        assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
        found[name] = outs[1].num_cached_tokens
    # 65 tokens: the 4 blocks hold the token before the last, Medusa recomputes one; 73: they do not
    assert found["plain"] == 64 and found["medusa"] == (48 if extra == 1 else 64)


def test_cache_salt_keeps_tenants_prefixes_apart(tiny_pair):
    """vLLM's cache_salt: a prompt's blocks are found only under the same salt (they were shared
    whatever the salt, which was accepted and ignored), offline and through the server's
    completions and chat; an empty salt is refused."""
    import httpx

    from specdec.server import ServerConfig, build_app
    from test_server import LiveServer

    llm = LLM(tiny_pair[0], dtype="float32", num_speculative_tokens=0, enable_prefix_caching=True)
    prompt = PROMPTS[2] * 4
    params = SamplingParams(temperature=0, max_tokens=4)

    def cached(**kw) -> int:
        return llm.generate({"prompt": prompt, **kw}, params)[0].stats.cached_tokens
    assert cached(cache_salt="a") == 0 and cached(cache_salt="b") == 0
    assert cached(cache_salt="a") > 0 and cached() == 0 and cached() > 0
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        cached(cache_salt="")
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))) as live:
        for path, body in (("/v1/completions", {"prompt": PROMPTS[3] * 4}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[3] * 4}]})):
            def hit(salt) -> int:
                r = httpx.post(live.url + path, json={"model": "tiny", "max_tokens": 2, "cache_salt": salt, **body},
                               timeout=60)
                assert r.status_code == 200, r.text
                return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert hit("t1") == 0 and hit("t2") == 0 and hit("t1") > 0
        r = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "cache_salt": ""}, timeout=60)
        assert r.status_code == 400


def test_a_preempted_request_coming_back_is_no_cache_lookup(tiny_pair):
    """Prompts that share nothing, preempted in a small pool: no prefix-cache hits are counted (a
    return after preemption found the blocks the request itself had written: a 35% hit rate), and
    each request's prompt counts once, whole, as vLLM's prefix_cache_queries."""
    target = tiny_pair[0]
    prompts = [{"prompt_token_ids": [10 + i] * 6 + [50 + i]} for i in range(4)]
    llm = LLM(model=target, dtype="float32", num_speculative_tokens=0, max_num_seqs=4, max_model_len=128,
              kv_cache_memory=_bytes_for(target, slots=128), enable_prefix_caching=True, block_size=16)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    assert llm.engine.num_preemptions > 0
    assert llm.engine.prefix_cache_hits == 0 and llm.engine.prefix_cache_queries == 4 * 7
    assert all(o.stats.cached_tokens == 0 for o in outs)
