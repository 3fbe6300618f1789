"""speculative_config's surface, as vLLM reads it (a bug hunter's D1-D7): the hybrids' first try of
their learned drafter at the default costs, K = 0 with "[ngram]", vLLM's prompt-lookup sizes, EAGLE
chains drafting K tokens, keys a method does not read, acceptance figures after a stop string, and
vLLM 0.6's speculative serve flags. On the bundled toy pair (models/)."""

from __future__ import annotations

import json
import logging

import pytest

from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.config import SpeculativeConfig
from specdec.defaults import BUNDLED_DRAFT, BUNDLED_TARGET, MODELS_DIR
from specdec.proposers.hybrid import LEARNED, HybridSettings, SourceRecords

TARGET, DRAFT, EAGLE = str(BUNDLED_TARGET), str(BUNDLED_DRAFT), str(MODELS_DIR / "eagle")
PROMPTS = ["def fibonacci(n):", "class A:\n    def __init__(self", "The quick brown fox"]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def plain():
    llm = LLM(model=TARGET, max_model_len=256, num_speculative_tokens=0)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _ids(llm, prompts=PROMPTS, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


# D1: the hybrids' learned drafter gets a first try at the default costs

def test_a_fresh_request_tries_the_learned_drafter_at_the_default_costs():
    records = SourceRecords(8, HybridSettings())
    assert records.choose(n=0, lookup_len=0, learned_max=8).source == LEARNED
    records.observe(records.choose(n=0, lookup_len=0, learned_max=8), 0)    # tried, rejected
    # measured now: its (poor) record decides, and plain decoding wins until the next probe
    assert records.choose(n=0, lookup_len=0, learned_max=8).source is None


@pytest.mark.parametrize("method,model", [("ngram+eagle", EAGLE), ("ngram+draft_model", DRAFT)])
def test_hybrids_with_default_costs_use_their_learned_drafter_and_stay_lossless(plain, method, model):
    llm = LLM(model=TARGET, max_model_len=256,
              speculative_config={"method": method, "model": model, "num_speculative_tokens": 4})
    assert _ids(llm) == plain
    counts = llm.engine.proposer.counts
    assert counts.learned_drafts > 0 and counts.learned_tokens > 0, counts


# D2: K = 0 is plain decoding with "[ngram]" too

def test_ngram_with_k_0_decodes_plainly(plain):
    llm = LLM(model=TARGET, max_model_len=256, speculative_model="[ngram]", num_speculative_tokens=0)
    assert llm.engine.proposer is None and llm.spec.num_speculative_tokens == 0
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert all(o.metrics.num_drafts == 0 for o in outs)


def test_cli_ngram_with_k_0_decodes_plainly(capsys):
    code = main(["generate", "--model", TARGET, "--speculative-model", "[ngram]", "--num-speculative-tokens", "0",
                 "--max-tokens", "12", "--ignore-eos", "--json", "def f(x):\n    return x\ndef f(x"])
    out = capsys.readouterr().out
    assert code == 0 and json.loads(out)["stats"]["num_drafts"] == 0


# D3: vLLM's prompt-lookup sizes

@pytest.mark.parametrize("given,sizes", [
    ({}, (5, 5)),
    ({"prompt_lookup_max": 3}, (3, 3)),
    ({"prompt_lookup_min": 5}, (5, 5)),
    ({"prompt_lookup_min": 2}, (2, 2)),
    ({"prompt_lookup_min": None, "prompt_lookup_max": None}, (5, 5)),
    ({"prompt_lookup_min": None, "prompt_lookup_max": 7}, (7, 7)),
    ({"prompt_lookup_min": 2, "prompt_lookup_max": 4}, (2, 4)),
])
def test_ngram_lookup_sizes_follow_vllm(given, sizes):
    spec = SpeculativeConfig.from_dict({"method": "ngram", **given})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == sizes


@pytest.mark.parametrize("model", ["[ngram]", "ngram"])
def test_model_ngram_selects_prompt_lookup(model):
    spec = SpeculativeConfig.from_dict({"model": model, "num_speculative_tokens": 3})
    assert (spec.method, spec.model, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", None, 5, 5)
    llm = LLM(model=TARGET, max_model_len=256, speculative_config={"model": model, "num_speculative_tokens": 3})
    assert llm.engine.proposer.name == "ngram" and llm.engine.proposer.n_max == 5


@pytest.mark.parametrize("given", [{"prompt_lookup_min": 3, "prompt_lookup_max": 2}, {"prompt_lookup_min": 0},
                                   {"prompt_lookup_max": 0}])
def test_bad_lookup_sizes_are_refused(given):
    with pytest.raises(ValueError, match="prompt_lookup"):
        SpeculativeConfig.from_dict({"method": "ngram", **given})


def test_specdec_own_lookup_methods_and_the_bench_keep_min_1_max_4():
    from specdec.bench.methods import _spec
    for method in ("suffix", "ngram+eagle"):
        spec = SpeculativeConfig.from_dict({"method": method, "model": EAGLE if "eagle" in method else None})
        assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (1, 4)
    bench = _spec("ngram", 4, None, {})
    assert (bench.prompt_lookup_min, bench.prompt_lookup_max) == (1, 4)
    bench = _spec("ngram", 4, None, {"prompt_lookup_min": 2})          # one given: vLLM's rule
    assert (bench.prompt_lookup_min, bench.prompt_lookup_max) == (2, 2)


# D4: EAGLE chains draft num_speculative_tokens tokens

@pytest.mark.parametrize("k", [8, 12])
def test_eagle_chain_drafts_k_tokens(plain, k):
    llm = LLM(model=TARGET, max_model_len=256, speculative_config={"method": "eagle", "model": EAGLE,
                                                                   "num_speculative_tokens": k, "topk": 1})
    assert llm.engine.proposer.caps.max_tree_size == k
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain
    s = outs[0].metrics
    assert s.num_drafts > 0 and len(s.drafted_per_position) == k      # drafted up to position k, not 8


def test_eagle_chain_depth_below_k_is_refused():
    with pytest.raises(ValueError, match="depth"):
        LLM(model=TARGET, max_model_len=256, speculative_config={"method": "eagle", "model": EAGLE,
                                                                 "num_speculative_tokens": 12, "depth": 8, "topk": 1})


def test_eagle_chain_auto_and_hybrid_depth(plain):
    auto = LLM(model=TARGET, max_model_len=256, speculative_config={"method": "eagle", "model": EAGLE,
                                                                    "num_speculative_tokens": "auto", "topk": 1})
    assert auto.engine.proposer.caps.max_tree_size == 8 and _ids(auto) == plain
    hybrid = LLM(model=TARGET, max_model_len=256, speculative_config={"method": "ngram+eagle", "model": EAGLE,
                                                                      "num_speculative_tokens": 12})
    assert hybrid.engine.proposer.learned_depth == 12 and _ids(hybrid) == plain
    capped = LLM(model=TARGET, max_model_len=256, speculative_config={"method": "ngram+eagle", "model": EAGLE,
                                                                      "num_speculative_tokens": 12, "depth": 3})
    assert capped.engine.proposer.learned_depth == 3 and _ids(capped) == plain


def test_eagle_tree_keeps_its_depth_rules():
    llm = LLM(model=TARGET, max_model_len=256, speculative_config={"method": "eagle", "model": EAGLE,
                                                                   "num_speculative_tokens": 16, "topk": 2})
    assert llm.engine.proposer.depth is None and llm.engine.proposer.caps.max_tree_size is None


# D5: keys the method does not read, K = 0, disable_by_batch_size, keyword arguments beside the config

@pytest.mark.parametrize("method,extra,key", [
    ("draft_model", {"model": DRAFT, "topk": 2}, "topk"),
    ("ngram", {"verify_cost": 0.1}, "verify_cost"),
    ("ngram", {"suffix_decoding_min_token_prob": 0.2}, "suffix_decoding_min_token_prob"),
    ("layer_skip", {"model": DRAFT, "num_layers": 1}, "model"),
    ("ngram", {"posterior_threshold": 0.2}, "posterior_threshold"),
    ("ngram", {"max_k": 6}, "max_k"),
])
def test_a_key_the_method_does_not_read_warns_naming_it(caplog, method, extra, key):
    with caplog.at_level(logging.WARNING):
        LLM(model=TARGET, max_model_len=256, speculative_config={"method": method, "num_speculative_tokens": 2,
                                                                 **extra})
    said = [r.getMessage() for r in caplog.records if repr(key) in r.getMessage()]
    assert len(said) == 1 and repr(method) in said[0], [r.getMessage() for r in caplog.records]


def test_keys_a_method_reads_do_not_warn(caplog):
    with caplog.at_level(logging.WARNING):
        LLM(model=TARGET, max_model_len=256,
            speculative_config={"method": "ngram+eagle", "model": EAGLE, "num_speculative_tokens": 3, "verify_cost": 0.1,
                                "prompt_lookup_min": 2, "prompt_lookup_max": 8, "depth": 3, "topk": 1})
    assert not [r for r in caplog.records if "does not read" in r.getMessage()]


def test_unknown_keys_fail_at_k_0_too():
    with pytest.raises(ValueError, match="unknown key 'prompt_lookup_maxx'"):
        LLM(model=TARGET, max_model_len=256, speculative_config={"method": "ngram", "num_speculative_tokens": 0,
                                                                 "prompt_lookup_maxx": 3})


@pytest.mark.parametrize("extra,message", [
    ({"disable_by_batch_size": 1}, "disable_by_batch_size"),
    ({"posterior_threshold": 5}, "posterior_threshold"),
    ({"posterior_alpha": 0}, "posterior_alpha"),
])
def test_bad_values_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=TARGET, max_model_len=256, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                                 **extra})


