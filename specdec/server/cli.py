"""`specdec serve ...` and `python -m specdec.entrypoints.openai.api_server ...`: vLLM's command line.

vLLM flags that mean nothing here (--gpu-memory-utilization 0.9, --swap-space 4, ...: vllm_flags.VLLM_FLAGS)
are accepted with a warning, so an existing vLLM command line works with only the module name
changed; any other unknown flag (a typo such as --max-num-seq) is an error, as in vLLM. Flag names
may be spelt with underscores (--max_model_len), as vLLM's parser allows. A model that cannot
load, or a --device this machine lacks, fails before the port opens, with one line and status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from ..cli import (_is_number, _json_list, add_engine_args, add_legacy_speculative_args, add_model_args,
                   check_device, expand_argv, fold_legacy_speculative, help_keyword, keyword_help, llm_from_args)
from ..cli import positive_int as _positive
from ..tokenizer import load_chat_template
from .control import dev_mode
from .lora import parse_lora_module, runtime_updating_allowed
from ..vllm_flags import _switch, _takes_many, bool_value, check_refused, ignored_flags



def add_parser(sub) -> None:
    """Register `serve`. Its flags are parsed by build_parser() in run(), which tolerates vLLM's
    unknown ones; a strict subparser would reject them before run() is reached."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (vLLM's flags)", add_help=False,
                       prefix_chars="\x00")      # no option syntax: every word lands in `argv`
    p.add_argument("argv", nargs=argparse.REMAINDER)


def _log_config(path: str | None) -> dict | None:
    """--log-config-file's JSON, checked now (before the model loads) by logging itself."""
    if not path:
        return None
    import copy
    import json
    import logging.config

    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as e:
        raise ValueError(f"--log-config-file {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--log-config-file {path}: not JSON ({e})") from None
    if not isinstance(config, dict) or "version" not in config:
        raise ValueError(f"--log-config-file {path}: a logging.config.dictConfig object with a 'version' key")
    try:
        logging.config.dictConfig(copy.deepcopy(config))
    except (ValueError, TypeError, AttributeError, ImportError) as e:
        raise ValueError(f"--log-config-file {path}: {e}") from None
    return config


