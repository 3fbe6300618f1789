"""vLLM's --generation-config (auto / vllm / a folder) and --override-generation-config, and
generation_config.json's max_new_tokens as the server-wide cap vLLM makes of it."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from conftest import make_checkpoint
from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.server import ServerConfig, build_app
from test_server import LiveServer


@pytest.fixture(scope="module")
def folders(tiny_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    model = root / "m"
    make_checkpoint(model, tokenizer_from=tiny_pair[0])
    (model / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.3, "top_p": 0.5, "top_k": 5, "max_new_tokens": 7, "eos_token_id": 1}))
    other = root / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.9, "max_new_tokens": 3}))
    return model, other


def test_a_folder_and_overrides(folders, tmp_path, caplog):
    model, other = folders
    assert LLM(str(model), generation_config=str(other)).get_default_sampling_params() == \
        SamplingParams(temperature=0.9, max_tokens=3)
    llm = LLM(str(model), override_generation_config={"temperature": 0.6, "max_new_tokens": 4})
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.6, top_p=0.5, top_k=5, max_tokens=4)
    assert LLM(str(model), generation_config="vllm", override_generation_config={"top_p": 0.8}) \
        .get_default_sampling_params() == SamplingParams(top_p=0.8)
    with caplog.at_level(logging.WARNING, logger="specdec"):
        LLM(str(model), override_generation_config={"do_sample": True, "temperature": 0.2})
    assert "do_sample set no sampling default" in caplog.text
    with pytest.raises(ValueError, match="no generation_config.json there"):
        LLM(str(model), generation_config=str(tmp_path))
    with pytest.raises(ValueError, match="must be an object"):
        LLM(str(model), override_generation_config=[1])


def test_cli_flags(folders, tmp_path, capsys):
    model, other = folders
    base = ["generate", "--model", str(model), "--ignore-eos", "--json", "--temperature", "0", "def"]
    assert main(base + ["--generation-config", str(other)]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 3
    assert main(base + ["--override-generation-config", '{"max_new_tokens": 2}']) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 2
    assert main(base + ["--generation-config", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert "no generation_config.json there" in err and "Traceback" not in err
    # serve takes the flag as its own now (it was dropped as "no meaning here")
    from specdec.server.cli import parse_args

    args, ignored = parse_args(["--model", str(model), "--override-generation-config", '{"temperature": 0.5}'])
    assert args.override_generation_config == {"temperature": 0.5} and not ignored


def test_max_new_tokens_caps_every_request(folders):
    """vLLM: generation_config.json's max_new_tokens is a server-wide limit (min with the request's)."""
    model, _ = folders
    llm = LLM(str(model), num_speculative_tokens=0, max_model_len=128)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("m",)))) as live:
        chat = httpx.post(f"{live.url}/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "ignore_eos": True})
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 7
        short = httpx.post(f"{live.url}/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "ignore_eos": True})
        assert short.json()["usage"]["completion_tokens"] == 2
        # completions' own default of 16 is capped too
        comp = httpx.post(f"{live.url}/v1/completions", timeout=60,
                          json={"model": "m", "prompt": "def", "ignore_eos": True})
        assert comp.status_code == 200 and comp.json()["usage"]["completion_tokens"] == 7


def test_beams_and_bad_overrides(folders):
    model, _ = folders
    with pytest.raises(ValueError, match=r"override_generation_config \(merged over --generation-config vllm\)"):
        LLM(str(model), generation_config="vllm", override_generation_config={"temperature": -1})
    llm = LLM(str(model), num_speculative_tokens=0, max_model_len=128)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("m",)))) as live:
        r = httpx.post(f"{live.url}/v1/chat/completions", timeout=120, json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "n": 2,
            "use_beam_search": True, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2 * 7     # the cap, per beam
