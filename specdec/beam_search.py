"""Beam search: vLLM's `LLM.beam_search(prompts, BeamSearchParams(beam_width, max_tokens))`.

As vLLM runs it, on top of the engine rather than inside it: each step every live beam is one
request for a single token with its 2 x beam_width most likely next tokens and their
log-probabilities (the greedy distribution, or the temperature's); the beam_width best of all
extensions by cumulative log-probability live on, those ending in an end-of-sequence token
(unless ignore_eos) are set aside as finished. At the end the finished and the live beams are
ranked by cum_logprob / len ** length_penalty (len: prompt and output tokens, the EOS not
counted), and the beam_width best are returned, best first. All beams of all prompts of a step
run as one batch. Prefix caching (on unless the LLM was built with enable_prefix_caching=False)
serves the shared prefixes from its cache; without it the prompt is prefilled again each step.
A beam that fills the context (max_model_len tokens, prompt and output) cannot be extended: it
is set aside as finished (finish_reason "length") and ranked with the others at the end, as
vLLM's loop completes a beam whose step came back empty at the max-model-len.
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


class BeamSearch:
    """The search over several prompts, one step at a time, whoever runs the steps (the offline
    LLM, or the server's engine jobs): `pending()` lists the beams to extend, `advance(tops)`
    takes each one's (token, log-probability) candidates, `result(decode)` ranks the end."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos: set[int],
                 max_model_len: int | None = None):
        """max_model_len: the context's length; a beam that long is finished (None: no limit)."""
        self.prompts, self.params, self.eos = [list(p) for p in prompts], params, eos
        self.max_model_len = max_model_len
        self.live = [[BeamSearchSequence(list(p))] for p in prompts]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0

    def step_params(self) -> SamplingParams:
        """One token with the 2 x width likeliest next tokens (greedy: the unscaled distribution)."""
        return SamplingParams(temperature=self.params.temperature, max_tokens=1, logprobs=2 * self.params.beam_width,
                              ignore_eos=True, seed=0 if self.params.temperature > 0 else None)

    def pending(self) -> list[tuple[int, BeamSearchSequence]]:
        """The beams to extend this step; those that fill the context are finished first."""
        if self.steps >= self.params.max_tokens:
            return []
        if self.max_model_len is not None:
            for i, beams in enumerate(self.live):
                full = [b for b in beams if len(b.tokens) >= self.max_model_len]
                for b in full:
                    b.finish_reason = "length"
                    self.done[i].append(b)
                self.live[i] = [b for b in beams if len(b.tokens) < self.max_model_len]
        return [(i, b) for i, beams in enumerate(self.live) for b in beams]

    def advance(self, todo: list[tuple[int, BeamSearchSequence]], tops: list) -> None:
        grown: list[list[BeamSearchSequence]] = [[] for _ in self.prompts]
        for (i, beam), top in zip(todo, tops):
            for tok, lp in top:
                new = BeamSearchSequence(beam.tokens + [tok], beam.logprobs + [lp], beam.cum_logprob + lp)
                if tok in self.eos and not self.params.ignore_eos:
                    new.finish_reason = "stop"
                    self.done[i].append(new)
                else:
                    grown[i].append(new)
        self.live = [sorted(g, key=lambda b: b.cum_logprob, reverse=True)[:self.params.beam_width] for g in grown]
        self.steps += 1

    def result(self, decode) -> list[BeamSearchOutput]:
        """decode(token ids) -> text. Each prompt's width best beams, best first; `text` is the
        prompt's and the output's (vLLM's), without the EOS unless include_stop_str_in_output."""
        out = []
        for i, prompt in enumerate(self.prompts):
            for b in self.live[i]:
                b.finish_reason = b.finish_reason or "length"
            best = sorted(self.done[i] + self.live[i], key=lambda b: beam_score(b, self.eos, self.params.length_penalty),
                          reverse=True)[:self.params.beam_width]
            for b in best:
                b.text = decode(prompt + self.output_ids(b, len(prompt)))
            out.append(BeamSearchOutput(best))
        return out

    def output_ids(self, beam: BeamSearchSequence, prompt_len: int) -> list[int]:
        ids = beam.tokens[prompt_len:]
        return ids[:-1] if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output else ids


def beam_search(llm, prompts: list[list[int]], params: BeamSearchParams, lora_request=None,
                progress=None) -> list[BeamSearchOutput]:
    """The offline search: each step's beams through llm.generate as one batch (lora_request: one
    for every prompt, or one per prompt; progress: called once per step)."""
    loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
    search = BeamSearch(prompts, params, set(llm.tokenizer.eos_token_ids), llm.engine.max_model_len)
    while todo := search.pending():
        outs = llm.generate([{"prompt_token_ids": b.tokens} for _, b in todo], search.step_params(),
                            lora_request=[loras[i] for i, _ in todo])
        search.advance(todo, [o.outputs[0].logprobs[0].top for o in outs])
        if progress is not None:
            progress()
    return search.result(lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=True))
