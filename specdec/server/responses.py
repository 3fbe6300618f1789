"""Response bodies and server-sent events for /v1/completions and /v1/chat/completions.

The two endpoints differ only in names and in how a choice carries its text, so one collector
and one streamer serve both through a small format object. Beyond OpenAI's fields every
response carries `"speculative"`: the request's RequestStats (summed over its choices); in a
stream each choice's last chunk carries its own, and the usage chunk the request's.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..metrics import RequestStats
from ..tokenizer import Tokenizer
from .errors import APIError, error_body, log
from ..logprobs import TokenLogprob
from .logprobs import TextOffsets, chat_logprobs, completion_logprobs, token_namer, vllm_prompt_logprobs
from .serving import Generation
from .reasoning import HARMONY, ReasoningStream, parse_harmony, prompt_think, reasoning_stream, split_reasoning
from .tools import ToolPlan, ToolStream, extract, json_arguments, tool_call


@dataclass
class ChoiceResult:
    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None     # echo with logprobs
    prompt_index: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionFormat:
    object = chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, tokenizer: Tokenizer, want_logprobs: bool, echo: list[str] | None = None,
                 tokens_as_ids: bool = False, prompts: list[list[int]] | None = None, per_prompt: int = 1):
        """echo: each prompt's text, put before its choices' text (OpenAI's echo); with logprobs,
        the prompts' ids (choice i is of prompt i // per_prompt), whose tokens are listed first."""
        self.name, self.want_logprobs, self.echo = token_namer(tokenizer, tokens_as_ids), want_logprobs, echo
        self.prompts, self.per_prompt = prompts, per_prompt
        self.want_prompt_logprobs = False      # vLLM's prompt_logprobs field: listed on each choice
        self.return_token_ids = False          # vLLM's return_token_ids: ids beside the text
        self.tokenizer, self.params = tokenizer, None      # params: the request's (collect, stream)
        self._offsets: dict[int, TextOffsets] = {}        # a stream's choices' text_offset trackers

    def _logprobs(self, prompt_index: int, entries: list[TokenLogprob], prompt_logprobs, offsets: TextOffsets) -> dict:
        prompt = self._prompt(prompt_index, prompt_logprobs)
        at = (offsets.prompt() if prompt else []) + offsets.add([e.token_id for e in entries])
        return completion_logprobs(self.name, entries, at, prompt, self.params.logprobs if self.params else None)

    def _tracker(self, prompt_index: int) -> TextOffsets:
        prompt = self.prompts[prompt_index] if self.prompts else []
        return TextOffsets(self.tokenizer, prompt, self.echo[prompt_index] if self.echo else None,
                           self.params.skip_special_tokens if self.params else True)

    def _prompt(self, prompt_index: int, prompt_logprobs) -> tuple | None:
        if not (self.echo and self.prompts and prompt_logprobs):
            return None
        return self.prompts[prompt_index], prompt_logprobs

    def prefix(self, prompt_index: int) -> str:
        return self.echo[prompt_index] if self.echo else ""

    def top_level(self, results: list[ChoiceResult]) -> dict:
        return {}                              # completions list prompt logprobs per choice

    def choice(self, r: ChoiceResult) -> dict:
        lp = (self._logprobs(r.prompt_index, r.logprobs, r.prompt_logprobs, self._tracker(r.prompt_index))
              if self.want_logprobs else None)
        out = {"index": r.index, "text": "".join(r.text), "logprobs": lp,
               "finish_reason": r.finish_reason, "stop_reason": r.stop_reason}
        if self.want_prompt_logprobs and self.prompts and r.prompt_logprobs is not None:
            out["prompt_logprobs"] = vllm_prompt_logprobs(self.name, self.prompts[r.prompt_index], r.prompt_logprobs)
        return out

    def opening(self, index: int) -> dict | None:
        return None

    def delta(self, index: int, text: str, logprobs: list[TokenLogprob], offset: int,
              finish_reason: str | None, stop_reason, prompt_logprobs=None) -> dict:
        if self.want_logprobs and index not in self._offsets:
            self._offsets[index] = self._tracker(index // self.per_prompt)
        lp = (self._logprobs(index // self.per_prompt, logprobs, prompt_logprobs, self._offsets[index])
              if self.want_logprobs else None)
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason, "stop_reason": stop_reason}

class ChatFormat:
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, tokenizer: Tokenizer, want_logprobs: bool, tokens_as_ids: bool = False, role: str = "assistant",
                 prompt: list[int] | None = None, tools: ToolPlan | None = None, reasoning: str | None = None,
                 include_reasoning: bool = True, echo: str | None = None):
        self.name, self.want_logprobs = token_namer(tokenizer, tokens_as_ids), want_logprobs
        self.raw = None if tokens_as_ids else tokenizer.token_bytes
        # vLLM's chat echo: the last (assistant) message's content put before the content; only
        # the generated text goes through the reasoning and tool parsers
        self.echo = echo
        self.role, self.prompt = role, prompt
        self.want_prompt_logprobs = False      # vLLM's prompt_logprobs field: listed once, beside the choices
        self.return_token_ids = False          # vLLM's return_token_ids: ids beside the text
        # tool_choice named / required / auto: replies become tool calls (tools.py); "none": text
        self.tools = tools if tools is not None and tools.mode != "none" else None
        # --reasoning-parser: the thinking apart from the answer (reasoning.py); the answer then
        # goes to the tool parser
        self.reasoning, self.include_reasoning = reasoning, include_reasoning
        # qwen3: whether the prompt opened (QwQ) or closed (thinking off) a think block
        self.think = prompt_think(tokenizer.decode(prompt[-8:])) if reasoning == "qwen3" and prompt else None
        # gpt-oss's calls (--tool-call-parser openai) are harmony messages: the reasoning parser finds them
        self.harmony_calls = (reasoning == HARMONY and self.tools is not None and self.tools.mode == "auto"
                              and self.tools.parser == "openai")
        self._call_counts: dict[int, int] = {}
        self._streams: dict[int, ToolStream] = {}
        self._thinking: dict[int, ReasoningStream] = {}
        self._failed: set[int] = set()         # choices whose parsers failed: plain text from then on

    def top_level(self, results: list[ChoiceResult]) -> dict:
        if not (self.want_prompt_logprobs and self.prompt and results and results[0].prompt_logprobs is not None):
            return {}
        return {"prompt_logprobs": vllm_prompt_logprobs(self.name, self.prompt, results[0].prompt_logprobs)}

    def prefix(self, prompt_index: int) -> str:
        return ""                              # the echo is put before the parsed content (choice, opening)

    def choice(self, r: ChoiceResult) -> dict:
        """The finished choice; a parser that fails leaves the reply as text (vLLM's answer too)."""
        try:
            out = self._parsed_choice(r)
        except Exception:                      # noqa: BLE001 - a parser's bug must not fail the request
            log.exception("the reasoning / tool-call parser failed; the reply is returned as text")
            out = {"index": r.index, "message": {"role": self.role, "content": "".join(r.text)},
                   "logprobs": self._logprobs(r.logprobs), "finish_reason": r.finish_reason,
                   "stop_reason": r.stop_reason}
        if self.echo is not None:
            out["message"]["content"] = self.echo + (out["message"]["content"] or "")
        return out

    def _parsed_choice(self, r: ChoiceResult) -> dict:
        message, finish = {"role": self.role, "content": "".join(r.text)}, r.finish_reason
        if self.reasoning is not None:
            if self.harmony_calls:
                thought, answer, found = parse_harmony(message["content"], True, True, finish == "length")
                if found:
                    message["tool_calls"] = [tool_call(c.name, json_arguments(c.arguments)) for c in found]
                    finish = "tool_calls" if finish == "stop" else finish
            else:
                thought, answer = split_reasoning(self.reasoning, message["content"], self.think)
            message["content"] = answer if answer or not (thought or message.get("tool_calls")) else None
            if self.include_reasoning:    # vLLM's newer name and its older one (both sent)
                message["reasoning"] = message["reasoning_content"] = thought or None
        if self.tools is not None and message["content"] is not None and not self.harmony_calls:
            message["content"], calls, finish = extract(self.tools, message["content"], finish)
            if calls:
                message["tool_calls"] = calls
        return {"index": r.index, "message": message, "logprobs": self._logprobs(r.logprobs), "finish_reason": finish,
                "stop_reason": r.stop_reason}

    def opening(self, index: int) -> dict | None:
        # OpenAI's streams name the role once, in a first chunk of its own (with the echo, if any)
        return {"index": index, "delta": {"role": self.role, "content": self.echo or ""}, "logprobs": None,
                "finish_reason": None}

    def delta(self, index: int, text: str, logprobs: list[TokenLogprob], offset: int,
              finish_reason: str | None, stop_reason, prompt_logprobs=None) -> dict | None:
        """One step's chunk choice (None: all of it held back). A parser that fails sends what it
        held and this step's text as content, and the rest of the choice streams as text."""
        if index not in self._failed:
            held = self._pending(index)        # as fed, before this step: what a failure gives back (no copy)
            try:
                return self._parsed_delta(index, text, logprobs, finish_reason, stop_reason)
            except Exception:                  # noqa: BLE001 - a parser's bug must not cut the stream
                log.exception("the reasoning / tool-call parser failed; the reply streams on as text")
                self._failed.add(index)
                text = "".join(held) + text
        if not (text or logprobs or finish_reason):
            return None
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": self._logprobs(logprobs),
                "finish_reason": finish_reason, "stop_reason": stop_reason}

    def _pending(self, index: int) -> tuple[str, ...]:
        rs, ts = self._thinking.get(index), self._streams.get(index)
        return (rs.pending() if rs is not None else ()) + (ts.pending() if ts is not None else ())

    def _parsed_delta(self, index: int, text: str, logprobs: list[TokenLogprob], finish_reason: str | None,
                      stop_reason) -> dict | None:
        calls: list[dict] = []
        thought = ""
        if self.reasoning is not None:     # the thinking first; what follows </think> is the answer
            rs = self._thinking.get(index)
            if rs is None:
                rs = self._thinking[index] = reasoning_stream(self.reasoning, self.harmony_calls, self.think)
            thought, text = rs.feed(text)
            if finish_reason is not None:
                more_thought, rest = rs.finish(finish_reason == "length")
                thought, text = thought + more_thought, text + rest
            thought = thought if self.include_reasoning else ""
            if self.harmony_calls:
                for c in rs.take_calls():
                    n = self._call_counts.get(index, 0)
                    calls.append({"index": n, **tool_call(c.name, json_arguments(c.arguments))})
                    self._call_counts[index] = n + 1
                if finish_reason == "stop" and self._call_counts.get(index):
                    finish_reason = "tool_calls"
        if self.tools is not None and not self.harmony_calls:    # text becomes content and call deltas; some held
            ts = self._streams.setdefault(index, ToolStream(self.tools))
            text, calls = ts.feed(text)
            if finish_reason is not None:
                rest, more, finish_reason = ts.finish(finish_reason)
                text, calls = text + rest, calls + more
        if (self.reasoning is not None or self.tools is not None) and not (
                text or thought or calls or logprobs or finish_reason):
            return None                    # all of it held back
        delta = {"content": text} if text else {}
        if thought:
            delta["reasoning"] = delta["reasoning_content"] = thought
        if calls:
            delta["tool_calls"] = calls
        return {"index": index, "delta": delta, "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def _logprobs(self, entries) -> dict | None:
        return chat_logprobs(self.name, entries, self.raw) if self.want_logprobs else None


def _head(fmt, model: str, chunk: bool, response_id: str | None) -> dict:
    """response_id: the body's id (vLLM's cmpl-<request id>); None: one of fmt's kind made up."""
    return {"id": response_id or fmt.id_prefix + uuid.uuid4().hex, "object": fmt.chunk_object if chunk else fmt.object,
            "created": int(time.time()), "model": model}


def cached_prompt_tokens(gen: Generation) -> int:
    """Each prompt's tokens found in the prefix cache (the most any of its choices found: they
    may run side by side), summed over the prompts."""
    per = gen.per_prompt
    return sum(max((s.cached_tokens for s in gen.stats[p * per:(p + 1) * per] if s is not None), default=0)
               for p in range(len(gen.prompts)))


def usage(gen: Generation, completion_tokens: int, returned: list[int] | None = None) -> dict:
    """OpenAI's usage (cached_tokens: cached_prompt_tokens); completion_tokens_details when the
    request gave a prediction, as OpenAI's (vLLM's, without one: none). The prediction counts are
    of the choices returned (`returned`: their candidates' indices, best_of > n; None: all), as
    OpenAI defines them against the completion: each choice's add up to the prediction's length."""
    prompt_tokens = sum(len(p) for p in gen.prompts)
    cached = cached_prompt_tokens(gen)
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}
    if gen.prediction is not None:     # OpenAI's Predicted Outputs counts, over the choices (an empty one: zeros)
        stats = gen.stats if returned is None else [gen.stats[i] for i in returned]
        done = [s for s in stats if s is not None]
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": sum(s.accepted_prediction_tokens for s in done),
            "rejected_prediction_tokens": sum(s.rejected_prediction_tokens for s in done)}
    return out


