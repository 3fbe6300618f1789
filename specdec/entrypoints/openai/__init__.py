"""vLLM's module entry points (`python -m vllm.entrypoints.openai.api_server ...`) under specdec's name."""

from __future__ import annotations

import argparse
import sys


def module_main(run, prog: str, argv: list[str] | None = None) -> int:
    """run(Namespace(argv=...), prog) as a command: its bad input one line on stderr and status 2."""
    from ...model import CheckpointError

    try:
        return run(argparse.Namespace(argv=list(sys.argv[1:] if argv is None else argv)), prog=prog)
    except KeyboardInterrupt:
        return 130
    except (CheckpointError, ValueError, OSError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return 2
