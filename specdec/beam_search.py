"""Beam search: vLLM's `LLM.beam_search(prompts, BeamSearchParams(beam_width, max_tokens))`.

As vLLM runs it, on top of the engine rather than inside it: each step every live beam is one
request for a single token with its 2 x beam_width most likely next tokens and their
log-probabilities (as logprobs_mode reports them: with the default raw_logprobs the model's own
distribution, which temperature does not change; a logits mode: the logits, summed as vLLM
sums them, whatever their sign); the beam_width best of all
extensions by cumulative log-probability live on, those ending in an end-of-sequence token
(unless ignore_eos) are set aside as finished. At the end the finished and the live beams are
ranked by cum_logprob / len ** length_penalty (len: prompt and output tokens, the EOS not
counted), and the beam_width best are returned, best first. All beams of all prompts of a step
run as one batch. Prefix caching (on unless the LLM was built with enable_prefix_caching=False)
serves the shared prefixes from its cache; without it the prompt is prefilled again each step.
A beam that fills the context (max_model_len tokens, prompt and output) cannot be extended: it
is set aside as finished (finish_reason "length") and ranked with the others at the end, as
vLLM's loop completes a beam whose step came back empty at the max-model-len.
With no end-of-sequence token among the candidates (ignore_eos, or none comes up) the beams are
transformers' generate(num_beams=...)'s; with one, vLLM's rules (every EOS beam among the 2 x width
candidates kept, the length counting the prompt) and transformers' (the output's length, its own
stopping rule) pick different beams, and this follows vLLM's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .config import SamplingParams
from .logprobs import Logprob


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
        if not math.isfinite(self.length_penalty):      # before the search: it is read only at the end
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty}")


@dataclass
class BeamSearchSequence:
    """One beam, vLLM's fields in vLLM's order. `tokens`: the prompt's and the output's ids;
    `logprobs`: per output token, its step's {token id: Logprob} (the token chosen and the step's
    2 x width candidates, as vLLM keeps them: `seq.logprobs[i][tok].logprob`); `lora_request`:
    the adapter the beam ran with; `text`: decode(tokens) with the tokenizer's defaults (vLLM's
    offline text: the prompt's and the output's, special tokens and an EOS kept). finish_reason
    ("stop": an EOS ended it; "length") is what vLLM's server reports of a beam; stop_reason stays
    None, as vLLM's LLM.beam_search leaves it (the server reports the EOS id, as vLLM's)."""
    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos: set[int], length_penalty: float) -> float:
    """vLLM's cum_logprob / len ** length_penalty, through logs where len ** length_penalty leaves
    the floats (length_penalty 400 on 6 tokens, -110 on 1,000): then +-inf or +-0.0 at worst.
    Ranking uses _rank, whose order these floats can lose."""
    try:
        return beam.cum_logprob / (_length(beam, eos) ** length_penalty)
    except (OverflowError, ZeroDivisionError):
        sign, key = _rank(beam, eos, length_penalty)
        log = sign * key                                  # log |score|
        return sign * (math.inf if log > 709 else math.exp(log))


def _length(beam: BeamSearchSequence, eos: set[int]) -> int:
    return len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in eos else 0)


def _rank(beam: BeamSearchSequence, eos: set[int], length_penalty: float) -> tuple[int, float]:
    """A key in beam_score's order for every finite length_penalty and either sign of cum_logprob
    (a logits logprobs_mode sums logits, often positive): the score's sign, then log(score) where it
    is positive, -log(-score) where negative; log |score| = log |cum_logprob| - length_penalty *
    log(len) stays finite where the score itself overflows or rounds to 0."""
    cum = beam.cum_logprob
    if cum == 0:
        return 0, 0.0
    sign = 1 if cum > 0 else -1
    return sign, sign * (math.log(abs(cum)) - length_penalty * math.log(_length(beam, eos)))


class BeamSearch:
    """The search over several prompts, one step at a time, whoever runs the steps (the offline
    LLM, or the server's engine jobs): `pending()` lists the beams to extend, `advance(todo,
    entries)` takes each one's step logprobs, `result(decode)` ranks the end."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos: set[int],
                 max_model_len: int | None = None, lora_requests: list | None = None):
        """max_model_len: the context's length; a beam that long is finished (None: no limit).
        lora_requests: one per prompt (None: the base model), carried by its beams."""
        self.prompts, self.params, self.eos = [list(p) for p in prompts], params, eos
        self.max_model_len = max_model_len
        loras = lora_requests if lora_requests is not None else [None] * len(prompts)
        self.live = [[BeamSearchSequence(list(p), lora_request=lora)] for p, lora in zip(prompts, loras)]
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

    def advance(self, todo: list[tuple[int, BeamSearchSequence]], entries: list) -> None:
        """entries: each pending beam's step logprobs (a TokenLogprob: the 2 x width likeliest in
        `.top`, and a {token id: Logprob} mapping); a beam whose entry is None ends, as vLLM drops it."""
        grown: list[list[BeamSearchSequence]] = [[] for _ in self.prompts]
        for (i, beam), entry in zip(todo, entries):
            if entry is None:
                continue
            # the step's {token id: Logprob}, one dict shared by the beam's children (as vLLM's)
            step = dict(entry) if isinstance(entry, Mapping) else \
                {t: Logprob(lp, r + 1) for r, (t, lp) in enumerate(entry.top)}
            for tok, lp in entry.top:
                new = BeamSearchSequence(beam.tokens + [tok], beam.logprobs + [step], beam.lora_request,
                                         beam.cum_logprob + lp)
                if tok in self.eos and not self.params.ignore_eos:
                    new.finish_reason = "stop"
                    self.done[i].append(new)
                else:
                    grown[i].append(new)
        self.live = [sorted(g, key=lambda b: b.cum_logprob, reverse=True)[:self.params.beam_width] for g in grown]
        self.steps += 1

    def result(self, decode) -> list[BeamSearchOutput]:
        """decode(token ids) -> text. Each prompt's width best beams, best first; `text` is
        decode(tokens), vLLM's (output_ids gives what a server's choice shows)."""
        out = []
        for i in range(len(self.prompts)):
            for b in self.live[i]:
                b.finish_reason = b.finish_reason or "length"
            best = sorted(self.done[i] + self.live[i], key=lambda b: _rank(b, self.eos, self.params.length_penalty),
                          reverse=True)[:self.params.beam_width]
            for b in best:
                b.text = decode(b.tokens)
            out.append(BeamSearchOutput(best))
        return out

    def output_ids(self, beam: BeamSearchSequence, prompt_len: int) -> list[int]:
        ids = beam.tokens[prompt_len:]
        return ids[:-1] if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output else ids


def beam_search(llm, prompts: list[list[int]], params: BeamSearchParams, lora_request=None,
                progress=None, cache_salts: list[str | None] | None = None) -> list[BeamSearchOutput]:
    """The offline search: each step's beams through llm.generate as one batch (lora_request: one
    for every prompt, or one per prompt; progress: called once per step; cache_salts: each
    prompt's cache_salt or None, which its beams' requests keep, as the server's do)."""
    loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
    salts = cache_salts or [None] * len(prompts)
    search = BeamSearch(prompts, params, set(llm.tokenizer.eos_token_ids), llm.engine.max_model_len, list(loras))
    while todo := search.pending():
        asks = [{"prompt_token_ids": b.tokens} if salts[i] is None else
                {"prompt_token_ids": b.tokens, "cache_salt": salts[i]} for i, b in todo]
        outs = llm.generate(asks, search.step_params(),
                            lora_request=[b.lora_request for _, b in todo])
        search.advance(todo, [o.outputs[0].logprobs[0] if o.outputs[0].logprobs else None for o in outs])
        if progress is not None:
            progress()
    return search.result(llm.tokenizer.decode)       # vLLM's tokenizer.decode(beam.tokens)
