"""`specdec bench serve` results: results.json, results.md (tables with the command) and a plot
of throughput, median TPOT and goodput against load, one line per variant."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def write_all(results: dict, out: Path, json_name: str = "results.json") -> list[Path]:
    paths = [out / json_name, out / "results.md"]
    paths[0].write_text(json.dumps(results, indent=1) + "\n")
    paths[1].write_text(markdown(results))
    png = out / "serve.png"
    if plot(results, png):
        paths.append(png)
    return paths


def _load(p: dict) -> str:
    ramp = p.get("ramp")
    rate = f"{ramp['start_rps']:g}->{ramp['end_rps']:g}/s {ramp['strategy']}" if ramp \
        else "" if p["rate"] == "inf" else f"{p['rate']}/s"
    conc = f"c={p['concurrency']}" if p["concurrency"] else ""
    return " ".join(x for x in (rate, conc) if x) or "all at once"


def _ms(d: dict, key: str) -> str:
    """A latency in ms with the digits that let the table's ratios be recomputed: 2.47, 24.7, 247."""
    x = d.get(key)
    if x is None:
        return "–"
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}" if abs(x) < 100 else f"{x:.0f}"


def _x(x, digits=2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _times(x) -> str:
    """A ratio as "1.23x", "–" where there is none (no goodput SLO, no TPOT)."""
    return _x(x) + ("" if x is None else "x")


def summary_table(results: dict) -> str:
    lines = ["| variant | load | done | output tok/s | req/s | goodput req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
             "| ITL p50 / p99 ms | E2EL p50 ms | acceptance | tokens per draft step |", "|" + "---|" * 12]
    for v in results["variants"]:
        for p in v["points"]:
            s = p["speculation"]
            lines.append(f"| {v['name']} | {_load(p)} | {p['completed']}/{p['num_prompts']} | {p['output_throughput']:.1f} "
                         f"| {p['request_throughput']:.3f} | {_x(p['request_goodput'], 3)} "
                         f"| {_ms(p['ttft'], 'median')} / {_ms(p['ttft'], 'p99')} "
                         f"| {_ms(p['tpot'], 'median')} / {_ms(p['tpot'], 'p99')} "
                         f"| {_ms(p['itl'], 'median')} / {_ms(p['itl'], 'p99')} | {_ms(p['e2el'], 'median')} "
                         f"| {_x(s['acceptance_rate'])} | {_x(s['mean_acceptance_length'])} |")
    return "\n".join(lines)


def comparison_table(results: dict) -> str:
    """Each variant against plain batched decoding at the same load: throughput, goodput,
    median TPOT (plain's / the variant's: > 1 is faster)."""
    plain, others = _plain_and_others(results)
    if plain is None or not others:
        return ""
    head = "| load | plain tok/s | plain TPOT p50 ms | " + " | ".join(
        f"{v['name']}: throughput / goodput / TPOT speedup" for v in others) + " |"
    lines = [head, "|" + "---|" * (3 + len(others))]
    for i, p in enumerate(plain["points"]):
        cells = []
        for v in others:
            q = v["points"][i]
            good = (q["request_goodput"] / p["request_goodput"]) if p["request_goodput"] else None
            tpot = (p["tpot"]["median"] / q["tpot"]["median"]) if p["tpot"]["median"] and q["tpot"]["median"] else None
            cells.append(f"{q['output_throughput'] / p['output_throughput']:.2f}x / {_times(good)} / {_times(tpot)}"
                         if p["output_throughput"] else "–")
        lines.append(f"| {_load(p)} | {p['output_throughput']:.1f} | {_ms(p['tpot'], 'median')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plain_and_others(results: dict) -> tuple[dict | None, list[dict]]:
    """The plain batched variant (K = 0), if any, and the rest."""
    plain = next((v for v in results["variants"] if v.get("k") == 0), None)
    return plain, [v for v in results["variants"] if v is not plain]


def _ratios_cell(xs: list[float]) -> str:
    return " / ".join(f"{x:.2f}x" for x in xs) + (f" (spread {max(xs) / min(xs):.2f})" if len(xs) > 1 else "")


def rounds_table(results: dict) -> str:
    """With --rounds > 1: each variant against plain within every round (the same requests, one
    after the other), so that a run shows how far its own rounds agree; empty otherwise."""
    plain, others = _plain_and_others(results)
    if plain is None or not others or not any(len(p.get("rounds", [])) > 1 for p in plain["points"]):
        return ""
    lines = ["| load | variant | TPOT speedup per round | throughput per round |", "|---|---|---|---|"]
    for i, p in enumerate(plain["points"]):
        for v in others:
            pairs = list(zip(p.get("rounds", []), v["points"][i].get("rounds", [])))
            tpot = [a["tpot_median_ms"] / b["tpot_median_ms"] for a, b in pairs
                    if a["tpot_median_ms"] and b["tpot_median_ms"]]
            thr = [b["output_throughput"] / a["output_throughput"] for a, b in pairs
                   if a["output_throughput"] and b["output_throughput"]]
            lines.append(f"| {_load(p)} | {v['name']} | {_ratios_cell(tpot) or '–'} | {_ratios_cell(thr) or '–'} |")
    return "\n".join(lines)


def console(results: dict) -> str:
    """Each variant's load points in the block `vllm bench serve` prints, with the speculative
    counters below it."""
    def line(label: str, value) -> str:
        return f"{label:<40} {value}"

    def rule(title: str = "", ch: str = "-") -> str:
        return f" {title} ".center(50, ch) if title else ch * 50

    names = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
             "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}
    shown = results.get("settings", {}).get("percentile_metrics") or list(names)     # --percentile-metrics
    out = []
    for v in results["variants"]:
        for p in v["points"]:
            out += [rule(f"{v['name']}, {_load(p)}", "="),
                    line("Successful requests:", p["completed"]), line("Failed requests:", p["failed"])]
            if p.get("concurrency") is not None:
                out.append(line("Maximum request concurrency:", p["concurrency"]))
            if p.get("rate") not in (None, "inf"):
                out.append(line("Request rate configured (RPS):", f"{p['rate']:.2f}"))
            out += [line("Benchmark duration (s):", f"{p['duration_s']:.2f}"),
                    line("Total input tokens:", p["total_input_tokens"]),
                    line("Total generated tokens:", p["total_output_tokens"]),
                    line("Request throughput (req/s):", f"{p['request_throughput']:.2f}")]
            if p.get("request_goodput") is not None:
                out.append(line("Request goodput (req/s):", f"{p['request_goodput']:.2f}"))
            out += [line("Output token throughput (tok/s):", f"{p['output_throughput']:.2f}")]
            if "max_output_tokens_per_s" in p:         # results recorded before they were measured lack them
                out += [line("Peak output token throughput (tok/s):", f"{p['max_output_tokens_per_s']:.2f}"),
                        line("Peak concurrent requests:", f"{p['max_concurrent_requests']:.2f}")]
            if p.get("total_token_throughput") is not None:
                out.append(line("Total token throughput (tok/s):", f"{p['total_token_throughput']:.2f}"))
            for key, (title, short) in names.items():
                if key not in shown:                   # vLLM prints nothing of a metric not selected
                    continue
                m = p[key]
                out.append(rule(title))
                out += [line(f"Mean {short} (ms):", _ms2(m.get("mean"))),
                        line(f"Median {short} (ms):", _ms2(m.get("median")))]
                out += [line(f"P{k[1:]} {short} (ms):", _ms2(m[k])) for k in m if k.startswith("p")]
            spec = p.get("speculation") or {}
            if spec.get("num_drafts"):
                out += [rule("Speculative Decoding"),
                        line("Acceptance rate (%):", f"{100 * spec['acceptance_rate']:.2f}"),
                        line("Acceptance length:", f"{spec['mean_acceptance_length']:.2f}"),
                        line("Drafts:", spec["num_drafts"]), line("Draft tokens:", spec["draft_tokens"]),
                        line("Accepted tokens:", spec["accepted_tokens"])]
                if spec.get("per_position_acceptance_rates"):
                    out.append("Per-position acceptance (%):")
                    out += [line(f"  Position {i}:", f"{100 * r:.2f}")
                            for i, r in enumerate(spec["per_position_acceptance_rates"])]
            out.append(rule(ch="="))
    return "\n".join(out)


def _ms2(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _spec_bench_requests(settings: dict) -> str:
    """How results recorded before the datasets were described made their requests."""
    return f"{settings['dataset']} first turns through the chat template, max_tokens {settings['output_len']}"


def markdown(results: dict) -> str:
    m, s = results["machine"], results["settings"]
    slo = ", ".join(f"{k} <= {v:g} ms" for k, v in s["goodput_slo_ms"].items()) or "none given"
    lines = ["# specdec bench serve", "", "```bash", results["command"], "```", "",
             f"- machine: {m['cpu']}, {m['cores']} cores, load average {m.get('load_average')} before, "
             f"{m.get('load_average_after')} after (other jobs share the cores: see the README on timing)",
             f"- kernels: {m.get('kernels', 'not recorded')}; specdec {m.get('specdec_commit', '?')}, torch {m.get('torch', '?')}",
             f"- requests: {s.get('requests') or _spec_bench_requests(s)}, streamed, "
             f"temperature {s['temperature']:g}"
             + "".join(f", {k} {s[k]:g}" for k in ("top_p", "top_k", "min_p") if s.get(k) is not None)
             + f", ignore_eos {s['ignore_eos']}, burstiness "
             f"{float(s['burstiness']):g}; goodput SLOs: {slo}; client: {s.get('client', 'openai')}",
             "- TTFT: request sent -> first chunk with tokens; TPOT: (E2EL - TTFT) / (output tokens - 1) per request; "
             "ITL: gaps between chunks (a speculative step's chunk carries several tokens); acceptance from the "
             "server's /metrics over the load point", "", "## Per variant and load", "", summary_table(results), ""]
    comparison = comparison_table(results)
    if comparison:
        lines += ["## Against plain batched decoding at the same load", "",
                  "Ratios: the variant's output throughput and goodput over plain's, and plain's median TPOT over the "
                  "variant's (above 1: the variant is faster).", "", comparison, ""]
    by_round = rounds_table(results)
    if by_round:
        lines += ["## Round by round", "",
                  "The same ratios within each round: the variants took turns on the same requests, so a spread "
                  "between rounds is the machine's drift, and a figure that only one round shows is not one "
                  "to read.", "", by_round, ""]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> bool:
    variants = [v for v in results["variants"] if v["points"]]
    if not variants:
        return False
    by_rate = any(p["rate"] != "inf" for p in variants[0]["points"])
    xkey, xlabel = ("rate", "request rate (requests/s)") if by_rate else ("concurrency", "concurrent requests")
    panels = [("output_throughput", "output tokens/s"), ("tpot", "median TPOT (ms)")]
    if any(p["request_goodput"] is not None for p in variants[0]["points"]):
        panels.append(("request_goodput", "goodput (requests/s within SLOs)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (key, label) in zip(axes, panels):
        for v in variants:
            pts = [p for p in v["points"] if p[xkey] not in (None, "inf")]
            ys = [p[key]["median"] if isinstance(p[key], dict) else p[key] for p in pts]
            ax.plot([p[xkey] for p in pts], ys, marker="o", label=v["name"])
        ax.set(xlabel=xlabel, ylabel=label)
        if not by_rate:
            ticks = sorted({p[xkey] for p in variants[0]["points"] if p[xkey]})
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"specdec bench serve: {results['machine']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
