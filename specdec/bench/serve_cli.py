"""`specdec bench serve`: flags (vLLM's names where vLLM has them), variants, load points, run.

    specdec bench serve --num-speculative-tokens 0,4,auto --max-concurrency 1,2,4,8,16,32 \\
        --num-prompts 32 --output-len 128 --goodput ttft:2000 tpot:100

starts one server per variant (0 = plain batched decoding; the method is the default model's,
or --speculative-config's), all before the first load point, and measures the load points
variant after variant (interleaved, so that a machine whose load drifts affects all alike).
With --base-url (or vLLM's --host/--port) it measures that one running server instead.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

OUTPUT_LEN = 128            # --output-len's default
DEFAULT_KS = "0,4,auto"     # --num-speculative-tokens' (servers started here)
DEFAULT_CONCURRENCY = "1,2,4,8,16,32"     # --max-concurrency's, without --request-rate or a ramp
RANDOM_INPUT_LEN = 1024     # --random-input-len's


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", help="measure this running server (http://host:port) instead of starting servers")
    p.add_argument("--host", help="vLLM's: measure the running server at this host (default 127.0.0.1 when --port "
                                  "is given) instead of starting servers")
    p.add_argument("--port", type=int, help="vLLM's: measure the running server at this port (default 8000 when "
                                            "--host is given) instead of starting servers")
    p.add_argument("--label", help="the variant's name with --base-url (default server; vLLM's result files: "
                                   "their name's prefix, default the backend)")
    p.add_argument("--model", help="target for the servers started (default: the default model); with --base-url, "
                                   "the model the requests name (vLLM's meaning; default: the server's first)")
    p.add_argument("--served-model-name", help="the model name the requests carry (default: the server's first)")
    p.add_argument("--lora-modules", nargs="+", metavar="NAME",
                   help="LoRA adapters the server serves (its --lora-modules names): each request names one of "
                        "them, drawn at random with --seed (vLLM's)")
    p.add_argument("--speculative-config", type=_json, help="the method for the speculative variants (JSON, as serve)")
    p.add_argument("--num-speculative-tokens", type=_ks,
                   help=f"variants: 0 = plain batched decoding, K, auto (default {DEFAULT_KS})")
    p.add_argument("--server-args", help="more flags for every server started, e.g. '--max-num-seqs 32' (prefix caching stays off "
                        "unless these name it: every load point sends the same prompts)")
    p.add_argument("--dataset-name", default="spec_bench",
                   choices=["spec_bench", "random", "prefix_repetition", "custom", "sharegpt"],
                   help="spec_bench: Spec-Bench's questions as chats (default: the bundled 240, or --dataset-path); "
                        "random: prompts of random token ids of set lengths (vLLM's, sent as token ids to "
                        "/v1/completions); prefix_repetition: random prompts sharing a few random prefixes (vLLM's: "
                        "what prefix caching serves); custom: --dataset-path JSONL; sharegpt: --dataset-path, a "
                        "ShareGPT JSON file (first turns as chats, max_tokens their replies' lengths)")
    p.add_argument("--spec-bench-category", help="only this Spec-Bench category (default: all, interleaved)")
    p.add_argument("--spec-bench-output-len", type=int,
                   help="vLLM's: max_tokens of each request unless --output-len is given (which wins, as in vLLM)")
    p.add_argument("--dataset-path", help="spec_bench: a Spec-Bench question.jsonl ({\"turns\", \"category\", "
                                          "\"question_id\"} a line; default: the bundled 240 questions); "
                                          'custom: a JSON Lines file, one {"prompt": ...} a line (optional '
                                          '"output_tokens"), sent through the chat template; sharegpt: a ShareGPT '
                                          'JSON file (a list of {"conversations": [...]})')
    p.add_argument("--disable-shuffle", action="store_true",
                   help="send the dataset's prompts in its own order (default: a seeded shuffle)")
    p.add_argument("--no-oversample", action="store_true",
                   help="send each prompt at most once a load point, fewer than --num-prompts if the dataset is "
                        "smaller (default: repeat the prompts up to --num-prompts)")
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256,
                   help="prefix_repetition: tokens of each shared prefix (default 256)")
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=256,
                   help="prefix_repetition: random tokens after the prefix, per request (default 256)")
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=10,
                   help="prefix_repetition: distinct prefixes, each shared by an equal share of the requests "
                        "(default 10)")
    p.add_argument("--prefix-repetition-output-len", type=int,
                   help="prefix_repetition: max_tokens of each request (default: --output-len)")
    p.add_argument("--sharegpt-output-len", type=int, help="sharegpt: max_tokens of every request (default: "
                                                             "--output-len if given, else the length of the "
                                                             "conversation's reply, as vLLM)")
    p.add_argument("--skip-chat-template", action="store_true",
                   help="custom: send the prompts as they are to /v1/completions")
    p.add_argument("--random-input-len", type=int, help="random: prompt tokens (default: --input-len, else 1024)")
    p.add_argument("--input-len", type=int, help="vLLM's: random: --random-input-len")
    p.add_argument("--random-output-len", type=int,
                   help="random: output tokens, i.e. max_tokens (default: --output-len)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: lengths drawn uniformly within +- this share of the lengths given (default 0)")
    p.add_argument("--random-prefix-len", type=int, default=0,
                   help="random: a random prefix of this many tokens shared by every prompt (default 0)")
    p.add_argument("--tokenizer", help="random, sharegpt: the tokenizer that draws the ids or counts the lengths "
                                       "(default: the served model's, when its files are on this machine)")
    p.add_argument("--request-rate", default="inf", type=_rates,
                   help="requests/s, comma-separated (inf = all at once; default inf)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="Gamma shape of arrival gaps (1 = Poisson; inf = every gap 1/rate)")
    p.add_argument("--ramp-up-strategy", choices=["linear", "exponential"],
                   help="vLLM's: instead of --request-rate, a rate going from --ramp-up-start-rps to "
                        "--ramp-up-end-rps over each load point's requests")
    p.add_argument("--ramp-up-start-rps", type=float, help="the ramp's first rate (requests/s)")
    p.add_argument("--ramp-up-end-rps", type=float, help="the ramp's last rate (requests/s)")
    p.add_argument("--max-concurrency", type=_concurrency,
                   help=f"requests in flight at most, comma-separated, or none (default {DEFAULT_CONCURRENCY}; with "
                        "--request-rate or --ramp-up-strategy given, none: vLLM's, the arrivals alone set the load)")
    p.add_argument("--num-prompts", type=int,
                   help="requests per load point, exactly that many (vLLM's); default: 32, or twice the load point's "
                        "concurrency if more")
    p.add_argument("--output-len", type=int, help=f"max_tokens of each request (default {OUTPUT_LEN}; sharegpt: "
                                                    "the replies' lengths unless given)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="every request generates its max_tokens (always on with --dataset-name random, as vLLM)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, help="nucleus sampling of every request (default: the server's)")
    p.add_argument("--top-k", type=int, help="top-k sampling of every request (vLLM's extension; default: the server's)")
    p.add_argument("--min-p", type=float, help="min-p sampling of every request (vLLM's extension; default: the server's)")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs, e.g. ttft:2000 tpot:100 (vLLM's)")
    p.add_argument("--metric-percentiles", default="50,90,99", type=_percentiles,
                   help="percentiles reported, comma-separated, each in [0, 100] (default 50,90,99)")
    p.add_argument("--warmup", "--num-warmups", type=int, default=2, help="requests sent to each server before measuring")
    p.add_argument("--rounds", type=int, default=1,
                   help="split each load point's requests into rounds (of at least twice its concurrency) in which "
                        "the variants take turns, so that a machine whose speed drifts over minutes weighs on all "
                        "alike (default 1: each variant's whole load point in turn)")
    p.add_argument("--client", default="aiohttp", choices=["aiohttp", "openai"],
                   help="the benchmark's HTTP client: aiohttp with the events parsed by hand (default, as vLLM's "
                        "benchmark), or the official openai client (~3x its CPU per chunk, taken from the server "
                        "on a machine of few cores; runs recorded before 2026-12-05 used it)")
    p.add_argument("--backend", default="openai-chat", choices=["openai-chat", "openai", "vllm"],
                   help="vLLM's: openai-chat sends chats to /v1/chat/completions (default); openai and vllm send "
                        "each prompt as it is, without the chat template, to /v1/completions (random prompts go "
                        "to /v1/completions as token ids either way)")
    p.add_argument("--endpoint", choices=["/v1/chat/completions", "/v1/completions"],
                   help="vLLM's: the backend's endpoint, named instead of the backend")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="metrics whose --metric-percentiles are reported (vLLM's; default all four)")
    p.add_argument("--profile", action="store_true",
                   help="vLLM's: torch.profiler over the measured requests (after the warm-up): servers started here "
                        "record into OUT/profile/<variant>; a --base-url server must run with --profiler-config")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="results folder (default bench/serve/<cpu kind>: the checkout's, else "
                                            "under the current directory)")
    p.add_argument("--result-dir", type=Path, help="vLLM's name for --out")
    p.add_argument("--result-filename", help="with --save-result: vLLM's result file's name in that folder (a "
                                             "single variant and load point; else its stem, then each one's)")
    p.add_argument("--save-result", action="store_true",
                   help="also write each variant's load point as vLLM's result JSON (flat keys: mean_ttft_ms, "
                        "spec_decode_acceptance_rate...), named as vLLM names it; results.json, results.md and "
                        "serve.png are always written")
    p.add_argument("--save-detailed", action="store_true",
                   help="vLLM's: the result files keep per-request lists (input_lens, ttfts, itls, generated_texts, "
                        "errors...)")


def _split(value: str) -> list[str]:
    items = [x.strip() for x in value.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError("must list at least one value")
    return items


def _ks(value: str) -> list:
    out = []
    for x in _split(value):
        if x != "auto" and not (x.isdigit() and int(x) <= 64):
            raise argparse.ArgumentTypeError(f'each must be an integer in [0, 64] or "auto", got {x!r}')
        out.append(x if x == "auto" else int(x))
    return list(dict.fromkeys(out))


def _rates(value: str) -> list[float]:
    try:
        rates = [float(x) for x in _split(value)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates must be numbers or inf, got {value!r}") from None
    if any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError("rates must be > 0")
    return rates


def _concurrency(value: str) -> list[int | None]:
    if value == "none":
        return [None]
    try:
        out = [int(x) for x in _split(value)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be integers >= 1 or 'none', got {value!r}") from None
    if any(c < 1 for c in out):
        raise argparse.ArgumentTypeError("must be integers >= 1")
    return out


def _percentiles(value: str) -> list[float]:
    try:
        out = [float(x) for x in _split(value)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be numbers, got {value!r}") from None
    if any(not 0 <= p <= 100 for p in out):
        raise argparse.ArgumentTypeError(f"each must be in [0, 100], got {value!r}")
    return out


def _json(value: str) -> dict:
    from ..cli import _json_obj

    return _json_obj(value)


def cpu_kind() -> str:
    """A folder name for this CPU: vendor family and the kernels' best instruction set."""
    from .. import kernels
    from .machine import cpu_model

    cpu = cpu_model().lower()
    family = next((f for f in ("xeon", "epyc", "ryzen", "core", "graviton", "neoverse") if f in cpu), None)
    isa = kernels.describe().split(" ", 1)[0].replace("_", "")
    return "-".join(x for x in (family or __import__("platform").machine(), isa) if x)


