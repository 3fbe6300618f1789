"""The offline API as vLLM's (tester report 61): dtype "float" is float32, and a token top-k /
top-p / min-p removed has logprob -inf offline (vLLM's Logprob), -9999.0 only in the server's
JSON, which has no infinity (vLLM's serving_completion / serving_chat clamp)."""

from __future__ import annotations

import math

import openai
import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.defaults import BUNDLED_TARGET

IDS = {"prompt_token_ids": [0, 537, 16037, 14, 84, 295]}
TOP_K3 = dict(temperature=0.5, top_k=3, seed=1, max_tokens=2, logprobs=5)


def test_dtype_float_is_float32():
    assert LLM(BUNDLED_TARGET, dtype="float", num_speculative_tokens=0).target.dtype == torch.float32


@pytest.fixture(scope="module", params=["processed_logprobs", "processed_logits"])
def processed(request):
    return LLM(BUNDLED_TARGET, dtype="float32", num_speculative_tokens=0, logprobs_mode=request.param)


def test_a_removed_token_is_minus_infinity_offline(processed):
    for entry in processed.generate(IDS, SamplingParams(**TOP_K3))[0].outputs[0].logprobs:
        values = [lp for _, lp in entry.top]
        assert all(math.isfinite(v) for v in values[:3]) and values[3:] == [-math.inf, -math.inf]
        assert math.isfinite(entry.logprob)


def test_the_server_sends_minus_infinity_as_9999(processed):
    from specdec.server import ServerConfig, build_app
    from test_server import LiveServer

    with LiveServer(build_app(processed, ServerConfig(served_model_names=("toy",)))) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        prompt = IDS["prompt_token_ids"]
        done = client.completions.create(model="toy", prompt=prompt, temperature=0.5, seed=1, max_tokens=2, logprobs=5,
                                         extra_body={"top_k": 3})
        for top in done.choices[0].logprobs.top_logprobs:
            assert sorted(top.values())[:2] == [-9999.0, -9999.0]
        chat = client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}],
                                              temperature=0.5, top_logprobs=5, logprobs=True, max_tokens=2, seed=1,
                                              extra_body={"top_k": 3})
        for item in chat.choices[0].logprobs.content:
            assert [t.logprob for t in item.top_logprobs][3:] == [-9999.0, -9999.0]
        client.close()
