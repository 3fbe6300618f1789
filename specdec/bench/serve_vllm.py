"""`specdec bench serve --save-result`: each variant's load point also as the flat JSON that
`vllm bench serve --save-result` writes (vllm/benchmarks/serve.py: main_async and benchmark), so
that scripts written for vLLM's results read specdec's: the same keys, times in ms, acceptance in
percent, per-request lists only with --save-detailed (vLLM drops them otherwise), and vLLM's file
name, `{label}-{rate}qps[-concurrency{c}]-{model}-{date}.json`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from .serve import METRICS, Load, Measured, peaks, per_position

DETAILED = ("input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors")


def _stats(values: list[float], percentiles: list[float]) -> dict:
    """vLLM's figures of one metric in ms: an empty list counts as [0], as np.mean(x or 0) does."""
    xs = np.array(values or [0.0]) * 1000.0
    return {"mean": float(np.mean(xs)), "median": float(np.median(xs)), "std": float(np.std(xs)),
            "percentiles": [(p, float(np.percentile(xs, p))) for p in percentiles]}


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def speculation(counters: dict) -> dict:
    """vLLM's spec_decode_* keys from the counters' increments; none when nothing was drafted."""
    drafts = counters.get("spec_decode_num_drafts_total", 0.0)
    drafted = counters.get("spec_decode_num_draft_tokens_total", 0.0)
    accepted = counters.get("spec_decode_num_accepted_tokens_total", 0.0)
    if drafted <= 0:
        return {}
    return {"spec_decode_acceptance_rate": accepted / drafted * 100,
            "spec_decode_acceptance_length": 1 + accepted / drafts if drafts > 0 else 0.0,
            "spec_decode_num_drafts": int(drafts), "spec_decode_draft_tokens": int(drafted),
            "spec_decode_accepted_tokens": int(accepted),
            "spec_decode_per_position_acceptance_rates": [a / drafts for a in per_position(counters)]
            if drafts > 0 else []}


def flat_result(m: Measured, args, head: dict, slo: dict) -> dict:
    """vLLM's result JSON of one load point: head (date, backend, label, model_id, tokenizer_id),
    the traffic, the benchmark's figures, then the speculative counters."""
    load: Load = m.load
    ok = [r for r in m.results if r.ok]
    out_lens = [r.output_tokens if r.ok else 0 for r in m.results]
    total_in, total_out, wall = sum(r.prompt_tokens for r in ok), sum(out_lens), m.wall
    good = [r for r in ok if all((getattr(r, k) or 0.0) <= v for k, v in slo.items())]   # a TPOT of None: 0
    result = {**head, "num_prompts": len(m.results),
              "request_rate": load.rate if load.rate != float("inf") else "inf",
              "burstiness": args.burstiness, "max_concurrency": load.concurrency,
              **({"ramp_up_strategy": load.ramp[0], "ramp_up_start_rps": load.ramp[1],
                  "ramp_up_end_rps": load.ramp[2]} if load.ramp else {}),
              "duration": wall, "completed": len(ok), "failed": len(m.results) - len(ok),
              "total_input_tokens": total_in, "total_output_tokens": total_out,
              "request_throughput": len(ok) / wall, "request_goodput": len(good) / wall if slo else None,
              "output_throughput": total_out / wall, "total_token_throughput": (total_in + total_out) / wall,
              "input_lens": [r.prompt_tokens for r in m.results], "output_lens": out_lens,
              "ttfts": [r.ttft if r.ok else 0.0 for r in m.results],
              "itls": [[float(x) for x in r.itl] if r.ok else [] for r in m.results],
              "latencies": [r.e2el if r.ok else 0.0 for r in m.results],
              "start_times": [r.sent for r in m.results],
              # each request's wait for --max-concurrency (vLLM keeps this list without --save-detailed)
              "queue_times": [r.sent - r.arrived for r in m.results],
              "generated_texts": [r.text for r in m.results],
              "errors": [r.error for r in m.results],
              **dict(zip(("max_output_tokens_per_s", "max_concurrent_requests"), peaks(m.results))),
              "rtfx": 0.0,                  # vLLM's speech-recognition figure: no audio here
              **({"rps_change_events": m.rps_change_events} if m.rps_change_events else {})}
    result.update(speculation(m.counters))
    values = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [g for r in ok for g in r.itl], "e2el": [r.e2el for r in ok]}
    for name in METRICS:                    # vLLM's order, whatever order --percentile-metrics gave
        if name not in args.percentile_metrics:
            continue
        s = _stats(values[name], args.metric_percentiles)
        result.update({f"mean_{name}_ms": s["mean"], f"median_{name}_ms": s["median"], f"std_{name}_ms": s["std"]})
        result.update({f"p{_p_word(p)}_{name}_ms": v for p, v in s["percentiles"]})
    if not getattr(args, "save_detailed", False):
        for key in DETAILED:
            del result[key]
    return result


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def file_name(label: str, load: Load, model_id: str, date: str) -> str:
    """vLLM's compute_result_filename without --result-filename."""
    concurrency = f"-concurrency{load.concurrency}" if load.concurrency is not None else ""
    base = model_id.rstrip("/").split("/")[-1]
    if load.ramp:
        return (f"{label}-ramp-up-{load.ramp[0]}-{load.ramp[1]:g}qps-{load.ramp[2]:g}qps{concurrency}-"
                f"{base}-{date}.json")
    return f"{label}-{load.rate}qps{concurrency}-{base}-{date}.json"


def write(runs: list[tuple[str, str | None, Measured]], args, out: Path, head: dict, slo: dict) -> list[Path]:
    """One vLLM result file per (variant, its "label" key, measured load point): --result-filename
    when there is a single one (else its stem with the variant and load after), vLLM's default name
    otherwise (the label, else the backend, first)."""
    paths = []
    variants = {name for name, _, _ in runs}
    for name, label, m in runs:
        file_label = label or args.backend
        if args.result_filename and len(runs) == 1:
            name = args.result_filename
        elif args.result_filename:
            load = m.load
            parts = ([_slug(name)] if len(variants) > 1 else []) + [
                f"ramp-up-{load.ramp[0]}-{load.ramp[1]:g}qps-{load.ramp[2]:g}qps" if load.ramp else f"{load.rate}qps"]
            parts += [f"concurrency{load.concurrency}"] if load.concurrency is not None else []
            name = f"{Path(args.result_filename).stem}-{'-'.join(parts)}.json"
        else:
            name = file_name(_slug(file_label), m.load, head["model_id"], head["date"])
        path = out / name
        path.write_text(json.dumps(flat_result(m, args, {**head, "label": label}, slo)))
        paths.append(path)
    return paths
