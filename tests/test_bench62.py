"""review62's command-line defects, through `python -m specdec` runs: `bench --hf-config-path`
applied and recorded (D2); `bench serve --base-url` refusing the flags of servers it starts (D3);
a line that is not UTF-8 failing alone in the remote client and the local chat, which exit 1 (D4);
non-finite sampling values refused before the model loads (D9)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from test_server import LiveServer

from conftest import _scale_embeddings, make_checkpoint, make_tokenizer
from gguf_helpers import write_gguf
from specdec.cli import main
from specdec.llm import LLM
from specdec.server import ServerConfig, build_app

MODELS = Path(__file__).resolve().parents[1] / "models"
MIXED = b"first\ncaf\xe9\nthird\n"            # the middle line is Latin-1, not UTF-8
NOT_UNICODE = "the text is not valid Unicode: a lone surrogate at character 3"


def run_main(*argv) -> int:
    """main(argv) in this process, for refusals made before anything loads (argparse's exit too)."""
    try:
        return main([str(a) for a in argv])
    except SystemExit as e:
        return e.code


def specdec(*argv, stdin: bytes | None = None, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec", *map(str, argv)], input=stdin, capture_output=True,
                          timeout=300, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.fixture(scope="module")
def server():
    """The bundled toy target with its draft, K=3 (what D3's flags claim to change)."""
    llm = LLM(str(MODELS / "target"), speculative_model=str(MODELS / "draft"), num_speculative_tokens=3,
              max_model_len=256, max_num_seqs=2)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("toy",)))) as live:
        live.api = live.url + "/v1"
        live.client = openai.OpenAI(base_url=live.api, api_key="EMPTY", max_retries=0, timeout=60)
        yield live


