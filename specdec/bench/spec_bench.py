"""Spec-Bench in `specdec bench --prompts spec-bench`: its questions, per-category results, a plot.

bench/prompts/spec_bench/question.jsonl holds 240 of Spec-Bench's 480 questions (Apache-2.0,
LICENSE beside it). Each question's first turn goes through the model's chat template as one
user message, as Spec-Bench runs them (greedy, batch 1). Results are reported per category,
in Spec-Bench's order: its six tasks (MT-bench's eight categories together as "mt_bench",
then translation, summarization, qa, math_reasoning, rag), each MT-bench category alone, and
all prompts together ("overall").
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from ..defaults import data_path

NAME = "spec-bench"
QUESTIONS = data_path("bench", "prompts", "spec_bench", "question.jsonl")
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
TASKS = ("translation", "summarization", "qa", "math_reasoning", "rag")
ORDER = ("overall", "mt_bench", *TASKS, *MT_BENCH)


def read_questions(path: Path = QUESTIONS, limit_per_category: int | None = None,
                   categories: list[str] | None = None) -> list[dict]:
    """[{"id", "category", "prompt"}] in file order; the first `limit_per_category` of each category
    (of `categories` only, when given: an unknown name is an error naming the known ones)."""
    out, seen = [], {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            turn, cat, qid = row["turns"][0], row["category"], row["question_id"]
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not a Spec-Bench question ({type(e).__name__}: {e})") from None
        if not isinstance(turn, str) or not turn or not isinstance(cat, str):
            raise ValueError(f"{path}:{n}: turns[0] must be a non-empty string and category a string")
        if (categories is not None and cat not in categories) or \
                (limit_per_category is not None and seen.get(cat, 0) >= limit_per_category):
            seen.setdefault(cat, 0)
            continue
        seen[cat] = seen.get(cat, 0) + 1
        out.append({"id": str(qid), "category": cat, "prompt": turn})
    unknown = sorted(set(categories or []) - set(seen))
    if unknown:
        raise ValueError(f"{path}: no category {unknown[0]!r} (categories: {', '.join(sorted(seen))})")
    if not out:
        raise ValueError(f"{path}: no questions")
    return out


def chat_prompt(tokenizer, text: str) -> list[int]:
    """The first turn as one user message through the model's chat template."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)      # the template writes its own BOS


def category_indices(categories: list[str | None]) -> dict[str, list[int]]:
    """Prompt indices of each reported group, in ORDER (groups without prompts left out)."""
    groups = {"overall": list(range(len(categories)))}
    groups["mt_bench"] = [i for i, c in enumerate(categories) if c in MT_BENCH]
    for cat in (*TASKS, *MT_BENCH):
        groups[cat] = [i for i, c in enumerate(categories) if c == cat]
    for cat in sorted({c for c in categories if c is not None} - set(ORDER)):   # a category of a newer file
        groups[cat] = [i for i, c in enumerate(categories) if c == cat]
    return {k: v for k, v in groups.items() if v}


def category_summaries(variants, runs, prompts, greedy: bool) -> dict[str, dict]:
    """Per group: the summary of each variant over that group's prompts alone."""
    from .summary import summarize_variant

    out = {}
    for group, idx in category_indices([p.category for p in prompts]).items():
        sub = {name: [[rep[i] for i in idx] for rep in reps] for name, reps in runs.items()}
        out[group] = {"num_prompts": len(idx),
                      "methods": [summarize_variant(v, sub, greedy, [prompts[i].id for i in idx]) for v in variants]}
    return out


def _tau(m: dict) -> float:
    """Spec-Bench's tau: tokens per target forward (results written before tokens_per_forward
    was recorded held it as mean_accepted_length)."""
    return m.get("tokens_per_forward", m["mean_accepted_length"])


def _cell(m: dict) -> str:
    sp = m["speedup_vs_plain"]
    tau = _tau(m) if m["num_drafts"] else None
    return ("–" if sp is None else f"{sp['median']:.2f}x") + (f" / {tau:.2f}" if tau is not None else "")


