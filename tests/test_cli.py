"""`specdec generate`: output shapes, the comparison, and one-line errors for bad input."""

from __future__ import annotations

import json

import pytest

from specdec.cli import main


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_and_compare(tiny_pair, capsys):
    target, draft = tiny_pair
    code, out, err = run(capsys, "generate", "--model", str(target), "--speculative-model", str(target),
                         "--num-speculative-tokens", "3", "--max-tokens", "12", "--ignore-eos", "--json",
                         "--compare", "def add(a, b):")
    assert code == 0
    result = json.loads(out)
    assert len(result["token_ids"]) == 12 and result["finish_reason"] == "length"
    assert result["stats"]["acceptance_rate"] == 1.0
    assert result["compare"]["identical"] is True and result["compare"]["speedup"] > 0
    assert result["compare"]["runs"] == 3          # a short answer: each side's best of three runs


def test_compare_decodes_plain_over_the_same_kv_cache_dtype(tiny_pair, capsys):
    """--compare's plain run uses the speculative run's --kv-cache-dtype (it used the default
    cache, so an int8 run reported its lossless output as not identical)."""
    target, _ = tiny_pair
    code, out, err = run(capsys, "generate", "--model", str(target), "--kv-cache-dtype", "int8", "--max-tokens", "64",
                         "--ignore-eos", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                         '"prompt_lookup_min": 1, "prompt_lookup_max": 4}', "--json", "--compare", "def add(a, b):\n    return")
    assert code == 0, err
    assert json.loads(out)["compare"]["identical"] is True


def test_generate_streams_text_and_prints_stats(tiny_pair, capsys):
    target, draft = tiny_pair
    code, out, err = run(capsys, "generate", "--model", str(target), "--speculative-model", str(draft),
                         "--num-speculative-tokens", "2", "--max-tokens", "8", "--show-acceptance",
                         "--temperature", "0.8", "--seed", "3", "def add(a, b):")
    assert code == 0 and out.startswith("def add(a, b):")
    assert "acceptance rate" in err and "mean accepted length" in err and "tokens/s" in err


