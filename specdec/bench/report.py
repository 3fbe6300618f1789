"""results.json, results.md and the PNG plots from the summarized results."""

from __future__ import annotations

import json
from pathlib import Path

from . import machine, plots, spec_bench


def write_all(results: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for scenario in results["scenarios"]:
        written += plots.plot_scenario(scenario, out)
    results["plots"] = [p.name for p in written]
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results))
    return [out / "results.json", out / "results.md", *written]


def _num(x, digits: int = 2, suffix: str = "") -> str:
    return "–" if x is None else f"{x:.{digits}f}{suffix}"


def _spread(s: dict | None, digits: int = 2, suffix: str = "") -> str:
    if s is None:
        return "–"
    return f"{s['median']:.{digits}f}{suffix} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def _greedy(m: dict) -> str:
    g = m["greedy_match"]
    if g is None:
        return "n/a (sampled)"
    if g["identical"]:
        return "yes"
    why = "; logit near-ties" if g.get("all_listed_near_ties") else ""
    return f"**NO** ({g['mismatched_prompts']}/{g['checked_prompts']} prompts{why})"


def _positions(xs: list[float], limit: int = 8) -> str:
    shown = " ".join(f"{x:.2f}" for x in xs[:limit])
    return (shown + " …") if len(xs) > limit else (shown or "–")


HEADER = ("| method | K | tokens/s median (min–max) | × specdec plain | × plain, decode phase | × HF plain | predicted × own plain | α | tokens/step "
          "| acceptance by position | target fwd ms | draft ms/token | c | greedy = plain |")


def table(scenario: dict) -> str:
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for m in scenario["methods"]:
        k = "–" if m["k"] in (None, 0) else str(m["k"])
        if m["k"] in (None, "auto") and m["num_drafts"]:
            k += f" (mean {m['mean_k']:.1f})"
        name = m["name"].split(" K=")[0] + (" (transformers)" if m["family"] == "transformers" else "")
        lines.append("| " + " | ".join([
            name, k, _spread(m["tokens_per_second"], 1), _spread(m["speedup_vs_plain"], 2, "x"),
            _spread(m.get("decode_speedup_vs_plain"), 2, "x"),
            _spread(m["speedup_vs_hf_plain"], 2, "x"), _num(m["predicted_speedup"], 2, "x"),
            _num(m["acceptance_rate"], 3), _num(m["mean_accepted_length"], 2),
            _positions(m["per_position_acceptance"]), _num(m["target_forward_ms"], 2),
            _num(m["draft_token_ms"], 3), _num(m["c"], 3), _greedy(m)]) + " |")
    return "\n".join(lines)


def _header_lines(results: dict) -> list[str]:
    mach, cfg = results["machine"], results["config"]
    lines = [f"Command: `{results['command']}`", "",
             (f"Machine: {mach['cpu']}, {mach['cores']} cores, torch {mach['torch']} with {mach['torch_threads']} "
              f"threads, transformers {mach['transformers']}, specdec {mach['specdec_commit']}; load average "
              f"{mach['load_average']} at the start, {mach.get('load_average_end')} at the end."
              + (f" CPU kernels: {mach['kernels']}." if mach.get("kernels") else ""))]
    if machine.busy(mach):
        lines += ["", (f"**Warning:** other work held at least half of the {mach['cores']} cores when this run "
                       "started: these timings are not representative.")]
    lines += ["", f"Target `{cfg['model']}`, draft `{cfg['draft_model']}`, dtype {cfg['dtype']}, device {cfg['device']}."]
    roof = results.get("roofline")
    if roof:
        lines += ["", f"Roofline for plain decoding: {roof['weight_bytes_per_step'] / 1e6:.1f} MB of {roof['dtype']} weights "
                      f"per token at {roof['memory_bandwidth_gb_s']} GB/s (measured copy bandwidth) = "
                      f"{roof['roofline_tokens_per_second']} tokens/s."]
    return lines


LEGEND = (
    "Columns: tokens/s over each repeat's prompts (median and min–max of repeats); speedups are ratios "
    "within each repeat (tokens/s include the prompt's prefill; \"decode phase\" leaves it out: output "
    "tokens over the time after the prompt's forward, the per-token latency users see once streaming starts); predicted × is (1 − α^(K+1)) / ((1 − α)(Kc + 1)) over the method's own family's plain "
    "decoding, from its measured α (acceptance rate), K (mean drafted per step) and c = draft ms per drafted "
    "token / target ms per verification forward; tokens/step = output tokens per target forward; greedy = plain "
    "compares every token of every repeat with specdec plain decoding."
)


def markdown(results: dict) -> str:
    lines = ["# specdec bench", "", *_header_lines(results), "", LEGEND]
    for s in results["scenarios"]:
        lines += ["", f"## {s['prompt_set']} prompts, temperature {s['temperature']:g}", "",
                  f"{s['num_prompts']} prompts (mean {s['prompt_tokens_mean']} tokens), up to {s['max_tokens']} new tokens, "
                  f"{s['repeats']} interleaved repeats after one warm-up per method. Speedups are per-repeat ratios "
                  f"(median, min–max).", "", table(s)]
        if s.get("categories"):
            lines += ["", "### Per category (Spec-Bench)", "", spec_bench.tables(s)]
        plain = next((m for m in s["methods"] if m["name"] == "plain"), None)
        roof = results.get("roofline")
        if plain and roof:
            frac = plain["tokens_per_second"]["median"] / roof["roofline_tokens_per_second"]
            lines += ["", f"specdec plain runs at {frac:.0%} of the roofline "
                          f"({roof['roofline_tokens_per_second'] / plain['tokens_per_second']['median']:.2f}x from it)."]
        for name in results.get("plots", []):
            if name.endswith(f"_{s['name']}.png"):
                lines += ["", f"![{name}]({name})"]
    if results["skipped"]:
        lines += ["", "## Skipped", ""]
        lines += [f"- {x['method']}" + (f" K={x['k']}" if x["k"] is not None else "") + f": {x['reason']}"
                  for x in results["skipped"]]
    return "\n".join(lines) + "\n"
