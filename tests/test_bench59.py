"""`specdec bench serve` against vLLM's `vllm bench serve` (vllm/benchmarks/serve.py): the arrival
schedule, the general length flags, the result file's and console's peak figures; the refusal of
vLLM's `bench throughput` / `latency` flags; an unreachable server."""

from __future__ import annotations

import argparse
import json
import socket

import pytest

from specdec.bench import serve, serve_vllm
from specdec.bench.serve_report import console
from specdec.cli import main
from test_bench_serve import fake_vllm
from test_server import LiveServer


def test_poisson_arrivals_end_at_num_prompts_over_rate():
    """vLLM's get_request scales the summed gaps so that the last request goes at exactly
    num_prompts / rate, whatever the seed; the schedule still follows --seed."""
    for burstiness in (1.0, 0.5, 3.0):
        for seed in range(10):
            assert sum(serve.arrival_gaps(16, 4.0, burstiness, seed)) == pytest.approx(4.0)
            times = serve.arrival_times(16, 4.0, burstiness, seed)
            assert times[-1] == pytest.approx(4.0) and times == sorted(times) and times[0] > 0
    assert serve.arrival_times(16, 4.0, 1.0, 3) == serve.arrival_times(16, 4.0, 1.0, 3)
    assert serve.arrival_times(16, 4.0, 1.0, 3) != serve.arrival_times(16, 4.0, 1.0, 4)
    assert serve.arrival_times(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    assert serve.arrival_times(4, 2.0, float("inf"), 0) == [0.5, 1.0, 1.5, 2.0]
    # a ramp is not scaled (vLLM's): the gaps are 1 / each request's rate
    assert serve.arrival_times(3, float("inf"), float("inf"), 0, ramp=("linear", 1.0, 4.0)) == \
        pytest.approx([1.0, 1.4, 1.65])


def test_general_length_flags_overwrite_the_datasets_own(tiny_pair, tmp_path):
    """vLLM's main_async: --input-len overwrites --random-input-len and --output-len the datasets'
    own output lengths (random, prefix_repetition, sharegpt, spec_bench)."""
    target, _ = tiny_pair
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([{"conversations": [{"from": "human", "value": "Write a short line about rain."},
                                                       {"from": "gpt", "value": "It rains on the hills all day."}]}]))
    runs = {"random": ["--dataset-name", "random", "--input-len", "6", "--random-input-len", "4",
                       "--random-output-len", "3"],
            "prefix_repetition": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "4",
                                  "--prefix-repetition-suffix-len", "2", "--prefix-repetition-output-len", "3"],
            "sharegpt": ["--dataset-name", "sharegpt", "--dataset-path", str(sharegpt), "--sharegpt-output-len", "4"],
            "spec_bench": ["--spec-bench-output-len", "3"]}
    sent = {}
    with LiveServer(fake_vllm(target, bodies := [])) as live:
        for name, flags in runs.items():
            bodies.clear()
            assert main(["bench", "serve", "--base-url", live.url, "--num-prompts", "2", "--max-concurrency", "1",
                         "--warmup", "0", "--output-len", "5", "--out", str(tmp_path / name), *flags]) == 0, name
            sent[name] = list(bodies)
    assert [len(b["prompt"]) for b in sent["random"]] == [6, 6]
    assert {name: [b["max_tokens"] for b in bodies] for name, bodies in sent.items()} == \
        {name: [5, 5] for name in runs}


def _args(**kw):
    return argparse.Namespace(burstiness=1.0, metric_percentiles=[50.0, 99.0], percentile_metrics=serve.METRICS,
                              save_detailed=False, **kw)


