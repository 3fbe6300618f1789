"""`python -m specdec.entrypoints.openai.run_batch -i requests.jsonl -o results.jsonl --model ...`

vLLM's module path and flags; the same as `specdec run-batch`.
"""

from __future__ import annotations

import sys

from . import module_main

PROG = "python -m specdec.entrypoints.openai.run_batch"


def main(argv: list[str] | None = None) -> int:
    from ...server.run_batch import run

    return module_main(run, PROG, argv)


if __name__ == "__main__":
    sys.exit(main())
