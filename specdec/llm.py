"""The Python API, in vLLM's shape: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from .config import SamplingParams, SpeculativeConfig
from .engine import Engine, StepEvent
from .metrics import RequestStats
from .model import CheckpointError, load_model
from .model.vocab_draft import is_vocab_draft, load_vocab_draft
from .proposers import build_proposer
from .tokenizer import Tokenizer, TokenizerError, first_vocab_mismatch

MODELS_DIR = Path(os.environ.get("SPECDEC_MODELS", Path(__file__).resolve().parent.parent / "models"))
DEFAULT_TARGET = MODELS_DIR / "target"
DEFAULT_DRAFT = MODELS_DIR / "draft"


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    stats: RequestStats = field(default_factory=RequestStats)


def _speculative(speculative_model, num_speculative_tokens, speculative_config) -> SpeculativeConfig | None:
    if speculative_config is not None:
        if isinstance(speculative_config, SpeculativeConfig):
            return speculative_config
        return SpeculativeConfig.from_dict(speculative_config)
    if speculative_model is None:
        return None
    if str(speculative_model) in ("[ngram]", "ngram"):
        return SpeculativeConfig(method="ngram", num_speculative_tokens=num_speculative_tokens or 4)
    return SpeculativeConfig(method="draft_model", model=str(speculative_model),
                             num_speculative_tokens=4 if num_speculative_tokens is None else num_speculative_tokens)


class LLM:
    """A target model, optionally with a speculative proposer.

    LLM(model=DIR, speculative_model=DIR, num_speculative_tokens=K) or
    LLM(model=DIR, speculative_config={"method": "draft_model", "model": DIR, "num_speculative_tokens": K}).
    With model=None the bundled target is used (and, given no speculative arguments at all,
    the bundled draft).
    """

    def __init__(self, model: str | os.PathLike | None = None, speculative_model: str | None = None,
                 num_speculative_tokens: int | str | None = None, speculative_config: dict | None = None,
                 dtype: str = "auto", device: str = "cpu", max_model_len: int | None = None,
                 seed: int | None = None, tokenizer: str | None = None):
        if model is None:
            model = DEFAULT_TARGET
            if speculative_model is None and speculative_config is None and num_speculative_tokens != 0:
                speculative_model = DEFAULT_DRAFT
        self.model_path = str(model)
        self.seed = seed
        self.spec = _speculative(speculative_model, num_speculative_tokens, speculative_config)
        self.dtype, self.device = dtype, device
        self.target = load_model(model, dtype, device)
        try:
            self.tokenizer = Tokenizer(tokenizer or model)
        except TokenizerError as e:
            raise CheckpointError(str(e)) from None
        if max_model_len is not None and not 1 < max_model_len <= self.target.config.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [2, {self.target.config.max_position_embeddings}], got {max_model_len}")
        max_len = max_model_len or self.target.config.max_position_embeddings
        proposer = None
        if self.spec is not None and self.spec.num_speculative_tokens != 0:
            proposer = build_proposer(self.spec, self.target, self._load_draft, max_len)
            draft = getattr(proposer, "model", None)
            if draft is not None and draft is not self.target:
                max_len = min(max_len, draft.config.max_position_embeddings)
        self.engine = Engine(self.target, self.tokenizer, proposer,
                             self.spec.num_speculative_tokens if self.spec else 0, max_len,
                             max_k=self.spec.max_k if self.spec else 8)
        self._counter = 0

    def _load_draft(self, folder: str):
        if is_vocab_draft(folder):      # a draft over a draft vocabulary, on the target's embeddings
            draft = load_vocab_draft(folder, self.target)
        else:
            draft = load_model(folder, self.dtype, self.device)
        try:
            draft_tok = Tokenizer(folder)
        except TokenizerError:
            draft_tok = None     # a draft folder without tokenizer files shares the target's
        if draft_tok is not None:
            bad = first_vocab_mismatch(self.tokenizer, draft_tok)
            if bad is not None:
                raise CheckpointError(
                    f"draft and target vocabularies differ at token id {bad}: target has "
                    f"{self.tokenizer.id_to_token(bad)!r}, draft has {draft_tok.id_to_token(bad)!r}")
        return draft

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return None, list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise ValueError("a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [...]}")

    def _params(self, params: SamplingParams | None) -> SamplingParams:
        params = params or SamplingParams()
        if params.seed is None and self.seed is not None and not params.greedy:
            import dataclasses
            params = dataclasses.replace(params, seed=self.seed + self._counter)
        return params

    def stream(self, prompt, sampling_params: SamplingParams | None = None, index: int = 0) -> Iterator[StepEvent]:
        """Yield a StepEvent per decoding step (new tokens and text) for one completion."""
        params = self._params(sampling_params)
        _, ids = self._prompt_ids(prompt)
        self._counter += 1
        return self.engine.generate(ids, params, seed_offset=index)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        single = isinstance(prompts, (str, dict))
        prompts = [prompts] if single else list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError("sampling_params must be one per prompt")
            plist = list(sampling_params)
        else:
            plist = [sampling_params] * len(prompts)
        results = []
        for prompt, params in zip(prompts, plist):
            params = self._params(params)
            text, ids = self._prompt_ids(prompt)
            self.engine.check_prompt(ids, params)
            stats, outputs = RequestStats(prompt_tokens=len(ids)), []
            for i in range(params.n):
                event, toks, parts = None, [], []
                for event in self.engine.generate(ids, params, seed_offset=i):
                    toks += event.token_ids
                    parts.append(event.text)
                outputs.append(CompletionOutput(i, "".join(parts), toks, event.finish_reason, event.stop_reason))
                stats.merge(event.stats)
            stats.prompt_tokens = len(ids)
            stats.time_to_first_token_s = event.stats.time_to_first_token_s
            results.append(RequestOutput(str(self._counter), text, ids, outputs, True, stats))
            self._counter += 1
        return results
