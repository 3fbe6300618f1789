"""`python -m specdec.entrypoints.openai.api_server --model ... --speculative-model ...`

vLLM's module path and flags; the same server as `specdec serve`.
"""

from __future__ import annotations

import sys

from . import module_main

PROG = "python -m specdec.entrypoints.openai.api_server"


def main(argv: list[str] | None = None) -> int:
    from ...server.cli import run

    return module_main(run, PROG, argv)


if __name__ == "__main__":
    sys.exit(main())
