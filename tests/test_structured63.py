"""A draft path the target rejects may walk llguidance's parser into a failure (the text forced
after `a` in `start: x | "b"` / `x: "a" x` outgrows a parser row): it had latched the request's
error and aborted a request whose output was valid, so speculation changed the result. Only the
emitted tokens may end a request now, where plain decoding ends it. best_of under a grammar
ranks its candidates by the masked logprobs whether logprobs is asked for or not (it had ranked
by unmasked ones unless logprobs was set, and returned other choices)."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.config import StructuredOutputsParams
from specdec.defaults import BUNDLED_DRAFT, BUNDLED_TARGET

ENDLESS_BRANCH = StructuredOutputsParams(grammar='start: x | "b"\nx: "a" x\n')
PROMPTS = ["Answer: ", "b b b b b", "x", "a a a a a a a a b", "hello"]


@pytest.fixture(scope="module")
def plain():
    return LLM(model=BUNDLED_TARGET, num_speculative_tokens=0)


SPECULATIVE = {"draft model": {"model": str(BUNDLED_DRAFT), "num_speculative_tokens": 3},
               "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                         "prompt_lookup_max": 3}}


def _outputs(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=ENDLESS_BRANCH)
    return [(o.outputs[0].text, list(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("method", SPECULATIVE)
def test_speculation_gives_what_plain_decoding_gives(plain, method):
    """"Answer: " is "b" and EOS, "stop", plainly; the draft model's rejected `a` had aborted it.
    Where the target enters the endless branch, both abort after the same tokens."""
    speculative = LLM(model=BUNDLED_TARGET, speculative_config=SPECULATIVE[method])
    expected = _outputs(plain, PROMPTS)
    assert expected[0][:3] == ("b", [72, 1], "stop")
    assert any(reason == "abort" for *_, reason, _ in expected)        # the endless branch is reached too
    assert _outputs(speculative, PROMPTS) == expected


def test_a_failure_on_a_rejected_path_leaves_the_request_alone(plain):
    grammar = plain.engine.grammars.grammar(ENDLESS_BRANCH)
    tokenizer = plain.get_tokenizer()
    a, b = (tokenizer.encode(t, add_special_tokens=False) for t in ("a", "b"))
    eos = plain.engine.eos_ids
    grammar.masks([[], a])
    grammar.forced(a, 4)                       # the text forced after "a" outgrows the parser
    grammar.masks([a + a, b])
    assert grammar.valid_prefix(b) == 1
    grammar.advance(b)
    assert grammar.error is None and grammar.is_accepting()
    row = grammar.masks([[]])[0]
    allowed = [t for t in range(plain.engine.grammars.vocab_size) if row[t // 32] >> (t % 32) & 1]
    assert allowed == sorted(eos)


def test_best_of_ranks_by_the_masked_logprobs_asked_for_logprobs_or_not(plain):
    spec = StructuredOutputsParams(choice=["red", "green", "blue", "cyan"])
    common = dict(seed=5, temperature=1.0, max_tokens=12, structured_outputs=spec)
    candidates = plain.generate(["Word:"], SamplingParams(n=4, logprobs=1, **common), use_tqdm=False)[0].outputs
    best = sorted(candidates, key=lambda c: -c.cumulative_logprob)[:2]
    for logprobs in (None, 1):
        outputs = plain.generate(["Word:"], SamplingParams(n=2, best_of=4, logprobs=logprobs, **common),
                                 use_tqdm=False)[0].outputs
        assert [c.text for c in outputs] == [c.text for c in best]
        assert [c.cumulative_logprob for c in outputs] == pytest.approx([c.cumulative_logprob for c in best])
