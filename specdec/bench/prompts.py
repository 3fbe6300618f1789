"""Prompt sets: JSON lines {"prompt": str, "max_tokens": optional int, "id": optional str}."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from . import spec_bench
from ..defaults import data_path

BUNDLED = data_path("bench", "prompts")


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    ids: list[int]                # token ids, encoded once and fed to every method alike
    max_tokens: int
    category: str | None = None   # Spec-Bench's category: results are also reported per category


def resolve(spec: str) -> Path:
    """A path, or the name of a bundled set ("code", "repeat"; "spec-bench" is load_prompts')."""
    path = Path(spec)
    if path.is_file():
        return path
    bundled = BUNDLED / f"{spec}.jsonl"
    if bundled.is_file():
        return bundled
    names = ", ".join(sorted(p.stem for p in BUNDLED.glob("*.jsonl")))
    raise ValueError(f"--prompts: {spec!r} is neither a file nor a bundled set ({names}, spec-bench)")


def read_rows(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise ValueError(f'{path}:{n}: each line must be an object with a non-empty "prompt" string')
        mt = row.get("max_tokens")
        if mt is not None and not (isinstance(mt, int) and not isinstance(mt, bool) and mt >= 1):
            raise ValueError(f"{path}:{n}: max_tokens must be an integer >= 1, got {mt!r}")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def load_prompts(spec: str, tokenizer, max_tokens: int, max_len: int, limit: int | None = None,
                 limit_per_category: int | None = None, categories: list[str] | None = None) -> tuple[str, list[Prompt]]:
    """(set name, prompts). Each prompt's max_tokens is capped so prompt + output fits the
    context: every method then stops at the same place, which the greedy comparison needs.
    "spec-bench": Spec-Bench's questions, first turn through the chat template (spec_bench.py)."""
    if spec == spec_bench.NAME:
        path = spec_bench.QUESTIONS
        rows = spec_bench.read_questions(path, limit_per_category, categories)[:limit]
    else:
        path = resolve(spec)
        rows = read_rows(path)[:limit]
    prompts = []
    for i, row in enumerate(rows):
        ids = spec_bench.chat_prompt(tokenizer, row["prompt"]) if spec == spec_bench.NAME else tokenizer.encode(row["prompt"])
        room = max_len - len(ids)
        if room < 1:
            raise ValueError(f"{path}: prompt {i} has {len(ids)} tokens; the context holds {max_len}")
        prompts.append(Prompt(str(row.get("id", i)), row["prompt"], ids, min(row.get("max_tokens") or max_tokens, room),
                              row.get("category")))
    return (spec_bench.NAME if spec == spec_bench.NAME else path.stem), prompts
