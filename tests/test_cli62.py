"""The command line as a tester (review62) met it, each through a real `specdec` process on the toy
target: vLLM 0.6's switches that take an optional true / false, --config values that start with
"-" and YAML lists for comma-list flags, --help=KEYWORD into a closed pipe, and Ctrl-C while the
start-up still imports torch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from serve_helpers import wait_listening

ROOT = Path(__file__).resolve().parents[1]
TARGET = str(ROOT / "models" / "target")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _specdec(*words: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec", *words], capture_output=True, text=True,
                          timeout=timeout, env=ENV, cwd=ROOT)


# -- D1. vLLM 0.6's StoreBoolean switches (nargs="?"): `--enable-chunked-prefill False` ----------

def test_generate_takes_a_true_false_after_vllm_06s_optional_value_switches():
    """The True had been taken for the prompt, then `Hello` refused as an unexpected argument; a
    word that is not true / false after such a switch is still the prompt."""
    r = _specdec("generate", "--model", TARGET, "--max-tokens", "2", "--enable-chunked-prefill", "True",
                 "--multi-step-stream-outputs", "Hello")
    assert r.returncode == 0, r.stderr[-800:]
    assert r.stdout.startswith("Hello") and len(r.stdout) > len("Hello")     # the prompt, then its continuation
    assert "ignoring vLLM flag (specdec does not use it): --enable-chunked-prefill True" in r.stderr
    assert "ignoring vLLM flag (specdec does not use it): --multi-step-stream-outputs\n" in r.stderr


def test_serve_takes_a_true_false_after_vllm_06s_optional_value_switches(tmp_path):
    """`serve --port 0 --enable-chunked-prefill False ... MODEL` (the model after the options) had
    exited 2 with "unexpected argument 'False'"; it serves, warning about the ignored flags."""
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "specdec", "serve", "--port", "0", "--enable-chunked-prefill",
                             "False", "--multi-step-stream-outputs", "false", "--disable-logprobs-during-spec-decoding",
                             "TRUE", TARGET], stdout=open(log, "w"), stderr=subprocess.STDOUT, env=ENV, cwd=ROOT)
    try:
        url = wait_listening(proc, log)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        assert client.models.list().data[0].id == TARGET
        out = client.completions.create(model=TARGET, prompt="Hello", max_tokens=2)
        assert out.usage.completion_tokens == 2
    finally:
        proc.terminate()
        proc.wait(60)
    text = log.read_text()
    for flag in ("--enable-chunked-prefill False", "--multi-step-stream-outputs false",
                 "--disable-logprobs-during-spec-decoding TRUE"):
        assert f"ignoring vLLM flag (specdec does not use it): {flag}\n" in text


# -- D5 / D8. --config: values that start with "-", YAML lists for comma-list flags ---------------

def test_config_values_may_start_with_a_dash(tmp_path):
    """`stop: ["---"]` had failed with "argument --stop: expected one argument"."""
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {TARGET}\nmax-tokens: 3\nchat: true\nsystem: '- be brief'\nstop: ['---', '-']\n")
    r = _specdec("generate", "Hi", "--config", str(config), "--json")
    assert r.returncode == 0, r.stderr[-800:]
    assert json.loads(r.stdout)["stats"]["output_tokens"] <= 3


def test_bench_config_lists_for_comma_list_flags(tmp_path):
    """`num-speculative-tokens: [1, 2]` had been refused ("got '[1'"): a YAML list for a flag that
    reads a comma list is that list (bench serve's max-concurrency and request-rate alike)."""
    from specdec.cli import _subparser, build_parser, expand_argv

    config = tmp_path / "b.yaml"
    config.write_text(f"model: {TARGET}\nmethods: [ngram]\nnum-speculative-tokens: [1, 2]\ntemperature: [0]\n"
                      f"no-peers: true\nlimit-prompts: 1\nmax-tokens: 4\nrepeats: 1\nout: {tmp_path / 'out'}\n")
    r = _specdec("bench", "--config", str(config))
    assert r.returncode == 0, r.stderr[-800:]
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert result["config"]["num_speculative_tokens"] == [1, 2] and result["config"]["temperatures"] == [0.0]

    config.write_text("max-concurrency: [1, 2]\nrequest-rate: [4, inf]\nnum-speculative-tokens: [0, auto]\n")
    parser = build_parser("bench")
    serve = _subparser(_subparser(parser, "bench"), "serve")
    args = parser.parse_args(["bench", "serve", *expand_argv(["--config", str(config)], serve)])
    assert (args.max_concurrency, args.request_rate, args.num_speculative_tokens) == ([1, 2], [4.0, float("inf")],
                                                                                     [0, "auto"])


# -- D6. --help=KEYWORD into a closed pipe -----------------------------------------------------

@pytest.mark.parametrize("words", [["generate", "--help=all"], ["chat", "--help=temperature"],
                                   ["bench", "--help=listgroup"]])
def test_help_keyword_into_a_closed_pipe_is_quiet(words):
    read, write = os.pipe()
    os.close(read)
    try:
        r = subprocess.run([sys.executable, "-m", "specdec", *words], stdout=write, stderr=subprocess.PIPE,
                           stdin=subprocess.DEVNULL, env=ENV, cwd=ROOT, timeout=120)
    finally:
        os.close(write)
    assert (r.returncode, r.stderr.decode()) == (0, "")


# -- D7. Ctrl-C while the start-up imports torch -----------------------------------------------

ENTRY_POINT = "import sys; from specdec.cli import main; sys.exit(main())"     # the console script's code


@pytest.mark.parametrize("launch", [["-m", "specdec"], ["-c", ENTRY_POINT]], ids=["python-m", "console-script"])
def test_ctrl_c_while_torch_loads_is_one_line_and_130(launch):
    """SIGINT as soon as torch's library is mapped (its import is under way) had printed a
    KeyboardInterrupt traceback through specdec/__init__.py and died by the signal."""
    proc = subprocess.Popen([sys.executable, *launch, "generate", "Hi", "--model", TARGET, "--max-tokens", "50"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 60
    while "libtorch" not in maps.read_text():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (130, "interrupted\n")


def test_the_lazy_package_still_reaches_its_submodules():
    """`import specdec` then `specdec.kernels` (the README's release_threads), `specdec.inputs`:
    the lazy __init__ imports a submodule on first use, as the eager one had them imported."""
    code = ("import specdec\n"
            "assert specdec.kernels.__name__ == 'specdec.kernels'\n"
            "assert specdec.inputs.TokensPrompt and specdec.config.SamplingParams is specdec.SamplingParams\n"
            "try:\n    specdec.no_such_thing\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit(1)\n")
    assert subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True).returncode == 0


def test_config_dotted_keys_take_bools_and_lists(tmp_path):
    """`speculative_config.x: true` / `false` / `[1, 2]` in a --config file read as on the command
    line; a true one had needed a value (and took the next flag as it), false was dropped."""
    from specdec.server.cli import parse_args

    for value, expected in (("true", True), ("false", False), ("[1, 2]", [1, 2])):
        f = tmp_path / "c.yaml"
        f.write_text(f"speculative_config.method: ngram\nspeculative_config.x: {value}\n")
        args = parse_args(["m", "--config", str(f), "--port", "18792"])[0]
        assert args.speculative_config == {"method": "ngram", "x": expected} and args.port == 18792


def test_a_closed_stdout_is_not_a_crash(tmp_path):
    """Started with stdout closed (`>&-`, Python's sys.stdout None): the command runs (its output
    goes nowhere) instead of an AttributeError traceback."""
    code = ("import sys; sys.argv = ['specdec', 'generate', '--model', 'models/target', '--max-tokens', '2', 'hi']\n"
            "from specdec.cli import main; raise SystemExit(main())\n")
    r = subprocess.run([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       cwd=Path(__file__).resolve().parents[1], env={**os.environ, "OMP_NUM_THREADS": "1"},
                       pass_fds=(), close_fds=True, preexec_fn=lambda: os.close(1))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
