"""PNG plots per scenario: speedup against K with the analytic curve; acceptance by draft position."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")                    # files only: no display on a server or in tests
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .summary import OWN_PLAIN, predicted_speedup  # noqa: E402


def _label(m: dict) -> str:
    return m["method"] + (" (transformers)" if m["family"] == "transformers" else "")


def _fixed_k_groups(methods: list[dict]) -> dict[str, list[dict]]:
    """Variants with an integer K > 0 (and drafts), grouped by method, sorted by K."""
    groups = defaultdict(list)
    for m in methods:
        if isinstance(m["k"], int) and m["k"] > 0 and m["speedup_vs_plain"] is not None:
            groups[_label(m)].append(m)
    return {name: sorted(ms, key=lambda m: m["k"]) for name, ms in groups.items()}


def _pooled(ms: list[dict]) -> tuple[float, float] | None:
    """alpha over all drafted tokens of a method's K values, and the median c."""
    drafted = sum(m["draft_tokens"] for m in ms)
    cs = [m["c"] for m in ms if m["c"] is not None]
    if not drafted or not cs:
        return None
    return sum(m["accepted_tokens"] for m in ms) / drafted, float(np.median(cs))


def _base_label(m: dict) -> str:
    """hf_assisted_default and _heuristic share hf_assisted's colour."""
    return _label({**m, "method": m["method"].removesuffix("_default").removesuffix("_heuristic")})


def _own_plain(scenario: dict, family: str) -> float:
    """Where a family's plain decoding sits on the axis: the analytic speedup is over the
    family's own plain decoding (c is measured against its own forwards)."""
    if family == "specdec":
        return 1.0
    own = OWN_PLAIN.get(family)
    peer = next((m for m in scenario["methods"] if m["method"] == own), None)
    return peer["speedup_vs_plain"]["median"] if peer and peer["speedup_vs_plain"] else float("nan")


def speedup_plot(scenario: dict, path: Path) -> bool:
    groups = _fixed_k_groups(scenario["methods"])
    if not groups:
        return False
    fig, ax = plt.subplots(figsize=(10, 5))
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = {name: cycle[i % len(cycle)] for i, name in enumerate(groups)}
    k_max = max(m["k"] for ms in groups.values() for m in ms)
    grid = np.linspace(1, k_max, 100)
    for name, ms in groups.items():
        ks = [m["k"] for m in ms]
        med = [m["speedup_vs_plain"]["median"] for m in ms]
        err = [[a - m["speedup_vs_plain"]["min"] for a, m in zip(med, ms)],
               [m["speedup_vs_plain"]["max"] - a for a, m in zip(med, ms)]]
        ax.errorbar(ks, med, yerr=err, marker="o", capsize=3, color=colors[name], label=name)
        pooled = _pooled(ms)
        if pooled is not None:
            alpha, c = pooled
            base = _own_plain(scenario, ms[0]["family"])
            ax.plot(grid, [base * predicted_speedup(alpha, k, c) for k in grid], "--", color=colors[name],
                    alpha=0.6, label=f"{name}: analytic (α={alpha:.2f}, c={c:.2f})")
    for m in scenario["methods"]:
        if m["k"] in (None, "auto") and m["num_drafts"] and m["speedup_vs_plain"] is not None:
            ax.plot([m["mean_k"]], [m["speedup_vs_plain"]["median"]], marker="*", markersize=12, linestyle="none",
                    color=colors.get(_base_label(m), "black"), label=f"{m['name']} (at its mean K)")
    ax.axhline(1.0, color="black", linewidth=0.8, label="specdec plain")
    for family, style in (("transformers", ":"), ("llama.cpp", "-.")):
        peer_plain = _own_plain(scenario, family)
        if not math.isnan(peer_plain):                 # that family's plain decoding ran
            ax.axhline(peer_plain, color="grey", linestyle=style, label=f"{family} plain")
    ax.set(xlabel="K (tokens drafted per step)", ylabel="speedup over specdec plain (tokens/s ratio)",
           title=f"{scenario['prompt_set']} prompts, temperature {scenario['temperature']:g}: "
                 "measured (median, min–max) and analytic (dashed)")
    ax.set_xticks(sorted({m["k"] for ms in groups.values() for m in ms}))
    _finish(fig, ax, path)
    return True


def acceptance_plot(scenario: dict, path: Path) -> bool:
    """Per method, its largest fixed K: P(position i accepted | drafted)."""
    groups = _fixed_k_groups(scenario["methods"])
    curves = {name: ms[-1] for name, ms in groups.items() if ms[-1]["per_position_acceptance"]}
    if not curves:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, m in curves.items():
        acc = m["per_position_acceptance"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{name} K={m['k']}")
    ax.set(xlabel="draft position", ylabel="acceptance (given drafted)", ylim=(0, 1.02),
           title=f"Acceptance by draft position: {scenario['prompt_set']}, temperature {scenario['temperature']:g}")
    ax.set_xticks(range(1, max(len(m["per_position_acceptance"]) for m in curves.values()) + 1))
    _finish(fig, ax, path)
    return True


def _finish(fig, ax, path: Path) -> None:
    # the legend beside the axes: inside, it hides the curves it names
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_scenario(scenario: dict, out: Path) -> list[Path]:
    written = []
    from .spec_bench import plot as category_plot

    kinds = [("speedup", speedup_plot), ("acceptance", acceptance_plot)]
    if scenario.get("categories"):
        kinds.append(("categories", category_plot))
    for kind, draw in kinds:
        path = out / f"{kind}_{scenario['name']}.png"
        if draw(scenario, path):
            written.append(path)
    return written