def _json_obj_arg(value: str) -> dict:
    import json

    try:
        obj = json.loads(value)
    except json.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {value!r}")
    return obj


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {value!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {port}")
    return port


def _env_key() -> str | None:
    """--api-key's default: $SPECDEC_API_KEY, else vLLM's $VLLM_API_KEY; an empty variable is none."""
    return os.environ.get("SPECDEC_API_KEY") or os.environ.get("VLLM_API_KEY") or None


def bind_socket(host: str, port: int, uds: str | None = None):
    """The listening socket, bound now (before the model loads, as vLLM binds before building its
    engine): a port in use or an address this machine lacks is a one-line ValueError. uds: a Unix
    domain socket's path instead (vLLM's --uds; a stale socket file there is replaced)."""
    import socket
    import stat

    if uds is not None:
        if os.path.exists(uds) and stat.S_ISSOCK(os.stat(uds).st_mode):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                try:
                    probe.connect(uds)
                except OSError:         # nobody listens: a stale socket of a server that died
                    os.unlink(uds)
                else:
                    raise ValueError(f"cannot listen on {uds}: a server is listening there already")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        where = uds
    else:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        where = f"{host}:{port}"
    try:
        sock.bind(uds if uds is not None else (host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {where}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def build_parser(prog: str = "specdec serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, allow_abbrev=False, usage=f"{prog} [MODEL] [options]",
                                description="OpenAI-compatible server with speculative decoding. MODEL, "
                                            "first or after the options (as in `vllm serve MODEL`), is the same as --model.")
    add_model_args(p)
    add_engine_args(p)
    add_legacy_speculative_args(p)
    p.add_argument("--config-model", help=argparse.SUPPRESS)      # --config's `model` (a MODEL given here wins)
    p.add_argument("--served-model-name", nargs="+", help="name(s) clients use in `model` (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only, where vLLM's "
                                                           "binds every interface: --host 0.0.0.0 for a container)")
    p.add_argument("--port", type=_port, default=8000, help="the port to listen on (default 8000); bound before the "
                                                              "model loads, so a port in use fails at once")
    p.add_argument("--api-key", nargs="+", default=_env_key(),
                   help="require `Authorization: Bearer KEY` on /v1/*, /v2/*, /invocations and the control routes that "
                        "change state (POST /pause, /resume and the dev-mode routes); several keys: any "
                        "of them (vLLM's, to rotate keys) (default: $SPECDEC_API_KEY, else vLLM's $VLLM_API_KEY; "
                        "an empty one is no key)")
    p.add_argument("--seed", type=_seed, default=0,
                   help="seeds sampling requests that bring no seed of their own, in the order they reach the engine: seed, seed + 16, "
                        "... (default 0, as vLLM's: a run reproduces, two requests never share draws); none: "
                        "fresh randomness (suffix decoding's response cache then serves unseeded sampling too)")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--chat-template", help="a Jinja chat template file, or the template itself, used instead of "
                                           "the tokenizer's (a request's own chat_template still wins)")
    p.add_argument("--response-role", default="assistant", help="the role chat responses name (default: assistant)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats lines in the log (vLLM's: every VLLM_LOG_STATS_INTERVAL seconds, default 10, "
                        "throughput, requests running and waiting, KV cache usage, prefix cache hit rate and "
                        "the SpecDecoding metrics)")
    p.add_argument("--allowed-origins", type=_json_list, default=["*"], help='CORS origins, JSON (default ["*"])')
    p.add_argument("--allowed-methods", type=_json_list, default=["*"], help='CORS methods, JSON (default ["*"])')
    p.add_argument("--allowed-headers", type=_json_list, default=["*"], help='CORS headers, JSON (default ["*"])')
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument("--root-path", default="", help="the path prefix a proxy serves the app under")
    p.add_argument("--ssl-keyfile", help="serve HTTPS with this private key (PEM)")
    p.add_argument("--ssl-certfile", help="... and this certificate (PEM)")
    p.add_argument("--ssl-ca-certs", help="CA certificates for client certificates (PEM)")
    p.add_argument("--ssl-cert-reqs", type=int, choices=(0, 1, 2), default=0,
                   help="whether clients must show a certificate (Python's ssl.CERT_*: 0 none, 1 optional, 2 required)")
    p.add_argument("--ssl-ciphers", default=None, help="the TLS ciphers to allow (OpenSSL's cipher list; uvicorn's)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='logprobs name tokens "token_id:<id>" (a request may say otherwise)')
    p.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc or /openapi.json")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="run a chat_template sent with a request (default: refused with 400; a template is code)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": the model calls tools on its own, read by --tool-call-parser')
    p.add_argument("--tool-call-parser", help="the format of the model's tool calls: hermes (Hermes 2 Pro / 3, "
                                              "Qwen2.5), llama3_json (Llama 3.1 / 3.2), pythonic (Llama 3.2 / 4 "
                                              "pythonic templates), mistral (Mistral 7B v0.3+), openai (gpt-oss's harmony calls)")
    p.add_argument("--exclude-tools-when-tool-choice-none", action=argparse.BooleanOptionalAction, default=False,
                   help='vLLM\'s: with tool_choice "none" the tools are left out of the chat template')
    p.add_argument("--reasoning-parser", help="return a reasoning model's <think> block as reasoning_content: "
                                              "deepseek_r1 (DeepSeek-R1 and its distills), qwen3 (Qwen3, QwQ), "
                                              "openai_gptoss (gpt-oss's harmony channels; the default for gpt-oss)")
    p.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="log each request: its prompt, sampling parameters, and how it ended (vLLM's flag)")
    p.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                   help="the older vLLM spelling of --no-enable-log-requests (the default)")
    p.add_argument("--enable-log-outputs", action=argparse.BooleanOptionalAction, default=False,
                   help="with --enable-log-requests: also log each completion's output text, token ids and "
                        "finish reason as it ends (vLLM's flag)")
    p.add_argument("--max-log-len", type=_positive,
                   help="with --enable-log-requests: at most this many prompt characters and token ids per line")
    p.add_argument("--enable-request-id-headers", action=argparse.BooleanOptionalAction, default=False,
                   help="every response carries X-Request-Id: the request's own, or a new one (vLLM's flag); "
                        "completion ids (cmpl-<id>, chatcmpl-<id>) and --enable-log-requests lines use it")
    p.add_argument("--middleware", action="append", default=[],
                   help="vLLM's: the import path of an ASGI middleware class (app.add_middleware) or of an async HTTP "
                        "middleware function f(request, call_next), added around the app; repeat the flag for several")
    p.add_argument("--default-chat-template-kwargs", type=_json_obj_arg, default=None,
                   help="vLLM's: a JSON object of chat template variables every chat request gets, under its own "
                        "chat_template_kwargs (e.g. '{\"enable_thinking\": false}')")
    p.add_argument("--chat-template-content-format", choices=["auto", "string", "openai"], default="auto",
                   help="vLLM's: a message's content reaches the chat template as its text (string) or as OpenAI's "
                        "list of text parts (openai); auto (default): parts for a template that loops over them")
    p.add_argument("--log-config-file", default=os.environ.get("VLLM_LOGGING_CONFIG_PATH"),
                   help="vLLM's: a JSON logging configuration (logging.config.dictConfig's schema) for specdec's and "
                        "uvicorn's loggers (default: $VLLM_LOGGING_CONFIG_PATH)")
    p.add_argument("--uds", default=None, help="vLLM's: listen on this Unix domain socket instead of --host/--port")
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="vLLM's: no uvicorn access log line per request")
    p.add_argument("--disable-access-log-for-endpoints", type=lambda v: tuple(x.strip() for x in v.split(",") if x.strip()),
                   default=(), help="vLLM's: comma-separated paths whose access log lines are dropped, e.g. "
                                    "/health,/metrics,/ping")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="vLLM's: GET /tokenizer_info answers the tokenizer's configuration (special tokens, "
                        "tokenizer_config.json's keys, the chat template in use)")
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="vLLM's: every stream ends with a usage chunk, as if it asked stream_options.include_usage")
    p.add_argument("--metrics-prefix", choices=["specdec", "vllm"], default="specdec",
                   help="the name prefix of /metrics' families: specdec (specdec:num_requests_running, ...) or vllm "
                        "(vllm:num_requests_running, ...: vLLM's Grafana dashboard and alerts read the server "
                        "unchanged); default specdec")
    p.add_argument("--enable-server-load-tracking", action=argparse.BooleanOptionalAction, default=False,
                   help="GET /load answers {\"server_load\": the requests running the model} (vLLM's flag)")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    lora = p.add_argument_group("LoRA adapters (vLLM's flags; a request names one in `model`)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters beside the base model")
    lora.add_argument("--lora-modules", nargs="+", action="extend", type=parse_lora_module, metavar="NAME=PATH",
                      help='adapters served under their names: NAME=PATH (a Hugging Face PEFT folder or a llama.cpp GGUF '
                           'LoRA file) or JSON '
                           '\'{"name": ..., "path": ..., "base_model_name": ...}\'; /v1/load_lora_adapter adds more '
                           'when VLLM_ALLOW_RUNTIME_LORA_UPDATING=true')
    lora.add_argument("--max-loras", type=_positive, default=1, help="adapters one step may run at once (default 1)")
    lora.add_argument("--max-lora-rank", type=_positive, default=16, help="the largest adapter rank (default 16)")
    lora.add_argument("--max-cpu-loras", type=_positive,
                      help="adapters kept loaded in memory once unused (default: --max-loras)")
    lora.add_argument("--lora-dtype", choices=["auto", "float16", "bfloat16", "float32"], default="auto",
                      help="the adapters' weights: auto = bfloat16 beside bf16 or quantized matrices, else float32; "
                           "float16 is float32 on the CPU")
    ray = p.add_argument_group("replicas behind Ray Serve (any of these runs the server as a Ray Serve deployment)")
    ray.add_argument("--replicas", type=_positive, help="engine replicas behind the one endpoint")
    ray.add_argument("--data-parallel-size", "-dp", type=_positive, default=None,
                     help="vLLM's data parallelism: that many engine replicas, as --replicas N (on Ray Serve)")
    ray.add_argument("--autoscale", type=_min_max, metavar="MIN,MAX",
                     help="let Ray Serve scale between MIN and MAX replicas with the load")
    ray.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")
    ray.add_argument("--replica-cpus", type=float, help="CPUs Ray reserves per replica (default: --tensor-parallel-size)")
    return p


