"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: the n best beams of each prompt (n is the beam
width), through the same engine jobs as any request (specdec/beam_search.py's BeamSearch,
stepped here: each step's beams are one Generation), so beams batch with other traffic and a
client that leaves cancels them. Not streamed (the beams are known only at the end), as vLLM."""

from __future__ import annotations

import time

from ..beam_search import BeamSearch, BeamSearchParams
from ..config import SamplingParams
from .errors import APIError
from .fields import structured_outputs


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
    search, outputs = await _search(service, body, prompts, sampling.max_tokens, arrival, lora, response_id)
    choices, completion_tokens = [], 0
    for p, (prompt, out) in enumerate(zip(prompts, outputs)):
        for j, beam in enumerate(out.sequences):
            ids = search.output_ids(beam, len(prompt))
            completion_tokens += len(ids)
            choices.append({"index": p * search.params.beam_width + j, "text": service.tokenizer.decode(ids, skip_special_tokens=True),
                            "logprobs": None, "finish_reason": beam.finish_reason, "stop_reason": None,
                            **({"token_ids": list(ids), "prompt_token_ids": list(prompt)} if body.return_token_ids
                               else {})})
    return _answer(response_id, "text_completion", service.model_name(lora, body.model), choices, prompts,
                   completion_tokens)


async def beam_chat(service, body, arrival: float, lora, response_id: str) -> dict:
    """use_beam_search on /v1/chat/completions: the beams of the rendered conversation, each a
    plain assistant message (no tools, reasoning split or structured outputs with it); with
    echo, the last message (when it has the reply's role) put before each, as vLLM's chat does
    for every choice, beams included."""
    if body.tools or body.logprobs or body.best_of is not None:
        raise APIError(400, "use_beam_search does not combine with tools, logprobs or best_of", "use_beam_search")
    prompts, sampling, _ = await service.off_loop(service.prepare_chat, body)
    if sampling.structured_outputs is not None:
        raise APIError(400, "use_beam_search does not combine with structured outputs", "use_beam_search")
    # prepare_chat's: the request's max_completion_tokens / max_tokens under generation_config.json's cap
    search, outputs = await _search(service, body, prompts, sampling.max_tokens, arrival, lora, response_id)
    echo = service.chat_echo(body) or ""
    choices, completion_tokens = [], 0
    for j, beam in enumerate(outputs[0].sequences):
        ids = search.output_ids(beam, len(prompts[0]))
        completion_tokens += len(ids)
        choices.append({"index": j, "message": {"role": service.config.response_role,
                                                "content": echo + service.tokenizer.decode(ids, skip_special_tokens=True)},
                        "logprobs": None, "finish_reason": beam.finish_reason, "stop_reason": None,
                        **({"token_ids": list(ids)} if body.return_token_ids else {})})
    answer = _answer(response_id, "chat.completion", service.model_name(lora, body.model), choices, prompts,
                     completion_tokens)
    if body.return_token_ids:            # vLLM's: the prompt's ids beside the choices
        answer["prompt_token_ids"] = list(prompts[0])
    return answer


async def _search(service, body, prompts: list[list[int]], max_tokens: int | None, arrival: float, lora,
                  response_id: str):
    """The beam search of `prompts` with the body's settings, stepped through engine jobs."""
    if body.stream:
        raise APIError(400, "use_beam_search cannot be streamed (the beams are known only at the end)", "stream")
    model = service.llm.generation_defaults
    temperature = body.temperature if body.temperature is not None else model.get("temperature", 1.0)
    try:
        params = BeamSearchParams(beam_width=body.n, max_tokens=max_tokens if max_tokens is not None else 16,
                                  ignore_eos=body.ignore_eos, temperature=temperature,
                                  length_penalty=body.length_penalty,
                                  include_stop_str_in_output=body.include_stop_str_in_output)
    except ValueError as e:
        raise APIError(400, str(e), "max_tokens" if "max_tokens" in str(e) else
                       "temperature" if "temperature" in str(e) else "n") from None
    limit = service.engine.max_logprobs
    if limit >= 0 and 2 * params.beam_width > limit:     # each step reads 2 x width candidates per beam
        raise APIError(400, f"use_beam_search: n (the beam width) can be at most {limit // 2} here "
                            f"(--max-logprobs {limit}), got {params.beam_width}", "n")
    service._check_prompts(prompts, SamplingParams(n=params.beam_width, max_tokens=params.max_tokens), "prompt")
    search = BeamSearch(prompts, params, set(service.tokenizer.eos_token_ids), lora_requests=[lora] * len(prompts))
    step = search.step_params()
    while todo := search.pending():
        entries: list = [None] * len(todo)
        aborted = False
        async with service.generation([b.tokens for _, b in todo], step, arrival, body.priority, lora,
                                      response_id, cache_salt=getattr(body, "cache_salt", None)) as gen:
            async for index, event in gen.steps():
                if event.logprobs:
                    entries[index] = event.logprobs[0]
                aborted |= event.finish_reason == "abort"
        if aborted:         # the server paused (POST /pause): the beams so far are the answer
            for _, beam in todo:
                beam.finish_reason = "abort"
            break
        search.advance(todo, entries)
    return search, search.result(service.tokenizer.decode)


def _answer(response_id: str, kind: str, model: str, choices: list, prompts, completion_tokens: int) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    return {"id": response_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
