"""`specdec train report`: the quality numbers of a target/draft pair on the held-out test split.

- validation and test loss of each model on the same fixed windows as its training's evaluation
  (the seq_len, batch_size, eval_batches and corpus_limit_mb its training.json records), so they
  are training.json's losses, up to the bf16 rounding of the saved weights;
- acceptance rate and mean accepted length of draft-model speculation at K (default 4), greedy
  and at temperature 1, completing test-split function headers;
- the share of those functions whose greedy completion `ast.parse` accepts. Greedy speculative
  output is the target's own greedy output (lossless), so one run gives both.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import torch

from ..config import SamplingParams
from ..llm import LLM
from .data import encode_split
from .lm import TrainConfig, device_name, eval_windows, evaluate


def function_headers(n: int) -> list[dict]:
    from ..bench.make_prompts import _round_robin, held_out_functions

    keep = lambda f: f.body_lines >= 2 and len(f.header) <= 1500  # noqa: E731
    return [{"id": f"{f.file}:{f.qualname}", "prompt": f.header}
            for f in _round_robin(held_out_functions(), keep, n, set())]


def completed_body(completion: str) -> str:
    """The completion's lines up to the first one back at column 0 (where the body ends); a
    last line cut short by max_tokens is dropped."""
    lines = completion.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.strip() and not line[0].isspace():
            return "".join(lines[:i])
    return "".join(lines if completion.endswith("\n") else lines[:-1])


def completes(header: str, completion: str) -> bool:
    """The completion adds at least one statement and the function parses."""
    body = completed_body(completion)
    if not any(s.strip() and not s.strip().startswith("#") for s in body.splitlines()):
        return False
    try:
        ast.parse(header + body)
        return True
    except (SyntaxError, ValueError):
        return False


EVAL_KEYS = ("seq_len", "batch_size", "eval_batches", "corpus_limit_mb")   # what fixes lm.eval_windows


def losses(folder: Path, tok) -> dict:
    """Validation and test loss of the model in `folder` on its training's evaluation windows
    (training.json's config; a folder without an LM's training.json: 16 windows of 512 tokens),
    with "windows" saying which."""
    from ..model import load_model

    model = load_model(folder, "float32")
    path = folder / "training.json"
    trained = json.loads(path.read_text()).get("config", {}) if path.is_file() else {}
    if "eval_batches" in trained:         # an LM's (specdec train target / draft) record
        cfg, source = TrainConfig(**{k: trained[k] for k in EVAL_KEYS if k in trained}), "its training's evaluation"
    else:
        cfg, source = TrainConfig(seq_len=512, batch_size=4, eval_batches=4), "no training.json"
    out = {}
    for split in ("validation", "test"):
        tokens = encode_split(tok, split, limit_mb=cfg.corpus_limit_mb)
        out[f"{split}_loss"] = round(evaluate(model, eval_windows(np.asarray(tokens), cfg)), 4)
    out["windows"] = f"{cfg.eval_batches * cfg.batch_size} windows of {cfg.seq_len} tokens per split, {source}"
    return out


def run_report(target: Path, draft: Path, k: int = 4, n: int = 50, max_tokens: int = 128,
               dtype: str = "bfloat16") -> dict:
    llm = LLM(model=target, speculative_model=draft, num_speculative_tokens=k, dtype=dtype)
    prompts = function_headers(n)
    result = {"k": k, "functions": len(prompts), "max_tokens": max_tokens, "dtype": dtype}
    for temp in (0.0, 1.0):
        params = SamplingParams(temperature=temp, max_tokens=max_tokens, seed=0)
        outs = llm.generate([p["prompt"] for p in prompts], params)
        drafted = sum(o.stats.draft_tokens for o in outs)
        accepted = sum(o.stats.accepted_tokens for o in outs)
        emitted = sum(o.stats.output_tokens for o in outs)
        passes = sum(o.stats.target_forward_passes for o in outs)
        key = "greedy" if temp == 0 else "temperature_1"
        result[key] = {"acceptance_rate": round(accepted / max(1, drafted), 4),
                       "mean_accepted_length": round(emitted / max(1, passes), 4)}
        if temp == 0:
            ok = [completes(p["prompt"], o.outputs[0].text) for p, o in zip(prompts, outs)]
            result["ast_parse_share"] = round(sum(ok) / len(ok), 4)
    result["machine"] = f"{device_name(torch.device(llm.device))}, {torch.get_num_threads()} thread(s)"   # sums differ per CPU
    result["target"] = losses(target, llm.tokenizer)
    result["draft"] = losses(draft, llm.tokenizer)
    return result


BEGIN = "<!-- specdec train report: generated; each run replaces what lies between these markers -->"
END = "<!-- end of specdec train report -->"
HEADING = "## Quality (held-out test split)"


def quality_section(r: dict, command: str) -> str:
    """The report's block of a card: its table and the command that measured it."""
    g, t = r["greedy"], r["temperature_1"]
    machine = f", on {r['machine']}" if r.get("machine") else ""
    windows = "".join(f"; {who} losses: {r[who]['windows']}" for who in ("target", "draft")
                      if r[who].get("windows"))
    return f"""| | |
|---|---|
| target validation / test loss | {r['target']['validation_loss']} / {r['target']['test_loss']} |
| draft validation / test loss | {r['draft']['validation_loss']} / {r['draft']['test_loss']} |
| acceptance rate, K={r['k']}, greedy | {g['acceptance_rate']} (tokens per target forward {g['mean_accepted_length']}) |
| acceptance rate, K={r['k']}, temperature 1 | {t['acceptance_rate']} (tokens per target forward {t['mean_accepted_length']}) |
| target's greedy completions that add a body `ast.parse` accepts | {r['ast_parse_share']:.0%} of {r['functions']} test-split functions |

Measured on {r['functions']} documented test-split functions (def line and docstring as the prompt,
{r['max_tokens']} new tokens, {r['dtype']}{machine}){windows} by:
```
{command}
```
"""


def with_report(card: str, block: str) -> str:
    """The card with the report's block in place of the last run's (between BEGIN and END): text
    around it, written by hand, is kept. A card without the markers gets a Quality section at its end,
    or, written by a specdec before the markers, has its Quality section replaced as it was then."""
    block = f"{BEGIN}\n{block}{END}"
    start = card.find(BEGIN)
    end = card.find(END, start)
    if start >= 0 and end >= 0:
        return card[:start] + block + card[end + len(END):]
    start = card.find(f"{HEADING}\n")
    if start >= 0:
        end = card.find("\n## ", start + len(HEADING))
        rest = card[end + 1:] if end >= 0 else ""
        return card[:start] + f"{HEADING}\n\n{block}\n" + ("\n" + rest if rest else "")
    return card.rstrip("\n") + f"\n\n{HEADING}\n\n{block}\n"


def write_into_cards(r: dict, command: str, *folders: Path) -> None:
    for folder in folders:
        card = folder / "README.md"
        text = card.read_text() if card.is_file() else f"# {folder.name}\n"
        card.write_text(with_report(text, quality_section(r, command)))
        (folder / "quality.json").write_text(json.dumps(r, indent=1) + "\n")
