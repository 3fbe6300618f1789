"""Write the benchmark prompt sets from the held-out TEST split of the stdlib corpus.

    python -m specdec.bench.make_prompts [--out bench/prompts]

- code.jsonl: a function's signature and docstring; the model completes the body. Drawn only
  from test-split files, so the bundled models never trained on them.
- repeat.jsonl: a whole function, then a comment announcing a rename and the renamed def line;
  the natural continuation copies the body (the case prompt lookup is built for).

Deterministic for a given stdlib: files in sorted order, functions in source order, one per
file per pass, so the sets spread across files rather than drain the first one.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from ..train.data import corpus_files, stdlib_root

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "bench" / "prompts"
NUM_CODE, NUM_REPEAT = 20, 10
CODE_MAX_CHARS, REPEAT_MAX_CHARS = 1200, 1400


@dataclass(frozen=True)
class Function:
    file: str
    qualname: str
    source: str        # the whole function, dedented
    header: str        # decorators + def line(s) + docstring, dedented
    body_lines: int    # code lines after the docstring (not blank, not comments)
    statements: int    # top-level statements after the docstring
    args: tuple[str, ...]


def _functions(rel: str, text: str) -> list[Function]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node, owner in _walk_defs(tree):
        start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
        source = textwrap.dedent("".join(lines[start:node.end_lineno]))
        doc = ast.get_docstring(node, clean=False)
        if doc is None or len(node.body) < 2:
            continue
        header = textwrap.dedent("".join(lines[start:node.body[0].end_lineno]))
        body = "".join(lines[node.body[0].end_lineno:node.end_lineno])
        args = tuple(a.arg for a in node.args.args + node.args.kwonlyargs if a.arg not in ("self", "cls"))
        qual = f"{owner}.{node.name}" if owner else node.name
        code_lines = sum(1 for s in body.splitlines() if s.strip() and not s.strip().startswith("#"))
        out.append(Function(rel, qual, source, header, code_lines, len(node.body) - 1, args))
    return out


def _walk_defs(tree: ast.Module):
    """Top-level functions and methods of top-level classes, in source order."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, None
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield sub, node.name


def held_out_functions(root: Path | None = None) -> list[list[Function]]:
    """Per test-split file (sorted), its documented functions in source order."""
    root = root or stdlib_root()
    per_file = []
    for rel in corpus_files(root)["test"]:
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        fns = _functions(rel, text)
        if fns:
            per_file.append(fns)
    return per_file


def _round_robin(per_file: list[list[Function]], keep, n: int, skip: set[tuple[str, str]]) -> list[Function]:
    """Take up to n functions passing `keep`, one per file per pass."""
    queues = [[f for f in fns if keep(f) and (f.file, f.qualname) not in skip] for fns in per_file]
    picked: list[Function] = []
    while len(picked) < n and any(queues):
        for q in queues:
            if q and len(picked) < n:
                picked.append(q.pop(0))
    return picked


def code_prompts(per_file) -> list[dict]:
    # at least two statements: an abstract method's lone `raise NotImplementedError` is no test
    keep = lambda f: f.body_lines >= 4 and f.statements >= 2 and len(f.header) <= CODE_MAX_CHARS  # noqa: E731
    return [{"prompt": f.header, "id": f"{f.file}:{f.qualname}"}
            for f in _round_robin(per_file, keep, NUM_CODE, set())]


def _renamed(f: Function) -> tuple[str, str]:
    """(old, new): the longest argument name (or, lacking arguments, the function name)."""
    if f.args:
        old = max(f.args, key=lambda a: (len(a), a))
    else:
        old = f.qualname.rsplit(".", 1)[-1]
    return old, f"new_{old.lstrip('_')}"


def repeat_prompts(per_file, exclude: set[tuple[str, str]]) -> list[dict]:
    keep = lambda f: 4 <= f.body_lines <= 30 and len(f.source) <= REPEAT_MAX_CHARS  # noqa: E731
    out = []
    for f in _round_robin(per_file, keep, NUM_REPEAT, exclude):
        old, new = _renamed(f)
        def_line = next(line for line in f.source.splitlines(keepends=True) if line.lstrip().startswith(("def ", "async def ")))
        renamed_def = re.sub(rf"\b{re.escape(old)}\b", new, def_line)
        prompt = (f"{f.source.rstrip()}\n\n\n# The same function with `{old}` renamed to `{new}`;"
                  f" nothing else changes.\n{renamed_def}")
        out.append({"prompt": prompt, "id": f"{f.file}:{f.qualname}"})
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.bench.make_prompts", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    per_file = held_out_functions()
    code = code_prompts(per_file)
    used = {tuple(r["id"].split(":", 1)) for r in code}
    repeat = repeat_prompts(per_file, used)
    write_jsonl(args.out / "code.jsonl", code)
    write_jsonl(args.out / "repeat.jsonl", repeat)
    print(f"wrote {len(code)} code and {len(repeat)} repeat prompts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
