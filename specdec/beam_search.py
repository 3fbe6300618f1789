"""Beam search: vLLM's `LLM.beam_search(prompts, BeamSearchParams(beam_width, max_tokens))`.

As vLLM runs it, on top of the engine rather than inside it: each step every live beam is one
request for a single token with its 2 x beam_width most likely next tokens and their
log-probabilities (the greedy distribution, or the temperature's); the beam_width best of all
extensions by cumulative log-probability live on, those ending in an end-of-sequence token
(unless ignore_eos) are set aside as finished. At the end the finished and the live beams are
ranked by cum_logprob / len ** length_penalty (len: prompt and output tokens, the EOS not
counted), and the beam_width best are returned, best first. All beams of all prompts of a step
run as one batch. The prompt is prefilled again each step unless the LLM was built with
enable_prefix_caching=True, which then serves the shared prefixes from its cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` holds the prompt's and the output's ids (vLLM's), `text` their text."""
    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos: set[int], length_penalty: float) -> float:
    n = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in eos else 0)
    return beam.cum_logprob / (n ** length_penalty)


def beam_search(llm, prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    eos = set(llm.tokenizer.eos_token_ids)
    width = params.beam_width
    step = SamplingParams(temperature=params.temperature, max_tokens=1, logprobs=2 * width, ignore_eos=True,
                          seed=0 if params.temperature > 0 else None)
    live = [[BeamSearchSequence(list(p))] for p in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        todo = [(i, b) for i, beams in enumerate(live) for b in beams]
        if not todo:
            break
        outs = llm.generate([{"prompt_token_ids": b.tokens} for _, b in todo], step)
        grown: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, beam), out in zip(todo, outs):
            for tok, lp in out.outputs[0].logprobs[0].top:
                new = BeamSearchSequence(beam.tokens + [tok], beam.logprobs + [lp], beam.cum_logprob + lp)
                if tok in eos and not params.ignore_eos:
                    new.finish_reason = "stop"
                    done[i].append(new)
                else:
                    grown[i].append(new)
        live = [sorted(g, key=lambda b: b.cum_logprob, reverse=True)[:width] for g in grown]
    results = []
    for i, prompt in enumerate(prompts):
        for b in live[i]:
            b.finish_reason = b.finish_reason or "length"
        best = sorted(done[i] + live[i], key=lambda b: beam_score(b, eos, params.length_penalty), reverse=True)[:width]
        for b in best:
            out = b.tokens[len(prompt):]
            if b.finish_reason == "stop" and not params.include_stop_str_in_output:
                out = out[:-1]
            b.text = llm.tokenizer.decode(prompt + out)
        results.append(BeamSearchOutput(best))
    return results