def tables(scenario: dict) -> str:
    """Spec-Bench's table: a row per method, a column per category, cells speedup / tau; then
    acceptance by draft position per category for each drafting method."""
    cats = scenario["categories"]
    groups = [g for g in cats if g in ORDER] + [g for g in cats if g not in ORDER]
    names = [m["name"] for m in cats["overall"]["methods"]]
    head = "| method | " + " | ".join(f"{g} ({cats[g]['num_prompts']})" for g in groups) + " |"
    # tau is tokens per target forward (results.json's tokens_per_forward), not vLLM's mean acceptance
    # length 1 + accepted / drafts (its mean_accepted_length): the two differ once a step drafts nothing
    lines = ["Speedup over specdec plain / tau, tokens per target forward (results.json's tokens_per_forward; "
             "its mean_accepted_length is vLLM's 1 + accepted / drafts):", "",
             head, "|" + "---|" * (len(groups) + 1)]
    for j, name in enumerate(names):
        lines.append(f"| {name} | " + " | ".join(_cell(cats[g]["methods"][j]) for g in groups) + " |")
    if any(m.get("decode_speedup_vs_plain") for m in cats["overall"]["methods"]):
        # long prompts (summarization, rag) spend most of a request in the prefill, which no
        # proposer shortens: the decoding phase alone shows what speculation does
        lines += ["", "Decoding phase alone (each prompt's prefill left out), speedup over specdec plain:", "",
                  head, "|" + "---|" * (len(groups) + 1)]
        for j, name in enumerate(names):
            cells = [cats[g]["methods"][j].get("decode_speedup_vs_plain") for g in groups]
            lines.append(f"| {name} | " + " | ".join("–" if c is None else f"{c['median']:.2f}x" for c in cells) + " |")
    lines += ["", "Acceptance by draft position (P(position i accepted | drafted)):", "",
              "| method | category | positions 1.. |", "|---|---|---|"]
    for j, name in enumerate(names):
        for g in groups:
            acc = cats[g]["methods"][j]["per_position_acceptance"]
            if acc:
                lines.append(f"| {name} | {g} | {' '.join(f'{x:.2f}' for x in acc[:8])} |")
    return "\n".join(lines)


def plot(scenario: dict, path: Path) -> bool:
    """Grouped bars: speedup and tau per category, one bar per drafting method."""
    cats = scenario["categories"]
    groups = [g for g in ORDER if g in cats and g not in MT_BENCH] or list(cats)
    methods = [j for j, m in enumerate(cats["overall"]["methods"]) if m["num_drafts"]]
    if not methods:
        return False
    fig, axes = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    width = 0.8 / len(methods)
    for slot, j in enumerate(methods):
        xs = [i + slot * width for i in range(len(groups))]
        sp = [(cats[g]["methods"][j]["speedup_vs_plain"] or {}).get("median", 0.0) for g in groups]
        tau = [_tau(cats[g]["methods"][j]) for g in groups]
        label = cats["overall"]["methods"][j]["name"]
        axes[0].bar(xs, sp, width, label=label)
        axes[1].bar(xs, tau, width, label=label)
    axes[0].axhline(1.0, color="black", linewidth=0.8)
    axes[0].set(ylabel="speedup over plain", title=f"Spec-Bench, temperature {scenario['temperature']:g}")
    axes[1].set(ylabel="tau (tokens per target forward)")
    axes[1].set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], groups, rotation=20)
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def method_card_table(results: dict, name: str) -> str:
    """One method's Spec-Bench figures per category (for a model card): tau, acceptance rate,
    speedup over plain and whether greedy output equalled plain, for every scenario of a run."""
    lines = ["| temperature | category | prompts | tau (tokens per target forward) | acceptance | speedup over plain "
             "| greedy = plain |",
             "|---|---|---|---|---|---|---|"]
    for s in results["scenarios"]:
        for group, c in s.get("categories", {}).items():
            m = next((m for m in c["methods"] if m["name"] == name), None)
            if m is None:
                continue
            sp = m["speedup_vs_plain"]
            g = m["greedy_match"]
            same = "–" if g is None else ("yes" if g["identical"] else f"no ({g['mismatched_prompts']})")
            acc = "–" if m["acceptance_rate"] is None else f"{m['acceptance_rate']:.3f}"
            speed = "–" if sp is None else f"{sp['median']:.2f}x"
            lines.append(f"| {s['temperature']:g} | {group} | {c['num_prompts']} | {_tau(m):.2f} | {acc} | "
                         f"{speed} | {same} |")
    return "\n".join(lines)
