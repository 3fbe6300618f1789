"""The training corpus: the Python standard library's own source, split by file.

The split is a pure function of each file's path relative to the stdlib root (a hash), so it is
the same on every machine; `data/split.json` records the files of this interpreter's stdlib.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path

import numpy as np

SPLITS = ("train", "validation", "test")
VALID_PERCENT, TEST_PERCENT = 3, 3


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(rel_path: str) -> str:
    """train / validation / test for a path relative to the stdlib root; deterministic."""
    bucket = int(hashlib.sha256(rel_path.encode()).hexdigest(), 16) % 100
    if bucket < TEST_PERCENT:
        return "test"
    if bucket < TEST_PERCENT + VALID_PERCENT:
        return "validation"
    return "train"


def corpus_files(root: Path | None = None) -> dict[str, list[str]]:
    root = root or stdlib_root()
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if rel.startswith("site-packages/") or "/site-packages/" in rel:
            continue
        out[split_of(rel)].append(rel)
    return out


def read_texts(split: str, root: Path | None = None, limit_mb: float | None = None) -> list[str]:
    """The split's files in path order; with limit_mb, only the first files up to that size."""
    root = root or stdlib_root()
    texts, size = [], 0
    for rel in corpus_files(root)[split]:
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a handful of test files are deliberately not UTF-8
        if limit_mb is not None and texts and size + len(text) > limit_mb * 1e6:
            break
        texts.append(text)
        size += len(text)
    return texts


def write_split_record(path: Path, root: Path | None = None) -> None:
    files = corpus_files(root)
    record = {"root": "sysconfig stdlib", "rule": f"sha256(relative path) % 100: < {TEST_PERCENT} test, "
              f"< {TEST_PERCENT + VALID_PERCENT} validation, else train", **files}
    path.write_text(json.dumps(record, indent=1) + "\n")


def encode_split(tokenizer, split: str, root: Path | None = None, limit_mb: float | None = None) -> np.ndarray:
    """All files of a split as one token stream, each file framed by <bos> ... <eos>."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    ids: list[int] = []
    texts = read_texts(split, root, limit_mb)
    for enc in tokenizer.backend.encode_batch(texts, add_special_tokens=False):
        ids.append(bos)
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int32)


def cached_tokens(tokenizer, split: str, cache_dir: Path, limit_mb: float | None = None) -> np.ndarray:
    """A split's token stream, cached in cache_dir/<split>.npy with what made it (<split>.json: the
    tokenizer's fingerprint and limit_mb); a cache made by another tokenizer or limit is remade.
    A cache from before that record is used as it is."""
    from .provenance import folder_record, tokenizer_fingerprint, write_record

    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"{split}.npy"
    made_by = {"tokenizer": tokenizer_fingerprint(tokenizer), "limit_mb": limit_mb}
    rec = folder_record(cache_dir, f"{split}.json")
    if path.is_file() and (rec is None or rec == made_by):
        return np.load(path)
    arr = encode_split(tokenizer, split, limit_mb=limit_mb)
    tmp = cache_dir / f"{split}.tmp.npy"
    np.save(tmp, arr)
    os.replace(tmp, path)
    write_record(cache_dir / f"{split}.json", made_by)
    return arr