def _seed(value: str) -> int | None:
    if value.strip().lower() == "none":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or none, got {value!r}") from None


def _min_max(value: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in value.split(","))
    except ValueError:
        lo = hi = -1
    if not 0 <= lo <= hi or hi < 1:
        raise argparse.ArgumentTypeError(f"must be MIN,MAX with 0 <= MIN <= MAX and MAX >= 1, got {value!r}")
    return lo, hi


def parse_args(argv: list[str], prog: str = "specdec serve", extra=None) -> tuple[argparse.Namespace, list[str]]:
    """-> (args, the vLLM flags that were ignored); ValueError for any other unknown word.
    extra(parser): adds a command's own flags (run-batch's)."""
    parser = build_parser(prog)
    if extra is not None:
        extra(parser)
    argv = expand_argv(argv, parser, positional_model=True)
    argv = _join_many(argv)
    # `vllm serve MODEL [options]`: a first word that is not a flag names the model
    tag = argv.pop(0) if argv and not argv[0].startswith("-") else None
    args, unknown = parser.parse_known_args(argv)
    if tag is None:        # `vllm serve --port 8000 MODEL`: argparse takes the model after the options too
        i = _stray(unknown)
        if i is not None:
            tag = unknown.pop(i)
    if tag is not None:
        if args.model is not None and args.model != tag:
            raise ValueError(f"the model is named twice: {tag!r} and --model {args.model!r}")
        args.model = tag
    _check_api_keys(args)
    if args.model is None:
        args.model = args.config_model
    fold_legacy_speculative(args)
    _data_parallel_as_replicas(args)
    return args, ignored_flags(unknown, [s for a in parser._actions for s in a.option_strings])


