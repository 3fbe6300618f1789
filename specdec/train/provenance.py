"""What fixes the meaning of a checkpoint or a data folder, recorded beside it and checked on reuse.

A training run's checkpoint (the work folder) and the data folders it reads or fills (answers,
self-distillation data, EAGLE-3 features) each keep a small record: the target (its path and a
cheap fingerprint: config, tokenizer and a sample of the weight files), the data the run reads
(folder and the shards it uses), the draft vocabulary and the options that shape the model and
its schedule. A resume or reuse that disagrees is refused with one line naming what differs and
how to go on (RunMismatch, a ValueError: the CLI prints it as `specdec: error: ...`, exit 2), as
Hugging Face's Trainer and torchtune keep the run's arguments with its checkpoint for this.

Checkpoints and folders written before these records existed carry none: they are accepted as
before, with the checks that need no record (shapes, a checkpoint's own draft vocabulary).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

SAMPLE = 1 << 20            # bytes read from each end of a weight file for its fingerprint
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


class RunMismatch(ValueError):
    """A checkpoint or data folder reused with settings other than those that made it (one line)."""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def file_sample(path: Path) -> str:
    """sha256 of a file's size, its first and its last SAMPLE bytes: cheap on a large file, and
    two checkpoints of one shape with different weights differ in it."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(SAMPLE))
        if size > SAMPLE:
            f.seek(max(SAMPLE, size - SAMPLE))
            h.update(f.read(SAMPLE))
    return h.hexdigest()[:16]


def target_fingerprint(target: str | os.PathLike) -> dict:
    """The target (a Hugging Face folder, a .gguf, or a folder holding one): its resolved path and
    a fingerprint of its config.json, tokenizer and weight files (see file_sample)."""
    p = Path(target)
    files = [p] if p.is_file() else sorted(q for q in p.iterdir() if q.is_file() and q.suffix.lower() in WEIGHT_SUFFIXES) \
        if p.is_dir() else []
    h = hashlib.sha256()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if p.is_dir() and (p / name).is_file():
            h.update(name.encode() + (p / name).read_bytes())
    for f in files:
        h.update(f.name.encode() + file_sample(f).encode())
    return {"path": str(p.resolve()), "fingerprint": h.hexdigest()[:16]}


def tokenizer_fingerprint(tokenizer) -> str:
    """A specdec Tokenizer's vocabulary and rules (its backend serialized), hashed."""
    return _sha(tokenizer.backend.to_str().encode())


def same_target(recorded: dict | None, now: dict) -> bool:
    """One model: the same fingerprint (a folder moved or copied keeps its meaning)."""
    return recorded is None or recorded.get("fingerprint") == now["fingerprint"]


def data_fingerprint(folder: Path, paths) -> dict:
    """The data a run reads: its folder and a fingerprint of those shard files (names and
    file_sample), so a copied or moved folder is the same data and a remade shard is not."""
    h = hashlib.sha256()
    for p in paths:
        h.update(Path(p).name.encode() + file_sample(Path(p)).encode())
    return {"path": str(Path(folder).resolve()), "shards": len(paths), "fingerprint": h.hexdigest()[:16]}


def folder_record(folder: Path, name: str = "config.json") -> dict | None:
    path = folder / name
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_record(path: Path, record: dict) -> None:
    """JSON through a temporary file (an interrupted write leaves the old record)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


def _show(v) -> str:
    if isinstance(v, dict) and "path" in v:
        return v["path"]
    if isinstance(v, (list, tuple)):
        return ",".join(map(str, v)) if all(isinstance(x, (int, float, str)) for x in v) else f"{len(v)} entries"
    return str(v)


def check_run(recorded: dict | None, now: dict, where: str, flags: dict[str, str] | None = None,
              advice: str = "use another --work (or the same options to resume)", sep: str = ": ") -> None:
    """Compare a checkpoint's record with this run's, key by key in `now`'s order; the first
    difference is a RunMismatch naming it. Keys the record lacks (an older checkpoint) pass.
    flags: the command-line flag a key comes from, for the message; "target" entries compare by
    fingerprint (same_target). The message reads f"{where}{sep}made with ..."."""
    if recorded is None:
        return
    flags = flags or {}
    for key, value in now.items():
        if key not in recorded:
            continue
        old = recorded[key]
        if isinstance(value, dict) and "fingerprint" in value:
            differs = not isinstance(old, dict) or old.get("fingerprint") != value["fingerprint"]
        elif isinstance(old, dict) and "fingerprint" in old:
            differs = True          # a target then, none now
        else:
            differs = _plain(old) != _plain(value)
        if differs:
            flag = flags.get(key, key)
            if isinstance(value, dict) and "fingerprint" in value and isinstance(old, dict) and \
                    old.get("path") == value["path"]:
                raise RunMismatch(f"{where}{sep}made with {flag} {old['path']} as it was then; what it holds has changed "
                                  f"since; {advice}")
            raise RunMismatch(f"{where}{sep}made with {flag} {_show(old)} (this run: {_show(value)}); {advice}")


def _plain(v):
    """JSON's view of a value (tuples as lists, tensors as lists), for comparing with a record."""
    if isinstance(v, torch.Tensor):
        return v.tolist()
    return json.loads(json.dumps(v))


def check_state(module: torch.nn.Module, state: dict, where: str, advice: str = "use another --work") -> None:
    """Before load_state_dict: the checkpoint's tensors are the ones `module` has, of the same
    shapes; else a RunMismatch naming the first that differs (not torch's multi-line error)."""
    own = module.state_dict()
    for k in sorted(set(own) ^ set(state)):
        raise RunMismatch(f"{where}: its checkpoint {'lacks' if k in own else 'holds'} {k}, which the model these "
                          f"options build {'has' if k in own else 'does not have'} (another kind, --num-heads or "
                          f"--layers); {advice}")
    for k, v in own.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise RunMismatch(f"{where}: its checkpoint's {k} is {tuple(state[k].shape)}, these options build "
                              f"{tuple(v.shape)} (another --draft-vocab, --num-heads, config or target shape); {advice}")


def load_optimizer(opt: torch.optim.Optimizer, state: dict, where: str, advice: str = "use another --work") -> None:
    try:
        opt.load_state_dict(state)
    except ValueError:
        raise RunMismatch(f"{where}: its checkpoint's optimizer holds other parameters than these options train "
                          f"(e.g. --freeze-lm-head); {advice}") from None
