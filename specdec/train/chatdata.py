"""`specdec train prompts | answers`: the chat training data, its files and its data card.

    <out>/instructions.jsonl   self-instruct tasks the target wrote (reused when present)
    <out>/prompts.jsonl        {"id", "family", "source", "prompt"} per line, shuffled
    <out>/prompts.json         counts per family and source, material sizes, the overlap check
    <out>/README.md            the data card
    <answers>/shard_*.pt       the target's answers and features (answers.py)
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import torch

from ..model import load_model
from ..sampling import make_generator
from ..tokenizer import Tokenizer
from .answers import AnswerConfig, answer_batch, chat_ids
from .overlap import check_overlap, eval_texts
from .prompts import Material, PromptConfig, build_prompts, clean_instruction, self_instruct_prompts
from ..defaults import data_path

SPEC_BENCH = data_path("bench", "prompts", "spec_bench", "question.jsonl")


def _log(s: str) -> None:
    print(s, file=sys.stderr, flush=True)


def self_instruct(target_dir: Path, material: Material, cfg: PromptConfig, n: int, path: Path,
                  dtype: str = "bfloat16", batch: int = 48) -> list[str]:
    """Tasks the target writes after three examples each (sampled at temperature 1, top-p 0.95),
    cleaned and deduplicated; cached in `path`."""
    if path.is_file():
        return [json.loads(ln)["prompt"] for ln in path.read_text().splitlines() if ln.strip()]
    model, tok = load_model(target_dir, dtype), Tokenizer(target_dir)
    acfg = AnswerConfig(max_new_tokens=48, temperature=1.0, top_p=0.95, greedy_fraction=0.0)
    asks = self_instruct_prompts(cfg, material, n)
    tasks, seen = [], set()
    for b in range(0, len(asks), batch):
        part = [chat_ids(tok, a) for a in asks[b:b + batch]]
        with torch.inference_mode():
            out = answer_batch(model, part, [False] * len(part), acfg, set(tok.eos_token_ids),
                               make_generator(cfg.seed * 7919 + b))
        for r in out:
            task = clean_instruction(tok.decode(r["answer"], skip_special_tokens=True))
            if task and task.lower() not in seen:
                seen.add(task.lower())
                tasks.append(task)
        _log(f"self-instruct: {min(b + batch, len(asks))}/{len(asks)} asked, {len(tasks)} tasks kept")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in tasks))
    return tasks


def make_prompt_set(out: Path, cfg: PromptConfig, target: Path | None, n_self_instruct: int,
                    eval_path: Path | None, command: str, material: Material | None = None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    material = material or Material.gather(cfg)
    instructions = []
    if target is not None and n_self_instruct > 0:
        instructions = self_instruct(target, material, cfg, n_self_instruct, out / "instructions.jsonl")
    prompts = build_prompts(cfg, material, instructions)
    report = None
    if eval_path is not None:
        prompts, report = check_overlap(prompts, eval_texts(eval_path))
        report["evaluation_file"] = str(eval_path)
    if not prompts:
        raise ValueError(f"--count {cfg.count}: no prompt made" + (" (all overlapped the evaluation questions)"
                                                                   if report and report["prompts_checked"] else ""))
    (out / "prompts.jsonl").write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in prompts))
    summary = {"command": command, "config": asdict(cfg), "prompts": len(prompts),
               "families": dict(Counter(p["family"] for p in prompts).most_common()),
               "sources": dict(Counter(p["source"].split(":")[0] for p in prompts).most_common()),
               "material": {"passages": len(material.passages), "stdlib_functions": len(material.functions),
                            "catalog_pairs": {k: len(v) for k, v in material.pairs.items()},
                            "german_man_sentences": len(material.german),
                            "self_instruct_tasks": len(instructions)},
               "overlap": report, "wall_time_s": round(time.time() - t0, 1)}
    (out / "prompts.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "README.md").write_text(data_card(summary))
    return summary


def data_card(s: dict) -> str:
    fam = "\n".join(f"| {k} | {v} |" for k, v in s["families"].items())
    m, o = s["material"], s["overlap"]
    if o:
        check = (f"Checked against `{o['evaluation_file']}` ({o['evaluation_turns']} turns): "
                 f"{o['dropped_exact']} exact, {o['dropped_shared_13gram']} with a shared 13-gram and "
                 f"{o['dropped_near_duplicate_8gram']} 8-gram near duplicates dropped out of {o['prompts_checked']}; "
                 f"{o['prompts_sharing_any_8gram_kept']} kept prompts share at least one 8-gram (largest shared "
                 f"fraction {o['max_8gram_fraction_kept']}). Rules: {o['rules']}.")
    else:
        check = "No evaluation set was given: **not checked for overlap**."
    return f"""# Chat training prompts

{s['prompts']} prompts made on this machine by `specdec train prompts` (specdec/train/prompts.py),
without any download: templates and word lists written for specdec (specdec/train/seeds.py) filled at
random, text found on the machine (specdec/train/documents.py) and tasks the target wrote itself.

| family | prompts |
|---|---|
{fam}

Material: {m['passages']} passages (stdlib docstrings, installed packages' READMEs), {m['stdlib_functions']}
stdlib functions, message-catalog sentence pairs {m['catalog_pairs']}, {m['german_man_sentences']} German
man-page sentences, {m['self_instruct_tasks']} self-instruct tasks.

**Evaluation overlap.** No Spec-Bench question was read to make these prompts. {check}

Made by:
```
{s['command']}
```
"""
