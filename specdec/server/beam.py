"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: the n best beams of each prompt (n is the beam
width), through the same engine jobs as any request (specdec/beam_search.py's BeamSearch,
stepped here: each step's beams are one Generation), so beams batch with other traffic and a
client that leaves cancels them. The beams are known only at the end, so `stream: true` gets
vLLM's answers then: completions one event holding the whole body, chat the beams as chunks
(each choice's role, then its text)."""

from __future__ import annotations

import json
import time

from ..beam_search import BeamSearch, BeamSearchParams
from ..config import SamplingParams
from ..prediction import common_subsequence
from .errors import APIError
from .fields import structured_outputs
from .responses import ChatFormat, ChoiceResult


async def beam_completion(service, body, arrival: float, lora, response_id: str) -> dict:
    """use_beam_search on /v1/completions: the request is checked and its prompts tokenized and
    truncated (truncate_prompt_tokens) as any completion's (Service.prepare_completion, as vLLM
    preprocesses before it branches to beam search); then the beams of each prompt."""
    service._check_generates("Completions")
    if body.logprobs is not None or body.echo or body.best_of is not None:
        raise APIError(400, "use_beam_search does not combine with logprobs, echo or best_of", "use_beam_search")
    if structured_outputs(body)[0] is not None:
        raise APIError(400, "use_beam_search does not combine with structured outputs", "use_beam_search")
    prompts, sampling = await service.off_loop(service.prepare_completion, body)
    search, outputs, cached = await _search(service, body, prompts, sampling.max_tokens, arrival, lora, response_id)
    choices, completion_tokens = [], 0
    for p, (prompt, out) in enumerate(zip(prompts, outputs)):
        for j, beam in enumerate(out.sequences):
            ids = search.output_ids(beam, len(prompt))
            completion_tokens += len(ids)
            choices.append({"index": p * search.params.beam_width + j, "text": service.tokenizer.decode(ids, skip_special_tokens=True),
                            "logprobs": None, "finish_reason": beam.finish_reason, "stop_reason": _stop_reason(beam),
                            **({"token_ids": list(ids), "prompt_token_ids": list(prompt)} if body.return_token_ids
                               else {})})
    answer = _answer(response_id, "text_completion", service.model_name(lora, body.model), choices, prompts,
                     completion_tokens, cached)
    # vLLM's completions stream no beams: a streamed request gets the body as one event
    return [_event(answer), _DONE] if body.stream else answer


async def beam_chat(service, body, arrival: float, lora, response_id: str) -> dict | list[str]:
    """use_beam_search on /v1/chat/completions: the beams of the rendered conversation, each
    parsed as a plain reply is (ChatFormat: --reasoning-parser's split, chat echo); no tools,
    logprobs or structured outputs with it. Streamed: the choices as vLLM's chat streams its
    beams (events). A prediction is checked as a plain request's and counted over the beams
    (completion_tokens_details), as a plain decoding server counts it: no step drafts from it."""
    if body.tools or body.logprobs or body.best_of is not None:
        raise APIError(400, "use_beam_search does not combine with tools, logprobs or best_of", "use_beam_search")
    (prompts, sampling, _), prediction = await service.off_loop(
        lambda: (service.prepare_chat(body), service.prediction_ids(body)))
    if sampling.structured_outputs is not None:
        raise APIError(400, "use_beam_search does not combine with structured outputs", "use_beam_search")
    # prepare_chat's: the request's max_completion_tokens / max_tokens under generation_config.json's cap
    search, outputs, cached = await _search(service, body, prompts, sampling.max_tokens, arrival, lora, response_id)
    fmt = ChatFormat(service.tokenizer, False, role=service.chat_role(body), prompt=prompts[0],
                     reasoning=service.config.reasoning_parser, include_reasoning=body.include_reasoning,
                     echo=service.chat_echo(body))
    results = []
    for j, beam in enumerate(outputs[0].sequences):
        ids = search.output_ids(beam, len(prompts[0]))
        # as the plain reply's text: harmony's channels are special tokens prepare_chat keeps
        text = service.tokenizer.decode(ids, skip_special_tokens=sampling.skip_special_tokens)
        results.append(ChoiceResult(j, [text], list(ids), finish_reason=beam.finish_reason,
                                    stop_reason=_stop_reason(beam)))
    model = service.model_name(lora, body.model)
    details = None if prediction is None else await service.off_loop(_prediction_details, prediction, results)
    if body.stream:
        return _chat_events(service, body, fmt, results, prompts[0], response_id, model, details, cached)
    choices = [{**fmt.choice(r), **({"token_ids": r.token_ids} if body.return_token_ids else {})} for r in results]
    answer = _answer(response_id, "chat.completion", model, choices, prompts, sum(len(r.token_ids) for r in results),
                     cached, details)
    if body.return_token_ids:            # vLLM's: the prompt's ids beside the choices
        answer["prompt_token_ids"] = list(prompts[0])
    return answer


def _prediction_details(prediction: list[int], results: list[ChoiceResult]) -> dict:
    """OpenAI's Predicted Outputs counts summed over the beams (responses.usage's for a plain reply):
    the prediction's tokens that appear in each beam, in order, and the rest."""
    accepted = [common_subsequence(prediction, r.token_ids) for r in results]
    return {"accepted_prediction_tokens": sum(accepted),
            "rejected_prediction_tokens": len(prediction) * len(results) - sum(accepted)}


def _chat_events(service, body, fmt: ChatFormat, results: list[ChoiceResult], prompt: list[int], response_id: str,
                 model: str, details: dict | None, cached: int) -> list[str]:
    """vLLM's chat stream of finished beams: each choice's role chunk, then each choice's whole
    text in one chunk with its finish_reason (through the streaming parsers, as any stream's),
    the usage chunk if asked, [DONE]."""
    head = {"id": response_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
    opts = body.stream_options
    include_usage = bool(opts and opts.include_usage) or service.config.enable_force_include_usage
    continuous = include_usage and bool(opts and opts.continuous_usage_stats)

    def usage(r: ChoiceResult | None) -> dict:
        if not include_usage:
            return {}
        if not continuous:
            return {"usage": None}
        done = len(r.token_ids) if r is not None else 0
        return {"usage": {"prompt_tokens": len(prompt), "completion_tokens": done, "total_tokens": len(prompt) + done}}

    events = []
    for r in results:
        chunk = {**head, "choices": [fmt.opening(r.index)], **usage(None)}
        if body.return_token_ids:
            chunk["prompt_token_ids"] = list(prompt)
        events.append(_event(chunk))
    for r in results:
        choice = fmt.delta(r.index, "".join(r.text), [], 0, r.finish_reason, r.stop_reason)
        if body.return_token_ids:
            choice["token_ids"] = r.token_ids
        events.append(_event({**head, "choices": [choice], **usage(r)}))
    if include_usage:
        completion = sum(len(r.token_ids) for r in results)
        events.append(_event({**head, "choices": [], "usage": {
            "prompt_tokens": len(prompt), "completion_tokens": completion, "total_tokens": len(prompt) + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            **({"completion_tokens_details": details} if details is not None else {})}}))
    return events + [_DONE]


async def _search(service, body, prompts: list[list[int]], max_tokens: int | None, arrival: float, lora,
                  response_id: str):
    """The beam search of `prompts` with the body's settings, stepped through engine jobs.
    max_tokens None (not asked, no generation_config.json cap): what the context leaves, as a
    plain request's and vLLM's (get_max_tokens): each prompt's beams end at the max-model-len.
    -> (search, its result, cached): cached is usage's prompt_tokens_details.cached_tokens, each
    prompt's tokens found in the prefix cache by its first step (the prompt's own request; later
    steps find the beams' own tokens too), summed over the prompts as a plain request's usage."""
    model = service.llm.generation_defaults
    temperature = body.temperature if body.temperature is not None else model.get("temperature", 1.0)
    try:
        room = service.engine.max_model_len - min(len(p) for p in prompts)
        params = BeamSearchParams(beam_width=body.n, max_tokens=max_tokens if max_tokens is not None else room,
                                  ignore_eos=body.ignore_eos, temperature=temperature,
                                  length_penalty=body.length_penalty,
                                  include_stop_str_in_output=body.include_stop_str_in_output)
    except ValueError as e:
        raise APIError(400, str(e), next((f for f in ("max_tokens", "temperature", "length_penalty") if f in str(e)),
                                         "n")) from None
    limit = service.engine.max_logprobs
    if limit >= 0 and 2 * params.beam_width > limit:     # each step reads 2 x width candidates per beam
        raise APIError(400, f"use_beam_search: n (the beam width) can be at most {limit // 2} here "
                            f"(--max-logprobs {limit}), got {params.beam_width}", "n")
    # a budget the request did not name (generation_config's cap) ends where the context does
    asked = getattr(body, "max_tokens", None) is not None or getattr(body, "max_completion_tokens", None) is not None
    service._check_prompts(prompts, SamplingParams(n=params.beam_width, max_tokens=max_tokens), "prompt", asked=asked)
    search = BeamSearch(prompts, params, set(service.tokenizer.eos_token_ids), service.engine.max_model_len,
                        lora_requests=[lora] * len(prompts))
    step = search.step_params()
    cached: int | None = None
    while todo := search.pending():
        entries: list = [None] * len(todo)
        aborted = False
        async with service.generation([b.tokens for _, b in todo], step, arrival, body.priority, lora,
                                      response_id, cache_salt=getattr(body, "cache_salt", None)) as gen:
            async for index, event in gen.steps():
                if event.logprobs:
                    entries[index] = event.logprobs[0]
                aborted |= event.finish_reason == "abort"
        if cached is None:
            first = [0] * len(prompts)
            for (p, _), stats in zip(todo, gen.stats):
                if stats is not None:
                    first[p] = max(first[p], stats.cached_tokens)
            cached = sum(first)
        if aborted:         # the server paused (POST /pause): the beams so far are the answer
            for _, beam in todo:
                beam.finish_reason = "abort"
            break
        search.advance(todo, entries)
    return search, search.result(service.tokenizer.decode), cached or 0


def _stop_reason(beam) -> int | None:
    """vLLM's server gives a beam that EOS ended the EOS id as its stop_reason (a plain request's
    EOS stop, and vLLM's offline LLM.beam_search, leave None); the beam's last token is that EOS."""
    return beam.tokens[-1] if beam.finish_reason == "stop" else None


def _answer(response_id: str, kind: str, model: str, choices: list, prompts, completion_tokens: int, cached: int,
            details: dict | None = None) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    return {"id": response_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens,
                      "prompt_tokens_details": {"cached_tokens": cached},
                      **({"completion_tokens_details": details} if details is not None else {})}}


_DONE = "data: [DONE]\n\n"


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