def variants(args) -> list[dict]:
    """[{name, k, argv}] of the servers to start."""
    from ..proposers.suffix import CACHE_KEY
    from .serve import without_prefix_caching

    out = []
    # every load point sends the same prompts: a server's prefix cache (on by default) would
    # serve the later points' prompts from the earlier ones' blocks
    base = without_prefix_caching((["--model", args.model] if args.model else []) + shlex.split(args.server_args or ""))
    for k in args.num_speculative_tokens or _ks(DEFAULT_KS):      # None: not given (servers_started's defaults)
        if k == 0:
            out.append({"name": "plain", "k": 0, "argv": base + ["--num-speculative-tokens", "0"]})
            continue
        argv = list(base)
        if args.speculative_config:
            cfg = {**args.speculative_config, "num_speculative_tokens": k}
            if cfg.get("method") == "suffix":
                # every load point sends the same prompts: the cache of earlier outputs would draft them
                cfg.setdefault(CACHE_KEY, 0)
            argv += ["--speculative-config", json.dumps(cfg)]
        else:
            argv += ["--num-speculative-tokens", str(k)]
        out.append({"name": f"speculative K={k}", "k": k, "argv": argv})
    return out


def check_variants(found: list[dict]) -> None:
    """What a variant's server would refuse before loading its model and the flags alone tell (a K
    without a method: --model names a model with no default one), as one line before any server
    starts, not after the variants before it have started and loaded. Flags its parser refuses
    stay the server's error, named with its log."""
    import contextlib
    import io

    from ..server.cli import parse_args

    for v in found:
        if not v["k"]:
            continue
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                a, _ = parse_args(v["argv"])
        except (ValueError, SystemExit):
            continue
        if a.model is not None and a.speculative_model is None and a.speculative_config is None:
            raise ValueError(f"{v['name']}: num_speculative_tokens was provided without speculative_model (or "
                             f"speculative_config): {a.model} has no default method; give --speculative-config, "
                             f"or --num-speculative-tokens 0 alone")