def _check_api_keys(args) -> None:
    """--api-key takes several keys (vLLM's), so `--api-key KEY MODEL` takes the model as a second
    key: a key that names an existing file or folder is refused, the model named first instead."""
    keys = getattr(args, "api_key", None)
    if isinstance(keys, list) and len(keys) > 1:
        for key in keys[1:]:
            if os.path.exists(key):
                raise ValueError(f"--api-key took {key!r} as a second key, and it is a path: name the model "
                                 f"before the flags (specdec serve MODEL --api-key KEY) or with --model")


def _data_parallel_as_replicas(args) -> None:
    """vLLM's --data-parallel-size N: N engines behind one endpoint, which --replicas N is here."""
    dp = getattr(args, "data_parallel_size", None)
    if dp is None or dp == 1:
        return
    if args.replicas is not None and args.replicas != dp:
        raise ValueError(f"--data-parallel-size {dp} and --replicas {args.replicas} disagree (they are the same: "
                         f"engine replicas)")
    if args.autoscale is not None:
        raise ValueError("--data-parallel-size and --autoscale: give one (a fixed count, or a range)")
    args.replicas = dp


def _join_many(argv: list[str]) -> list[str]:
    """An ignored vLLM flag that takes several values (MULTI_VALUE_FLAGS) as one word, its values
    up to the next flag joined (as vLLM's nargs="+" takes them): `--prompt-adapters a=/x b=/y`
    -> `--prompt-adapters=a=/x b=/y`."""
    out, i = [], 0
    while i < len(argv):
        word = argv[i]
        if _takes_many(word):
            j = i + 1
            while j < len(argv) and not (argv[j].startswith("-") and not _is_number(argv[j])):
                j += 1
            out.append(word + ("=" + " ".join(argv[i + 1:j]) if j > i + 1 else ""))
            i = j
            continue
        out.append(word)
        i += 1
    return out


def _stray(unknown: list[str]) -> int | None:
    """The index of the first unknown word that is neither a flag nor an unknown flag's value."""
    prev_flag = False
    for i, word in enumerate(unknown):
        if word.startswith("-") and not _is_number(word):
            prev_flag = "=" not in word and not _switch(word)
        elif prev_flag or (i and bool_value(unknown[i - 1], word)):
            prev_flag = False
        else:
            return i
    return None


def server_config(args):
    from .config import ServerConfig

    names = tuple(args.served_model_name or [args.model or "specdec"])
    keys = [args.api_key] if isinstance(args.api_key, str) else args.api_key or []
    keys = tuple(k for k in keys if k)                                              # "": no key, as vLLM
    return ServerConfig(served_model_names=names, api_key=keys or None,             # one key: kept as a string
                        max_request_bytes=args.max_request_bytes, seed=args.seed,
                        chat_template=load_chat_template(args.chat_template), response_role=args.response_role,
                        trust_request_chat_template=args.trust_request_chat_template,
                        allowed_origins=tuple(args.allowed_origins), allowed_methods=tuple(args.allowed_methods),
                        allowed_headers=tuple(args.allowed_headers), allow_credentials=args.allow_credentials,
                        root_path=args.root_path, return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                        disable_fastapi_docs=args.disable_fastapi_docs,
                        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
                        reasoning_parser=args.reasoning_parser, enable_log_requests=args.enable_log_requests,
                        enable_log_outputs=args.enable_log_outputs,
                        max_log_len=args.max_log_len, lora_modules=tuple(_lora_modules(args)),
                        allow_runtime_lora_updating=runtime_updating_allowed(),
                        dev_mode=dev_mode(),
                        enable_request_id_headers=args.enable_request_id_headers,
                        enable_server_load_tracking=args.enable_server_load_tracking,
                        log_stats=not args.disable_log_stats, log_stats_interval=_stats_interval(),
                        metrics_prefix=args.metrics_prefix,
                        default_chat_template_kwargs=args.default_chat_template_kwargs,
                        enable_force_include_usage=args.enable_force_include_usage,
                        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                        disable_uvicorn_access_log=args.disable_uvicorn_access_log,
                        disable_access_log_for_endpoints=args.disable_access_log_for_endpoints,
                        chat_template_content_format=args.chat_template_content_format,
                        log_config=_log_config(args.log_config_file))


