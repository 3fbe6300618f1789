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


COLUMNS = ("method", "K", "tokens/s median (min–max)", "× specdec plain", "× plain, decode phase", "× HF plain",
           "× llama.cpp plain", "of roofline", "predicted × own plain", "α", "tokens/step", "acceptance by position",
           "target fwd ms", "draft ms/token", "c", "greedy = plain", "greedy = own plain")
OPTIONAL = {"× HF plain": "speedup_vs_hf_plain", "× llama.cpp plain": "speedup_vs_llamacpp_plain",
            "× plain, decode phase": "decode_speedup_vs_plain", "greedy = own plain": "greedy_match_own_plain"}
FAMILY_LABEL = {"transformers": " (transformers)", "llama.cpp": " (llama.cpp)"}


def _own(m: dict) -> str:
    g = m.get("greedy_match_own_plain")
    return "–" if g is None else _greedy({"greedy_match": g})


def table(scenario: dict) -> str:
    """One row per method; a column that no method fills (a peer family that did not run) is left out."""
    methods = scenario["methods"]
    cols = [c for c in COLUMNS if c not in OPTIONAL or any(m.get(OPTIONAL[c]) is not None for m in methods)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for m in methods:
        k = "–" if m["k"] in (None, 0) else str(m["k"])
        if m["k"] in (None, "auto") and m["num_drafts"]:
            k += f" (mean {m['mean_k']:.1f})"
        roof = m.get("roofline_fraction")
        cell = {
            "method": m["name"].split(" K=")[0] + FAMILY_LABEL.get(m["family"], ""), "K": k,
            "tokens/s median (min–max)": _spread(m["tokens_per_second"], 1),
            "× specdec plain": _spread(m["speedup_vs_plain"], 2, "x"),
            "× plain, decode phase": _spread(m.get("decode_speedup_vs_plain"), 2, "x"),
            "× HF plain": _spread(m.get("speedup_vs_hf_plain"), 2, "x"),
            "× llama.cpp plain": _spread(m.get("speedup_vs_llamacpp_plain"), 2, "x"),
            "of roofline": "–" if roof is None else f"{roof:.0%}",
            "predicted × own plain": _num(m["predicted_speedup"], 2, "x"), "α": _num(m["acceptance_rate"], 3),
            "tokens/step": _num(m.get("tokens_per_forward", m["mean_accepted_length"]), 2), "acceptance by position": _positions(m["per_position_acceptance"]),
            "target fwd ms": _num(m["target_forward_ms"], 2), "draft ms/token": _num(m["draft_token_ms"], 3),
            "c": _num(m["c"], 3), "greedy = plain": _greedy(m), "greedy = own plain": _own(m)}
        lines.append("| " + " | ".join(cell[c] for c in cols) + " |")
    return "\n".join(lines)


def _header_lines(results: dict) -> list[str]:
    mach, cfg = results["machine"], results["config"]
    lines = [f"Command: `{results['command']}`", "",
             (f"Machine: {mach['cpu']}, {mach['cores']} cores, torch {mach['torch']} with {mach['torch_threads']} "
              f"threads, transformers {mach['transformers']}, specdec {mach['specdec_commit']}; load average "
              f"{mach['load_average']} at the start, {mach.get('load_average_end')} at the end."
              + (f" CPU kernels: {mach['kernels']}." if mach.get("kernels") else "")
              + (f" GPU: {mach['gpu']}." if mach.get("gpu") else ""))]
    if machine.busy(mach):
        lines += ["", (f"**Warning:** other work held at least half of the {mach['cores']} cores when this run "
                       "started: these timings are not representative.")]
    lines += ["", f"Target `{cfg['model']}`, draft `{cfg['draft_model']}`, dtype {cfg['dtype']}, device {cfg['device']}, "
                  f"{cfg.get('threads')} threads for every method, timed by the {cfg.get('clock', 'wall')} clock"
                  + (" (the process's CPU time)" if cfg.get("clock") == "cpu" else "") + "."]
    lc = next((m["settings"] for s in results["scenarios"] for m in s["methods"] if m["family"] == "llama.cpp"), None)
    if lc:
        lines += ["", f"llama.cpp: llama-cpp-python {lc['llama_cpp_python']}, {lc['system_info']}"]
    roof = results.get("roofline")
    if roof:
        lines += ["", f"Roofline for plain decoding: {roof['weight_bytes_per_step'] / 1e6:.1f} MB of {roof['dtype']} weights "
                      f"per token at {roof['memory_bandwidth_gb_s']} GB/s (measured copy bandwidth) = "
                      f"{roof['roofline_tokens_per_second']} tokens/s"
                      + (" (bandwidth and tokens per CPU-second)." if cfg.get("clock") == "cpu" else ".")]
    return lines


LEGEND = (
    "Columns: tokens/s over each repeat's prompts (median and min–max of repeats); speedups are ratios "
    "within each repeat (tokens/s include the prompt's prefill; \"decode phase\" leaves it out: output "
    "tokens over the time after the prompt's forward, the per-token latency users see once streaming starts); predicted × is (1 − α^(K+1)) / ((1 − α)(Kc + 1)) over the method's own family's plain "
    "decoding, from its measured α (acceptance rate), K (mean drafted per step) and c = draft ms per drafted "
    "token / target ms per verification forward; tokens/step = output tokens per target forward; greedy = plain "
    "compares every token of every repeat with specdec plain decoding, \"greedy = own plain\" a peer's speculation "
    "with that peer's own plain decoding; \"of roofline\" is tokens/s over the plain-decoding roofline above (weight "
    "bytes per token / copy bandwidth; the same GGUF bytes for llama.cpp)."
)


def markdown(results: dict) -> str:
    lines = ["# specdec bench", "", *_header_lines(results), "", LEGEND]
    for s in results["scenarios"]:
        lines += ["", f"## {s['prompt_set']} prompts, temperature {s['temperature']:g}", "",
                  f"{s['num_prompts']} prompts (mean {s['prompt_tokens_mean']} tokens), "
                  f"{'exactly' if s.get('ignore_eos') else 'up to'} {s['max_tokens']} new tokens"
                  f"{' (EOS ignored)' if s.get('ignore_eos') else ''}, "
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
