"""`specdec bench throughput` and `specdec bench latency`: vLLM's offline benchmarks
(`vllm bench throughput`, `vllm bench latency`) on one LLM in this process, no server.

    specdec bench throughput --dataset-name spec_bench --num-prompts 32 --output-json t.json
    specdec bench latency --input-len 32 --output-len 128 --batch-size 8

throughput: every prompt goes into one LLM.generate; it prints vLLM's lines (requests/s, total
and output tokens/s, prompt and output token totals) and, with speculation, the acceptance rate
and mean acceptance length of that run (LLM.get_metrics()'s counters, before and after).
latency: one batch of random prompts, generated num-iters times after num-iters-warmup untimed
times; it prints the mean, standard deviation and vLLM's percentiles of the batch's latency.

Both take the model and engine flags of `specdec generate` / `serve`. The defaults that vLLM
sizes for a GPU are smaller here (a few CPU cores): --num-prompts 32 (vLLM 1000),
--num-iters-warmup 2 and --num-iters 5 (vLLM 10 and 30). Sampling is greedy unless
--temperature says otherwise (vLLM's benchmarks sample at 1.0). Every result names the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import sys
import time
from pathlib import Path

NUM_PROMPTS = 32            # vLLM's 1000 takes an hour on two cores
RANDOM_INPUT_LEN = 128      # vLLM has none for throughput (it must be given); 1024 in bench serve
OUTPUT_LEN = 128
NUM_ITERS_WARMUP = 2        # vLLM's 10
NUM_ITERS = 5               # vLLM's 30
PERCENTAGES = (10, 25, 50, 75, 90, 99)
DATASETS = ("random", "spec_bench", "prefix_repetition", "custom", "sharegpt")
RANDOM_IDS = ("random", "prefix_repetition")      # prompts of random token ids: EOS is ignored


def _output_json(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--output-json", type=Path, help=f"write the {what} results to this JSON file (vLLM's keys, "
                                                    "the machine and the command line besides)")


def _common(p: argparse.ArgumentParser) -> None:
    from ..cli import add_engine_args, add_model_args

    add_model_args(p)
    add_engine_args(p)
    p.add_argument("--n", type=int, default=1, help="completions per prompt (default 1)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default; vLLM's benchmarks sample at 1.0)")
    p.add_argument("--seed", type=int, default=0, help="the engine's seed and the prompts' (default 0)")


def add_throughput_arguments(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--dataset-name", default="random",
                   help=f"one of {', '.join(DATASETS)} (default random): random token ids of set lengths; "
                        "spec_bench: Spec-Bench's questions through the chat template (the bundled 240, or "
                        "--dataset-path); prefix_repetition: random prompts sharing a few random prefixes; "
                        'custom: --dataset-path JSONL, one {"prompt": ...} a line; sharegpt: --dataset-path, '
                        "a ShareGPT JSON file (as `specdec bench serve` reads them)")
    p.add_argument("--dataset-path", help="spec_bench: a Spec-Bench question.jsonl; custom: a JSON Lines file; "
                                          "sharegpt: a ShareGPT JSON file")
    p.add_argument("--spec-bench-category", help="spec_bench: only this category (default: all)")
    p.add_argument("--skip-chat-template", action="store_true", help="custom: the prompts as they are")
    p.add_argument("--num-prompts", type=int, default=NUM_PROMPTS,
                   help=f"requests (default {NUM_PROMPTS}; vLLM's 1000 is too many for a few CPU cores); "
                        "a dataset smaller than this is repeated")
    p.add_argument("--input-len", type=int, help=f"random: prompt tokens (default {RANDOM_INPUT_LEN})")
    p.add_argument("--random-input-len", type=int, help="random: vLLM's name for --input-len (wins over it)")
    p.add_argument("--output-len", type=int,
                   help=f"max_tokens of every request (default {OUTPUT_LEN}; sharegpt: the replies' lengths)")
    p.add_argument("--random-output-len", type=int, help="random: vLLM's name for --output-len (wins over it)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: lengths drawn uniformly within +- this share of the lengths (default 0)")
    p.add_argument("--prefix-len", type=int,
                   help="random: a random prefix of this many tokens shared by every prompt (default 0)")
    p.add_argument("--random-prefix-len", type=int, help="random: vLLM's name for --prefix-len (wins over it)")
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256,
                   help="prefix_repetition: tokens of each shared prefix (default 256)")
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=256,
                   help="prefix_repetition: random tokens after it, per request (default 256)")
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=10,
                   help="prefix_repetition: distinct prefixes (default 10)")
    p.add_argument("--prefix-repetition-output-len", type=int,
                   help="prefix_repetition: max_tokens (default: --output-len)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="every request generates its max_tokens (always on for random and prefix_repetition: "
                        "their lengths are exact; vLLM's throughput ignores EOS on every dataset)")
    _output_json(p, "throughput")


def add_latency_arguments(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (random ids; default 32)")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt, EOS ignored (default 128)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts in the batch (default 8)")
    p.add_argument("--num-iters-warmup", type=int, default=NUM_ITERS_WARMUP,
                   help=f"untimed runs of the batch first (default {NUM_ITERS_WARMUP}; vLLM's 10)")
    p.add_argument("--num-iters", type=int, default=NUM_ITERS,
                   help=f"timed runs of the batch (default {NUM_ITERS}; vLLM's 30)")
    _output_json(p, "latency")
    # as vLLM's: the same batch every iteration, which a prefix cache would serve from the first
    p.set_defaults(enable_prefix_caching=False)
    for action in p._actions:
        if "--enable-prefix-caching" in action.option_strings:
            action.help = ("reuse cached prompt prefixes (default off here, as vLLM's latency benchmark: every "
                           "iteration runs the same batch, which a prefix cache would serve from the first)")


def run(args) -> int:
    return (run_throughput if args.bench_command == "throughput" else run_latency)(args)


# ---------------------------------------------------------------- throughput

def check_throughput(args) -> None:
    """Settle and check the flags (vLLM's spellings mapped as bench serve maps them); files read
    later are checked here too, all before the model loads."""
    if args.dataset_name not in DATASETS:
        raise ValueError(f"--dataset-name {args.dataset_name}: not a dataset here (choose from {', '.join(DATASETS)})")
    random_ids = args.dataset_name == "random"
    for flag, value in (("--input-len", args.input_len), ("--random-input-len", args.random_input_len),
                        ("--random-output-len", args.random_output_len)):
        if value is not None and not random_ids:
            raise ValueError(f"{flag} goes with --dataset-name random")
    if args.dataset_path is not None and args.dataset_name not in ("spec_bench", "custom", "sharegpt"):
        raise ValueError("--dataset-path goes with --dataset-name spec_bench, custom or sharegpt")
    if args.dataset_name in ("custom", "sharegpt") and not args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path FILE")
    if args.spec_bench_category and args.dataset_name != "spec_bench":
        raise ValueError("--spec-bench-category goes with --dataset-name spec_bench")
    if args.skip_chat_template and args.dataset_name != "custom":
        raise ValueError("--skip-chat-template goes with --dataset-name custom")
    for flag, value in (("--random-input-len", args.random_input_len), ("--random-output-len", args.random_output_len)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    # vLLM's throughput.py: the random_* flag wins, with a warning when both are given
    for name in ("input_len", "output_len", "prefix_len"):
        given = getattr(args, "random_" + name)
        if given is not None and getattr(args, name) is not None and random_ids:
            flag = name.replace("_", "-")
            print(f"specdec bench throughput: warning: both --{flag} and --random-{flag} are given: "
                  f"--random-{flag} ({given}) is used, as vLLM's", file=sys.stderr)
        if given is not None:
            setattr(args, name, given)
    if args.input_len is None:
        args.input_len = RANDOM_INPUT_LEN
    if args.prefix_len is None:
        args.prefix_len = 0
    args.sharegpt_output_len = args.output_len if args.dataset_name == "sharegpt" else None
    if args.output_len is None:
        args.output_len = OUTPUT_LEN
    if args.prefix_repetition_output_len is None:
        args.prefix_repetition_output_len = args.output_len
    for flag, value in (("--num-prompts", args.num_prompts), ("--n", args.n), ("--input-len", args.input_len),
                        ("--output-len", args.output_len)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.sharegpt_output_len is not None and args.sharegpt_output_len < 4:
        raise ValueError("--output-len: sharegpt's max_tokens must be >= 4 (vLLM's bound)")
    if random_ids and not 0.0 <= args.random_range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    if random_ids and args.prefix_len < 0:
        raise ValueError("--prefix-len must be >= 0")
    if args.dataset_name == "prefix_repetition":
        from .serve import check_prefix_repetition

        check_prefix_repetition(args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
                                args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len)
    if args.dataset_name in RANDOM_IDS:
        args.ignore_eos = True
    _check_common(args)


def _check_common(args) -> None:
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ValueError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}")
    if args.output_json is not None:
        if args.output_json.is_dir():
            raise ValueError(f"--output-json {args.output_json}: is a folder")
        if not args.output_json.parent.is_dir():
            raise ValueError(f"--output-json {args.output_json}: no folder {args.output_json.parent}")


def read_dataset(args):
    """What the chosen dataset gives before the model loads (a file is read here, so that a bad
    one fails first): a list of items, or for datasets that need the model's tokenizer, None."""
    from . import serve

    if args.dataset_name == "spec_bench":
        return serve.questions(args.spec_bench_category, args.dataset_path)
    if args.dataset_name == "custom":
        return serve.custom_requests(args.dataset_path, args.skip_chat_template)
    if args.dataset_name == "sharegpt":
        return serve.sharegpt_pairs(args.dataset_path)
    return None


def requests(args, llm, read) -> list[dict]:
    """[{"prompt": {"prompt_token_ids": ids}, "max_tokens": n}] of --num-prompts requests. Chat
    items go through the model's chat template; those whose prompt leaves no room for their
    output in the context are left out (as bench serve does), before the seeded sample."""
    from . import serve

    tok = llm.tokenizer
    if args.dataset_name == "random":
        items = serve.random_requests(tok, args.num_prompts, args.input_len, args.output_len,
                                      args.random_range_ratio, args.prefix_len, args.seed)
    elif args.dataset_name == "prefix_repetition":
        items = serve.prefix_repetition_requests(tok, args.num_prompts, args.prefix_repetition_prefix_len,
                                                 args.prefix_repetition_suffix_len,
                                                 args.prefix_repetition_num_prefixes,
                                                 args.prefix_repetition_output_len, args.seed)
    elif args.dataset_name == "sharegpt":
        items = serve.sharegpt_requests(read, tok, args.sharegpt_output_len, args.seed)
    else:
        items = read
    out = []
    for it in items:
        if "prompt_token_ids" in it:
            ids = it["prompt_token_ids"]
        elif "messages" in it:
            ids = llm.chat_prompt(it["messages"])["prompt_token_ids"]
        else:
            ids = tok.encode(it["prompt"])
        out.append({"prompt": {"prompt_token_ids": ids}, "max_tokens": it.get("max_tokens", args.output_len)})
    limit = llm.engine.max_model_len
    fit = [r for r in out if len(r["prompt"]["prompt_token_ids"]) + r["max_tokens"] <= limit]
    if not fit:
        raise ValueError(f"no prompt of --dataset-name {args.dataset_name} leaves room for its output tokens in "
                         f"the model's {limit} (--max-model-len)")
    if len(fit) < len(out):
        print(f"{len(out) - len(fit)} of {len(out)} prompts leave no room for their output tokens in {limit}: "
              "left out", file=sys.stderr)
    if args.dataset_name in RANDOM_IDS:
        return fit
    return serve.sample(fit, args.num_prompts, args.seed)


def run_throughput(args) -> int:
    from ..config import SamplingParams
    from ..cli import llm_from_args

    check_throughput(args)
    read = read_dataset(args)
    llm = llm_from_args(args, seed=args.seed)
    llm.check_runner("generate")
    reqs = requests(args, llm, read)
    params = [SamplingParams(n=args.n, temperature=args.temperature, max_tokens=r["max_tokens"],
                             ignore_eos=args.ignore_eos) for r in reqs]
    _warm_up(llm)
    before = counters(llm)
    start = time.perf_counter()
    outputs = llm.generate([r["prompt"] for r in reqs], params, use_tqdm=sys.stderr.isatty())
    elapsed = time.perf_counter() - start
    spec = acceptance(llm, before, counters(llm))
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    total = prompt_tokens + output_tokens
    print(f"Throughput: {len(reqs) / elapsed:.2f} requests/s, {total / elapsed:.2f} total tokens/s, "
          f"{output_tokens / elapsed:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    _print_speculation(llm, spec)
    _print_machine()
    if args.output_json is not None:
        results = {"elapsed_time": elapsed, "num_requests": len(reqs), "total_num_tokens": total,
                   "requests_per_second": len(reqs) / elapsed, "tokens_per_second": total / elapsed,
                   "total_num_prompt_tokens": prompt_tokens, "total_num_output_tokens": output_tokens,
                   "output_tokens_per_second": output_tokens / elapsed, **(spec or {}),
                   "speculative": method(llm),
                   "settings": {"dataset_name": args.dataset_name, "num_prompts": args.num_prompts, "n": args.n,
                                "input_len": args.input_len if args.dataset_name == "random" else None,
                                "output_len": args.sharegpt_output_len if args.dataset_name == "sharegpt"
                                else args.output_len,
                                "temperature": args.temperature, "ignore_eos": args.ignore_eos, "seed": args.seed,
                                "max_num_seqs": args.max_num_seqs, "model": llm.model_path}}
        write(args, results)
    return 0


# ---------------------------------------------------------------- latency

def run_latency(args) -> int:
    import numpy as np

    from ..config import SamplingParams
    from ..cli import llm_from_args
    from . import serve

    for flag, value, least in (("--input-len", args.input_len, 1), ("--output-len", args.output_len, 1),
                               ("--batch-size", args.batch_size, 1), ("--num-iters", args.num_iters, 1),
                               ("--num-iters-warmup", args.num_iters_warmup, 0)):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    _check_common(args)
    llm = llm_from_args(args, seed=args.seed)
    llm.check_runner("generate")
    if args.input_len + args.output_len > llm.engine.max_model_len:
        raise ValueError(f"--input-len + --output-len ({args.input_len + args.output_len}) exceed the model's "
                         f"{llm.engine.max_model_len} tokens (--max-model-len)")
    prompts = [{"prompt_token_ids": it["prompt_token_ids"]}
               for it in serve.random_requests(llm.tokenizer, args.batch_size, args.input_len, args.output_len,
                                               seed=args.seed)]
    params = SamplingParams(n=args.n, temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)

    def once() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start

    print(f"Warming up: {args.num_iters_warmup} runs of the batch", file=sys.stderr, flush=True)
    for _ in range(args.num_iters_warmup):
        once()
    before = counters(llm)
    latencies = []
    for i in range(args.num_iters):
        latencies.append(once())
        print(f"iteration {i + 1} of {args.num_iters}: {latencies[-1]:.3f} s", file=sys.stderr, flush=True)
    spec = acceptance(llm, before, counters(llm))
    arr = np.array(latencies)
    percentiles = np.percentile(arr, PERCENTAGES)
    print(f"Avg latency: {arr.mean().item()} seconds")
    print(f"Std latency: {arr.std().item()} seconds")
    for pct, value in zip(PERCENTAGES, percentiles.tolist()):
        print(f"{pct}% percentile latency: {value} seconds")
    _print_speculation(llm, spec)
    _print_machine()
    if args.output_json is not None:
        results = {"avg_latency": arr.mean().item(), "std_latency": arr.std().item(), "latencies": latencies,
                   "percentiles": {str(p): v for p, v in zip(PERCENTAGES, percentiles.tolist())}, **(spec or {}),
                   "speculative": method(llm),
                   "settings": {"input_len": args.input_len, "output_len": args.output_len,
                                "batch_size": args.batch_size, "n": args.n, "num_iters_warmup": args.num_iters_warmup,
                                "num_iters": args.num_iters, "temperature": args.temperature, "seed": args.seed,
                                "enable_prefix_caching": args.enable_prefix_caching, "model": llm.model_path}}
        write(args, results)
    return 0


# ---------------------------------------------------------------- shared

def _warm_up(llm) -> None:
    """One short untimed request first (its counters are left out), so the timed run excludes
    one-off costs; random ids, so that it shares no prefix with the benchmark's prompts."""
    from ..config import SamplingParams
    from .serve import random_requests

    ids = random_requests(llm.tokenizer, 1, 8, 4, seed=2**31 - 1)[0]["prompt_token_ids"]
    llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))