# --- D2: bench --hf-config-path ----------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """A one-layer llama's F32 GGUF, and a folder whose config.json does not fit its tensors."""
    root = tmp_path_factory.mktemp("bench62")
    make_tokenizer(root / "tok", vocab=320)
    hf = make_checkpoint(root / "hf", layers=1, tokenizer_from=root / "tok")
    _scale_embeddings(hf, 8.0)
    bad = root / "bad"
    shutil.copytree(hf, bad)
    cfg = json.loads((hf / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": cfg["intermediate_size"] * 2}))
    return {"gguf": write_gguf(hf, root / "m.gguf"), "hf": hf, "bad": bad}


BENCH = ("--methods", "plain", "--no-peers", "--repeats", "1", "--limit-prompts", "1", "--max-tokens", "4",
         "--temperature", "0")


def test_bench_applies_and_records_hf_config_path(gguf, tmp_path, capsys):
    """bench runs the GGUF with --hf-config-path's config, as generate does: a config that does not
    fit the file's tensors fails (it had been ignored, exit 0), a missing folder is generate's one
    line before the model loads or --out is made, and a good folder is in the recorded command."""
    r = specdec("bench", "--model", gguf["gguf"], "--hf-config-path", gguf["bad"], *BENCH, "--out", tmp_path / "bad")
    err = r.stderr.decode()
    assert r.returncode == 2 and str(gguf["bad"] / "config.json") in err, err[-800:]
    rc = run_main("bench", "--model", gguf["gguf"], "--hf-config-path", tmp_path / "nowhere", *BENCH,
                  "--out", tmp_path / "none")
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err[-800:]
    assert f"hf_config_path model folder '{tmp_path / 'nowhere'}' does not exist" in err
    assert not (tmp_path / "none").exists()
    r = specdec("bench", "--model", gguf["gguf"], "--hf-config-path", gguf["hf"], *BENCH, "--out", tmp_path / "ok")
    assert r.returncode == 0, r.stderr.decode()[-800:]
    results = json.loads((tmp_path / "ok" / "results.json").read_text())
    assert f"--hf-config-path {gguf['hf']}" in results["command"]
    assert results["config"]["hf_config_path"] == str(gguf["hf"])


# --- D3: bench serve --base-url and the flags of the servers it would start ---------------------

def test_bench_serve_base_url_refuses_the_started_servers_flags(server, tmp_path, capsys):
    """The running server (draft_model, K=3) is measured as it runs: --num-speculative-tokens,
    --speculative-config and --server-args, which it ignores, are one line (exit 2) before any
    request, with nothing recorded; vLLM's --host/--port name the running server alike."""
    r = specdec("bench", "serve", "--base-url", server.url, "--server-args", "--max-num-seqs 4",
                "--num-speculative-tokens", "8", "--speculative-config", '{"method": "ngram"}',
                "--num-prompts", "2", "--max-concurrency", "1", "--output-len", "4", "--warmup", "0",
                "--out", tmp_path / "b")
    err = r.stderr.decode()
    assert r.returncode == 2 and err.count("\n") == 1, err
    assert "--num-speculative-tokens, --speculative-config, --server-args: configure the servers started here" in err
    assert not (tmp_path / "b").exists()
    port = server.url.rsplit(":", 1)[1]
    rc = run_main("bench", "serve", "--port", port, "--num-speculative-tokens", "0", "--num-prompts", "2",
                  "--max-concurrency", "1", "--output-len", "4", "--warmup", "0", "--out", tmp_path / "p")
    err = capsys.readouterr().err
    assert rc == 2 and "--num-speculative-tokens: configures the servers started here" in err, err
    assert not (tmp_path / "p").exists()


# --- D4: a line that is not UTF-8 ----------------------------------------------------------------

def _answer(server, prompt: str, chat: bool) -> str:
    if chat:
        r = server.client.chat.completions.create(model="toy", messages=[{"role": "user", "content": prompt}],
                                                  temperature=0, max_tokens=4)
        return r.choices[0].message.content
    return server.client.completions.create(model="toy", prompt=prompt, temperature=0, max_tokens=4).choices[0].text


@pytest.mark.parametrize("io", ["utf-8:surrogateescape", "utf-8:strict"])   # a C locale's stdin; a UTF-8 locale's
def test_complete_sends_every_line_but_the_one_not_utf8(server, io):
    """The bad line is one error line naming its character, the next line is still completed, and
    the command exits 1 at the end (client_cli's docstring); it had ended the run with a codec error
    about a JSON body's position, exit 2."""
    r = specdec("complete", "--url", server.api, "--temperature", "0", "--max-tokens", "4", stdin=MIXED,
                env={"PYTHONIOENCODING": io})
    out, err = r.stdout.decode(), r.stderr.decode()
    assert r.returncode == 1, err
    assert out == f"{_answer(server, 'first', False)}\n{_answer(server, 'third', False)}\n"
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert NOT_UNICODE in line and "(the prompt was not sent)" in line
    assert "Traceback" not in err and "codec" not in err


def test_remote_chat_goes_on_after_a_line_not_utf8(server, capsys):
    """chat --url: the bad line's turn is not kept, the next one gets the answer a conversation of
    `first` and `third` gets, exit 1; -q and --system with such text are one line (exit 2)."""
    r = specdec("chat", "--url", server.api, "--temperature", "0", "--max-tokens", "4", stdin=MIXED)
    out, err = r.stdout.decode(), r.stderr.decode()
    assert r.returncode == 1, err
    first = _answer(server, "first", True)
    third = server.client.chat.completions.create(
        model="toy", temperature=0, max_tokens=4,
        messages=[{"role": "user", "content": "first"}, {"role": "assistant", "content": first},
                  {"role": "user", "content": "third"}]).choices[0].message.content
    assert out == f"{first}\n{third}\n"
    assert sum(NOT_UNICODE in x for x in err.splitlines()) == 1 and "Traceback" not in err
    for flag in ("-q", "--system-prompt"):              # argv's bytes b"caf\xe9" as Python reads them
        assert run_main("chat", "--url", server.api, flag, "caf\udce9") == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and NOT_UNICODE in err, err


def test_local_chat_exits_1_after_a_failed_message():
    """The local chat goes on after the bad line (as before) and now exits 1, as the remote one."""
    r = specdec("chat", "--model", MODELS / "target", "--temperature", "0", "--max-tokens", "2", stdin=MIXED,
                env={"PYTHONIOENCODING": "utf-8:surrogateescape"})
    err = r.stderr.decode()
    assert r.returncode == 1, err
    assert sum("not valid Unicode" in x for x in err.splitlines()) == 1
    assert len([x for x in err.splitlines() if x.startswith("[2 tokens")]) == 2      # first and third answered


# --- D9: non-finite values ------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["bench", "--model", MODELS / "target", "--methods", "plain", "--no-peers", "--temperature", "0,inf"],
    ["bench", "--model", MODELS / "target", "--methods", "plain", "--no-peers", "--temperature", "nan"],
    ["bench", "throughput", "--model", MODELS / "target", "--temperature", "inf"],
    ["bench", "latency", "--model", MODELS / "target", "--temperature", "inf"],
    ["bench", "serve", "--temperature", "inf"],
    ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--top-p", "nan"],      # before it is asked for
    ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--min-p", "1.5"],
])
def test_bench_refuses_non_finite_sampling_before_loading(argv, tmp_path, capsys, monkeypatch):
    """Refused with the flag named before a model loads or a server starts, no --out made; inf
    had passed the flag check, then failed after the load, leaving an empty --out folder."""
    monkeypatch.chdir(tmp_path)
    out = ["--output-json", tmp_path / "o.json"] if argv[1] in ("throughput", "latency") else ["--out", tmp_path / "o"]
    rc = run_main(*argv, *out)
    err = capsys.readouterr().err
    flag = next(a for a in argv if str(a).startswith("--") and a not in ("--model", "--methods", "--no-peers",
                                                                         "--base-url"))
    assert rc == 2 and flag in err.splitlines()[-1], err[-800:]
    assert "machine:" not in err and "starting" not in err         # nothing loaded, no server started
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.json").exists()
