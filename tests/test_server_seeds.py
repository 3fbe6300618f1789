"""The server's seeds for sampling requests that bring none (--seed, vLLM V1's default 0): every
prompt and choice of a request draws apart; a seed the request gives is shared by its prompts, as
vLLM's."""

from __future__ import annotations

import httpx
import pytest

from specdec import LLM
from specdec.server import ServerConfig, build_app
from test_server import LiveServer


@pytest.fixture(scope="module")
def live(tiny_pair):
    llm = LLM(str(tiny_pair[0]), num_speculative_tokens=0, max_model_len=128)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",), seed=0))) as server:
        yield server


def _texts(live, **body) -> list[str]:
    r = httpx.post(f"{live.url}/v1/completions", timeout=120, json={
        "model": "tiny", "max_tokens": 16, "temperature": 1.0, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def test_prompts_of_one_request_draw_apart(live):
    texts = _texts(live, prompt=["def add(a, b):"] * 3, n=2)
    assert len(set(texts)) == 6          # 2 of 6 before: each prompt's choice i took seed + i


def test_a_given_seed_is_shared_by_the_prompts(live):
    texts = _texts(live, prompt=["def add(a, b):"] * 2, n=2, seed=7)
    assert texts[0] == texts[2] and texts[1] == texts[3] and texts[0] != texts[1]