def servers_started(args) -> None:
    """The flags that configure the servers started here, settled; with a running server
    (--base-url, --host/--port), which runs with its own settings, they are an error: measured
    anyway, the results would record a configuration that was not run."""
    given = [flag for flag, value in (("--num-speculative-tokens", args.num_speculative_tokens),
                                      ("--speculative-config", args.speculative_config),
                                      ("--server-args", args.server_args)) if value is not None]
    if args.base_url and given:
        raise ValueError(f"{', '.join(given)}: configure{'s' if len(given) == 1 else ''} the servers started here; "
                         "with --base-url (or --host/--port) the running server is measured with its own settings: "
                         f"leave {'it' if len(given) == 1 else 'them'} out")
    if args.num_speculative_tokens is None:
        args.num_speculative_tokens = _ks(DEFAULT_KS)
    if args.server_args is None:
        args.server_args = ""


def check_sampling(args) -> None:
    """The sampling flags every request carries, checked as a server checks them (SamplingParams,
    vLLM's bounds) before any server starts or request goes: a bad one would fail them all."""
    from ..config import SamplingParams

    try:
        SamplingParams(**{k: getattr(args, k) for k in ("temperature", "top_p", "top_k", "min_p")
                          if getattr(args, k) is not None})
    except ValueError as e:                                # "top_p must be ..." -> "--top-p must be ..."
        name, _, rest = str(e).partition(" ")
        raise ValueError(f"--{name.replace('_', '-')} {rest}") from None