def counters(llm) -> dict:
    """LLM.get_metrics()'s speculative counters by name (the per-position one a list)."""
    return {m.name: (list(m.values) if hasattr(m, "values") else m.value)
            for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}


def acceptance(llm, before: dict, after: dict) -> dict | None:
    """The speculative counters' increments as vLLM's result keys (acceptance rate in percent,
    acceptance length = 1 + accepted per draft, per-position acceptance per draft); None when
    decoding plainly."""
    if llm.engine.proposer is None:
        return None

    def delta(name):
        return after.get(f"vllm:spec_decode_{name}", 0) - before.get(f"vllm:spec_decode_{name}", 0)

    drafts, drafted, accepted = delta("num_drafts"), delta("num_draft_tokens"), delta("num_accepted_tokens")
    was = before.get("vllm:spec_decode_num_accepted_tokens_per_pos", [])
    per_pos = [a - (was[i] if i < len(was) else 0)
               for i, a in enumerate(after.get("vllm:spec_decode_num_accepted_tokens_per_pos", []))]
    return {"spec_decode_acceptance_rate": accepted / drafted * 100 if drafted else 0.0,
            "spec_decode_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
            "spec_decode_num_drafts": drafts, "spec_decode_draft_tokens": drafted,
            "spec_decode_accepted_tokens": accepted,
            "spec_decode_per_position_acceptance_rates": [a / drafts for a in per_pos] if drafts else []}


