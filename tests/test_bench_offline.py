"""`specdec bench throughput` and `specdec bench latency` (vLLM's offline benchmarks) end to end
on the tiny pair through specdec.cli.main: vLLM's printed lines and JSON keys, counts that agree
with each other, acceptance with a draft model, bad values as one line and exit 2. No timings
are asserted."""

from __future__ import annotations

import json
import re

import pytest

from specdec.cli import build_parser, main
from specdec.defaults import BUNDLED_TARGET

THROUGHPUT = re.compile(r"^Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, ([\d.]+) output tokens/s$", re.M)


def _totals(out: str) -> tuple[int, int]:
    prompt = int(re.search(r"^Total num prompt tokens:\s+(\d+)$", out, re.M).group(1))
    output = int(re.search(r"^Total num output tokens:\s+(\d+)$", out, re.M).group(1))
    return prompt, output


def test_throughput_random_plain(tiny_pair, tmp_path, capsys):
    target, _ = tiny_pair
    path = tmp_path / "t.json"
    assert main(["bench", "throughput", "--model", str(target), "--num-prompts", "3", "--input-len", "10",
                 "--output-len", "6", "--output-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert THROUGHPUT.search(out), out
    assert _totals(out) == (3 * 10, 3 * 6)             # random prompts: exact lengths, EOS ignored
    assert "Speculative decoding: none" in out and "Machine: " in out
    r = json.loads(path.read_text())
    for key in ("elapsed_time", "num_requests", "total_num_tokens", "requests_per_second", "tokens_per_second"):
        assert key in r, key
    assert r["num_requests"] == 3 and r["total_num_tokens"] == 3 * 10 + 3 * 6
    assert r["total_num_prompt_tokens"] + r["total_num_output_tokens"] == r["total_num_tokens"]
    assert r["requests_per_second"] * r["elapsed_time"] == pytest.approx(3)
    assert r["tokens_per_second"] * r["elapsed_time"] == pytest.approx(r["total_num_tokens"])
    assert r["speculative"] is None and "spec_decode_acceptance_rate" not in r
    assert r["machine"]["cpu"] and r["command"].startswith("specdec bench throughput --model")
    assert r["settings"]["dataset_name"] == "random" and r["settings"]["ignore_eos"] is True


def test_throughput_with_a_draft_reports_acceptance(tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair
    path = tmp_path / "t.json"
    # vLLM's spellings of the lengths, and n completions per prompt
    assert main(["bench", "throughput", "--model", str(target), "--speculative-model", str(draft),
                 "--num-speculative-tokens", "2", "--num-prompts", "3", "--random-input-len", "8",
                 "--random-output-len", "7", "--n", "2", "--output-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert _totals(out) == (3 * 8, 3 * 7 * 2)
    assert "Speculative decoding: draft_model, K=2" in out
    line = re.search(r"^Acceptance rate: ([\d.]+)% \((\d+) of (\d+) draft tokens\), mean acceptance length: ([\d.]+)",
                     out, re.M)
    assert line, out
    r = json.loads(path.read_text())
    assert r["speculative"]["method"] == "draft_model" and r["speculative"]["num_speculative_tokens"] == 2
    drafted, accepted, drafts = r["spec_decode_draft_tokens"], r["spec_decode_accepted_tokens"], r["spec_decode_num_drafts"]
    assert drafted > 0 and 0 <= accepted <= drafted and 0 < drafts <= drafted <= 2 * drafts
    assert (int(line.group(2)), int(line.group(3))) == (accepted, drafted)
    assert r["spec_decode_acceptance_rate"] == pytest.approx(100 * accepted / drafted)
    assert r["spec_decode_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    assert len(r["spec_decode_per_position_acceptance_rates"]) == 2
    assert sum(r["spec_decode_per_position_acceptance_rates"]) * drafts == pytest.approx(accepted)
    assert r["total_num_tokens"] == 3 * 8 + 3 * 7 * 2


def test_throughput_datasets_through_the_chat_template(tiny_pair, tmp_path, capsys):
    target, _ = tiny_pair
    custom = tmp_path / "p.jsonl"
    custom.write_text('{"prompt": "def add(a, b):", "output_tokens": 3}\n{"prompt": "for i in range(10):"}\n')
    path = tmp_path / "c.json"
    assert main(["bench", "throughput", "--model", str(target), "--dataset-name", "custom", "--dataset-path",
                 str(custom), "--num-prompts", "2", "--output-len", "5", "--ignore-eos",
                 "--output-json", str(path)]) == 0
    out = capsys.readouterr().out
    prompt, output = _totals(out)
    assert output == 3 + 5 and prompt > 0                  # each prompt once, its own max_tokens kept
    assert json.loads(path.read_text())["num_requests"] == 2
    # Spec-Bench's questions (the bundled file), sampled and repeated up to --num-prompts; EOS may end them
    assert main(["bench", "throughput", "--model", str(BUNDLED_TARGET), "--dataset-name", "spec_bench",
                 "--spec-bench-category", "qa", "--num-prompts", "3", "--output-len", "4",
                 "--output-json", str(path)]) == 0
    out = capsys.readouterr().out
    prompt, output = _totals(out)
    r = json.loads(path.read_text())
    assert r["num_requests"] == 3 and 3 <= output <= 3 * 4 and prompt > 3 * 10
    assert r["total_num_tokens"] == prompt + output and r["settings"]["dataset_name"] == "spec_bench"


def test_latency(tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair
    path = tmp_path / "l.json"
    assert main(["bench", "latency", "--model", str(target), "--speculative-model", str(draft),
                 "--num-speculative-tokens", "2", "--input-len", "8", "--output-len", "6", "--batch-size", "2",
                 "--num-iters-warmup", "1", "--num-iters", "3", "--output-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^Avg latency: [\d.e-]+ seconds$", out, re.M), out
    for pct in (10, 25, 50, 75, 90, 99):
        assert re.search(rf"^{pct}% percentile latency: [\d.e-]+ seconds$", out, re.M), pct
    assert "Acceptance rate: " in out
    r = json.loads(path.read_text())
    assert len(r["latencies"]) == 3 and r["avg_latency"] == pytest.approx(sum(r["latencies"]) / 3)
    assert list(r["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    values = list(r["percentiles"].values())
    assert values == sorted(values) and min(r["latencies"]) <= values[0] <= values[-1] <= max(r["latencies"])
    assert r["spec_decode_draft_tokens"] > 0 and "std_latency" in r and r["machine"]["cpu"]
    assert r["settings"]["enable_prefix_caching"] is False           # as vLLM's: the same batch every time


def test_latency_plain_defaults_parse():
    args = build_parser("bench").parse_args(["bench", "latency"])
    assert (args.input_len, args.output_len, args.batch_size, args.n) == (32, 128, 8, 1)
    assert args.num_iters_warmup >= 1 and args.num_iters >= 3 and args.enable_prefix_caching is False


def test_engine_flags_and_bench_serve_still_parse():
    parse = build_parser("bench").parse_args
    args = parse(["bench", "throughput", "--num-speculative-tokens", "3", "--speculative-config",
                  '{"method": "ngram"}', "--max-num-seqs", "4", "--kv-cache-dtype", "int8", "--dtype", "float32"])
    assert args.num_speculative_tokens == 3 and args.speculative_config == {"method": "ngram"}
    assert (args.max_num_seqs, args.kv_cache_dtype, args.dtype) == (4, "int8", "float32")
    assert args.dataset_name == "random" and args.enable_prefix_caching is True
    serve = parse(["bench", "serve", "--num-prompts", "4", "--num-speculative-tokens", "0,4"])
    assert serve.bench_command == "serve" and serve.num_prompts == 4 and serve.num_speculative_tokens == [0, 4]
    bench = parse(["bench", "--num-speculative-tokens", "1,2", "--out", "x"])
    assert bench.bench_command is None and bench.num_speculative_tokens == [1, 2]


def test_bad_values_exit_2_before_the_model_loads(tmp_path, capsys):
    missing_model = str(tmp_path / "no-model")             # the flags fail first, or this would be the error
    (tmp_path / "folder.json").mkdir()
    for flags, message in ((["--num-prompts", "0"], "--num-prompts must be >= 1"),
                           (["--input-len", "0"], "--input-len must be >= 1"),
                           (["--output-len", "0"], "--output-len must be >= 1"),
                           (["--n", "0"], "--n must be >= 1"),
                           (["--dataset-name", "nope"], "--dataset-name nope"),
                           (["--dataset-name", "custom"], "--dataset-path"),
                           (["--dataset-name", "custom", "--dataset-path", str(tmp_path / "none.jsonl")],
                            "none.jsonl"),
                           (["--dataset-name", "spec_bench", "--dataset-path", str(tmp_path / "q.jsonl")], "q.jsonl"),
                           (["--dataset-name", "sharegpt", "--dataset-path", str(tmp_path / "s.json")], "s.json"),
                           (["--dataset-name", "spec_bench", "--input-len", "8"], "--input-len goes with"),
                           (["--dataset-path", "x.jsonl"], "--dataset-path goes with"),
                           (["--random-range-ratio", "1.5"], "--random-range-ratio"),
                           (["--temperature", "-1"], "--temperature"),
                           (["--output-json", str(tmp_path / "folder.json")], "is a folder"),
                           (["--output-json", str(tmp_path / "no" / "t.json")], "no folder")):
        assert main(["bench", "throughput", "--model", missing_model, *flags]) == 2, flags
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (flags, err)
    for flags, message in ((["--input-len", "0"], "--input-len must be >= 1"),
                           (["--batch-size", "0"], "--batch-size"),
                           (["--num-iters", "0"], "--num-iters must be >= 1"),
                           (["--num-iters-warmup", "-1"], "--num-iters-warmup"),
                           (["--n", "0"], "--n must be >= 1")):
        assert main(["bench", "latency", "--model", missing_model, *flags]) == 2, flags
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (flags, err)


def test_lengths_past_the_context_exit_2(tiny_pair, capsys):
    target, _ = tiny_pair                                   # 256 positions
    assert main(["bench", "latency", "--model", str(target), "--input-len", "200", "--output-len", "100",
                 "--num-iters", "1", "--num-iters-warmup", "0"]) == 2
    err = capsys.readouterr().err
    assert "--max-model-len" in err and len(err.strip().splitlines()) == 1
    assert main(["bench", "throughput", "--model", str(target), "--num-prompts", "1", "--input-len", "200",
                 "--output-len", "100"]) == 2
    err = capsys.readouterr().err
    assert "no prompt" in err and len(err.strip().splitlines()) == 1
