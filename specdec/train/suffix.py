"""`specdec train suffix`: a datastore for method "suffix" from the target's own answers.

Nothing is trained: the answers written by `specdec train answers` (each with the last few
prompt tokens, the chat template's assistant header) are indexed for suffix lookup
(proposers/suffix_index.py) and saved as a folder the method loads as its `model`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from ..bench.machine import cpu_model
from ..proposers.suffix import HEADER_TOKENS, save_datastore
from ..proposers.suffix_index import SuffixIndex


def answer_documents(answers_dir: Path, shards: int | None, val_shards: int) -> tuple[list[np.ndarray], dict]:
    """Each answer with the HEADER_TOKENS prompt tokens before it, from the training shards (the
    first `val_shards` shards are validation, as for the heads: left out)."""
    from .answers import load_answer_shards

    paths = sorted(Path(answers_dir).glob("shard_*.pt"))
    if len(paths) <= val_shards:
        raise ValueError(f"{answers_dir}: {len(paths)} answer shards, need more than --val-shards {val_shards}")
    used = paths[val_shards:][:shards]
    docs, greedy = [], 0
    for p in used:
        d = load_answer_shards([p], hidden=False)
        offs, plens = d["offsets"].tolist(), d["prompt_lens"].tolist()
        for i, pl in enumerate(plens):
            start = offs[i] + max(0, pl - HEADER_TOKENS)
            docs.append(d["tokens"][start:offs[i + 1]].numpy())
            greedy += bool(d["greedy"][i])
    return docs, {"shards": [p.name for p in used], "answers": len(docs), "greedy_answers": greedy}


def build(answers_dir: Path, out: Path, shards: int | None = None, val_shards: int = 1, depth: int = 32,
          command: str = "") -> dict:
    t0 = time.time()
    docs, info = answer_documents(answers_dir, shards, val_shards)
    index = SuffixIndex.build(docs, depth)
    info.update({"num_tokens": index.num_tokens, "depth": depth, "build_s": round(time.time() - t0, 1),
                 "machine": cpu_model(), "command": command})
    save_datastore(index, out, {"source": info})
    return info


def summary(info: dict) -> str:
    return json.dumps({k: v for k, v in info.items() if k not in ("shards",)})
