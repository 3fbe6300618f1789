"""`specdec bench`: flags, then load once -> build variants -> measure each scenario -> report."""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path

from ..cli import _compilation_config
from ..cli import positive_int as _positive

DEFAULT_KS = "1,2,4,6,8,auto"


def add_parser(sub) -> None:
    from ..cli import add_model_args

    # "resolve": bench takes a list of K where generate takes one value
    p = sub.add_parser("bench", conflict_handler="resolve", allow_abbrev=False,
                       help="benchmark speculative methods side by side with transformers' generate; "
                            "bench serve / throughput / latency: vLLM's benchmarks")
    add_model_args(p)
    p.add_argument("--num-speculative-tokens", default=DEFAULT_KS, type=_ks,
                   help=f'comma-separated K values, "auto" included (default {DEFAULT_KS})')
    p.add_argument("--speculative-config", type=_per_method,
                   help='per-method settings as JSON, e.g. \'{"layer_skip": {"num_layers": 2}, "ngram": {"prompt_lookup_min": 1, "prompt_lookup_max": 3}}\'')
    p.add_argument("--methods", type=_names, help="comma-separated: plain, any registered method, hf_plain, hf_assisted, "
                   "hf_assisted_default, hf_assisted_heuristic, hf_prompt_lookup, llamacpp_plain, "
                   "llamacpp_prompt_lookup (default: plain, every registered method and every method of the --peers "
                   "families but hf_assisted_heuristic)")
    p.add_argument("--temperature", type=_temps, default="0,1", help="comma-separated temperatures (default 0,1)")
    p.add_argument("--top-p", type=_top_p, default=1.0,
                   help="nucleus sampling of the sampled runs, every method and peer alike (default 1.0: off)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="every request generates its max tokens (as vllm bench's flag): sampled runs of different "
                        "methods then time the same number of tokens, whatever text each draws")
    p.add_argument("--prompts", type=_names, default="code",
                   help="comma-separated prompt sets: bundled names (code, repeat), spec-bench (Spec-Bench's "
                        "questions through the chat template, reported per category) or .jsonl files (default code)")
    p.add_argument("--limit-prompts", type=_positive, help="use only the first N prompts of each set")
    p.add_argument("--limit-per-category", type=_positive,
                   help="spec-bench: only the first N questions of each category (a quick run)")
    p.add_argument("--categories", type=_names,
                   help="spec-bench: only these categories, comma-separated (e.g. summarization,rag,qa)")
    p.add_argument("--max-tokens", type=_positive, default=64, help="new tokens per prompt unless the set says (default 64)")
    p.add_argument("--repeats", type=_positive, default=3, help="timed repetitions after one warm-up (default 3)")
    p.add_argument("--peers", nargs="?", type=_families, const=["transformers"], default=["transformers"],
                   help="peers run on the same checkpoint and token ids: comma-separated families, transformers "
                        "(its generate) and llamacpp (llama.cpp through llama-cpp-python, GGUF targets; "
                        "pip install -e '.[peers]'); --peers alone = transformers (the default)")
    p.add_argument("--no-peers", dest="peers", action="store_const", const=[], help="no peers")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time requests by the wall clock (default) or by the process's CPU time (all its threads): "
                        "honest on a shared, loaded machine with --threads 1; with more threads it also counts "
                        "threads spinning while they wait for each other")
    p.add_argument("--seed", type=int, default=0, help="base seed of sampled runs (prompt i uses seed + i)")
    p.add_argument("--threads", type=_positive, help="torch threads (default: torch's choice)")
    p.add_argument("-O", "--compilation-config", default=None, type=_checked_compilation_config,
                   help='vLLM\'s: \'{"cudagraph_mode": "FULL_DECODE_ONLY"}\' runs every specdec variant\'s target '
                        "forwards as CUDA graphs (--device cuda; each engine captures its own)")
    p.add_argument("--out", type=Path,
                   help="folder for results.json, results.md and the plots (required); {cpu} in it is replaced by the "
                        "CPU's kind (e.g. bench/{cpu}/smollm2 -> bench/xeon-avx512vnni/smollm2: results kept per machine kind)")
    # argparse reads every word against bench's own flags first: without this, throughput's and
    # latency's --n (vLLM's) is an ambiguous abbreviation (--num-speculative-tokens, --no-peers)
    p.add_argument("--n", type=_after_subcommand, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="bench_command", metavar="{serve,throughput,latency}")
    from .offline import add_latency_arguments, add_throughput_arguments
    from .serve_cli import add_arguments

    add_arguments(sub.add_parser("serve", allow_abbrev=False, help="an OpenAI server under load (vLLM's `vllm bench serve`): throughput, "
                                 "goodput, TTFT/TPOT/ITL/E2EL, acceptance, plain vs fixed K vs auto"))
    add_throughput_arguments(sub.add_parser("throughput", allow_abbrev=False, help="every prompt through one LLM.generate (vLLM's `vllm "
                                            "bench throughput`): requests/s, tokens/s, acceptance"))
    add_latency_arguments(sub.add_parser("latency", allow_abbrev=False, help="one batch's end-to-end latency over iterations (vLLM's "
                                         "`vllm bench latency`): mean and percentiles"))