def concurrency(args) -> None:
    """--max-concurrency left out: the sweep DEFAULT_CONCURRENCY at all-at-once arrivals, but no
    cap when --request-rate or a ramp sets the arrivals (vLLM's default: a rate given alone is
    an open load, not one capped at 1, 2, ... 32 requests in flight)."""
    if args.max_concurrency is None:
        paced = args.request_rate != [float("inf")] or args.ramp_up_strategy is not None
        args.max_concurrency = [None] if paced else _concurrency(DEFAULT_CONCURRENCY)


def ramp(args) -> tuple[str, float, float] | None:
    """(strategy, start, end) of --ramp-up-strategy, checked; None without it."""
    from .serve import ramp_rates

    given = (args.ramp_up_start_rps, args.ramp_up_end_rps)
    if args.ramp_up_strategy is None:
        if any(x is not None for x in given):
            raise ValueError("--ramp-up-start-rps and --ramp-up-end-rps go with --ramp-up-strategy")
        return None
    if any(x is None for x in given):
        raise ValueError("--ramp-up-strategy needs --ramp-up-start-rps and --ramp-up-end-rps")
    if args.request_rate != [float("inf")]:
        raise ValueError("--request-rate and --ramp-up-strategy both set the rate: give one")
    ramp_rates(2, args.ramp_up_strategy, *given)         # checks the values
    return (args.ramp_up_strategy, *given)


