"""Log-probabilities of the output tokens under the target's raw distribution (before temperature,
top-k/top-p/min-p), as vLLM reports them by default.

The engine does not hand its logits out, so a LogprobScorer re-scores each step's tokens with a
KV cache of its own: one extra target forward pass per step, paid only by requests that ask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model import ForwardBatch, Transformer
from ..tokenizer import Tokenizer


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]      # the `top_n` most likely tokens, best first


class LogprobScorer:
    """Mirrors the engine's cache invariant: the cache holds every token but the last one."""

    def __init__(self, model: Transformer, prompt: list[int], max_len: int, top_n: int):
        self.model, self.top_n = model, min(top_n, model.config.vocab_size)
        self.cache = model.new_cache(1, max_len)
        self.seq = list(prompt)
        if len(prompt) > 1:
            self._forward(prompt[:-1], 0, logits=False)

    def score(self, new_tokens: list[int]) -> list[TokenLogprob]:
        if not new_tokens:
            return []
        # rows of [last, t_1 .. t_{m-1}] predict t_1 .. t_m
        logits = self._forward([self.seq[-1], *new_tokens[:-1]], len(self.seq) - 1)      # [m, V]
        logp = torch.log_softmax(logits.float(), dim=-1)
        chosen = logp.gather(1, torch.tensor(new_tokens, device=logp.device)[:, None])[:, 0].tolist()
        tops = [[] for _ in new_tokens]
        if self.top_n > 0:
            values, ids = logp.topk(self.top_n, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        self.seq += new_tokens
        return [TokenLogprob(t, lp, tuple(top)) for t, lp, top in zip(new_tokens, chosen, tops)]

    @torch.inference_mode()
    def _forward(self, tokens: list[int], start: int, logits: bool = True):
        batch = ForwardBatch.build(self.cache, [0], [len(tokens)], [start])
        return self.model(torch.tensor(tokens), self.cache, batch, logits=logits).logits


def _text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob], offset: int = 0) -> dict:
    """The legacy completions shape: parallel lists, `top_logprobs` as {token: logprob}."""
    tokens = [_text(tokenizer, e.token_id) for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [_top_dict(tokenizer, e.top) for e in entries],
            "text_offset": offsets}


def _top_dict(tokenizer: Tokenizer, top) -> dict[str, float]:
    """{token text: logprob}; tokens that decode alike (partial UTF-8 -> U+FFFD) keep the best."""
    out: dict[str, float] = {}
    for token_id, lp in top:
        out.setdefault(_text(tokenizer, token_id), lp)
    return out


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> dict:
    """The chat shape: one object per token with its bytes and its alternatives."""
    def item(token_id: int, logprob: float) -> dict:
        text = _text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]}
                        for e in entries]}