def _stats_interval() -> float:
    """VLLM_LOG_STATS_INTERVAL (vLLM's environment variable): seconds between the stats lines."""
    raw = os.environ.get("VLLM_LOG_STATS_INTERVAL", "10")
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"VLLM_LOG_STATS_INTERVAL must be a number of seconds > 0, got {raw!r}")
    return value


def _lora_modules(args) -> list:
    """--lora-modules, checked as far as can be before the model loads (the engine reads each
    folder once it has)."""
    modules = args.lora_modules or []
    if modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    for m in modules:
        if not (os.path.isdir(m.path) or (os.path.isfile(m.path) and m.path.endswith(".gguf"))):
            raise ValueError(f"--lora-modules {m.name}: {m.path} is neither a folder (a Hugging Face PEFT LoRA "
                             f"adapter) nor a .gguf file (llama.cpp's LoRA)")
    return modules


def build_llm(args):
    """The LLM of the command line: the model and engine flags, and the LoRA ones."""
    lora = {}
    if args.enable_lora:
        lora = dict(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                    max_cpu_loras=args.max_cpu_loras, lora_dtype=args.lora_dtype)
    return llm_from_args(args, seed=args.seed, **lora)


def run(args, prog: str = "specdec serve") -> int:
    """`args` from `specdec serve` (its words in args.argv) or a parsed namespace."""
    argv = None
    if hasattr(args, "argv"):
        keyword = help_keyword(args.argv)
        if keyword is not None:
            print(keyword_help(build_parser(prog), keyword), end="")
            return 0
        if "-h" in args.argv or "--help" in args.argv:
            build_parser(prog).print_help()
            return 0
        argv = expand_argv(args.argv, build_parser(prog), positional_model=True)    # replicas get --config's flags
        args, ignored = parse_args(argv, prog)
    else:
        ignored = []
    check_device(args.device)               # a device this machine lacks: one line, before the model loads
    check_refused(ignored)                  # --pipeline-parallel-size 2 and the like: LLM(...)'s refusal
    _logging_level()                        # a bad VLLM_LOGGING_LEVEL: one line, now
    _keep_alive_seconds()                   # and a bad VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    for flag in ignored:
        print(f"{prog}: warning: ignoring vLLM flag (specdec does not use it): {flag}", file=sys.stderr)
    config = server_config(args)            # bad settings fail before the model loads
    ssl = ssl_settings(args)
    if argv is not None and (args.replicas or args.autoscale or args.ray_address):
        if ssl:
            raise ValueError("--ssl-keyfile / --ssl-certfile need a single server (behind Ray Serve its proxy serves HTTP)")
        if args.uds:
            raise ValueError("--uds needs a single server (behind Ray Serve its proxy listens on --host / --port)")
        try:
            from .replicas_run import serve_replicas
        except ImportError as e:
            raise ValueError(f"--replicas / --autoscale / --ray-address run on Ray Serve, which is not installed "
                             f"({e.name}): pip install 'specdec[serve]'") from None
        return serve_replicas(args, argv, prog)
    middleware = load_middleware(getattr(args, "middleware", None) or [])
    sock = bind_socket(args.host, args.port, args.uds)
    try:
        _setup_logging(config)
        _log_start(args, prog, sock, "https" if ssl else "http")
        llm = build_llm(args)
        _log_engine(llm)
    except BaseException:
        sock.close()
        raise
    return serve(llm, config, args.host, args.port, args.uvicorn_log_level, ssl, sock=sock, middleware=middleware)


