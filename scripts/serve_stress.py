"""Stress a server: many streaming clients with random disconnects and bad requests mixed in
(specdec/bench/stress.py), for a fixed time; report 5xx, mismatches against solo outputs, the
server's memory over time. Exit status 0 when every check passed.

    python scripts/serve_stress.py --clients 64 --seconds 600 --out bench/serve/stress.json
    python scripts/serve_stress.py --model models/target --clients 16 --seconds 30
    python scripts/serve_stress.py --server-args "--enable-lora --lora-modules a=PATH b=PATH" --lora-modules a b

The server runs without prefix caching unless --server-args name it: the cache keeps the KV
pool's blocks after their requests, so the process touches more of the pool's pages as new
prompts come (84 MB of a 151 MB pool in 60 s, toy model with EAGLE, 16 clients), which the
memory check cannot tell from a leak.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from specdec.bench import serve, stress
from specdec.bench.machine import machine_info


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="default: the default model (SmolLM2 with its default suffix decoding when installed)")
    p.add_argument("--server-args", default="", help="more `specdec serve` flags")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between memory samples")
    p.add_argument("--out", type=Path, help="write the report here (JSON)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME",
                   help="the server's LoRA adapters: valid requests name one of them, or the base model, at random")
    args = p.parse_args()
    # the memory check reads the server's resident memory: a prefix cache (on by default) keeps
    # filling the KV pool's untouched pages while new prompts come, which reads as growth
    argv = serve.without_prefix_caching((["--model", args.model] if args.model else []) + shlex.split(args.server_args))
    log = (args.out.with_suffix(".server.log") if args.out else Path("serve_stress.server.log"))
    before = machine_info()["load_average"]
    serve.unwind_on_sigterm()
    with serve.server(argv, log) as started:
        report = stress.run(started.url, args.clients, args.seconds, args.max_tokens,
                            stress.process_rss(started.pid), args.sample_every, loras=tuple(args.lora_modules))
    result = {"command": shlex.join([sys.executable, *sys.argv]), "load_average_before": before,
              "load_average_after": machine_info()["load_average"], **report.to_dict()}
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    summary = {k: result[k] for k in ("ok", "actions", "status", "tokens", "num_failures", "memory_growth")}
    print(json.dumps(summary))
    return 0 if report.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
