"""speculative_config keys a tester (beam60) found taken and silently dropped: `max_model_len`, the
draft's context (vLLM's SpeculativeConfig.max_model_len: a sequence past it decodes without
speculation), and the draft's `quantization`. On the bundled toy pair (models/)."""

from __future__ import annotations

import logging

import pytest

from specdec import LLM, SamplingParams
from specdec.defaults import BUNDLED_DRAFT, BUNDLED_TARGET, MODELS_DIR

TARGET, DRAFT = str(BUNDLED_TARGET), str(BUNDLED_DRAFT)
EAGLE, MEDUSA = str(MODELS_DIR / "eagle"), str(MODELS_DIR / "medusa")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LONG, SHORT = "The cat sat on the mat. The cat sat on the", "The cat"      # 13 and 3 tokens


def _run(spec):
    llm = LLM(model=TARGET, speculative_config=spec) if spec else LLM(model=TARGET, num_speculative_tokens=0)
    outs = llm.generate([LONG, SHORT], GREEDY)
    counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}      # counters (a Vector: per-pos)
    return outs, counters


@pytest.fixture(scope="module")
def plain():
    return [o.outputs[0].token_ids for o in _run(None)[0]]


def test_draft_max_model_len_stops_drafting_past_it(plain):
    spec = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 3}
    free, _ = _run(spec)
    capped, counters = _run({**spec, "max_model_len": 8})
    assert [o.outputs[0].token_ids for o in capped] == [o.outputs[0].token_ids for o in free] == plain
    assert all(o.stats.draft_tokens > 0 for o in free)
    long, short = capped
    assert len(long.prompt_token_ids) == 13 and long.stats.num_drafts == long.stats.draft_tokens == 0
    # the 3-token prompt drafts at sequence lengths 4 .. 8 only, k <= 9 - n tokens each: 3+3+3+2+1
    assert 0 < short.stats.draft_tokens <= 12 < free[1].stats.draft_tokens
    assert counters["vllm:spec_decode_num_draft_tokens"] == short.stats.draft_tokens
    assert counters["vllm:spec_decode_num_drafts"] == short.stats.num_drafts


@pytest.mark.parametrize("spec", [{"method": "eagle", "model": EAGLE, "num_speculative_tokens": 3},
                                  {"method": "medusa", "model": MEDUSA, "num_speculative_tokens": 3}],
                         ids=["eagle", "medusa"])
def test_every_model_drafter_takes_the_draft_context(plain, spec):
    """vLLM sets every draft_model_config's max_model_len from it (all methods but lookup)."""
    free, _ = _run(spec)
    capped, counters = _run({**spec, "max_model_len": 8})
    assert [o.outputs[0].token_ids for o in capped] == plain
    assert free[0].stats.draft_tokens > 0 and capped[0].stats.draft_tokens == 0
    assert counters["vllm:spec_decode_num_draft_tokens"] == capped[1].stats.draft_tokens


def test_hybrid_caps_its_learned_drafter_only():
    llm = LLM(model=TARGET, speculative_config={"method": "ngram+draft_model", "model": DRAFT,
                                                "num_speculative_tokens": 3, "max_model_len": 8})
    proposer = llm.engine.proposer
    assert proposer.learned.caps.max_len == 8 and proposer.caps.max_len is None     # lookup drafts on


def test_max_model_len_warns_where_no_model_drafts(caplog):
    with caplog.at_level(logging.WARNING):
        llm = LLM(model=TARGET, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                    "max_model_len": 8})
    said = [r.getMessage() for r in caplog.records if "'max_model_len'" in r.getMessage()]
    assert len(said) == 1 and "'ngram'" in said[0] and "no effect" in said[0], said
    assert llm.engine.proposer.caps.max_len is None


def test_draft_quantization_warns_it_is_ignored(caplog, plain):
    with caplog.at_level(logging.WARNING):
        llm = LLM(model=TARGET, speculative_config={"method": "draft_model", "model": DRAFT,
                                                    "num_speculative_tokens": 3, "quantization": "fp8"})
    said = [r.getMessage() for r in caplog.records if "quantization" in r.getMessage()]
    assert len(said) == 1 and "'fp8'" in said[0] and "ignored" in said[0] and "\n" not in said[0], said
    assert [o.outputs[0].token_ids for o in llm.generate([LONG, SHORT], GREEDY)] == plain
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        LLM(model=TARGET, speculative_config={"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 3})
    assert not [r for r in caplog.records if "quantization" in r.getMessage()]
