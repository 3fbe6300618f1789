"""The decoding loop end to end on tiny checkpoints: lossless greedy, lossless sampling, edges."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
import transformers

from conftest import make_checkpoint
from specdec import LLM, SamplingParams
from specdec.detokenize import Detokenizer
from specdec.model import CheckpointError
from specdec import verify as verify_mod

PROMPTS = [f"def f{i}(x):\n    return x * {i}" for i in range(12)] + [
    "import os\n", "class A:\n", "for i in range(", "x = [", "# comment\n", "if __name__", "print(", "def add(a, b):"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tiny_pair):
    target, draft = tiny_pair
    return {
        "plain": LLM(model=target, dtype="float32", num_speculative_tokens=0),
        "draft": {k: LLM(model=target, speculative_model=draft, num_speculative_tokens=k, dtype="float32") for k in range(1, 9)},
        "self": LLM(model=target, speculative_model=target, num_speculative_tokens=4, dtype="float32"),
        "target_dir": target, "draft_dir": draft,
    }


def tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_greedy_speculative_equals_plain_for_every_k(models):
    plain = tokens(models["plain"], PROMPTS, GREEDY)
    assert len(PROMPTS) >= 20
    for k, llm in models["draft"].items():
        assert tokens(llm, PROMPTS, GREEDY) == plain, f"K={k}"


def test_greedy_equals_transformers_generate(models):
    ref = transformers.AutoModelForCausalLM.from_pretrained(models["target_dir"], dtype=torch.float32).eval()
    llm = models["draft"][4]
    for prompt in PROMPTS[:6]:
        ids = llm.tokenizer.encode(prompt)
        out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24, min_new_tokens=24,
                           pad_token_id=1, eos_token_id=None)[0, len(ids):].tolist()
        assert tokens(llm, [prompt], GREEDY)[0] == out


@pytest.mark.parametrize("method", [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
                                    {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 3}])
def test_self_speculative_methods_greedy_lossless(models, method):
    llm = LLM(model=models["target_dir"], speculative_config=method, dtype="float32")
    assert tokens(llm, PROMPTS[:8], GREEDY) == tokens(models["plain"], PROMPTS[:8], GREEDY)


def test_identical_draft_accepts_everything(models):
    out = models["self"].generate(PROMPTS[:4], GREEDY)
    assert all(o.stats.acceptance_rate == 1.0 for o in out)
    assert all(o.stats.mean_accepted_length > 4 for o in out)     # all accepted + bonus each step
    sampled = models["self"].generate(PROMPTS[:4], SamplingParams(temperature=1.0, seed=0, max_tokens=24, ignore_eos=True))
    assert min(o.stats.acceptance_rate for o in sampled) >= 0.98


def first_two_tokens(llm, prompt, params, n):
    counts = collections.Counter()
    for i in range(n):
        p = dataclasses.replace(params, seed=i)
        counts[tuple(llm.generate([prompt], p)[0].outputs[0].token_ids[:2])] += 1
    return counts


def exact_first_two(llm, prompt, params):
    """The processed target distribution over the first two output tokens, from its logits."""
    from specdec.sampling import process
    ids = llm.tokenizer.encode(prompt)
    with torch.no_grad():
        p1 = process(llm.target(torch.tensor([ids])).logits[0, -1:], params)[0]
        out = {}
        for a in torch.nonzero(p1).flatten().tolist():
            p2 = process(llm.target(torch.tensor([ids + [a]])).logits[0, -1:], params)[0]
            for b in torch.nonzero(p2).flatten().tolist():
                out[(a, b)] = p1[a].item() * p2[b].item()
    return out


def total_variation(counts, exact, n):
    keys = set(counts) | set(exact)
    return 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in keys)


def test_monte_carlo_speculative_sampling_matches_target(models, near_draft, monkeypatch):
    """Seeded Monte Carlo over two-token sequences; a deliberately broken verifier must fail."""
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=2, ignore_eos=True)
    llm = LLM(model=models["target_dir"], speculative_model=near_draft, num_speculative_tokens=2, dtype="float32")
    prompt, n = "def add(a, b):", 1000
    exact = exact_first_two(llm, prompt, params)
    # threshold: about three times the sampling noise of n draws over <= 4 outcomes
    good = total_variation(first_two_tokens(llm, prompt, params, n), exact, n)
    plain = total_variation(first_two_tokens(models["plain"], prompt, params, n), exact, n)
    assert good < 0.05 and plain < 0.05, (good, plain)
    stats = llm.generate([prompt], dataclasses.replace(params, seed=0, max_tokens=24)).pop().stats
    assert 0 < stats.acceptance_rate < 1         # both branches of the verifier are exercised

    real_plan = verify_mod.rejection_plan

    def accept_all(draft, q, p):                 # never rejects: the output follows q
        acc, cand = real_plan(draft, q, p)
        return torch.ones_like(acc), cand

    def wrong_residual(draft, q, p):             # recovers from p instead of norm(max(0, p - q))
        acc, cand = real_plan(draft, q, p)
        return acc, torch.cat([p[:-1], cand[-1:]])

    for broken_plan in (accept_all, wrong_residual):
        monkeypatch.setattr(verify_mod, "rejection_plan", broken_plan)
        broken = total_variation(first_two_tokens(llm, prompt, params, n), exact, n)
        assert broken > 0.05, (broken_plan.__name__, broken, stats.acceptance_rate)


def test_eos_stop_string_and_max_tokens_inside_a_draft_block(models):
    llm = models["self"]                      # accepts everything: every stop lands mid-block
    full = llm.generate(["def add(a, b):"], GREEDY)[0].outputs[0]
    stop_tok = full.token_ids[6]
    cut = full.token_ids.index(stop_tok)
    out = llm.generate(["def add(a, b):"], dataclasses.replace(GREEDY, stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == full.token_ids[:cut + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    # the same token as EOS (its id is in the tokenizer's eos list) ends generation there too
    llm.engine.eos_ids.add(stop_tok)
    try:
        out = llm.generate(["def add(a, b):"], dataclasses.replace(GREEDY, ignore_eos=False))[0].outputs[0]
        assert out.token_ids == full.token_ids[:cut + 1] and out.finish_reason == "stop"
    finally:
        llm.engine.eos_ids.discard(stop_tok)
    stop_str = full.text[5:8]
    out = llm.generate(["def add(a, b):"], dataclasses.replace(GREEDY, stop=[stop_str]))[0].outputs[0]
    assert out.text == full.text[:full.text.index(stop_str)] and out.finish_reason == "stop"
    assert out.stop_reason == stop_str
    out = llm.generate(["def add(a, b):"], dataclasses.replace(GREEDY, max_tokens=7))[0].outputs[0]
    assert out.token_ids == full.token_ids[:7] and out.finish_reason == "length"


def test_vllm_output_text_rules_and_sampling_fields(models):
    """vLLM's rules, with drafts that stop mid-block: the stop token's text is left out (kept with
    include_stop_str_in_output, as is a stop string); stop strings count only after min_tokens;
    EOS has no stop_reason; detokenize=False, allowed_token_ids (speculative == plain under it),
    truncate_prompt_tokens; SamplingParams set after construction, validated, copied per request."""
    llm, plain, prompt = models["self"], models["plain"], "def add(a, b):"
    tok = llm.tokenizer
    full = llm.generate([prompt], GREEDY)[0].outputs[0]
    stop_tok = full.token_ids[6]
    cut = full.token_ids.index(stop_tok)

    def run(**kw):
        return llm.generate([prompt], dataclasses.replace(GREEDY, **kw))[0].outputs[0]
    out = run(stop_token_ids=[stop_tok])
    assert out.token_ids == full.token_ids[:cut + 1] and out.text == tok.decode(full.token_ids[:cut])
    assert run(stop_token_ids=[stop_tok], include_stop_str_in_output=True).text == tok.decode(full.token_ids[:cut + 1])
    llm.engine.eos_ids.add(stop_tok)
    try:
        out = run(ignore_eos=False, stop_token_ids=[stop_tok])
        assert out.finish_reason == "stop" and out.stop_reason is None and out.text == tok.decode(full.token_ids[:cut])
    finally:
        llm.engine.eos_ids.discard(stop_tok)
    stop_str = full.text[5:8]
    at = full.text.index(stop_str)
    assert run(stop=[stop_str], include_stop_str_in_output=True).text == full.text[:at + len(stop_str)]
    # min_tokens: the stop string's first occurrence lies inside the first tokens' text, so it does not
    # count; the first that ends after that text does (vLLM's: it may start inside it). That text is
    # the detokenizer's (whole characters: the toy model's random bytes leave incomplete ones pending)
    n_first = next(n for n in range(1, 25) if len(tok.decode(full.token_ids[:n])) >= at + len(stop_str))
    late = run(stop=[stop_str], min_tokens=n_first)
    first = Detokenizer(tok, [], prompt=tok.encode(prompt))
    for t in full.token_ids[:n_first]:
        first.add(t)
    first.delta(final=False)
    after = len(first.text)
    nxt = full.text.find(stop_str, max(after - len(stop_str) + 1, 0))
    assert late.text == (full.text[:nxt] if nxt >= 0 else full.text) and len(late.token_ids) >= n_first
    out = run(detokenize=False)
    assert out.text == "" and out.token_ids == full.token_ids
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["x"])
    allowed = sorted(set(full.token_ids[:4]) | {5, 6, 7})
    spec = run(allowed_token_ids=allowed)
    assert set(spec.token_ids) <= set(allowed)
    assert spec.token_ids == plain.generate([prompt], dataclasses.replace(GREEDY, allowed_token_ids=allowed))[0].outputs[0].token_ids
    ids = tok.encode(PROMPTS[3])
    short = llm.generate([{"prompt_token_ids": ids}], dataclasses.replace(GREEDY, truncate_prompt_tokens=5))[0]
    assert short.prompt_token_ids == ids[-5:]
    assert short.outputs[0].token_ids == tokens(llm, [{"prompt_token_ids": ids[-5:]}], GREEDY)[0]
    sp = SamplingParams(temperature=0, ignore_eos=True)
    sp.max_tokens = 5
    with pytest.raises(ValueError, match="temperature"):
        sp.temperature = -1.0
    assert sp.temperature == 0 and sp.clone() == sp and sp.clone() is not sp
    req = llm.engine.add_request(ids, sp)
    sp.max_tokens = 9                         # the request keeps the copy it was given
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert len(req.out) == 5


def test_none_accepted_still_emits_one_token_per_step(models):
    llm = models["draft"][3]
    out = llm.generate(PROMPTS[:6], GREEDY)
    assert any(o.stats.accepted_tokens < o.stats.draft_tokens for o in out)
    for o in out:
        assert o.stats.output_tokens == 24
        assert o.stats.target_forward_passes <= 24


def test_k_larger_than_tokens_left_and_prompt_at_context_limit(tiny_pair):
    target, _ = tiny_pair
    llm = LLM(model=target, speculative_model=target, num_speculative_tokens=8, dtype="float32", max_model_len=40)
    ids = llm.tokenizer.encode("def add(a, b):")
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3 and out.stats.draft_tokens <= 2
    long = list(range(2, 41))[:39]                  # 39 tokens: one below the limit of 40
    out = llm.generate([{"prompt_token_ids": long}], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="prompt is too long"):
        llm.generate([{"prompt_token_ids": list(range(2, 42))}], GREEDY)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(ids) + len(out.outputs[0].token_ids) == 40   # runs to the context limit, never beyond


def test_seeded_runs_reproduce_and_unseeded_differ(models):
    llm = models["draft"][3]
    p = SamplingParams(temperature=1.0, max_tokens=16, seed=1234, ignore_eos=True)
    assert tokens(llm, PROMPTS[:3], p) == tokens(llm, PROMPTS[:3], p)
    free = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    runs = {tuple(tokens(llm, PROMPTS[:1], free)[0]) for _ in range(4)}
    assert len(runs) > 1


def test_vocabulary_mismatch_names_the_token(tmp_path, tiny_pair):
    target, _ = tiny_pair
    other = make_checkpoint(tmp_path / "other", seed=3)
    tok = (other / "tokenizer.json").read_text()
    import json
    data = json.loads(tok)
    vocab = data["model"]["vocab"]
    victim = next(t for t, i in vocab.items() if i == 50)
    vocab["zzzz"] = vocab.pop(victim)
    (other / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="token id 50"):
        LLM(model=target, speculative_model=other, num_speculative_tokens=2, dtype="float32")


def test_padded_draft_embedding_is_fine(tmp_path, tiny_pair):
    """A draft whose embedding matrix is padded beyond the tokenizer (as between Qwen sizes)."""
    target, _ = tiny_pair
    import json
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    padded = make_checkpoint(tmp_path / "padded", seed=1, layers=1, hidden=32, tokenizer_from=target, vocab=vocab + 37)
    llm = LLM(model=target, speculative_model=padded, num_speculative_tokens=3, dtype="float32")
    plain = LLM(model=target, dtype="float32", num_speculative_tokens=0)
    assert tokens(llm, PROMPTS[:4], GREEDY) == tokens(plain, PROMPTS[:4], GREEDY)
    sampled = llm.generate(PROMPTS[:2], SamplingParams(temperature=1.0, seed=0, max_tokens=8))
    assert all(len(o.outputs[0].token_ids) > 0 for o in sampled)


def test_invalid_sampling_parameters_name_the_field():
    for field, value in [("temperature", -1.0), ("top_p", 0.0), ("top_k", -3), ("min_p", 2.0),
                         ("max_tokens", 0), ("temperature", float("nan")), ("n", 0), ("seed", "x")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["x"] * 17)


def test_streaming_equals_batch_and_vllm_shape(models):
    llm = models["draft"][3]
    out = llm.generate("def add(a, b):", GREEDY)[0]
    streamed = list(llm.stream("def add(a, b):", GREEDY))
    assert "".join(e.text for e in streamed) == out.outputs[0].text
    assert sum((e.token_ids for e in streamed), []) == out.outputs[0].token_ids
    assert streamed[-1].finished and not any(e.finished for e in streamed[:-1])
    assert out.prompt == "def add(a, b):" and out.prompt_token_ids == llm.tokenizer.encode("def add(a, b):")
    d = out.stats.to_dict()
    for key in ("target_forward_passes", "draft_tokens", "accepted_tokens", "acceptance_rate",
                "mean_accepted_length", "per_position_acceptance", "tokens_per_second", "wall_time_s"):
        assert key in d
    assert len(d["per_position_acceptance"]) == 3
    n2 = llm.generate("def add(a, b):", SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8))[0]
    assert len(n2.outputs) == 2 and [o.index for o in n2.outputs] == [0, 1]


def test_draft_cache_right_after_full_acceptance_and_after_rejection(models):
    """The draft's cache after a step that accepted everything (two tokens pending: the last
    draft and the bonus) and after a rejection gives the same proposals as a fresh prefill."""
    from specdec.proposers import Committed, ProposeItem, RequestContext
    from specdec.sampling import make_generator

    llm = models["draft"][3]
    proposer, blocks = llm.engine.proposer, llm.engine.blocks
    seq = llm.tokenizer.encode("def add(a, b):")
    params = SamplingParams(temperature=1.0)

    def ctx():
        return RequestContext(params, make_generator(11), llm.target.config.vocab_size)

    def start(rid, seq):      # the target holds seq[:-1]: the draft prefills it
        blocks.add(rid)
        blocks.ensure(rid, 64)
        proposer.add_request(rid, ctx())
        proposer.update([Committed(rid, seq, len(seq) - 1, None, prefill=True)])

    def drop(rid):
        proposer.remove_request(rid)
        blocks.remove(rid)

    start("s", seq)
    draft = proposer.propose([ProposeItem("s", seq, 3)])[0]
    for accepted, recovered in ((3, 5), (1, 7)):      # all accepted + bonus; then a rejection
        seq = seq + draft.tokens.tolist()[:accepted] + [recovered]
        proposer.update([Committed("s", seq, len(seq) - 1, None, prefill=False)])
        assert proposer.kv.length("s") <= len(seq) - 1
        proposer.add_request("s", ctx())               # a fresh generator, as the fresh request's
        continued = proposer.propose([ProposeItem("s", seq, 3)])[0]
        start("f", seq)
        fresh = proposer.propose([ProposeItem("f", seq, 3)])[0]
        drop("f")
        assert continued.tokens.tolist() == fresh.tokens.tolist()
        assert (continued.probs - fresh.probs).abs().max() < 1e-5
        draft = continued
    drop("s")


def test_speculative_config_keys_are_checked_as_vllm_checks_them(tiny_pair):
    """A key specdec cannot honour is one clear error (vLLM rejects unknown keys too: a typo must
    not pass silently); vLLM's keys that mean nothing here are taken."""
    target = str(tiny_pair[0])
    base = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    for extra, message in (({"prompt_lookup_maxx": 3}, "unknown key 'prompt_lookup_maxx'"),
                           ({"draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size=2"),
                           ({"speculative_token_tree": "[(0,), (0, 0)]"}, "speculative_token_tree is not supported")):
        with pytest.raises(ValueError, match=message):
            LLM(target, speculative_config={**base, **extra})
    llm = LLM(target, speculative_config={**base, "enforce_eager": True, "draft_tensor_parallel_size": 1,
                                          "disable_log_stats": False, "revision": None})
    assert llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids


def test_n_is_not_capped_offline(models):
    """vLLM's n has no small cap: 20 samples of one prompt (the server still bounds one HTTP call)."""
    out = models["plain"].generate(["def f(x):"], SamplingParams(n=20, temperature=1.0, max_tokens=4, seed=1))[0]
    assert len(out.outputs) == 20 and len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_checkpoints_with_rope_buffers_load(tiny_pair, tmp_path):
    """transformers before 4.31 saved each layer's rotary_emb.inv_freq: taken as recomputable
    buffers (vLLM skips them), not refused as unexpected weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    target = tmp_path / "old"
    shutil.copytree(tiny_pair[0], target)
    sd = load_file(str(target / "model.safetensors"))
    layers = {int(k.split(".")[2]) for k in sd if k.startswith("model.layers.")}
    for i in layers:
        sd[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.rand(8)
    save_file(sd, str(target / "model.safetensors"), metadata={"format": "pt"})
    old = LLM(model=target, dtype="float32", num_speculative_tokens=0)
    assert tokens(old, PROMPTS[:2], GREEDY) == tokens(LLM(model=tiny_pair[0], dtype="float32",
                                                          num_speculative_tokens=0), PROMPTS[:2], GREEDY)


def test_a_separate_tokenizer_keeps_the_models_eos_ids(tiny_pair, tmp_path):
    """--tokenizer names another folder: what ends generation still comes from the model's own
    generation_config.json (vLLM's), not only from the tokenizer folder's."""
    import json
    import shutil

    model, tok = tmp_path / "model", tmp_path / "tok"
    shutil.copytree(tiny_pair[0], model)
    tok.mkdir()
    for f in tiny_pair[0].glob("tokenizer*.json"):
        shutil.copy(f, tok / f.name)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 100]}))
    assert {1, 100} <= LLM(model=model, tokenizer=str(tok), dtype="float32", num_speculative_tokens=0).engine.eos_ids


def test_a_draft_with_a_shorter_context_keeps_the_targets(tiny_pair, tmp_path):
    """vLLM keeps the target's context: a request past the draft's decodes plainly from there
    (the draft never writes a slot past its context), and a hybrid's lookup drafts on."""
    import json
    import shutil
    target, _ = tiny_pair
    short = tmp_path / "short"                   # the target itself with a 40-token context
    shutil.copytree(target, short)
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 40}))
    plain = LLM(model=target, dtype="float32", num_speculative_tokens=0)
    llm = LLM(model=target, speculative_model=short, num_speculative_tokens=4, dtype="float32",
              enable_prefix_caching=True, block_size=4)
    assert llm.engine.max_model_len == 256
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    ids = llm.tokenizer.encode("def add(a, b):")
    want = plain.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids
    proposer, ends = llm.engine.proposer, []
    forward = proposer._forward
    proposer._forward = lambda ids_, tokens_, counts, starts, logits: (
        ends.extend(s + n for s, n in zip(starts, counts)), forward(ids_, tokens_, counts, starts, logits))[1]
    out = llm.generate([{"prompt_token_ids": ids}], params)[0]
    assert out.outputs[0].token_ids == want and len(want) == 100
    # the draft is the target: it accepts everything while it may draft (n + k - 1 <= 40), then nothing more
    assert out.stats.draft_tokens == out.stats.accepted_tokens and 40 - len(ids) - 4 <= out.stats.accepted_tokens <= 40 - len(ids)
    # a prompt longer than the draft's context (refused before): plain decoding, a prefix-cache hit past it
    long = ids + want[:60]
    for _ in range(2):
        out = llm.generate([{"prompt_token_ids": long}], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
        assert out.outputs[0].token_ids == want[60:80] and out.stats.draft_tokens == 0
    assert llm.engine.prefix_cache_hits >= 64 and 0 < max(ends) <= 40     # the draft never wrote past its context
    # ngram+draft_model: lookup goes on drafting past the draft's context (the answer repeats itself)
    hybrid = LLM(model=target, dtype="float32", speculative_config={"method": "ngram+draft_model", "model": str(short),
                                                                  "num_speculative_tokens": 4})
    out = hybrid.generate([{"prompt_token_ids": ids}], params)[0]
    counts = hybrid.engine.proposer.counts
    assert out.outputs[0].token_ids == want and counts.lookup_accepted > 0
    assert counts.learned_tokens <= 40 - len(ids)


@pytest.mark.parametrize("stop,text", [("🎋🎌", "🎉"), ("🎉🎋🎌", ""), ("🎌", "🎉🎋"), ("测试", "中文")])
def test_streamed_text_never_holds_part_of_a_stop_string_split_over_byte_tokens(stop, text):
    """Characters made of several byte tokens: the hold-back for a stop string counts complete
    characters (a trailing partial one, U+FFFD until its last byte comes, released the character
    before it: '🎉🎋' streamed for a stop '🎋🎌', the server's non-streamed text too)."""
    from specdec.defaults import BUNDLED_TARGET
    from specdec.detokenize import Detokenizer
    from specdec.tokenizer import Tokenizer

    tok = Tokenizer(BUNDLED_TARGET)
    source = "🎉🎋🎌🎍" if "🎉" in stop + text or "🎋" in stop else "中文测试中文"
    detok = Detokenizer(tok, [stop])
    streamed, stopped = "", False
    for t in tok.encode(source, add_special_tokens=False):
        stopped = detok.add(t)
        streamed += detok.delta(final=stopped)
        if stopped:
            break
    assert stopped and detok.stop_reason == stop and streamed == detok.text == text