def speculative(*gens: Generation) -> dict:
    """The choices' statistics summed (over several generations: a batch of chats); prompt tokens
    counted once per prompt, as in usage."""
    total = RequestStats()
    done = [s for gen in gens for s in gen.stats if s is not None]
    for s in done:
        total.merge(s)
    total.prompt_tokens = sum(len(p) for gen in gens for p in gen.prompts)
    total.cached_tokens = sum(cached_prompt_tokens(gen) for gen in gens)     # per prompt, as usage counts them
    total.time_to_first_token_s = min((s.time_to_first_token_s for s in done), default=0.0)
    return total.to_dict()


async def collect(gen: Generation, fmt, model: str, response_id: str | None = None) -> dict:
    """Run a generation to the end and build the non-streaming body."""
    per = gen.per_prompt
    if isinstance(fmt, CompletionFormat):
        fmt.params = gen.params
    results = [ChoiceResult(i, [fmt.prefix(i // per)], prompt_index=i // per) for i in range(len(gen.prompts) * per)]
    score = [0.0] * len(results)
    async with gen:
        async for index, ev in gen.steps():
            r = results[index]
            r.text.append(ev.text)
            r.token_ids += ev.token_ids
            r.logprobs += ev.logprobs or []
            if ev.prompt_logprobs is not None:
                r.prompt_logprobs = ev.prompt_logprobs
            r.finish_reason, r.stop_reason = ev.finish_reason, ev.stop_reason
            score[index] = ev.cumulative_logprob if ev.cumulative_logprob is not None else score[index]
    tokens = sum(len(r.token_ids) for r in results)      # every candidate's tokens are billed
    returned = None
    if per > gen.params.n:       # best_of: each prompt's n candidates of highest cumulative logprob
        results = [r for p in range(len(gen.prompts))
                   for r in sorted(results[p * per:(p + 1) * per], key=lambda r: -score[r.index])[:gen.params.n]]
        returned = [r.index for r in results]
        for i, r in enumerate(results):
            r.index = i
    choices = [fmt.choice(r) for r in results]
    top = fmt.top_level(results)
    if fmt.return_token_ids:        # vLLM's: the generated ids on each choice; the prompt's beside them
        for c, r in zip(choices, results):
            c["token_ids"] = list(r.token_ids)
            if isinstance(fmt, CompletionFormat):
                c["prompt_token_ids"] = list(gen.prompts[r.prompt_index])
        if not isinstance(fmt, CompletionFormat):
            top["prompt_token_ids"] = list(gen.prompts[0])
    return {**_head(fmt, model, chunk=False, response_id=response_id), "choices": choices, **top,
            "usage": usage(gen, tokens, returned), "speculative": speculative(gen)}


def _usage_so_far(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def stream(gen: Generation, fmt, model: str, include_usage: bool, continuous_usage: bool = False,
                 response_id: str | None = None) -> AsyncIterator[str]:
    """Server-sent events: one chunk per decoding step that releases text, then `data: [DONE]`.
    include_usage: a last chunk with the request's usage (every other chunk says "usage": null);
    continuous_usage (vLLM's continuous_usage_stats): every chunk carries its choice's usage so far."""
    head = _head(fmt, model, chunk=True, response_id=response_id)
    n_choices = len(gen.prompts) * gen.params.n      # streams never carry best_of > n
    offsets, tokens, counts = [0] * n_choices, 0, [0] * n_choices
    if isinstance(fmt, CompletionFormat):
        fmt.params = gen.params     # its text_offset: each token's place in the returned text, as collect's

    def extra(i: int) -> dict:
        if not include_usage:
            return {}
        if not continuous_usage:
            return {"usage": None}
        return {"usage": _usage_so_far(len(gen.prompt_of(i)), counts[i])}
    echo = [fmt.prefix(i // gen.params.n) for i in range(n_choices)]
    held = [None] * n_choices        # prompt logprobs not sent yet
    # return_token_ids: each chunk carries the ids generated since its choice's last chunk; the
    # prompt's go in each choice's first chunk (chat: on the chunk, beside its role; completions:
    # on the choice), as vLLM's
    ids = [[] for _ in range(n_choices)] if fmt.return_token_ids else None
    chat_prompt_ids = fmt.return_token_ids and not isinstance(fmt, CompletionFormat)
    first = [True] * n_choices
    opened = False
    try:
        async with gen:
            async for index, ev in gen.steps():
                if not opened:     # the role chunks go with the first output, as vLLM's: a client
                    opened = True  # that times the first chunk with choices measures the prefill
                    for i in range(n_choices):
                        if (opening := fmt.opening(i)) is not None:
                            chunk = {**head, "choices": [opening], **extra(i)}
                            if chat_prompt_ids:
                                chunk["prompt_token_ids"] = list(gen.prompt_of(i))
                            yield _sse(chunk)
                tokens += len(ev.token_ids)
                counts[index] += len(ev.token_ids)
                if ids is not None:
                    ids[index] += ev.token_ids
                text, echo[index] = echo[index] + ev.text, ""
                prompt_lps, held[index] = held[index] or ev.prompt_logprobs, None
                if not (text or ev.finished or ev.logprobs):
                    held[index] = prompt_lps     # the echoed prompt's logprobs go with its text
                    continue            # text held back (a partial character or a possible stop string)
                choice = fmt.delta(index, text, ev.logprobs or [], offsets[index], ev.finish_reason, ev.stop_reason,
                                   prompt_lps)
                offsets[index] += len(text)
                if choice is None:      # all of it held back (a tool call being written)
                    continue
                if ids is not None:
                    choice["token_ids"], ids[index] = ids[index], []
                    if first[index] and isinstance(fmt, CompletionFormat):
                        choice["prompt_token_ids"] = list(gen.prompt_of(index))
                first[index] = False
                if choice.get("finish_reason") is not None and choice.get("delta", {}).get("tool_calls"):
                    # the calls, then the finish_reason in a chunk of its own (OpenAI's last chunk):
                    # the SDK's stream helper reads a finishing chunk before its deltas, so a call
                    # first seen there would never get its tool_calls.function.arguments.done
                    yield _sse({**head, "choices": [{**choice, "finish_reason": None, "stop_reason": None}],
                                **extra(index)})
                    choice = {"index": index, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"],
                              "stop_reason": choice["stop_reason"], **({"token_ids": []} if ids is not None else {})}
                chunk = {**head, "choices": [choice], **extra(index)}
                if ev.finished:
                    chunk["speculative"] = ev.stats.to_dict()
                yield _sse(chunk)
        if include_usage:
            yield _sse({**head, "choices": [], "usage": usage(gen, tokens), "speculative": speculative(gen)})
    except APIError as e:
        # the status line went out with the first byte; the error can only travel as an event
        yield _sse(error_body(e.status, e.message, e.param, e.code))
    except Exception as e:             # noqa: BLE001 - a bug: still an error event and the stream's end
        log.exception("a stream failed")
        yield _sse(error_body(500, f"internal error: {type(e).__name__}"))
    yield "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
