"""vLLM's module path for the outputs (`from vllm.outputs import RequestOutput, CompletionOutput`),
and how a streamed request's outputs are made from the engine's events.

RequestStream is vLLM v1's OutputProcessor for one request, shared by AsyncLLM.generate and the
LLMEngine view's step() (llm.llm_engine): SamplingParams.output_kind says what each output holds:
CUMULATIVE the completion so far (its logprobs and cumulative_logprob too), DELTA what is new
since the last output (the prompt's logprobs once, with the first), FINAL_ONLY one output at the
end with every completion in it. With n > 1 streamed each output holds the one completion that
moved (its `index` says which); the request is finished with the last.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from .config import RequestOutputKind, SamplingParams
from .logprobs import TokenLogprob
from .metrics import RequestStats

__all__ = ["RequestOutput", "CompletionOutput", "RequestStream"]


@dataclass
class CompletionOutput:
    """vLLM's, its fields in vLLM's order (cumulative_logprob and logprobs default to None here)."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # per output token, when SamplingParams.logprobs is set: vLLM's {token id: Logprob} (the token
    # and the most likely ones, with rank and decoded_token), also .token_id / .logprob / .top
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: object | None = None          # vLLM's: the request's LoRARequest, or None
    kv_transfer_params: dict | None = None      # vLLM's disaggregated prefill: always None here

    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput:
    """vLLM's RequestOutput, its constructor's arguments in vLLM's order and names (keywords it
    does not know are ignored with a warning, as vLLM's are, for code written for a newer one).
    metrics: specdec's RequestStats (timings, acceptance, and vLLM v1's RequestStateStats fields:
    arrival_time, queued_ts, ..., first_token_latency; also `.stats`, a fresh one when None);
    num_cached_tokens, when not given, is metrics.cached_tokens. encoder_prompt*: None
    (decoder-only models). prompt_logprobs: per prompt token (None for the first) its raw
    logprob and the prompt_logprobs most likely tokens at its position."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                 prompt_logprobs: list[TokenLogprob | None] | None = None, outputs: list[CompletionOutput] | None = None,
                 finished: bool = True, metrics: RequestStats | None = None, lora_request=None,
                 encoder_prompt: str | None = None, encoder_prompt_token_ids: list[int] | None = None,
                 num_cached_tokens: int | None = None, kv_transfer_params: dict | None = None, **kwargs):
        if kwargs:
            logging.getLogger("specdec").warning("RequestOutput: ignoring extra arguments: %s", sorted(kwargs))
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.outputs = outputs if outputs is not None else []
        self.finished = finished
        self.stats = metrics if metrics is not None else RequestStats()
        self.lora_request = lora_request
        self.encoder_prompt, self.encoder_prompt_token_ids = encoder_prompt, encoder_prompt_token_ids
        self._num_cached_tokens = num_cached_tokens
        self._kv_transfer_params = kv_transfer_params

    @property
    def metrics(self) -> RequestStats:
        """vLLM's name for a request's figures: specdec's RequestStats, which has vLLM v1's
        RequestStateStats fields (arrival_time, queued_ts, scheduled_ts, first_token_ts,
        last_token_ts, first_token_latency, num_generation_tokens, is_corrupted) besides its
        timings and acceptance."""
        return self.stats

    @metrics.setter
    def metrics(self, value: RequestStats) -> None:
        self.stats = value

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache (vLLM's RequestOutput.num_cached_tokens)."""
        return self.stats.cached_tokens if self._num_cached_tokens is None else self._num_cached_tokens

    @num_cached_tokens.setter
    def num_cached_tokens(self, value: int | None) -> None:
        self._num_cached_tokens = value

    @property
    def kv_transfer_params(self) -> dict | list[dict] | None:
        """vLLM's: the request's kv_transfer_params as given, else the completions' (one: its dict;
        several: a list; none: None)."""
        if self._kv_transfer_params is not None:
            return self._kv_transfer_params
        found = [c.kv_transfer_params for c in self.outputs if c.kv_transfer_params]
        return found[0] if len(found) == 1 else found or None

    @kv_transfer_params.setter
    def kv_transfer_params(self, value: dict | None) -> None:
        self._kv_transfer_params = value

    def add(self, next_output: "RequestOutput", aggregate: bool) -> None:
        """vLLM's: fold a later output of this request into this one. A completion of an index
        already here is extended by the new one's text, tokens and logprobs (aggregate: DELTA
        outputs) or replaced by it; a new index is appended."""
        self.finished |= next_output.finished
        for new in next_output.outputs:
            at = next((i for i, c in enumerate(self.outputs) if c.index == new.index), None)
            if at is None:
                self.outputs.append(new)
            elif not aggregate:
                self.outputs[at] = new
            else:
                c = self.outputs[at]
                c.text += new.text
                c.token_ids = [*c.token_ids, *new.token_ids]
                if new.logprobs:
                    c.logprobs = [*(c.logprobs or []), *new.logprobs]
                c.cumulative_logprob, c.finish_reason, c.stop_reason, c.kv_transfer_params = \
                    new.cumulative_logprob, new.finish_reason, new.stop_reason, new.kv_transfer_params

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
                f"prompt_token_ids={self.prompt_token_ids}, encoder_prompt={self.encoder_prompt!r}, "
                f"encoder_prompt_token_ids={self.encoder_prompt_token_ids}, prompt_logprobs={self.prompt_logprobs}, "
                f"outputs={self.outputs}, finished={self.finished}, metrics={self.metrics}, "
                f"lora_request={self.lora_request}, num_cached_tokens={self.num_cached_tokens})")


