"""The chat reply's role and echo as vLLM's get_chat_request_role reads them: --response-role after
a generation prompt; with add_generation_prompt false the last message's role, and echo puts that
message's content before every choice (plain, streamed with n > 1, beams, the batch route). The
reply had always named --response-role, so echo found nothing to repeat unless the last message
had that role (never, for a custom role no message may take)."""

from __future__ import annotations

import httpx
import openai
import pytest

from specdec import LLM
from specdec.server import ServerConfig, build_app

from test_server import LiveServer

CONTINUED = {"add_generation_prompt": False, "echo": True}


def _serve(target, role: str):
    # its own engine: a server's worker thread must be its engine's only caller
    llm = LLM(str(target), dtype="float32", num_speculative_tokens=0, max_model_len=128)
    return LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",), response_role=role)))


@pytest.fixture(scope="module")
def plain(tiny_pair):
    with _serve(tiny_pair[0], "assistant") as live:
        yield live


@pytest.fixture(scope="module")
def bot(tiny_pair):
    with _serve(tiny_pair[0], "bot") as live:
        yield live


def _chat(live, messages, **extra) -> dict:
    r = httpx.post(live.url + "/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": messages, "max_tokens": 3, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _streamed(live, messages, n: int, **extra) -> dict[int, tuple[str, str]]:
    """Each choice's (role of its first chunk, content joined) from the official client's stream."""
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    roles, texts = {}, {}
    for chunk in client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0, n=n,
                                                stream=True, extra_body=extra):
        for c in chunk.choices:
            roles.setdefault(c.index, c.delta.role)
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    return {i: (roles[i], texts[i]) for i in roles}


def test_without_a_generation_prompt_the_reply_takes_the_last_messages_role(plain):
    """The tester's first repro: two user turns, echo, no generation prompt: role user, "Hello" first."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "user", "content": "Hello"}]
    bare = _chat(plain, msgs, add_generation_prompt=False)["choices"][0]["message"]
    assert bare["role"] == "user"
    out = _chat(plain, msgs, n=2, **CONTINUED)
    assert [c["message"] for c in out["choices"]] == [{**c["message"], "role": "user",
                                                       "content": "Hello" + bare["content"]} for c in out["choices"]]
    assert out["usage"]["completion_tokens"] == 2 * 3            # the echo is not counted
    # streamed, n = 2: each choice's first chunk names the role, and its content starts with the echo
    assert _streamed(plain, msgs, 2, **CONTINUED) == {0: ("user", "Hello" + bare["content"]),
                                                      1: ("user", "Hello" + bare["content"])}
    # after a generation prompt: --response-role, and no echo of a user message
    after = _chat(plain, msgs, echo=True)["choices"][0]["message"]
    assert after == _chat(plain, msgs)["choices"][0]["message"] and after["role"] == "assistant"


def test_a_custom_response_role_still_echoes_a_continued_message(bot):
    """The tester's second repro (--response-role bot): the assistant's last message is echoed and
    the reply is the assistant's; with a generation prompt the reply is the bot's, with no echo."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]
    bare = _chat(bot, msgs, add_generation_prompt=False)["choices"][0]["message"]
    out = _chat(bot, msgs, **CONTINUED)["choices"][0]["message"]
    assert out["role"] == "assistant" and out["content"] == "Hello" + bare["content"]
    assert _streamed(bot, msgs, 1, **CONTINUED) == {0: ("assistant", "Hello" + bare["content"])}
    prompted = _chat(bot, msgs, echo=True)["choices"][0]["message"]
    assert prompted == _chat(bot, msgs)["choices"][0]["message"] and prompted["role"] == "bot"
    assert _streamed(bot, msgs, 1, echo=True)[0][0] == "bot"


def test_beams_and_the_batch_route_take_the_same_role(plain):
    """The other readers of the reply's role: use_beam_search (plain and streamed) and
    /v1/chat/completions/batch."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "user", "content": "Hello"}]
    beams = _chat(plain, msgs, n=2, use_beam_search=True, ignore_eos=True, **CONTINUED)
    assert [c["message"]["role"] for c in beams["choices"]] == ["user", "user"]
    assert all(c["message"]["content"].startswith("Hello") for c in beams["choices"])
    streamed = _streamed(plain, msgs, 2, use_beam_search=True, ignore_eos=True, **CONTINUED)
    assert [streamed[i] for i in (0, 1)] == [("user", c["message"]["content"]) for c in beams["choices"]]
    r = httpx.post(plain.url + "/v1/chat/completions/batch", timeout=60,
                   json={"model": "tiny", "messages": [msgs, msgs[:1]], "max_tokens": 3, "temperature": 0,
                         **CONTINUED})
    assert r.status_code == 200, r.text
    assert [c["message"]["role"] for c in r.json()["choices"]] == ["user", "user"]
    assert r.json()["choices"][0]["message"]["content"].startswith("Hello")
    assert r.json()["choices"][1]["message"]["content"].startswith("hi")
