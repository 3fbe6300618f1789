"""OpenAI's logprobs shapes for completions and chat. The figures come from the engine, which
reads them off the verification forward (specdec/logprobs.py): no second forward.
"""

from __future__ import annotations

from collections.abc import Callable

from ..logprobs import TokenLogprob
from ..tokenizer import Tokenizer

Namer = Callable[[int], str]


def token_namer(tokenizer: Tokenizer, as_ids: bool = False) -> Namer:
    """How a token is named in logprobs: its text, or "token_id:<id>" (vLLM's
    return_tokens_as_token_ids, for clients that need the exact ids)."""
    if as_ids:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(name: Namer, entries: list[TokenLogprob], offset: int = 0,
                        prompt: tuple[list[int], list[TokenLogprob | None]] | None = None) -> dict:
    """The legacy completions shape: parallel lists, `top_logprobs` as {token: logprob}.
    prompt: (the prompt's ids, their logprobs: None for the first token) listed before the
    entries, as OpenAI's echo with logprobs does (null logprob and alternatives first)."""
    items = list(zip(*prompt)) if prompt else []
    items += [(e.token_id, e) for e in entries]
    tokens = [name(t) for t, _ in items]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob if e is not None else None for _, e in items],
            "top_logprobs": [_top_dict(name, e.top, (t, e.logprob)) if e is not None else None for t, e in items],
            "text_offset": offsets}


def vllm_prompt_logprobs(name: Namer, ids: list[int], entries: list[TokenLogprob | None]) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} for the token itself and its position's most likely alternatives."""
    out: list[dict | None] = []
    for t, e in zip(ids, entries):
        if e is None:
            out.append(None)
            continue
        d = {str(i): {"logprob": lp, "rank": r + 1, "decoded_token": name(i)} for r, (i, lp) in enumerate(e.top)}
        d.setdefault(str(t), {"logprob": e.logprob, "rank": e.rank, "decoded_token": name(t)})
        out.append(d)
    return out


def _top_dict(name: Namer, top, chosen: tuple[int, float]) -> dict[str, float]:
    """{token text: logprob}: the position's most likely tokens and the chosen one (OpenAI's legacy
    completions list up to logprobs + 1, as vLLM does; logprobs 0 gives the chosen token alone);
    tokens that decode alike (partial UTF-8 -> U+FFFD) keep the best."""
    out: dict[str, float] = {}
    for token_id, lp in top:
        out.setdefault(name(token_id), lp)
    out.setdefault(name(chosen[0]), chosen[1])
    return out


def chat_logprobs(name: Namer, entries: list[TokenLogprob], raw: Callable[[int], bytes] | None = None) -> dict:
    """The chat shape: one object per token with its bytes and its alternatives. raw: a token's
    bytes (Tokenizer.token_bytes: a piece of a character is its own bytes, as OpenAI's, where its
    text is U+FFFD; `token` is what they read as); None: the named text's (vLLM's
    return_tokens_as_token_ids names)."""
    def item(token_id: int, logprob: float) -> dict:
        if raw is None:
            text = name(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        data = raw(token_id)       # the token as its bytes read (a SentencePiece piece with its space, as OpenAI's)
        return {"token": data.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(data)}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]}
                        for e in entries]}