def add_middleware(app, middleware: list) -> None:
    """load_middleware's objects around the app: a class as ASGI middleware, a function as HTTP middleware."""
    import inspect

    for m in middleware:
        if inspect.isclass(m):
            app.add_middleware(m)
        else:
            app.middleware("http")(m)


def _logging_level() -> str:
    """VLLM_LOGGING_LEVEL (vLLM's variable): specdec's loggers' level, default INFO; a level logging
    does not know is a one-line error (checked before the model loads)."""
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").strip().upper() or "INFO"
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"VLLM_LOGGING_LEVEL={level!r}: not a logging level (DEBUG, INFO, WARNING, ERROR, CRITICAL)")
    return level


def _setup_logging(config) -> None:
    """specdec's log lines from now on (before the model loads, as vLLM's): VLLM_LOGGING_LEVEL (default
    INFO) in vLLM's line shape (level, time, where, message), unless --log-config-file configured them."""
    if config.log_config is None:
        logging.basicConfig(level=_logging_level(), format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                            datefmt="%m-%d %H:%M:%S")


def _log_start(args, prog: str, sock, scheme: str) -> None:
    """vLLM's first lines (log_version_and_model, log_non_default_args, "Starting vLLM server on ..."),
    logged before the model loads: what is served, with which flags, and where."""
    import socket

    from .. import __version__
    from ..defaults import default_model

    log = logging.getLogger("specdec.server")
    log.info("specdec server version %s, serving model %s", __version__, args.model or default_model()[0])
    parser = build_parser(prog)
    dests = {a.dest for a in parser._actions} - {"help"}
    changed = {k: v for k, v in vars(args).items() if k in dests and v != parser.get_default(k)}
    log.info("non-default args: %s", {k: "***" if k == "api_key" else v for k, v in changed.items()})
    if sock.family == socket.AF_UNIX:
        where = f"unix:{sock.getsockname()}"
    else:
        host, port = sock.getsockname()[:2]
        where = f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"
    log.info("Starting specdec server on %s", where)


def _log_engine(llm) -> None:
    """What the engine runs (vLLM's "Initializing a V1 LLM engine ... speculative_config=..."): the
    model, its context and dtype, and the speculative method with its K, or plain decoding."""
    spec = llm.spec
    how = "plain decoding" if spec is None else (
        f"speculative decoding: method {spec.method}, num_speculative_tokens {spec.num_speculative_tokens}"
        + (f", drafter {spec.model}" if spec.model else ""))
    from ..async_llm import VllmConfigView

    model = VllmConfigView(llm).model_config         # the weights' dtype, as /server_info and model_config say
    logging.getLogger("specdec.server").info("engine: %s, max_model_len %s, dtype %s; %s", llm.model_path,
                                             model.max_model_len, model.dtype, how)


def _log_listening(sock, scheme: str) -> None:
    """uvicorn's own line, for the socket bound before the model loaded (a --port 0 run finds its port here)."""
    import socket

    log = logging.getLogger("uvicorn.error")
    if sock.family == socket.AF_UNIX:
        log.info("Uvicorn running on unix socket %s (Press CTRL+C to quit)", sock.getsockname())
        return
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    log.info("Uvicorn running on %s://%s:%d (Press CTRL+C to quit)", scheme, shown, port)


def load_middleware(paths: list[str]) -> list:
    """vLLM's --middleware: import paths of ASGI middleware (a class: app.add_middleware(cls)) or
    of HTTP middleware functions (async def f(request, call_next): @app.middleware("http")),
    imported before the model loads; a path that does not import is a one-line error."""
    import importlib
    import inspect

    out = []
    for path in paths:
        module, _, name = path.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module), name) if module else None
        except ImportError as e:
            raise ValueError(f"--middleware {path}: cannot import {module!r}: {e}") from None
        except AttributeError:
            obj = None
        if obj is None:
            raise ValueError(f"--middleware {path}: no such object (expected module.Name)")
        if not (inspect.isclass(obj) or inspect.iscoroutinefunction(obj)):
            raise ValueError(f"--middleware {path}: must be an ASGI middleware class or an async function "
                             f"(request, call_next)")
        out.append(obj)
    return out


