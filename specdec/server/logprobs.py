"""OpenAI's logprobs shapes for completions and chat. The figures come from the engine, which
reads them off the verification forward (specdec/logprobs.py): no second forward.
"""

from __future__ import annotations

from collections.abc import Callable

from ..detokenize import Detokenizer
from ..logprobs import FLOOR, TokenLogprob
from ..tokenizer import Tokenizer

Namer = Callable[[int], str]


def token_namer(tokenizer: Tokenizer, as_ids: bool = False) -> Namer:
    """How a token is named in logprobs: its text, or "token_id:<id>" (vLLM's
    return_tokens_as_token_ids, for clients that need the exact ids)."""
    if as_ids:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)


def _json(logprob: float) -> float:
    """A logprob as JSON can carry it: -inf (a token top-k, top-p or min-p removed, under the
    processed modes) as FLOOR, as vLLM's server sends it."""
    return max(logprob, FLOOR)


def completion_logprobs(name: Namer, entries: list[TokenLogprob], offsets: list[int],
                        prompt: tuple[list[int], list[TokenLogprob | None]] | None = None,
                        top_n: int | None = None) -> dict:
    """The legacy completions shape: parallel lists, `top_logprobs` as {token: logprob}.
    prompt: (the prompt's ids, their logprobs: None for the first token) listed before the
    entries, as OpenAI's echo with logprobs does (null logprob and alternatives first).
    offsets: each listed token's text_offset (TextOffsets). top_n: the request's logprobs, which
    bound every position's alternatives, the prompt's scored wider for prompt_logprobs too (vLLM's)."""
    items = list(zip(*prompt)) if prompt else []
    items += [(e.token_id, e) for e in entries]
    return {"tokens": [name(t) for t, _ in items],
            "token_logprobs": [_json(e.logprob) if e is not None else None for _, e in items],
            "top_logprobs": [_top_dict(name, e.top, (t, e.logprob), top_n) if e is not None else None for t, e in items],
            "text_offset": offsets}


class TextOffsets:
    """OpenAI's text_offset: where each token's text starts in a choice's returned text (the echoed
    prompt, then the output). The tokens are decoded one at a time, as the output's text is
    (after the prompt: specdec/detokenize.py), so a stream's offsets are the response's, whatever
    tokens each step brought (plain and speculative alike). A piece of a character points at that
    character; a token cut off with a stop string, where its text would have been."""

    def __init__(self, tokenizer: Tokenizer, prompt: list[int], echo: str | None, skip_special_tokens: bool):
        self._out = Detokenizer(tokenizer, [], skip_special_tokens, prompt=prompt)
        self._prompt, self._echo = prompt, echo
        self._tokenizer = tokenizer
        self._base = len(echo) if echo is not None else 0

    def prompt(self) -> list[int]:
        """The echoed prompt's tokens' offsets: the prompt decoded as echo_texts decodes ids. A
        text prompt echoes as sent: the decoded text's extra start (a BOS) or missing one (a
        truncated prompt) is shifted off."""
        echo = self._echo or ""
        decoded = self._tokenizer.decode(self._prompt, skip_special_tokens=False)
        shift = len(decoded) - len(echo) if decoded.endswith(echo) or echo.endswith(decoded) else 0
        d = Detokenizer(self._tokenizer, [], skip_special_tokens=False)
        return [min(max(d.feed(t) - shift, 0), len(echo)) for t in self._prompt]

    def add(self, token_ids: list[int]) -> list[int]:
        """The next output tokens' offsets."""
        return [self._base + self._out.feed(t) for t in token_ids]


def vllm_prompt_logprobs(name: Namer, ids: list[int], entries: list[TokenLogprob | None]) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} for the token itself and its position's most likely alternatives."""
    out: list[dict | None] = []
    for t, e in zip(ids, entries):
        if e is None:
            out.append(None)
            continue
        d = {str(i): {"logprob": _json(lp), "rank": r + 1, "decoded_token": name(i)} for r, (i, lp) in enumerate(e.top)}
        d.setdefault(str(t), {"logprob": _json(e.logprob), "rank": e.rank, "decoded_token": name(t)})
        out.append(d)
    return out


def _top_dict(name: Namer, top, chosen: tuple[int, float], top_n: int | None = None) -> dict[str, float]:
    """{token text: logprob}: the position's most likely tokens and the chosen one (OpenAI's legacy
    completions list up to logprobs + 1, as vLLM does; logprobs 0 gives the chosen token alone);
    tokens that decode alike (partial UTF-8 -> U+FFFD) keep the best. top_n: vLLM keeps the first
    top_n + 1 of the chosen token then the likeliest (a wider top: a prompt scored for prompt_logprobs)."""
    if top_n is not None and top_n >= 0:          # -1 (with --max-logprobs -1): the whole vocabulary
        keep = list(dict.fromkeys([chosen[0]] + [t for t, _ in top]))[:top_n + 1]
        top = [(t, lp) for t, lp in top if t in keep]
    out: dict[str, float] = {}
    for token_id, lp in top:
        out.setdefault(name(token_id), _json(lp))
    out.setdefault(name(chosen[0]), _json(chosen[1]))
    return out


def chat_logprobs(name: Namer, entries: list[TokenLogprob], raw: Callable[[int], bytes] | None = None) -> dict:
    """The chat shape: one object per token with its bytes and its alternatives. raw: a token's
    bytes (Tokenizer.token_bytes: a piece of a character is its own bytes, as OpenAI's, where its
    text is U+FFFD; `token` is what they read as); None: the named text's (vLLM's
    return_tokens_as_token_ids names)."""
    def item(token_id: int, logprob: float) -> dict:
        logprob = _json(logprob)
        if raw is None:
            text = name(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        data = raw(token_id)       # the token as its bytes read (a SentencePiece piece with its space, as OpenAI's)
        return {"token": data.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(data)}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]}
                        for e in entries]}