@dataclass
class _Choice:
    """One completion's output so far."""
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stats: RequestStats | None = None
    sent_tokens: int = 0                 # DELTA: what the last output already carried
    sent_text: int = 0


def logprob_namer(params: SamplingParams, token_name: Callable[[int], str]) -> Callable:
    """A logprob entry (or None) with its tokens' texts as decoded_token; with detokenize=False
    as it is, as vLLM's request without a tokenizer leaves decoded_token None."""
    if not params.detokenize:
        return lambda e: e
    return lambda e: None if e is None else e.named(token_name)


class RequestStream:
    """One request's n completions, fed its engine events (add, abort), giving its RequestOutputs
    (outputs: what the events since the last call make, by params.output_kind).
    token_name: a token id's text (the Logprob entries' decoded_token; none with detokenize=False,
    as vLLM's request without a tokenizer has)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 token_name: Callable[[int], str], lora_request=None):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.params, self.token_name, self.lora_request = params, token_name, lora_request
        self._name = logprob_namer(params, token_name)
        self.choices = [_Choice(i, logprobs=[] if params.logprobs is not None else None) for i in range(params.n)]
        self.open = set(range(params.n))          # the choices not finished yet
        self.prompt_logprobs = None
        self._prompt_logprobs_sent = False
        self._moved: set[int] = set()

    @property
    def finished(self) -> bool:
        return not self.open

    def add(self, index: int, event) -> None:
        """A StepEvent of choice `index` (one that finished already is ignored)."""
        if index not in self.open:
            return
        c = self.choices[index]
        c.token_ids += event.token_ids
        c.text += event.text
        if c.logprobs is not None and event.logprobs:
            c.logprobs += [self._name(e) for e in event.logprobs]
        if event.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [self._name(e) for e in event.prompt_logprobs]
        c.stats = event.stats
        if event.finished:
            c.finish_reason, c.stop_reason = event.finish_reason, event.stop_reason
            self.open.discard(index)
        self._moved.add(index)

    def abort(self) -> None:
        """Every open choice ends now (finish_reason "abort")."""
        for i in self.open:
            self.choices[i].finish_reason = "abort"
        self._moved |= self.open
        self.open.clear()

    def outputs(self) -> list[RequestOutput]:
        """The outputs of what moved since the last call: FINAL_ONLY one at the end (every choice
        in it); n > 1 streamed one per choice that moved, holding that choice alone, the request
        finished with the last (vLLM v1's ParentRequest); else one."""
        kind = self.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and self.open:
            return []
        moved, self._moved = self._moved, set()
        groups = [{i} for i in sorted(moved)] if self.params.n > 1 and kind != RequestOutputKind.FINAL_ONLY \
            else [moved] if moved else []
        outs = []
        for j, group in enumerate(groups):
            # DELTA: the prompt's logprobs come once, with the first output (vLLM's)
            lps = None if kind == RequestOutputKind.DELTA and self._prompt_logprobs_sent else self.prompt_logprobs
            self._prompt_logprobs_sent |= self.prompt_logprobs is not None
            outs.append(self._output(group, not self.open and j == len(groups) - 1, lps))
        return outs

    def _output(self, moved: set[int], finished: bool, prompt_logprobs) -> RequestOutput:
        kind = self.params.output_kind
        outputs = []
        for c in self.choices if kind == RequestOutputKind.FINAL_ONLY else (self.choices[i] for i in sorted(moved)):
            toks, txt, lps = c.token_ids, c.text, c.logprobs
            if kind == RequestOutputKind.DELTA:
                toks, txt = toks[c.sent_tokens:], txt[c.sent_text:]
                lps = lps[c.sent_tokens:] if lps is not None else None
                c.sent_tokens, c.sent_text = len(c.token_ids), len(c.text)
            cumulative = sum(e.logprob for e in c.logprobs) if c.logprobs is not None else None
            outputs.append(CompletionOutput(c.index, txt, list(toks), cumulative, list(lps) if lps is not None else None,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        stats = RequestStats()
        for c in self.choices:
            if c.stats is not None:
                stats.merge(c.stats)
        stats.prompt_tokens = len(self.prompt_token_ids)
        # the prompt's cached tokens once (the most any choice found), not summed over the choices (LLM's)
        stats.cached_tokens = max((c.stats.cached_tokens for c in self.choices if c.stats is not None), default=0)
        if self.choices[0].stats is not None:     # the request's own latencies: its first choice's (LLM's)
            stats.time_to_first_token_s = self.choices[0].stats.time_to_first_token_s
            stats.queue_time_s = self.choices[0].stats.queue_time_s
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             prompt_logprobs=prompt_logprobs, outputs=outputs, finished=finished, metrics=stats,
                             lora_request=self.lora_request)
