"""What a user who passes the wrong thing to --model is told: one line that names the file at
fault once and says what is wrong with it."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import make_checkpoint
from gguf_helpers import write_gguf
from specdec import LLM
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


def test_missing_gguf_file_is_no_such_file(tmp_path, capsys):
    missing = tmp_path / "missing.gguf"
    err = _error(capsys, "--model", str(missing))
    assert f"{missing}: no such file" in err and "folder" not in err, err


def test_a_weights_file_instead_of_its_folder(tiny, capsys):
    err = _error(capsys, "--model", str(tiny / "model.safetensors"))
    assert "does not exist" not in err and "is a file" in err and f"pass the folder that holds it ({tiny})" in err, err
    err = _error(capsys, "--model", str(tiny / "config.json"))
    assert f"pass the folder that holds it ({tiny})" in err, err


def test_missing_folder_still_says_so(tmp_path, capsys):
    err = _error(capsys, "--model", str(tmp_path / "nothing"))
    assert "does not exist" in err


@pytest.mark.parametrize("key,value,message", [
    ("temperature", "hot", "temperature must be"),
    ("max_new_tokens", -5, "max_tokens must be"),
    ("top_p", 3.0, "top_p"),
])
def test_bad_generation_config_value_names_the_file(tiny, tmp_path, capsys, key, value, message):
    folder = tmp_path / "m"
    shutil.copytree(tiny, folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, key: value}))
    path = folder / "generation_config.json"
    err = _error(capsys, "--model", str(folder))
    assert f"{path}: " in err and message in err, err
    with pytest.raises(ValueError, match="generation_config.json: "):
        LLM(str(folder))
    # vLLM's --generation-config vllm ignores the file: the model loads
    assert LLM(str(folder), generation_config="vllm").generation_defaults == {}