def vllm_flags(args) -> None:
    """Check and settle the flags vLLM's `bench serve` takes: --endpoint names the backend,
    --result-dir the folder, --percentile-metrics a tuple of metric names."""
    from .serve import METRICS

    if args.endpoint is not None:
        named = "openai-chat" if args.endpoint == "/v1/chat/completions" else "openai"
        if args.backend != "openai-chat" and named == "openai-chat":
            raise ValueError(f"--endpoint {args.endpoint} does not go with --backend {args.backend}")
        args.backend = named if args.backend == "openai-chat" else args.backend
    if args.out is not None and args.result_dir is not None:
        raise ValueError("--out and --result-dir name the same folder: give one")
    if args.result_filename is not None and (not args.result_filename.endswith(".json") or "/" in args.result_filename):
        raise ValueError("--result-filename must be a .json file name, without a folder")
    if args.result_filename is not None and not args.save_result:
        raise ValueError("--result-filename names the --save-result file: give --save-result too")
    if args.host is not None or args.port is not None:
        if args.base_url:
            raise ValueError("--base-url and --host/--port name the same server: give one")
        host = args.host or "127.0.0.1"
        args.base_url = f"http://{f'[{host}]' if ':' in host else host}:{8000 if args.port is None else args.port}"
    metrics = tuple(m.strip() for m in str(args.percentile_metrics).split(",") if m.strip())
    if not metrics or any(m not in METRICS for m in metrics):
        raise ValueError(f"--percentile-metrics: comma-separated names among {', '.join(METRICS)}")
    args.percentile_metrics = metrics


def lengths(args) -> None:
    """Settle the lengths as vLLM's main_async maps its general flags: --input-len, when given,
    overwrites --random-input-len, and --output-len overwrites the datasets' own output lengths
    (--random-output-len, --sharegpt-output-len, --prefix-repetition-output-len,
    --spec-bench-output-len). Random prompts ignore EOS (vLLM's main_async), so that each
    generates the length asked for."""
    if args.input_len is not None:
        if args.dataset_name != "random":
            raise ValueError("--input-len goes with --dataset-name random (vLLM maps it to --random-input-len)")
        args.random_input_len = args.input_len
    if args.random_input_len is None:
        args.random_input_len = RANDOM_INPUT_LEN
    if args.output_len is not None:
        if args.dataset_name == "sharegpt":
            if args.output_len < 4:
                raise ValueError("--output-len: sharegpt's max_tokens must be >= 4")
            args.sharegpt_output_len = args.output_len
        args.random_output_len = args.prefix_repetition_output_len = args.output_len
    elif args.spec_bench_output_len is not None:
        args.output_len = args.spec_bench_output_len
    if args.output_len is None:
        args.output_len = OUTPUT_LEN
    if args.dataset_name == "random":
        args.ignore_eos = True


