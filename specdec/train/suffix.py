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


def answers_target(answers_dir: Path) -> tuple[dict | None, int | None]:
    """The target the answers were written by (`train answers` records it in config.json) and its
    vocabulary size, read from its config (a Hugging Face folder or a GGUF); None for what is not
    known (an answers folder from before the record, a target moved away)."""
    from .provenance import folder_record

    target = (folder_record(Path(answers_dir)) or {}).get("target")
    if not isinstance(target, dict) or not target.get("path"):
        return None, None
    vocab = None
    try:
        from ..model.gguf import GGUFFile, find_gguf

        path = Path(target["path"])
        gguf = find_gguf(path)
        if gguf is not None:
            vocab = GGUFFile(gguf).config().vocab_size
        elif (path / "config.json").is_file():
            from ..model.config import text_config

            vocab = text_config(json.loads((path / "config.json").read_text())).get("vocab_size")
    except Exception:           # the record is a courtesy: a target that cannot be read leaves it out
        vocab = None
    return target, int(vocab) if isinstance(vocab, int) and vocab > 0 else None


def build(answers_dir: Path, out: Path, shards: int | None = None, val_shards: int = 1, depth: int = 32,
          command: str = "") -> dict:
    """The datastore, with the vocabulary size of the target that wrote the answers (when it can
    be read) recorded in its config.json: a target of another vocabulary refuses it."""
    t0 = time.time()
    docs, info = answer_documents(answers_dir, shards, val_shards)
    target, vocab = answers_target(answers_dir)
    index = SuffixIndex.build(docs, depth)
    if vocab is not None and index.max_token >= vocab:
        raise ValueError(f"--data {answers_dir}: token id {index.max_token} in the answers, but their target "
                         f"{target['path']} has a vocabulary of {vocab}")
    info.update({"num_tokens": index.num_tokens, "depth": depth, "build_s": round(time.time() - t0, 1),
                 "machine": cpu_model(), "command": command, "target": target})
    save_datastore(index, out, {"source": info}, vocab_size=vocab)
    return info


def summary(info: dict) -> str:
    return json.dumps({k: v for k, v in info.items() if k not in ("shards",)})
