"""`specdec serve`'s command line (vLLM's): underscore spellings, vLLM's flags that mean nothing
here taken with a warning, any other unknown flag refused, --device checked before the model loads."""

from __future__ import annotations

import pytest

from specdec.cli import main
from specdec.server.cli import parse_args


def test_underscore_spellings_are_the_dashed_flags():
    args, ignored = parse_args(["--model", "m", "--max_model_len", "512", "--speculative_config", '{"method": "ngram"}',
                                "--max_num_seqs=4", "--served_model_name", "a_b", "--gpu_memory_utilization=0.8", "--cpu_offload_gb=0"])
    assert (args.max_model_len, args.speculative_config, args.max_num_seqs) == (512, {"method": "ngram"}, 4)
    assert args.served_model_name == ["a_b"]                   # values keep their underscores
    assert ignored == ["--cpu-offload-gb=0"] and args.gpu_memory_utilization == 0.8


def test_vllm_flags_with_no_meaning_here_are_still_ignored():
    args, ignored = parse_args(["m", "--trust-remote-code", "--swap-space", "4", "--no-enable-chunked-prefill",
                                "-pp", "1", "--disable-log-stats", "--port", "9001"])
    assert args.model == "m" and args.port == 9001 and args.disable_log_stats      # honoured: tests/test_stat_logging.py
    assert ignored == ["--trust-remote-code", "--swap-space 4", "--no-enable-chunked-prefill", "-pp 1"]


@pytest.mark.parametrize("argv,message", [
    (["--max-num-seq", "4"], "unrecognized arguments: --max-num-seq (neither specdec's flags nor vLLM's; "
                             "did you mean --max-num-seqs?)"),
    (["--max_num_seq=4"], "unrecognized arguments: --max-num-seq "),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--config", "missing.yaml"], "--config missing.yaml: No such file or directory"),
])
def test_an_unknown_flag_is_an_error(argv, message):
    with pytest.raises(ValueError) as e:
        parse_args(["--model", "m", *argv])
    assert message in str(e.value)


def test_an_unknown_flag_is_one_line_and_exit_2(tmp_path, capsys):
    """Before the model loads (it does not exist): the typo is what is reported."""
    assert main(["serve", "--model", str(tmp_path / "missing"), "--max-num-seq", "4", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrecognized arguments: --max-num-seq" in err
    assert "warning" not in err
    from specdec.entrypoints.openai.api_server import PROG, main as api_server

    assert api_server(["--model", str(tmp_path / "missing"), "--max_num_seq", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{PROG}: error: unrecognized arguments: --max-num-seq") and err.count("\n") == 1


@pytest.mark.parametrize("device,message", [("cuda", "--device cuda: no CUDA device here"),
                                            ("tpu", "--device tpu: not a device")])
def test_a_device_this_machine_lacks_is_one_line(tmp_path, capsys, monkeypatch, device, message):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["serve", "--model", str(tmp_path / "missing"), "--device", device, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specdec: error: ") and message in err


def test_the_model_may_follow_the_options():
    """`vllm serve --port 8000 MODEL`: argparse there takes the model after the options too."""
    from specdec.server.cli import parse_args

    for argv in (["--port", "9", "m"], ["m", "--port", "9"], ["--max-model-len", "64", "m", "--port", "9"]):
        args, _ = parse_args(argv)
        assert (args.model, args.port) == ("m", 9), argv
    with pytest.raises(ValueError, match="unexpected argument 'extra'"):
        parse_args(["--port", "9", "m", "extra"])


def test_seed_default_and_none():
    """--seed 0 by default (vLLM V1's); `none` turns the server's seeding off."""
    assert parse_args(["m"])[0].seed == 0
    assert parse_args(["m", "--seed", "none"])[0].seed is None and parse_args(["m", "--seed", "7"])[0].seed == 7
    with pytest.raises(SystemExit):
        parse_args(["m", "--seed", "lots"])