def dataset(args, loads):
    """The requests to draw from: Spec-Bench's questions or the custom file's prompts, or, for the
    datasets that need the served model's tokenizer (random, sharegpt), a function of a server's
    URL that makes them once a server is up. Flags and files are checked here, before any starts."""
    from . import serve

    if args.dataset_name not in ("spec_bench", "custom", "sharegpt") and args.dataset_path:
        raise ValueError("--dataset-path goes with --dataset-name spec_bench, custom or sharegpt")
    if args.dataset_name != "custom" and args.skip_chat_template:
        raise ValueError("--skip-chat-template goes with --dataset-name custom")
    if args.dataset_name != "spec_bench" and args.spec_bench_category:
        raise ValueError("--spec-bench-category goes with --dataset-name spec_bench")
    if args.dataset_name in ("custom", "sharegpt") and not args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path FILE")
    if args.sharegpt_output_len is not None and (args.dataset_name != "sharegpt" or args.sharegpt_output_len < 4):
        raise ValueError("--sharegpt-output-len goes with --dataset-name sharegpt and must be >= 4")
    if args.dataset_name == "custom":
        return serve.custom_requests(args.dataset_path, args.skip_chat_template)
    if args.dataset_name == "sharegpt":
        pairs = serve.sharegpt_pairs(args.dataset_path)
        return lambda url: serve.sharegpt_requests(pairs, serve.served_tokenizer(url, args.tokenizer),
                                                   args.sharegpt_output_len, args.seed)
    if args.dataset_name == "random":
        _check_random(args)
        return lambda url: random_pool(args, loads, url)
    if args.dataset_name == "prefix_repetition":
        serve.check_prefix_repetition(args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
                                      args.prefix_repetition_num_prefixes, _prefix_repetition_output_len(args))
        return lambda url: prefix_repetition_pool(args, loads, url)
    return serve.questions(args.spec_bench_category, args.dataset_path)


def _check_random(args) -> None:
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    if args.random_input_len < 1 or (args.random_output_len is not None and args.random_output_len < 1) \
            or args.random_prefix_len < 0:
        raise ValueError("--random-input-len and --random-output-len must be >= 1, --random-prefix-len >= 0")


def _pool_size(args, loads) -> int:
    """Distinct prompts enough for the largest load point and the warm-up."""
    from .serve import point_size

    return max(point_size(load, args.num_prompts) for load in loads) + args.warmup


def random_pool(args, loads, url: str) -> list[dict]:
    """Distinct random prompts, enough for the largest load point and the warm-up."""
    from . import serve

    return serve.random_requests(serve.served_tokenizer(url, args.tokenizer), _pool_size(args, loads),
                                 args.random_input_len, args.random_output_len or args.output_len,
                                 args.random_range_ratio, args.random_prefix_len, args.seed)


def _prefix_repetition_output_len(args) -> int:
    return args.output_len if args.prefix_repetition_output_len is None else args.prefix_repetition_output_len


def prefix_repetition_pool(args, loads, url: str) -> list[dict]:
    """vLLM's prefix_repetition requests, as many as random_pool draws."""
    from . import serve

    return serve.prefix_repetition_requests(
        serve.served_tokenizer(url, args.tokenizer), _pool_size(args, loads), args.prefix_repetition_prefix_len,
        args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
        _prefix_repetition_output_len(args), args.seed)


def dataset_name(args) -> str:
    if args.dataset_name == "spec_bench":
        return "spec_bench" + (f":{args.spec_bench_category}" if args.spec_bench_category else "")
    return args.dataset_name


def requests_described(args) -> str:
    """How the requests were made, for the report."""
    if args.dataset_name == "random":
        ratio = f" (+-{args.random_range_ratio:.0%})" if args.random_range_ratio else ""
        prefix = f" after a shared random prefix of {args.random_prefix_len}" if args.random_prefix_len else ""
        return (f"random token ids{prefix}: {args.random_input_len}{ratio} prompt tokens, "
                f"{args.random_output_len or args.output_len}{ratio} max_tokens with ignore_eos (as vLLM forces "
                f"for random), sent to /v1/completions")
    if args.dataset_name == "prefix_repetition":
        return (f"random token ids: {args.prefix_repetition_num_prefixes} shared prefixes of "
                f"{args.prefix_repetition_prefix_len} tokens, each request's own {args.prefix_repetition_suffix_len} "
                f"after, {_prefix_repetition_output_len(args)} max_tokens, sent to /v1/completions")
    if args.dataset_name == "sharegpt":
        out = f"max_tokens {args.sharegpt_output_len}" if args.sharegpt_output_len \
            else "max_tokens the replies' lengths"
        return f"ShareGPT first turns from {args.dataset_path} through the chat template, {out}"
    if args.dataset_name == "custom":
        how = "as they are to /v1/completions" if args.skip_chat_template else "through the chat template"
        return f"custom prompts from {args.dataset_path}, {how}, max_tokens {args.output_len} unless the file says"
    source = f" from {args.dataset_path}" if args.dataset_path else ""
    return f"{dataset_name(args)} first turns{source} through the chat template, max_tokens {args.output_len}"


