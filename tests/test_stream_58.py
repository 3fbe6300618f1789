"""The completions' text as vLLM gives it, a tester's findings (stream58): a prompt of token ids cut
inside a character gets that character whole from the output token that finishes it (vLLM primes
its incremental detokenizer with the prompt); echo's prompt tokens list at most logprobs + 1
alternatives whatever prompt_logprobs asks (vLLM's cap); text_offset is each token's place in the
returned text, the same streamed or not, plain or speculative."""

from __future__ import annotations

import httpx
import pytest
from tokenizers.decoders import DecodeStream

from specdec import LLM, SamplingParams
from specdec.defaults import BUNDLED_DRAFT, BUNDLED_TARGET, MODELS_DIR
from specdec.detokenize import Detokenizer
from specdec.server import ServerConfig, build_app

from test_server import LiveServer

TEXT = "我喜欢吃苹果和香蕉，也喜欢吃西瓜。"


def vllm_text(tok, prompt: list[int], out: list[int]) -> str:
    """vLLM V1's FastIncrementalDetokenizer: a DecodeStream primed with the prompt's shortest suffix
    of 4 to 23 tokens that decodes whole, else the whole prompt, then stepped a token at a time."""
    backend, suffix = tok.backend, prompt
    if len(prompt) > 4:
        suffix = next((prompt[-i:] for i in range(4, min(len(prompt) + 1, 24))
                       if "\ufffd" not in backend.decode(prompt[-i:])), prompt)
    stream = DecodeStream(skip_special_tokens=True)
    for t in suffix:
        stream.step(backend, t)
    return "".join(stream.step(backend, t) or "" for t in out)


def _cuts(tok) -> list[int]:
    """Where TEXT's ids can be cut inside a character that the next token finishes."""
    ids = tok.encode(TEXT, add_special_tokens=False)
    return [c for c in range(1, len(ids)) if tok.decode(ids[:c]).endswith("\ufffd")
            and not tok.decode(ids[:c + 1]).endswith("\ufffd")]


@pytest.fixture(scope="module")
def pair():
    plain = LLM(BUNDLED_TARGET, max_model_len=512, max_num_seqs=4)
    spec = LLM(BUNDLED_TARGET, speculative_model=str(BUNDLED_DRAFT), num_speculative_tokens=4, max_model_len=512,
               max_num_seqs=4)
    return plain, spec


@pytest.fixture(scope="module")
def urls(pair):
    config = ServerConfig(served_model_names=("toy",))
    with LiveServer(build_app(pair[0], config)) as a, LiveServer(build_app(pair[1], config)) as b:
        yield a.url, b.url


def test_priming_decodes_a_bounded_window_of_a_long_prompt(pair, monkeypatch):
    """A long token-id prompt of stray bytes ending inside a character: priming decodes the last
    PRIME_MAX tokens, not ever-longer windows of the whole prompt (8,000 tokens had taken 2 s of
    the engine's thread per choice, quadratic), and the text is what whole-prompt priming gives."""
    import specdec.detokenize as detokenize

    tok = pair[0].get_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    stray = [i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd"][:3]
    decoded = []

    class Counting:
        def __getattr__(self, name):
            return getattr(tok, name)

        def decode(self, token_ids, *args, **kwargs):
            decoded.append(len(token_ids))
            return tok.decode(token_ids, *args, **kwargs)

    def text(prompt, out, counting=False):
        d = Detokenizer(Counting() if counting else tok, [], prompt=prompt)
        for t in out:
            d.add(t)
        return d.text
    text([stray[0]] * 8000 + ids[:_cuts(tok)[0]], [], counting=True)
    assert sum(decoded) < 4 * detokenize.PRIME_MAX ** 2, sum(decoded)
    cases = [([s] * 300 + ids[:cut], ids[cut:cut + more]) for s in stray for cut in _cuts(tok)[:3] for more in (1, 3)]
    capped = [text(p, o) for p, o in cases]
    monkeypatch.setattr(detokenize, "PRIME_MAX", 10 ** 9)
    assert capped == [text(p, o) for p, o in cases]


def test_detokenizer_finishes_the_prompts_character_as_vllm(pair):
    """Every cut of TEXT inside a character, followed by 0-4 more of its tokens one at a time: the
    text is vLLM's (the character whole, '我' where the output's byte alone is U+FFFD)."""
    tok = pair[0].get_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    cuts = _cuts(tok)
    assert cuts
    for cut in range(1, len(ids)):
        for more in range(5):
            prompt, out = ids[:cut], ids[cut:cut + 1 + more]
            d = Detokenizer(tok, [], prompt=prompt)
            for t in out:
                d.add(t)
                d.delta(final=False)
            assert d.text == vllm_text(tok, prompt, out), (cut, more)
    assert all(Detokenizer(tok, [], prompt=ids[:c]).feed(ids[c]) == 0 for c in cuts)


def test_prompt_cut_inside_a_character_offline_and_served(pair, urls):
    """LLM.generate and the server, streamed and not, plain and speculative: the output token that
    finishes the prompt's last character returns the character (the continue-generation flow)."""
    tok = pair[0].get_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    for cut in _cuts(tok):
        want = vllm_text(tok, ids[:cut], [ids[cut]])
        assert want and "\ufffd" not in want
        params = SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=[ids[cut]])
        for llm in pair:
            assert llm.generate({"prompt_token_ids": ids[:cut]}, params)[0].outputs[0].text == want
        body = {"model": "toy", "prompt": ids[:cut], "max_tokens": 1, "temperature": 0, "allowed_token_ids": [ids[cut]]}
        for url in urls:
            assert httpx.post(url + "/v1/completions", json=body).json()["choices"][0]["text"] == want
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
                text = "".join(c["text"] for line in r.iter_lines() if line.startswith("data: {")
                               for c in httpx.Response(200, content=line[6:]).json()["choices"])
            assert text == want


