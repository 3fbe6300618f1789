"""--replicas with vLLM's --hf-config-path (a GGUF run with a folder's config.json): the driver
checks the model as the replicas will load it, and the folder reaches them as an absolute path."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import make_checkpoint, make_tokenizer
from gguf_helpers import write_gguf
from specdec.model import CheckpointError
from specdec.server.replicas import application, check_model


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """A one-layer GGUF, a folder with its own config (RoPE changed) and one whose config does
    not fit the file's tensors (another hidden size)."""
    root = tmp_path_factory.mktemp("replicas61")
    make_tokenizer(root / "tok", vocab=320)
    hf = make_checkpoint(root / "hf", layers=1, tokenizer_from=root / "tok")
    config = json.loads((hf / "config.json").read_text())
    for name, change in (("same", {"rope_theta": 1e6}), ("wider", {"hidden_size": 2 * config["hidden_size"]})):
        shutil.copytree(hf, root / name)
        (root / name / "config.json").write_text(json.dumps({**config, **change}))
    return root, write_gguf(hf, root / "m.gguf")


def test_the_driver_checks_the_gguf_against_the_hf_config_path(gguf):
    root, path = gguf
    check_model(str(path), str(root / "same"))
    check_model(str(path))
    with pytest.raises(CheckpointError, match="config.json"):
        check_model(str(path), str(root / "wider"))        # the replicas would fail to load it
    with pytest.raises(CheckpointError, match="nowhere"):
        check_model(str(path), str(root / "nowhere"))


def test_replicas_get_the_hf_config_path_as_an_absolute_path(gguf, monkeypatch):
    root, path = gguf
    monkeypatch.chdir(root)
    app = application([str(path), "--replicas", "1", "--hf-config-path", "same"])
    argv = app._bound_deployment.init_args[0]
    assert argv[argv.index("--hf-config-path") + 1] == str(root / "same")
    with pytest.raises(CheckpointError, match="config.json"):
        application([str(path), "--replicas", "1", "--hf-config-path", "wider"])


def test_hf_config_path_with_tensor_parallelism_is_refused_by_the_driver(gguf):
    """As LLM() refuses it (the ranks load the GGUF's own config): before Ray starts, not in each replica."""
    root, path = gguf
    with pytest.raises(CheckpointError, match="tensor_parallel_size > 1"):
        check_model(str(path), str(root / "same"), tensor_parallel_size=2)