def requests_sent(args) -> str:
    """requests_described, with vLLM's openai backend's plain prompts."""
    text = requests_described(args)
    if args.backend == "openai-chat" or args.dataset_name in ("random", "prefix_repetition"):
        return text
    return text.replace("through the chat template", "as plain prompts (no chat template) to /v1/completions") \
        + f" (--backend {args.backend})"


def command_line(argv: list[str]) -> str:
    return shlex.join(["specdec", "bench", "serve", *argv])


def run(args, argv: list[str]) -> int:
    from . import serve, serve_vllm
    from .cli import output_folder
    from .machine import machine_info
    from .serve_report import console, write_all

    slo = serve.parse_goodput(args.goodput)
    vllm_flags(args)
    servers_started(args)
    check_sampling(args)
    lengths(args)
    if (args.num_prompts is not None and args.num_prompts < 1) or args.output_len < 1 or args.warmup < 0 \
            or not args.burstiness > 0 or args.rounds < 1:
        raise ValueError("--num-prompts, --output-len and --rounds must be >= 1, --warmup >= 0, --burstiness > 0")
    concurrency(args)
    loads = [serve.Load(r, c, ramp(args)) for r in args.request_rate for c in args.max_concurrency]
    most = max((c for c in args.max_concurrency if c is not None), default=None)
    if args.num_prompts is not None and most is not None and args.num_prompts < most:
        print(f"specdec bench serve: warning: --num-prompts {args.num_prompts} is below --max-concurrency {most}: "
              "those load points never fill, and their percentiles mean little", file=sys.stderr)
    if not args.base_url:
        check_variants(variants(args))
    pool = dataset(args, loads)     # a bad category, file or length fails before any server starts
    if args.backend != "openai-chat":                    # vLLM's openai backend: plain prompts, no template
        pool = (lambda make: lambda url: serve.as_completions(make(url)))(pool) if callable(pool) \
            else serve.as_completions(pool)
    out = args.out or args.result_dir or _results_root() / cpu_kind()
    output_folder(out, "--result-dir" if args.result_dir else "--out")
    sharegpt = args.dataset_name == "sharegpt"
    results = {"command": command_line(argv), "machine": machine_info(),
               "settings": {"output_len": args.sharegpt_output_len if sharegpt else args.output_len,
                            "temperature": args.temperature,
                            **{k: getattr(args, k) for k in ("top_p", "top_k", "min_p") if getattr(args, k) is not None}, "ignore_eos": args.ignore_eos,
                            "burstiness": "inf" if args.burstiness == float("inf") else args.burstiness,
                            "client": args.client,
                            "goodput_slo_ms": {k: round(v * 1000, 6) for k, v in slo.items()},   # 1001, not 1000.99..
                            "percentile_metrics": list(args.percentile_metrics),
                            "dataset": dataset_name(args), "requests": requests_sent(args),
                            "backend": sent_backend(args), "lora_modules": args.lora_modules, "shuffled": not args.disable_shuffle,
                            "oversampled": not args.no_oversample},
               "variants": []}
    runs = []           # (variant, its vLLM label, Measured) of each load point measured
    if args.base_url:
        url = args.base_url.rstrip("/")
        pool = pool(url) if callable(pool) else pool
        name = args.label or "server"
        measured = serve.measure(url, loads, serve.fitting(pool, url, args.output_len), args, slo)
        results["variants"].append({"name": name, "k": None, "argv": None, "points": [p for p, _ in measured]})
        runs = [(name, args.label, m) for _, m in measured]
        model = serve.first_model(url) if args.save_result else None
    else:
        model = _run_started(args, loads, pool, slo, out, results, runs)
    results["machine"]["load_average_after"] = machine_info()["load_average"]
    print(console(results))
    for path in write_all(results, out):
        print(path)
    if args.save_result:
        for path in serve_vllm.write(runs, args, out, _vllm_head(args, model), slo):
            print(path)
    for name, _, m in runs:
        if m.results and not any(r.ok for r in m.results):
            raise ValueError(f"every request of {name}, {m.load.name}, failed; the first: "
                             f"{serve.one_line(m.results[0].error)}")
    return 0


