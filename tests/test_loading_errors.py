"""What a user who passes the wrong thing to --model is told: one line that names the file at
fault once and says what is wrong with it."""

from __future__ import annotations


import pytest

from conftest import make_checkpoint
from gguf_helpers import write_gguf
from specdec.cli import main
from specdec.model import CheckpointError, load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "m", layers=1, hidden=32)


def _error(capsys, *argv) -> str:
    code = main(["generate", *argv, "hello"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("case,message", [
    ("arch", "unsupported architecture 'gpt2'"),
    ("rope", "unsupported rope scaling 'weird'"),        # a GGUFError raised while the config is read
])
def test_gguf_errors_name_the_file_once(tiny, tmp_path, capsys, case, message):
    out = tmp_path / f"{case}.gguf"
    if case == "arch":
        write_gguf(tiny, out, arch="gpt2")
    else:
        write_gguf(tiny, out, metadata={"llama.rope.scaling.type": "weird"})
    err = _error(capsys, "--model", str(out))
    assert message in err and err.count(str(out)) == 1, err
    with pytest.raises(CheckpointError) as e:
        load_model(out)
    assert str(e.value).count(str(out)) == 1