@pytest.mark.parametrize("kwargs,message", [
    ({"num_speculative_tokens": 1}, "num_speculative_tokens"),
    ({"speculative_model": EAGLE}, "speculative_model"),
])
def test_keyword_arguments_that_disagree_with_the_config_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=TARGET, max_model_len=256,
            speculative_config={"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 2}, **kwargs)


def test_keyword_arguments_that_agree_or_fill_in_are_taken():
    llm = LLM(model=TARGET, max_model_len=256, speculative_config={"method": "draft_model", "model": DRAFT},
              num_speculative_tokens=3, speculative_model=DRAFT)
    assert llm.spec.num_speculative_tokens == 3 and llm.spec.method == "draft_model"


def test_num_speculative_tokens_alone_needs_a_method(capsys):
    """K without a draft or a speculative config decoded plainly without a word; vLLM's ValueError
    now, in LLM() and the CLI. K 0 stays plain decoding, and without a model K alone sets the
    default model's method's K (README)."""
    with pytest.raises(ValueError, match="num_speculative_tokens was provided without speculative_model"):
        LLM(model=TARGET, max_model_len=256, num_speculative_tokens=3)
    assert LLM(model=TARGET, max_model_len=256, num_speculative_tokens=0).spec is None
    code = main(["generate", "--model", TARGET, "--num-speculative-tokens", "3", "--max-tokens", "4", "def f(x):"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "without speculative_model" in err
    default = LLM(num_speculative_tokens=2, max_model_len=256)
    assert default.spec is not None and default.spec.num_speculative_tokens == 2


def test_cli_speculative_config_beside_num_speculative_tokens_is_one_line(capsys):
    code = main(["generate", "--model", TARGET, "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 4}', "--num-speculative-tokens", "1",
                 "--max-tokens", "4", "def f(x):"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "num_speculative_tokens" in err


# D6: acceptance figures after a stop string cut the output

def test_mean_accepted_length_is_vllms_figure_after_a_stop_string():
    llm = LLM(model=TARGET, max_model_len=256,
              speculative_config={"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 5})
    out = llm.generate(["import os\n"], SamplingParams(temperature=0, max_tokens=48, stop=["\n\n"]))[0]
    s = out.metrics
    assert s.num_drafts > 0
    # verification's counts, before the stop string cut (vLLM's), and the figure derived from them
    assert sum(s.accepted_per_position) == s.accepted_tokens and sum(s.drafted_per_position) == s.draft_tokens
    assert s.mean_accepted_length == pytest.approx(1 + s.accepted_tokens / s.num_drafts)
    assert s.to_dict()["mean_accepted_length"] == pytest.approx(1 + s.accepted_tokens / s.num_drafts, abs=1e-4)
    assert s.tokens_per_forward == pytest.approx(s.output_tokens / s.target_forward_passes)
    metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    assert metrics["vllm:spec_decode_num_accepted_tokens"] == s.accepted_tokens
    assert metrics["vllm:spec_decode_num_drafts"] == s.num_drafts


# D7: vLLM 0.6's speculative serve flags

def test_legacy_speculative_serve_flags_set_the_config():
    from specdec.server.cli import parse_args
    args, ignored = parse_args(["--model", TARGET, "--speculative-model", "[ngram]", "--num-speculative-tokens", "3",
                                "--ngram-prompt-lookup-max", "4", "--ngram_prompt_lookup_min", "2",
                                "--speculative-disable-by-batch-size", "4",
                                "--spec-decoding-acceptance-method", "typical_acceptance_sampler",
                                "--typical-acceptance-sampler-posterior-threshold", "0.2",
                                "--typical-acceptance-sampler-posterior-alpha", "0.5"])
    assert ignored == []
    assert args.speculative_config == {"prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 4,
                                       "acceptance_method": "typical_acceptance_sampler", "posterior_threshold": 0.2,
                                       "posterior_alpha": 0.5}
    from specdec.llm import _speculative
    spec = _speculative(args.speculative_model, args.num_speculative_tokens, args.speculative_config)
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
            spec.disable_by_batch_size) == ("ngram", 3, 2, 4, 4)


@pytest.mark.parametrize("argv,message", [
    (["--speculative-config", '{"method": "ngram", "prompt_lookup_max": 3}', "--ngram-prompt-lookup-max", "2"],
     "disagrees"),
    (["--ngram-prompt-lookup-max", "2"], "need --speculative-model or --speculative-config"),
])
def test_legacy_flags_that_conflict_are_one_line(argv, message):
    from specdec.server.cli import parse_args
    with pytest.raises(ValueError, match=message):
        parse_args(["--model", TARGET, *argv])