def test_echo_alternatives_are_capped_at_logprobs(urls):
    """echo + logprobs 1 + prompt_logprobs 5: each echoed prompt token lists at most 2 alternatives
    (vLLM keeps the first logprobs + 1 of the token then the likeliest), the token among them; the
    prompt_logprobs field keeps its 5 (+ the token)."""
    body = {"model": "toy", "prompt": "def fib(n):\n    return", "max_tokens": 3, "temperature": 0, "echo": True,
            "logprobs": 1, "prompt_logprobs": 5}
    c = httpx.post(urls[0] + "/v1/completions", json=body).json()["choices"][0]
    lp = c["logprobs"]
    assert lp["top_logprobs"][0] is None
    assert all(1 <= len(top) <= 2 and tok in top for tok, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:]))
    assert max(len(p) for p in c["prompt_logprobs"][1:]) >= 5


def _streamed(url: str, body: dict) -> list[dict]:
    """Each choice's text and logprobs lists, the chunks joined."""
    out: dict[int, dict] = {}
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for x in httpx.Response(200, content=line[6:]).json()["choices"]:
                    a = out.setdefault(x["index"], {"text": "", "tokens": [], "text_offset": []})
                    a["text"] += x["text"]
                    if x["logprobs"]:
                        a["tokens"] += x["logprobs"]["tokens"]
                        a["text_offset"] += x["logprobs"]["text_offset"]
    return [out[i] for i in sorted(out)]


@pytest.fixture(scope="module")
def smol_urls(smollm2):
    plain = LLM(str(smollm2), max_model_len=512, max_num_seqs=4)
    spec = LLM(str(smollm2), speculative_config={"method": "draft_model", "num_speculative_tokens": 4,
               "model": str(MODELS_DIR / "smollm2-draft")}, max_model_len=512, max_num_seqs=4)
    config = ServerConfig(served_model_names=("smol",))
    with LiveServer(build_app(plain, config)) as a, LiveServer(build_app(spec, config)) as b:
        yield a.url, b.url


def test_text_offset_indexes_the_returned_text(smol_urls):
    """SmolLM2's Chinese (characters of several tokens), with echo and without, n=2: each offset is
    the token's place in the returned text (a whole token's text is there; a piece of a character
    points at it), never goes back, and is the same streamed or not, plain or speculative."""
    seen = []
    for url in smol_urls:
        for echo in (False, True):
            body = {"model": "smol", "prompt": ["北京是中国的首都，", "Hello 世界, this is"], "max_tokens": 16,
                    "temperature": 0, "logprobs": 1, "echo": echo, "n": 2}
            full = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"]
            streamed = _streamed(url, body)
            assert [c["text"] for c in full] == [s["text"] for s in streamed]
            assert [c["logprobs"]["text_offset"] for c in full] == [s["text_offset"] for s in streamed]
            for c in full:
                text, lp = c["text"], c["logprobs"]
                assert lp["text_offset"] == sorted(lp["text_offset"])
                for tok, at in zip(lp["tokens"], lp["text_offset"]):
                    if "\ufffd" not in tok:
                        assert text[at:at + len(tok)] == tok, (text, tok, at)
                    else:
                        assert at < len(text) and ord(text[at]) > 0x2000, (text, tok, at)
            seen.append([c["logprobs"]["text_offset"] for c in full])
    assert any("\ufffd" in t for t in lp["tokens"])      # pieces of characters were listed
    assert seen[:2] == seen[2:]          # plain == speculative