def ssl_settings(args) -> dict:
    """uvicorn's TLS settings from --ssl-*: both files or neither, each a PEM file that loads (a
    context built now, as uvicorn builds it once the model has loaded), the key the certificate's."""
    key, cert, ca = getattr(args, "ssl_keyfile", None), getattr(args, "ssl_certfile", None), getattr(args, "ssl_ca_certs", None)
    if not (key or cert or ca):
        return {}
    if not (key and cert):
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    for flag, path in (("--ssl-keyfile", key), ("--ssl-certfile", cert), ("--ssl-ca-certs", ca)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")
    out = {"ssl_keyfile": key, "ssl_certfile": cert, "ssl_ca_certs": ca, "ssl_cert_reqs": getattr(args, "ssl_cert_reqs", 0)}
    if getattr(args, "ssl_ciphers", None):
        out["ssl_ciphers"] = args.ssl_ciphers
    _check_tls(key, cert, ca, out.get("ssl_ciphers"))
    return out


def _check_tls(key: str, cert: str, ca: str | None, ciphers: str | None) -> None:
    """The TLS files load as uvicorn will load them; a ValueError naming the flag and file if not."""
    import ssl

    def reason(e: ssl.SSLError) -> str:
        return getattr(e, "reason", None) or str(e.args[-1] if e.args else e)

    try:
        ssl.create_default_context(cafile=cert)     # certificates only: a cert file that holds none fails here
    except ssl.SSLError as e:
        raise ValueError(f"--ssl-certfile {cert}: not a PEM certificate ({reason(e)})") from None
    class Encrypted(Exception):
        pass

    def no_password():          # an encrypted key: uvicorn asks for its passphrase; not asked twice
        raise Encrypted

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key, password=no_password)
    except Encrypted:
        pass                                   # the certificate was checked above; the key needs its passphrase
    except ssl.SSLError as e:
        if "KEY_VALUES_MISMATCH" in str(e):
            raise ValueError(f"--ssl-keyfile {key}: not the key of --ssl-certfile {cert}") from None
        raise ValueError(f"--ssl-keyfile {key}: not a PEM private key ({reason(e)})") from None
    if ca:
        try:
            context.load_verify_locations(ca)
        except ssl.SSLError as e:
            raise ValueError(f"--ssl-ca-certs {ca}: not PEM CA certificates ({reason(e)})") from None
    if ciphers:
        try:
            context.set_ciphers(ciphers)
        except ssl.SSLError as e:
            raise ValueError(f"--ssl-ciphers {ciphers!r}: {reason(e)}") from None


def _tls_http_protocol():
    """uvicorn's HTTP protocol (httptools where installed, as its "auto" picks, else h11), except
    that at shutdown an idle TLS connection is dropped at once. uvicorn closes idle keep-alive
    connections then, and asyncio waits up to 30 s (its ssl_shutdown_timeout) for each TLS peer's
    close_notify, which an idle client that is not reading never sends: the server (and a
    Kubernetes pod's SIGTERM grace of 30 s) waited that long. Connections with a response in
    flight are left to finish as before."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base

    class TLSHTTPProtocol(Base):
        def shutdown(self) -> None:
            idle = self.cycle is None or self.cycle.response_complete
            super().shutdown()
            if idle:
                self.transport.abort()

    return TLSHTTPProtocol


def uvicorn_config(app, config, log_level: str = "info", ssl: dict | None = None, **kw):
    """uvicorn's settings for the app: the log level, TLS (ssl_settings), the access log and the
    keep-alive timeout (--root-path is the app's own: build_app, as vLLM's)."""
    import uvicorn

    if ssl:
        kw.setdefault("http", _tls_http_protocol())
    quiet = getattr(config, "disable_access_log_for_endpoints", ())
    if quiet:               # vLLM's --disable-access-log-for-endpoints: these paths' access lines dropped
        _quiet_access_log(quiet)
    log_config = getattr(config, "log_config", None)
    if log_config is not None:
        kw["log_config"] = log_config        # uvicorn's loggers from --log-config-file too (vLLM's)
    # vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE: how long an idle keep-alive connection stays open (a load
    # balancer's own timeout must be shorter, or it sends requests down closed sockets: 502s)
    kw.setdefault("timeout_keep_alive", _keep_alive_seconds())
    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=None,
                          access_log=not getattr(config, "disable_uvicorn_access_log", False), **(ssl or {}), **kw)


def _keep_alive_seconds() -> int:
    raw = os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5")
    try:
        seconds = int(raw)
    except ValueError:
        raise ValueError(f"VLLM_HTTP_TIMEOUT_KEEP_ALIVE must be a whole number of seconds, got {raw!r}") from None
    if seconds < 0:
        raise ValueError(f"VLLM_HTTP_TIMEOUT_KEEP_ALIVE must be >= 0, got {seconds}")
    return seconds


class _PathFilter(logging.Filter):
    """Drops uvicorn's access lines of the given paths (its record args: client, method, path, ...)."""

    def __init__(self, paths):
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        path = args[2] if len(args) > 2 and isinstance(args[2], str) else ""
        return path.split("?", 1)[0] not in self.paths