def test_result_and_console_carry_vllms_peaks(capsys):
    """vLLM's calculate_metrics: the most token chunks within one second (from the first request
    sent) and the most requests in flight, a request ending as another starts not overlapping it;
    the result file also has rtfx and queue_times; the console prints them, the configured
    concurrency and rate, and a P50 line when 50 is asked for."""
    a = serve.RequestResult(ok=True, arrived=0.0, sent=0.0, chunks=[0.5, 0.6, 0.9], output_tokens=3, prompt_tokens=2)
    b = serve.RequestResult(ok=True, arrived=0.1, sent=0.2, chunks=[1.2, 1.5, 2.4], output_tokens=3, prompt_tokens=2)
    c = serve.RequestResult(ok=True, arrived=0.5, sent=0.9, chunks=[1.0, 1.1], output_tokens=2, prompt_tokens=2)
    failed = serve.RequestResult(ok=False, arrived=0.3, sent=0.3, error="boom")
    results = [a, b, c, failed]
    assert serve.peaks(results) == (4.0, 2)      # second 1 holds 1.2, 1.5, 1.0, 1.1; c starts as a ends
    assert serve.peaks([failed]) == (0.0, 0)
    m = serve.Measured(results=results, wall=3.0)
    point = m.point(serve.Load(2.0, 3), {}, _args())
    assert (point["max_output_tokens_per_s"], point["max_concurrent_requests"]) == (4.0, 2)
    flat = serve_vllm.flat_result(m, _args(), {"date": "d"}, {})
    assert (flat["max_output_tokens_per_s"], flat["max_concurrent_requests"], flat["rtfx"]) == (4.0, 2, 0.0)
    assert flat["queue_times"] == pytest.approx([0.0, 0.1, 0.4, 0.0])
    assert "p50_ttft_ms" in flat and "ttfts" not in flat
    text = console({"variants": [{"name": "x", "points": [point]}]})
    for line in ("Maximum request concurrency:             3", "Request rate configured (RPS):           2.00",
                 "Peak output token throughput (tok/s):    4.00", "Peak concurrent requests:                2.00",
                 "P50 TTFT (ms):", "P99 TTFT (ms):", "P50 E2EL (ms):"):
        assert line in text, line


def test_save_result_has_vllms_top_level_keys(tiny_pair, tmp_path, capsys):
    target, _ = tiny_pair
    with LiveServer(fake_vllm(target, [])) as live:
        assert main(["bench", "serve", "--base-url", live.url, "--num-prompts", "3", "--max-concurrency", "2",
                     "--warmup", "0", "--output-len", "3", "--metric-percentiles", "50,99", "--save-result",
                     "--result-filename", "r.json", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "P50 TTFT (ms):" in out and "Peak concurrent requests:" in out
    flat = json.loads((tmp_path / "r.json").read_text())
    assert {"max_output_tokens_per_s", "max_concurrent_requests", "rtfx", "queue_times"} <= set(flat)
    assert 1 <= flat["max_concurrent_requests"] <= 2 and flat["max_output_tokens_per_s"] >= 1


@pytest.mark.parametrize("flags, said", [
    (["throughput", "--backend", "vllm"], "--backend is vLLM's `bench throughput` flag, which specdec bench throughput "
                                          "does not take"),
    (["latency", "--profile"], "--profile is vLLM's `bench latency` flag, which specdec bench latency does not take"),
    (["throughput", "--disable-detokenize"], "--disable-detokenize is vLLM's `bench throughput` flag"),
    (["latency", "--num-prompts", "3"], "--num-prompts is a flag of `specdec bench serve` and "
                                        "`specdec bench throughput`, not of specdec bench latency"),
    (["throughput", "--num-promts", "3"], "did you mean --num-prompts?"),
])
def test_vllms_bench_flags_are_refused_as_such(flags, said, capsys):
    assert main(["bench", *flags]) == 2
    err = capsys.readouterr().err
    assert said in err and "did you mean " + flags[1] + "?" not in err and len(err.strip().splitlines()) == 1


def test_an_unreachable_server_names_its_url(tiny_pair, tmp_path, capsys):
    with socket.socket() as s:                  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["bench", "serve", "--port", str(port), "--num-prompts", "2", "--max-concurrency", "1",
                 "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"http://127.0.0.1:{port}/v1/models" in err and "check that the server is running" in err
    assert len(err.splitlines()) == 1
    target, _ = tiny_pair
    with LiveServer(fake_vllm(target, [])) as live:     # an extra /v1: every route 404s
        assert main(["bench", "serve", "--base-url", live.url + "/v1", "--num-prompts", "2", "--max-concurrency", "1",
                     "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{live.url}/v1/v1/models (HTTP 404)" in err and "drop the /v1" in err and len(err.splitlines()) == 1