def _after_subcommand(value: str):
    raise argparse.ArgumentTypeError("goes after `throughput` or `latency` (completions per prompt)")


def _top_p(value: str) -> float:
    try:
        p = float(value)
    except ValueError:
        p = -1.0
    if not 0 < p <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value!r}")
    return p


def _split(value: str) -> list[str]:
    items = [x.strip() for x in value.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError("must list at least one value")
    return items


def _names(value: str) -> list[str]:
    return _split(value)


def _ks(value: str) -> list:
    out = []
    for x in _split(value):
        if x == "auto":
            out.append(x)
            continue
        try:
            k = int(x)
        except ValueError:
            raise argparse.ArgumentTypeError(f'K must be an integer >= 1 or "auto", got {x!r}') from None
        if k < 1:
            raise argparse.ArgumentTypeError(f"K must be >= 1, got {k}")
        out.append(k)
    return list(dict.fromkeys(out))


def _temps(value: str) -> list[float]:
    try:
        temps = [float(x) for x in _split(value)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"temperatures must be numbers, got {value!r}") from None
    if any(not (math.isfinite(t) and t >= 0) for t in temps):
        raise argparse.ArgumentTypeError(f"temperatures must be finite numbers >= 0, got {value!r}")
    return list(dict.fromkeys(temps))


FAMILIES = ("transformers", "llamacpp")


def _families(value: str) -> list[str]:
    items = _split(value)
    bad = [x for x in items if x not in FAMILIES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown peer family {bad[0]!r} (choose from {', '.join(FAMILIES)})")
    return list(dict.fromkeys(items))


def _per_method(value: str) -> dict:
    from ..cli import _json_obj

    obj = _json_obj(value)
    if not all(isinstance(v, dict) for v in obj.values()):
        raise argparse.ArgumentTypeError('must map method names to objects: {"layer_skip": {"num_layers": 2}}')
    return obj


def command_line(args) -> str:
    """The run's full command with every setting explicit, for results and README."""
    parts = ["specdec", "bench"]
    for flag, value in (("--model", args.model), ("--speculative-model", args.speculative_model),
                        ("--quantization", None if args.quantization == "auto" else args.quantization),
                        ("--dtype", args.dtype), ("--device", args.device), ("--max-model-len", args.max_model_len),
                        ("--methods", ",".join(args.methods) if args.methods else None),
                        ("--num-speculative-tokens", ",".join(map(str, args.num_speculative_tokens))),
                        ("--temperature", ",".join(f"{t:g}" for t in args.temperature)),
                        ("--top-p", None if args.top_p == 1.0 else f"{args.top_p:g}"),
                        ("--prompts", ",".join(args.prompts)), ("--limit-prompts", args.limit_prompts),
                        ("--limit-per-category", args.limit_per_category),
                        ("--categories", ",".join(args.categories) if args.categories else None),
                        ("--max-tokens", args.max_tokens), ("--repeats", args.repeats), ("--seed", args.seed),
                        ("--threads", args.threads), ("--clock", args.clock), ("--out", args.out)):
        if value is not None:
            parts += [flag, str(value)]
    if args.ignore_eos:
        parts.append("--ignore-eos")
    import json
    if args.compilation_config:
        parts += ["--compilation-config", args.compilation_config]
    if args.hf_overrides:
        parts += ["--hf-overrides", json.dumps(args.hf_overrides)]
    if args.tokenizer:
        parts += ["--tokenizer", args.tokenizer]
    if args.hf_config_path:
        parts += ["--hf-config-path", args.hf_config_path]
    if args.generation_config != "auto":
        parts += ["--generation-config", args.generation_config]
    if getattr(args, "override_generation_config", None):
        parts += ["--override-generation-config", json.dumps(args.override_generation_config)]
    if args.disable_sliding_window:
        parts.append("--disable-sliding-window")
    if args.speculative_config:
        parts += ["--speculative-config", json.dumps(args.speculative_config)]
    parts += ["--peers", ",".join(args.peers)] if args.peers else ["--no-peers"]
    return shlex.join(parts)


def run(args) -> int:
    if args.bench_command == "serve":
        from .serve_cli import run as run_serve

        words = list(getattr(args, "words", None) or getattr(args, "command_line", []))   # --config's flags in
        return run_serve(args, words[words.index("serve") + 1:] if "serve" in words else [])
    if args.bench_command in ("throughput", "latency"):
        from . import offline

        return offline.run(args)
    if args.out is None:
        raise ValueError("specdec bench: --out is required")
    from . import machine
    from .spec_bench import NAME as SPEC_BENCH

    if SPEC_BENCH not in args.prompts and (args.limit_per_category is not None or args.categories):
        raise ValueError(f"--limit-per-category and --categories go with --prompts {SPEC_BENCH}")
    check_hf_config_path(args)
    args.out = output_folder(Path(str(args.out).replace("{cpu}", machine.cpu_kind())), "--out")
    from .run import run_benchmark

    results, written = run_benchmark(args, command_line(args))
    for s in results["scenarios"]:
        print(f"{s['name']}:", file=sys.stderr)
        for m in s["methods"]:
            sp = m["speedup_vs_plain"]
            g = m["greedy_match"]
            same = "" if g is None else ("  greedy identical" if g["identical"] else "  GREEDY MISMATCH")
            roof = m.get("roofline_fraction")
            print(f"  {m['name']:<30} {m['tokens_per_second']['median']:8.1f} tok/s"
                  f"  {sp['median'] if sp else float('nan'):5.2f}x"
                  + (f"  {roof:5.0%} of roofline" if roof is not None else "") + same, file=sys.stderr)
    for path in written:
        print(path)
    return 0


def check_hf_config_path(args) -> None:
    """--hf-config-path settled (a Hugging Face id: its cached snapshot at --revision under
    --download-dir, as LLM(...) reads it) and refused as generate refuses it, a folder without a
    config.json, before --out is made and the model loads."""
    if args.hf_config_path is None:
        return
    from ..llm import _hub_snapshot
    from ..model.checkpoint import CheckpointError, read_config

    args.hf_config_path = str(_hub_snapshot(args.hf_config_path, getattr(args, "revision", None),
                                            getattr(args, "download_dir", None)))
    try:
        read_config(args.hf_config_path)
    except CheckpointError as e:
        raise ValueError(f"{args.model or 'the default model'}: hf_config_path {e}") from None


def output_folder(path: Path, flag: str) -> Path:
    """path made a folder (it may exist as one) before anything runs; an error names the flag."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path}: exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None
    return path


def _checked_compilation_config(value: str) -> str:
    """-O's value checked as `specdec generate` checks it (an error names the flag), kept as text:
    the benchmark writes it into its command lines."""
    _compilation_config(value)
    return value
