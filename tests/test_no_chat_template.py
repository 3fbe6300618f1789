"""A model whose tokenizer has no chat template: chat is refused as vLLM (and transformers >= 4.44)
refuse it, never rendered with a made-up template; --chat-template / chat_template= still work."""

from __future__ import annotations

import io
import json
import shutil

import httpx
import pytest

from gguf_helpers import write_gguf
from specdec import LLM, SamplingParams
from specdec.cli import main

CONV = [{"role": "user", "content": "def add(a, b):"}]
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
MESSAGE = "this model's tokenizer has no chat template; pass --chat-template"


@pytest.fixture(scope="module")
def bare(tiny_pair, tmp_path_factory):
    """The tiny target with its tokenizer_config.json's chat_template taken out."""
    folder = tmp_path_factory.mktemp("bare") / "m"
    shutil.copytree(tiny_pair[0], folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def bare_llm(bare):
    return LLM(str(bare))


def test_llm_chat_raises_and_takes_a_template(bare_llm):
    with pytest.raises(ValueError) as e:
        bare_llm.chat(CONV, PARAMS)
    assert MESSAGE in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="no chat template"):
        bare_llm.get_tokenizer().apply_chat_template(CONV, tokenize=False, add_generation_prompt=True)
    out = bare_llm.chat(CONV, PARAMS, chat_template=TEMPLATE)[0]
    assert out.prompt == "[user] def add(a, b):\n>" and len(out.outputs[0].token_ids) == 4
    bare_llm.generate("def add(a, b):", PARAMS)        # plain prompts need no template


def test_gguf_without_a_template(tiny_pair, tmp_path):
    path = write_gguf(tiny_pair[0], tmp_path / "m.gguf", chat_template=None)
    llm = LLM(str(path))
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(CONV, PARAMS)


def test_server_answers_400(bare_llm):
    from specdec.server import ServerConfig, build_app
    from test_server import LiveServer

    body = {"model": "bare", "messages": CONV, "max_tokens": 4, "temperature": 0}
    with LiveServer(build_app(bare_llm, ServerConfig(served_model_names=("bare",)))) as live:
        r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400
        err = r.json()["error"]
        assert MESSAGE in err["message"] and err["type"] == "invalid_request_error"
        r = httpx.post(live.url + "/v1/completions", json={**body, "prompt": "def"}, timeout=60)
        assert r.status_code == 200                 # completions need no template
    with LiveServer(build_app(bare_llm, ServerConfig(served_model_names=("bare",), chat_template=TEMPLATE))) as live:
        r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == \
            len(bare_llm.tokenizer.encode("[user] def add(a, b):\n>", add_special_tokens=False))


def test_chat_repl_and_generate_chat_exit_2(bare, bare_llm, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/exit\n"))
    assert main(["chat", "--model", str(bare), "--max-tokens", "3"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and MESSAGE in err, err
    assert main(["generate", "--model", str(bare), "--chat", "hello", "--max-tokens", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and MESSAGE in err
    # --chat-template as vLLM's flag: a file, or the template itself
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    expected = bare_llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=3,
                             ignore_eos=True), chat_template=TEMPLATE)[0].outputs[0].token_ids
    for value in (str(path), TEMPLATE):
        monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/exit\n"))
        assert main(["chat", "--model", str(bare), "--max-tokens", "3", "--ignore-eos", "--chat-template", value]) == 0
        assert capsys.readouterr().out.count("\n") == 1
        assert main(["generate", "--model", str(bare), "--chat", "hello", "--max-tokens", "3", "--ignore-eos",
                     "--chat-template", value, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["token_ids"] == expected
