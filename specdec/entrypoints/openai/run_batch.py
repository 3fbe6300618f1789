"""`python -m specdec.entrypoints.openai.run_batch -i requests.jsonl -o results.jsonl --model ...`

vLLM's module path and flags; the same as `specdec run-batch`.
"""

from __future__ import annotations

import argparse
import sys

PROG = "python -m specdec.entrypoints.openai.run_batch"


def main(argv: list[str] | None = None) -> int:
    from ...model import CheckpointError
    from ...server.run_batch import run

    try:
        return run(argparse.Namespace(argv=list(sys.argv[1:] if argv is None else argv)), prog=PROG)
    except KeyboardInterrupt:
        return 130
    except (CheckpointError, ValueError, OSError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
