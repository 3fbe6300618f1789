"""CLI input errors are one line (review 64): argparse's own errors (a bad value, a missing
argument, an unknown subcommand) had printed the whole usage above the error, 40-65 lines for
generate and bench."""

from __future__ import annotations

import pytest

from specdec.cli import main


@pytest.mark.parametrize("argv, first", [
    (["bench", "serve", "--num-prompts", "abc"], "specdec bench serve: error: argument --num-prompts: invalid int value"),
    (["generate", "--max-tokens", "abc", "x"], "specdec generate: error: argument --max-tokens: invalid int value"),
    (["chat", "--temperature", "x"], "specdec chat: error: argument --temperature: invalid float value"),
    (["generate"], "specdec generate: error: the following arguments are required: prompt"),
    (["nosuch"], "specdec: error: argument cmd: invalid choice: 'nosuch'"),
])
def test_a_bad_argument_is_a_one_line_error(argv, first, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.count("\n") == 1 and err.startswith(first), err
    assert err.rstrip().endswith(f"(see {first.split(':')[0]} --help)")


def test_an_answer_the_terminal_cannot_encode_is_escaped_not_an_error():
    """stdout in ASCII (PYTHONIOENCODING=ascii, a C or Latin-1 locale): what it cannot encode is
    written as \\xe9; the command had ended mid-answer with "'ascii' codec can't encode", status 2."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    run = subprocess.run([sys.executable, "-m", "specdec", "generate", "--model", str(root / "models" / "target"),
                          "--max-tokens", "4", "--num-speculative-tokens", "0", "é café"],
                         capture_output=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr.decode("ascii", "replace")[-500:]
    assert run.stdout.startswith(b"\\xe9 caf\\xe9")