def _quiet_access_log(paths) -> None:
    access = logging.getLogger("uvicorn.access")
    access.filters = [f for f in access.filters if not isinstance(f, _PathFilter)]
    access.addFilter(_PathFilter(paths))


def serve(llm, config, host: str, port: int, log_level: str = "info", ssl: dict | None = None, sock=None,
          middleware: list = ()) -> int:
    """sock: a socket bound already (bind_socket); middleware: load_middleware's, added outermost."""
    import contextlib
    import socket

    import uvicorn

    from .app import build_app

    _setup_logging(config)
    app = build_app(llm, config)
    add_middleware(app, middleware)
    uds_path = sock.getsockname() if sock is not None and sock.family == socket.AF_UNIX else None
    worker = app.state.service.worker

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if sockets and self.started:      # uvicorn says where it listens only for sockets it bound itself
                _log_listening(sockets[0], "https" if ssl else "http")
            if self.started and not _keep_alive_on_engine_death():
                self.watchdog = asyncio.create_task(_watchdog(self, worker))

        async def shutdown(self, sockets=None) -> None:
            await super().shutdown(sockets)
            if self.force_exit:
                await _stop_now(self)
            if uds_path:                      # --uds: no socket file left behind (before uvicorn re-raises SIGTERM)
                with contextlib.suppress(OSError):
                    os.unlink(uds_path)

        def handle_exit(self, sig, frame) -> None:
            # a paused engine (POST /pause) would hold the requests uvicorn waits for: resume it
            app.state.service.worker.unpause_for_shutdown()
            draining = self.should_exit
            super().handle_exit(sig, frame)
            if draining:             # a second signal (SIGINT or SIGTERM, as vLLM's): stop now
                self.force_exit = True
                # uvicorn re-raises every captured signal once it has stopped: a second SIGINT
                # reached asyncio's handler as a KeyboardInterrupt inside the loop, and each task
                # left then printed its traceback; the first signal alone says how the server ended
                del self._captured_signals[1:]

    # uvicorn handles SIGTERM/SIGINT: stop accepting, finish in-flight requests, run the lifespan's
    # shutdown (which drains the engine worker), then return; a second signal: _stop_now
    Server(uvicorn_config(app, config, log_level, ssl, host=host, port=port)).run(
        sockets=[sock] if sock is not None else None)
    return 1 if worker.error is not None else 0


FORCED_EXIT_SECONDS = 5.0


async def _stop_now(server) -> None:
    """A forced exit (a second signal while draining): the requests in flight are dropped, their
    connections closed, which ends their handlers as a client leaving does (their engine jobs
    aborted); then the lifespan's shutdown, skipped by uvicorn's force exit, stops the engine
    thread. A handler still running after FORCED_EXIT_SECONDS is cancelled."""
    connections, tasks = list(server.server_state.connections), set(server.server_state.tasks)
    logging.getLogger("specdec.server").warning("Forced exit: %d request(s) in flight dropped", len(tasks))
    for connection in connections:
        connection.transport.abort()
    if tasks:
        _, left = await asyncio.wait(tasks, timeout=FORCED_EXIT_SECONDS)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
    if not server.lifespan.shutdown_event.is_set():
        await server.lifespan.shutdown()


def _keep_alive_on_engine_death() -> bool:
    """vLLM's VLLM_KEEP_ALIVE_ON_ENGINE_DEATH: a server whose engine died stays up (answering 503)."""
    return os.environ.get("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "0").strip().lower() in ("1", "true")


WATCHDOG_SECONDS = 1.0


async def _watchdog(server, worker) -> None:
    """vLLM's watchdog_loop / terminate_if_errored: once the engine is dead the server shuts down
    (graceful: the failed requests' answers go out), so that its supervisor restarts it rather
    than a balancer sending it requests that can only fail."""
    while worker.error is None:
        await asyncio.sleep(WATCHDOG_SECONDS)
    logging.getLogger("specdec.server").error("the engine is dead (%s): shutting the server down", worker.error)
    server.should_exit = True
