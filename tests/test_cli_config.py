"""vLLM's FlexibleArgumentParser conveniences on specdec's command lines: `--config FILE` (a YAML
file of flags, the command line winning over it), a JSON flag's keys given one at a time
(`--speculative-config.num_speculative_tokens 3`) and human-readable integers (`--max-model-len 4K`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from specdec.cli import main
from specdec.server.cli import parse_args

from serve_helpers import wait_listening


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_config_file_flags_and_the_command_line_wins(tmp_path):
    cfg = _yaml(tmp_path, """
model: models/target
port: 8123
max_model_len: 4K                      # underscores or dashes, human-readable integers
served-model-name: [a, b]
enable-prefix-caching: false           # a boolean's --no- form
enforce-eager: false                   # a store_true flag left at its default
speculative_config:
  method: ngram
  num_speculative_tokens: 3
allowed-origins: ["https://x.example"]
trust-remote-code: true                # vLLM's, ignored here with a warning as on the command line
seed: null                             # null: the default
""")
    args, ignored = parse_args(["--config", cfg])
    assert (args.model, args.port, args.max_model_len, args.served_model_name) == ("models/target", 8123, 4096, ["a", "b"])
    assert args.enable_prefix_caching is False and args.enforce_eager is False and args.seed == 0
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    assert args.allowed_origins == ["https://x.example"] and ignored == ["--trust-remote-code"]
    # command line > config file > defaults; a positional MODEL wins over the file's model
    args, _ = parse_args(["models/draft", f"--config={cfg}", "--port", "9000", "--enable-prefix-caching"])
    assert (args.model, args.port, args.enable_prefix_caching, args.max_model_len) == ("models/draft", 9000, True, 4096)
    args, _ = parse_args(["--config", cfg, "--model", "other"])
    assert args.model == "other"


@pytest.mark.parametrize("text,message", [
    ("a: [\n", "not valid YAML (line 2)"),
    ("- a\n- b\n", "must be a YAML mapping of flag names to values, got a list"),
    ("max-num-seq: 3\n", "unrecognized arguments: --max-num-seq (neither specdec's flags nor vLLM's; did you mean --max-num-seqs?)"),
    ("config: other.yaml\n", "a config file cannot name another"),
])
def test_a_bad_config_file_is_one_clear_error(tmp_path, text, message):
    with pytest.raises(ValueError) as e:
        parse_args(["m", "--config", _yaml(tmp_path, text)])
    assert message in str(e.value)
    with pytest.raises(ValueError, match="--config is given more than once"):
        parse_args(["m", "--config", "a.yaml", "--config", "b.yaml"])


def test_json_flags_take_their_keys_one_at_a_time():
    args, ignored = parse_args(["m", "--speculative-config.method", "ngram",
                                "--speculative_config.num_speculative_tokens", "2",   # the key keeps its underscores
                                "--speculative-config.prompt_lookup_max=4"])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}
    # in order: a whole JSON replaces what came before it (a flag given twice), a key sets itself over it
    args, _ = parse_args(["m", "--speculative-config.num_speculative_tokens", "2",
                          "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    args, _ = parse_args(["m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}',
                          "--speculative-config.num_speculative_tokens", "2"])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    args, _ = parse_args(["m", "--hf-overrides.rope_scaling.factor", "4.0", "--override-generation-config.x+", "a,1",
                          "--override-generation-config.x+=c"])
    assert args.hf_overrides == {"rope_scaling": {"factor": 4.0}}
    assert args.override_generation_config == {"x": ["a", 1, "c"]}
    args, ignored = parse_args(["m", "--kv-transfer-config.kv_connector", "X"])
    assert ignored == ['--kv-transfer-config {"kv_connector": "X"}']
    with pytest.raises(ValueError, match="--speculative-config.method needs a value"):
        parse_args(["m", "--speculative-config.method"])


def test_compilation_level_dotted():
    args, _ = parse_args(["m", "--compilation-config.level", "3"])
    assert args.compilation_config == {"level": 3}


@pytest.mark.parametrize("value,expected", [("4096", 4096), ("4K", 4096), ("32k", 32000), ("25.6k", 25600),
                                            ("1M", 1 << 20), ("auto", None), ("-1", None)])
def test_human_readable_integers(value, expected):
    args, _ = parse_args(["m", "--max-model-len", value, "--max-num-batched-tokens", "2K"])
    assert args.max_model_len == expected and args.max_num_batched_tokens == 2048


@pytest.mark.parametrize("value", ["1.5K", "4x", "1.0005k"])
def test_a_bad_human_readable_integer_is_refused(value, capsys):
    with pytest.raises(SystemExit):
        parse_args(["m", "--max-model-len", value])
    assert "must be an integer, optionally with a suffix" in capsys.readouterr().err


def test_generate_reads_a_config_file(tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair
    cfg = _yaml(tmp_path, f"model: {target}\nspeculative-model: {draft}\nnum_speculative_tokens: 3\n"
                          "max_tokens: 6\ntemperature: 0\nseed: 1\n")
    assert main(["generate", "--config", cfg, "--max-tokens", "4", "hello"]) == 0
    assert "acceptance rate" in capsys.readouterr().err      # the config's draft model ran
    assert main(["generate", "--config", str(tmp_path / "none.yaml"), "hello"]) == 2
    assert capsys.readouterr().err.strip() == f"specdec generate: error: --config {tmp_path / 'none.yaml'}: No such file or directory"


def test_serve_with_a_config_file(tiny_pair, tmp_path):
    """A real server started from `--config`: its names, context length and speculative method are
    the file's, its port the command line's (--port 0: the kernel's pick, read from the log)."""
    target, draft = tiny_pair
    cfg = _yaml(tmp_path, f"""
model: {target}
served_model_name: [cfg-model]
max-model-len: 0.2k
port: 1                                  # the command line's --port wins
speculative-config: {{model: "{draft}", num_speculative_tokens: 3}}
uvicorn-log-level: info                  # (not warning: "Uvicorn running on" is an INFO line)
""")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--config", cfg, "--port", "0"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    try:
        url = wait_listening(proc, log, timeout=120)
        assert int(url.rsplit(":", 1)[1]) != 1                  # not the file's port
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        model = client.models.list().data[0]
        assert model.id == "cfg-model" and model.model_extra["max_model_len"] == 200
        out = client.completions.create(model="cfg-model", prompt="def add(a, b):", max_tokens=12, temperature=0)
        assert out.usage.completion_tokens == 12
        metrics = httpx.get(url + "/metrics").text
        drafted = [line for line in metrics.splitlines() if line.startswith("specdec:spec_decode_num_draft_tokens_total")]
        assert drafted and float(drafted[0].split()[-1]) > 0
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_command_line_wins_over_the_file_for_json_flags_and_the_model(tmp_path):
    """A tester's findings: a YAML key with a dot was respelt (num_speculative_tokens became
    num-speculative-tokens, refused); the file's JSON could beat the command line's, or a dotted key
    on the command line was lost; `serve --port N MODEL --config FILE` said the model was named twice."""
    dotted = _yaml(tmp_path, "speculative_config.method: ngram\nspeculative_config.num_speculative_tokens: 3\n")
    assert parse_args(["m", "--config", dotted])[0].speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    whole = _yaml(tmp_path, "model: from-file\nspeculative-config: {method: ngram, num_speculative_tokens: 3}\n")
    args, _ = parse_args(["--config", whole, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 5} and args.model == "from-file"
    args, _ = parse_args(["--config", whole, "--speculative-config.num_speculative_tokens", "2"])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    args, _ = parse_args(["--port", "9000", "models/draft", "--config", whole])      # MODEL after the options
    assert args.model == "models/draft" and args.port == 9000
    args, _ = parse_args(["--config", whole, "--model", "flag"])
    assert args.model == "flag"


def test_bench_subcommands_read_a_config_file(tiny_pair, tmp_path, capsys):
    """`bench throughput --config FILE`: the file's flags belong to the subcommand (they landed on
    bench's own parser: a file holding only `model:` benchmarked the default model)."""
    import json

    target, _ = tiny_pair
    cfg = _yaml(tmp_path, f"model: {target}\nnum-prompts: 2\ninput-len: 4\noutput-len: 4\nenable-prefix-caching: false\n")
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--config", cfg, "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["num_requests"] == 2 and result["settings"]["model"] == str(target)
    assert "Throughput:" in capsys.readouterr().out