def sent_backend(args) -> str:
    """The backend the prompts really went through, as vLLM names it: random and prefix_repetition
    prompts, and custom ones with --skip-chat-template, go to /v1/completions (vLLM's openai
    backend) whatever --backend says."""
    if args.backend == "openai-chat" and (args.dataset_name in ("random", "prefix_repetition")
                                          or args.dataset_name == "custom" and args.skip_chat_template):
        return "openai"
    return args.backend


def _vllm_head(args, model: dict) -> dict:
    """The keys vLLM's result files open with: the model as vLLM names it (--model, else the
    server's first model's root)."""
    from datetime import datetime

    model_id, backend = args.model or model.get("root") or model["id"], sent_backend(args)
    return {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": backend, "backend": backend,
            "model_id": model_id, "tokenizer_id": args.tokenizer or model_id}


def _run_started(args, loads, pool, slo, out: Path, results: dict, runs: list) -> dict | None:
    """Start every variant's server, then measure each load point on each in turn; appends
    (variant, label, Measured) to runs; the first server's first model (with --save-result)."""
    from contextlib import ExitStack

    from . import serve

    serve.unwind_on_sigterm()
    with ExitStack() as stack:
        started = []
        for v in variants(args):
            log = out / f"server-{re.sub(r'[^a-z0-9]+', '-', v['name'].lower()).strip('-')}.log"
            print(f"starting {v['name']}: specdec serve {shlex.join(v['argv'])}", file=sys.stderr, flush=True)
            argv = v["argv"]
            if args.profile:
                folder = out / "profile" / log.stem.removeprefix("server-")
                argv = argv + ["--profiler-config", json.dumps({"profiler": "torch", "torch_profiler_dir": str(folder)})]
            started.append((v, stack.enter_context(serve.server(argv, log)).url))
            results["variants"].append({**v, "points": []})
        model = serve.first_model(started[0][1]) if args.save_result else None
        pool = pool(started[0][1]) if callable(pool) else pool
        pool = serve.fitting(pool, started[0][1], args.output_len)
        results["settings"]["prompts_that_fit"] = len(pool)
        results["settings"]["rounds"] = args.rounds
        for _, url in started:
            serve.warm_up(url, pool, args)
            if args.profile:
                serve.profile(url, "start")
        for load in loads:
            items = serve.point_requests(load, pool, args)
            # rounds of at least twice the concurrency each, the variants taking turns in every round
            rounds = max(1, min(args.rounds, len(items) // (2 * (load.concurrency or len(items)))))
            cuts = [len(items) * r // rounds for r in range(rounds + 1)]
            measured = [serve.Measured() for _ in started]
            for r in range(rounds):
                for (v, url), m, entry in zip(started, measured, results["variants"]):
                    print(f"{v['name']}:" + (f" {load.name}, round {r + 1} of {rounds}" if rounds > 1 else ""),
                          file=sys.stderr, flush=True)
                    m.run(url, items[cuts[r]:cuts[r + 1]], load, args, args.seed + r)
                    if r == rounds - 1:
                        entry["points"].append(m.point(load, slo, args))
                        runs.append((v["name"], v["name"], m))
        if args.profile:
            for _, url in started:
                serve.profile(url, "stop")
    return model


def _results_root() -> Path:
    """bench/serve: the checkout's (where the measured results are kept), else the current
    directory's (an installed specdec never writes into its own installation)."""
    checkout = Path(__file__).resolve().parents[2] / "bench" / "serve"
    return checkout if checkout.is_dir() else Path.cwd() / "bench" / "serve"
