"""vLLM's `use_beam_search` on /v1/completions: the n best beams of each prompt (n is the beam
width), through the same engine jobs as any request (specdec/beam_search.py's BeamSearch,
stepped here: each step's beams are one Generation), so beams batch with other traffic and a
client that leaves cancels them. Not streamed (the beams are known only at the end), as vLLM."""

from __future__ import annotations

import time
import uuid

from ..beam_search import BeamSearch, BeamSearchParams
from ..config import SamplingParams
from .errors import APIError


async def beam_completion(service, body, arrival: float, lora) -> dict:
    service._check_generates("Completions")
    if body.stream:
        raise APIError(400, "use_beam_search cannot be streamed (the beams are known only at the end)", "stream")
    if body.logprobs is not None or body.echo or body.best_of is not None:
        raise APIError(400, "use_beam_search does not combine with logprobs, echo or best_of", "use_beam_search")
    prompts = service._completion_prompts(body.prompt)
    model = service.llm.generation_defaults
    temperature = body.temperature if body.temperature is not None else model.get("temperature", 1.0)
    try:
        params = BeamSearchParams(beam_width=body.n, max_tokens=body.max_tokens if body.max_tokens is not None else 16,
                                  ignore_eos=body.ignore_eos, temperature=temperature,
                                  length_penalty=body.length_penalty,
                                  include_stop_str_in_output=body.include_stop_str_in_output)
    except ValueError as e:
        raise APIError(400, str(e), "n") from None
    service._check_prompts(prompts, SamplingParams(n=params.beam_width, max_tokens=params.max_tokens), "prompt")
    search = BeamSearch(prompts, params, set(service.tokenizer.eos_token_ids))
    step = search.step_params()
    while todo := search.pending():
        tops: list = [None] * len(todo)
        async with service.generation([b.tokens for _, b in todo], step, arrival, body.priority, lora) as gen:
            async for index, event in gen.steps():
                if event.logprobs:
                    tops[index] = event.logprobs[0].top
        search.advance(todo, tops)
    outputs = search.result(service.tokenizer.decode)
    choices, completion_tokens = [], 0
    for p, (prompt, out) in enumerate(zip(prompts, outputs)):
        for j, beam in enumerate(out.sequences):
            ids = search.output_ids(beam, len(prompt))
            completion_tokens += len(ids)
            choices.append({"index": p * params.beam_width + j, "text": service.tokenizer.decode(ids),
                            "logprobs": None, "finish_reason": beam.finish_reason, "stop_reason": None})
    prompt_tokens = sum(len(p) for p in prompts)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": service.model_name(lora), "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
