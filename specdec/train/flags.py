"""Checks on `specdec train ...` flags, made before anything is loaded, read or written.

The argparse types refuse a value the way argparse refuses any bad flag, naming it, with exit
status 2 and no traceback (`argument --batch: must be an integer >= 1, got '0'`); the folder
checks (check_folder, check_shards) raise ValueError, which the CLI prints as one line.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path


def int_range(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high] (high None: no upper bound)."""
    want = f">= {low}" if high is None else f"in [{low}, {high}]"

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer {want}, got {value!r}") from None
        if n < low or (high is not None and n > high):
            raise argparse.ArgumentTypeError(f"must be an integer {want}, got {value!r}")
        return n

    parse.__name__ = f"integer {want}"
    return parse


def float_range(low: float, high: float | None = None, low_open: bool = False):
    """An argparse type: a finite number above low (at least low unless low_open), at most high."""
    want = f"{'>' if low_open else '>='} {low:g}" if high is None else \
        f"in {'(' if low_open else '['}{low:g}, {high:g}]"

    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            x = math.nan
        if not math.isfinite(x) or x < low or (low_open and x == low) or (high is not None and x > high):
            raise argparse.ArgumentTypeError(f"must be a number {want}, got {value!r}")
        return x

    parse.__name__ = f"number {want}"
    return parse


positive_int = int_range(1)          # counts and sizes: steps of a run, batch, threads, shards ...
non_negative_int = int_range(0)      # counts where 0 means none: total steps (with --init), prompts to report
positive_float = float_range(0.0, low_open=True)     # learning rates
non_negative_float = float_range(0.0)                # loss weights, noise
unit_float = float_range(0.0, 1.0)                   # fractions


def layer_list(value: str) -> tuple[int, ...]:
    """An argparse type: comma-separated layer indices (integers >= 0), e.g. "2,4,5", returned in
    ascending order: the order features are read in at inference (specdec's loader and vLLM both
    capture them in layer order), so "5,2,4" means (2, 4, 5). A layer given twice is refused (the
    loader would read it once, and the head's input would be narrower than trained)."""
    try:
        layers = tuple(int(x) for x in value.split(","))
    except ValueError:
        layers = ()
    if not layers or min(layers) < 0:
        raise argparse.ArgumentTypeError(f"must be comma-separated layer indices >= 0, got {value!r}")
    twice = sorted({i for i in layers if layers.count(i) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"layer {twice[0]} given twice in {value!r}: each layer's features are read once")
    return tuple(sorted(layers))


def check_folder(flag: str, path: str | Path, what: str = "folder") -> Path:
    """The folder a flag names exists (before anything is made beside it)."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{flag} {path}: no such {what}" if not p.exists() else f"{flag} {path}: not a folder")
    return p


def check_shards(flag: str, path: str | Path, val_shards: int) -> None:
    """An answers folder (`specdec train answers`) holds more shards than --val-shards leaves out."""
    n = len(list(check_folder(flag, path, "answers folder").glob("shard_*.pt")))
    if n <= val_shards:
        raise ValueError(f"{flag} {path}: {n} answer shards, need more than --val-shards {val_shards} "
                         "(the first shards are held out)")