def method(llm) -> dict | None:
    """The speculative method that ran ({method, num_speculative_tokens, model}); None: plain."""
    spec = llm.spec
    if spec is None or llm.engine.proposer is None:
        return None
    return {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens, "model": spec.model}


def _print_speculation(llm, spec: dict | None) -> None:
    m = method(llm)
    if m is None:
        print("Speculative decoding: none (plain decoding)")
        return
    print(f"Speculative decoding: {m['method']}, K={m['num_speculative_tokens']}")
    if not spec["spec_decode_num_drafts"]:
        print("Acceptance rate: no drafts")
        return
    per_pos = " ".join(f"{x:.2f}" for x in spec["spec_decode_per_position_acceptance_rates"])
    print(f"Acceptance rate: {spec['spec_decode_acceptance_rate']:.2f}% ({spec['spec_decode_accepted_tokens']} of "
          f"{spec['spec_decode_draft_tokens']} draft tokens), mean acceptance length: "
          f"{spec['spec_decode_acceptance_length']:.2f} (per position: {per_pos})")


def _print_machine() -> None:
    import os

    from .machine import cpu_model

    load = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    print(f"Machine: {cpu_model()}, {os.cpu_count()} cores, load average {load}")


def write(args, results: dict) -> None:
    from .machine import machine_info

    results = {**results, "machine": machine_info(),
               "command": shlex.join(["specdec", *getattr(args, "command_line", [])])}
    args.output_json.write_text(json.dumps(results, indent=4, default=_plain) + "\n")
    print(args.output_json)


def _plain(obj):
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    return str(obj)