@pytest.mark.parametrize("argv,message", [
    (["--model", "/nonexistent/model"], "does not exist"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--max-tokens", "0"], "max_tokens"),
    (["-O", '{"cudagraph_mode": "FULLY"}'], "cudagraph_mode must be one of"),
    (["--compilation-config", '{"cudagraph_mode": "FULL_DECODE_ONLY"}'], "CUDA graphs need a CUDA device"),
    # chat-only flags without --chat were silently ignored
    (["--system", "Answer in French."], "--system needs --chat"),
    (["--chat-template", "{{ messages[0]['content'] }}"], "--chat-template needs --chat"),
    (["--system", "", "--chat-template", "t.jinja"], "--system and --chat-template need --chat"),
    # plain decoding compared with itself printed a "speedup"
    (["--compare"], "--compare needs a speculative method"),
    (["--speculative-model", "[ngram]", "--num-speculative-tokens", "0", "--compare"], "--compare needs a speculative"),
    # --json prints one object: the colours were silently dropped
    (["--show-acceptance", "--json"], "--show-acceptance colours the streamed text"),
])
def test_bad_input_is_one_line_and_exit_2(tiny_pair, capsys, argv, message):
    target, _ = tiny_pair
    argv = argv if argv[0] == "--model" else ["--model", str(target), *argv]
    code, out, err = run(capsys, "generate", *argv, "hello")
    assert code == 2
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_prompt_longer_than_context(tiny_pair, capsys):
    target, _ = tiny_pair
    code, _, err = run(capsys, "generate", "--model", str(target), "--max-model-len", "8", "x " * 50)
    assert code == 2 and "prompt is too long" in err


def test_vocabulary_mismatch_fails_fast(tiny_pair, tmp_path, capsys):
    import json as _json
    from conftest import make_checkpoint

    target, _ = tiny_pair
    other = make_checkpoint(tmp_path / "other", seed=2)
    data = _json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    victim = next(t for t, i in vocab.items() if i == 77)
    vocab["qqqq"] = vocab.pop(victim)
    (other / "tokenizer.json").write_text(_json.dumps(data))
    code, _, err = run(capsys, "generate", "--model", str(target), "--speculative-model", str(other), "x")
    assert code == 2 and "token id 77" in err


def test_train_and_generate_do_not_import_the_server():
    """`specdec train ...` (a GPU machine with torch and transformers but no fastapi) and
    `specdec generate` register only their own subcommand: the server's stack stays unloaded."""
    import subprocess
    import sys

    code = ("import sys\nfrom specdec.cli import main\n"
            "for argv in (['train', 'answers', '--help'], ['generate', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in ('fastapi', 'starlette', 'uvicorn', 'pydantic') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
    out = subprocess.run([sys.executable, "-m", "specdec", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "{generate,chat,complete,serve,run-batch,bench,train}" in out.stdout


def test_loading_a_model_leaves_torch_dynamo_sympy_and_fastapi_unimported(tiny_pair, smollm2):
    """A checkpoint or GGUF load builds its modules on the meta device without a meta tensor's
    normal_, pow or empty_like, which import torch._dynamo or sympy (~2 s of CPU at every start of
    the command); `specdec generate`'s reply splitter takes the server's reasoning module without
    FastAPI's stack."""
    import subprocess
    import sys

    code = ("import sys\nfrom specdec import LLM\nfrom specdec.chat import HarmonySplit\n"
            f"LLM(model={str(tiny_pair[0])!r}, speculative_model={str(tiny_pair[1])!r}, num_speculative_tokens=2)\n"
            f"LLM(model={str(smollm2)!r})\nHarmonySplit(True)\n"
            "print([m for m in ('torch._dynamo', 'sympy', 'fastapi') if m in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.fixture
def no_cuda(monkeypatch):
    """A CPU-only machine, whatever this one has."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("cmd", ["generate", "bench"])
@pytest.mark.parametrize("device,message", [
    ("cuda", "--device cuda: no CUDA device here"),
    ("cuda:1", "--device cuda:1: no CUDA device here"),
    ("tpu", "--device tpu: not a device"),
])
def test_a_device_this_machine_lacks_is_one_line(capsys, no_cuda, cmd, device, message):
    """Checked before anything loads (the missing model would fail otherwise): a CPU-only torch
    asked for cuda raised AssertionError deep in the loading, with a 37-line traceback."""
    argv = [cmd, "--model", "/nonexistent/model", "--device", device] + (["hello"] if cmd == "generate" else [])
    code, out, err = run(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("specdec: error: ") and message in err


@pytest.mark.parametrize("flag", ["-O", "--compilation-config", "--compilation_config"])
def test_compilation_config_that_is_no_json_names_the_flag(tiny_pair, capsys, flag):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(tiny_pair[0]), flag, "xx", "x"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Expecting value" not in err
    assert "argument -O/--compilation-config: expects a JSON object" in err and "-O3" in err


def test_compilation_config_takes_a_level_or_an_object():
    from specdec.cli import build_parser

    def parsed(value):
        return build_parser("generate").parse_args(["generate", "-O", value, "x"]).compilation_config

    assert parsed("3") == 3 and parsed('{"cudagraph_mode": "NONE"}') == {"cudagraph_mode": "NONE"}


@pytest.mark.parametrize("flag", ["--speculative-config", "--hf-overrides", "--pooler-config", "--logit-bias"])
def test_json_flags_name_themselves(capsys, flag):
    with pytest.raises(SystemExit) as e:
        main(["generate", flag, "xx", "x"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and f"argument {flag}" in err and "JSON" in err


def test_underscore_flag_names_as_vllm(tiny_pair, capsys):
    """vLLM's parser reads `--max_tokens 5` and `--max_model_len=64` as the dashed flags; a
    value is left as it is."""
    from specdec.cli import dashed_flags

    assert dashed_flags(["--max_model_len=64", "a_b", "--stop", "x_y", "--", "--keep_me"]) == \
        ["--max-model-len=64", "a_b", "--stop", "x_y", "--", "--keep_me"]
    code, out, err = run(capsys, "generate", "--model", str(tiny_pair[0]), "--max_tokens", "5", "--ignore_eos",
                         "--max_model_len=64", "--json", "def add(a, b):")
    assert code == 0, err
    assert len(json.loads(out)["token_ids"]) == 5


def test_generate_chat_reads_a_message_from_stdin_without_its_newline(tiny_pair, capsys, monkeypatch):
    """`echo hi | specdec generate --chat -` is the message "hi", as `specdec generate --chat hi` and
    as `specdec chat` reads it (the newline was part of the user message)."""
    import io

    target, _ = tiny_pair
    argv = ["generate", "--model", str(target), "--max-tokens", "4", "--ignore-eos", "--json", "--chat"]
    code, out, _ = run(capsys, *argv, "def add(a, b):")
    assert code == 0
    from_argv = json.loads(out)
    monkeypatch.setattr("sys.stdin", io.StringIO("def add(a, b):\n"))
    code, out, _ = run(capsys, *argv, "-")
    assert code == 0
    from_stdin = json.loads(out)
    assert from_stdin["stats"]["prompt_tokens"] == from_argv["stats"]["prompt_tokens"]
    assert from_stdin["token_ids"] == from_argv["token_ids"]


def test_generate_chat_with_an_empty_system_message(tiny_pair, capsys):
    """--system "" is a system message with no text (it replaces a template's default one), as
    LLM.chat renders [{"role": "system", "content": ""}, ...]; it was dropped."""
    from specdec import LLM, SamplingParams

    target, _ = tiny_pair
    conv = [{"role": "system", "content": ""}, {"role": "user", "content": "def add(a, b):"}]
    llm = LLM(str(target))
    with_system = llm.chat_prompt(conv)["prompt_token_ids"]
    assert with_system != llm.chat_prompt(conv[1:])["prompt_token_ids"]     # the template renders it
    expected = llm.chat(conv, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids
    code, out, err = run(capsys, "generate", "--model", str(target), "--max-tokens", "4", "--ignore-eos", "--json",
                         "--chat", "--system", "", "def add(a, b):")
    assert code == 0, err
    result = json.loads(out)
    assert result["stats"]["prompt_tokens"] == len(with_system) and result["token_ids"] == expected
