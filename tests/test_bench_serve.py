"""`specdec bench serve` on the tiny pair, a few requests: against a running server and with
the servers it starts itself; its metrics on hand-made request timings."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from specdec.bench import serve
from specdec.cli import main
from specdec.llm import LLM
from specdec.server import ServerConfig, build_app
from test_server import LiveServer


def test_summary_follows_vllms_definitions():
    a = serve.RequestResult(ok=True, sent=0.0, chunks=[0.5, 0.6, 0.9], output_tokens=5, prompt_tokens=7)
    b = serve.RequestResult(ok=True, sent=1.0, chunks=[3.0, 3.2], output_tokens=3, prompt_tokens=4)
    failed = serve.RequestResult(ok=False, error="BadRequestError: too long")
    s = serve.summarize([a, b, failed], wall=4.0, slo={"ttft": 1.0, "tpot": 0.2}, percentiles=[50, 99])
    assert (s["completed"], s["failed"], s["total_output_tokens"], s["total_input_tokens"]) == (2, 1, 8, 11)
    assert s["output_throughput"] == 2.0 and s["request_throughput"] == 0.5
    assert s["ttft"]["median"] == pytest.approx(1250.0)            # 500 and 2000 ms
    assert s["tpot"]["mean"] == pytest.approx((100.0 + 100.0) / 2)  # (0.9-0.5)/4, (3.2-3.0)/2
    assert s["itl"]["median"] == pytest.approx(200.0)              # gaps 100, 300, 200 ms
    assert s["e2el"]["median"] == pytest.approx(1550.0)
    assert s["request_goodput"] == 0.25                             # only a meets ttft <= 1 s
    assert s["errors"] == ["BadRequestError: too long"]


def test_arrivals_and_goodput_flags():
    gaps = serve.arrival_gaps(20000, rate=4.0, burstiness=0.5, seed=0)
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.05)
    assert np.std(gaps) > 1.3 * np.mean(gaps)             # burstier than Poisson (std = mean)
    assert serve.arrival_gaps(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    assert serve.parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 0.5, "tpot": 0.05}
    for bad in (["itl:5"], ["tpot:x"], ["tpot:0"]):
        with pytest.raises(ValueError, match="--goodput"):
            serve.parse_goodput(bad)


def test_ramp_up_follows_vllms_strategies():
    assert serve.ramp_rates(5, "linear", 2.0, 10.0) == [2.0, 4.0, 6.0, 8.0, 10.0]
    assert serve.ramp_rates(3, "exponential", 1.0, 16.0) == pytest.approx([1.0, 4.0, 16.0])
    assert serve.ramp_rates(1, "linear", 0.0, 3.0) == [3.0]
    for args in (("linear", 5.0, 1.0), ("exponential", 0.0, 4.0), ("linear", -1.0, 2.0), ("step", 1.0, 2.0)):
        with pytest.raises(ValueError, match="ramp-up"):
            serve.ramp_rates(4, *args)
    gaps = serve.arrival_gaps(4000, float("inf"), 1.0, 0, ramp=("linear", 1.0, 20.0))
    early, late = np.mean(gaps[:400]), np.mean(gaps[-400:])
    assert early > 5 * late and late == pytest.approx(1 / 19, rel=0.2)     # the rate climbs towards 20/s
    assert serve.arrival_gaps(3, float("inf"), 1.0, 0, ramp=("linear", 0.0, 2.0))[0] == 0.0
    assert serve.Load(float("inf"), 4, ("exponential", 1.0, 8.0)).name == "rate 1->8/s (exponential), concurrency 4"


def test_requests_without_usage_are_counted_by_the_tokenizer(tiny_pair):
    """A server that ignores stream_options (llama-cpp-python's) sends no usage: the generated text
    and the prompt go through the tokenizer, as vLLM's benchmark counts them."""
    from specdec.tokenizer import Tokenizer

    target, _ = tiny_pair
    tok = Tokenizer(target)
    item = {"messages": [{"role": "user", "content": "Say something."}]}
    counted = serve.RequestResult(ok=True, chunks=[0.1, 0.2], text="Hello there, friend")
    given = serve.RequestResult(ok=True, chunks=[0.1], text="Hi", output_tokens=7, prompt_tokens=3)
    args = argparse.Namespace(tokenizer=str(target))
    serve.count_without_usage([counted, given], [item, item], "http://127.0.0.1:9", args)
    assert counted.output_tokens == len(tok.encode("Hello there, friend", add_special_tokens=False))
    assert counted.prompt_tokens == serve.prompt_length(tok, item) and counted.ok
    assert (given.output_tokens, given.prompt_tokens) == (7, 3)                  # the server's usage stands
    with pytest.raises(ValueError, match="--tokenizer"):
        serve.count_without_usage([serve.RequestResult(ok=True, chunks=[0.1], text="x")], [item],
                                  "http://127.0.0.1:9", argparse.Namespace(tokenizer=None))


def test_bench_serve_against_a_running_server(tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair
    llm = LLM(target, speculative_model=str(draft), num_speculative_tokens=2, max_model_len=256)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))) as live:
        rc = main(["bench", "serve", "--base-url", live.url, "--label", "tiny K=2", "--max-concurrency", "1,2",
                   "--num-prompts", "3", "--output-len", "6", "--ignore-eos", "--goodput", "ttft:60000", "tpot:60000",
                   "--warmup", "1", "--out", str(tmp_path)])
    assert rc == 0
    results = json.loads((tmp_path / "results.json").read_text())
    (v,) = results["variants"]
    assert v["name"] == "tiny K=2" and [p["concurrency"] for p in v["points"]] == [1, 2]
    for p in v["points"]:
        assert p["completed"] == p["num_prompts"] == 3          # --num-prompts given: exactly (vLLM's)
        assert p["total_output_tokens"] == 6 * p["completed"] and p["output_throughput"] > 0
        assert p["request_goodput"] == p["request_throughput"]                       # loose SLOs: all meet them
        # times are measured, not asserted (a tiny model's burst of tokens can arrive microseconds apart)
        assert p["tpot"]["median"] >= 0 and p["speculation"]["draft_tokens"] > 0
    md = (tmp_path / "results.md").read_text()
    assert "specdec bench serve --base-url" in md and "| tiny K=2 | c=2 |" in md
    # vLLM's console block, once per load point, with the speculative counters
    out = capsys.readouterr().out
    assert out.count("Successful requests:") == 2 and out.count(" Speculative Decoding ") == 2
    assert "Output token throughput (tok/s):" in out and "P99 TPOT (ms):" in out and "P50 TPOT (ms):" in out
    assert (tmp_path / "serve.png").stat().st_size > 0


def test_both_clients_measure_the_same_stream(tiny_pair):
    """The default aiohttp client (events parsed by hand) and the official openai client see the
    same chunks and usage for the same greedy requests, and report a server's error alike."""
    import asyncio

    target, draft = tiny_pair
    llm = LLM(target, speculative_model=str(draft), num_speculative_tokens=2, max_model_len=256)
    items = [{"messages": [{"role": "user", "content": text}]} for text in ("Hello!", "def add(a, b):", "1 2 3")]
    items += [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt": "Once upon a time", "max_tokens": 4}]
    sampling = {"max_tokens": 7, "temperature": 0.0, "seed": 0, "extra_body": {"ignore_eos": True}}
    load = serve.Load(float("inf"), 2)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))) as live:
        seen = {}
        for client in serve.CLIENTS:
            results, wall = asyncio.run(serve.run_load(live.url, "tiny", items, load, 1.0, sampling, 0, client))
            assert wall > 0 and all(r.ok and r.error == "" for r in results), [r.error for r in results]
            seen[client] = [(r.output_tokens, r.prompt_tokens, len(r.chunks)) for r in results]
            assert [r.output_tokens for r in results] == [7, 7, 7, 7, 4] and all(r.chunks for r in results)
            assert results[3].prompt_tokens == 5
        assert seen["aiohttp"] == seen["openai"]
        too_long = [{"messages": [{"role": "user", "content": "word " * 400}]}]
        for client in serve.CLIENTS:
            (bad,), _ = asyncio.run(serve.run_load(live.url, "no-such-model", items[:1], load, 1.0, sampling, 0, client))
            assert not bad.ok and "404" in bad.error and "no-such-model" in bad.error
            (bad,), _ = asyncio.run(serve.run_load(live.url, "tiny", too_long, load, 1.0, sampling, 0, client))
            assert not bad.ok and "400" in bad.error and "prompt is too long" in bad.error
    with pytest.raises(ValueError, match="client"):
        asyncio.run(serve.run_load("http://127.0.0.1:9", "m", items[:1], load, 1.0, sampling, 0, "curl"))


def test_random_requests_follow_vllms_lengths(tiny_pair):
    from specdec.tokenizer import Tokenizer

    target, _ = tiny_pair
    tok = Tokenizer(target)
    exact = serve.random_requests(tok, 6, input_len=12, output_len=5, prefix_len=3, seed=1)
    assert [len(it["prompt_token_ids"]) for it in exact] == [15] * 6 and {it["max_tokens"] for it in exact} == {5}
    assert len({tuple(it["prompt_token_ids"][:3]) for it in exact}) == 1          # the shared prefix
    assert len({tuple(it["prompt_token_ids"][3:]) for it in exact}) == 6          # distinct prompts after it
    banned = tok.special_ids | {tok.bos_token_id, *tok.eos_token_ids}
    assert not banned & {t for it in exact for t in it["prompt_token_ids"]}
    assert all(0 <= t < tok.vocab_size for it in exact for t in it["prompt_token_ids"])
    spread = serve.random_requests(tok, 400, input_len=20, output_len=10, range_ratio=0.5, seed=2)
    ins, outs = [len(it["prompt_token_ids"]) for it in spread], [it["max_tokens"] for it in spread]
    assert (min(ins), max(ins)) == (10, 30) and (min(outs), max(outs)) == (5, 15)   # uniform within +-50%
    assert serve.random_requests(tok, 3, 8, 4, seed=9) == serve.random_requests(tok, 3, 8, 4, seed=9)
    with pytest.raises(ValueError, match="range-ratio"):
        serve.random_requests(tok, 1, 8, 4, range_ratio=1.0)


def test_prefix_repetition_requests_follow_vllms_shape(tiny_pair):
    """vLLM's prefix_repetition: num_prefixes random prefixes, each before an equal share of the
    requests' own random suffixes, shuffled; no special tokens; seeded."""
    from specdec.tokenizer import Tokenizer

    target, _ = tiny_pair
    tok = Tokenizer(target)
    items = serve.prefix_repetition_requests(tok, 12, prefix_len=8, suffix_len=5, num_prefixes=3, output_len=7, seed=4)
    assert len(items) == 12 and {it["max_tokens"] for it in items} == {7}
    assert {len(it["prompt_token_ids"]) for it in items} == {13}
    prefixes = [tuple(it["prompt_token_ids"][:8]) for it in items]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [4, 4, 4]       # 3 prefixes, 4 requests each
    assert len({tuple(it["prompt_token_ids"][8:]) for it in items}) == 12       # every suffix its own
    assert prefixes[:4] != [prefixes[0]] * 4 or prefixes[4:8] != [prefixes[4]] * 4   # shuffled, not grouped
    banned = tok.special_ids | {tok.bos_token_id, *tok.eos_token_ids}
    assert not banned & {t for it in items for t in it["prompt_token_ids"]}
    assert items == serve.prefix_repetition_requests(tok, 12, 8, 5, 3, 7, seed=4)
    assert len(serve.prefix_repetition_requests(tok, 2, 4, 4, num_prefixes=5, output_len=3)) == 5   # one per prefix
    with pytest.raises(ValueError, match="not both 0"):
        serve.prefix_repetition_requests(tok, 4, 0, 0, 2, 3)


def test_sampling_follows_vllms_shuffle_and_oversample_flags():
    pool = [{"n": i} for i in range(5)]
    shuffled = serve.sample(pool, 12, seed=3)
    assert len(shuffled) == 12 and shuffled[:5] != pool and sorted(x["n"] for x in shuffled[:5]) == list(range(5))
    assert shuffled[5:10] == shuffled[:5]                                       # repeated as needed
    assert serve.sample(pool, 7, seed=3, shuffle=False) == pool + pool[:2]      # --disable-shuffle
    assert serve.sample(pool, 12, seed=3, oversample=False) == shuffled[:5]     # --no-oversample: each once
    assert serve.sample(pool, 3, seed=3, shuffle=False, oversample=False) == pool[:3]


def test_spec_bench_questions_from_a_file(tmp_path):
    """--dataset-name spec_bench --dataset-path: a Spec-Bench question.jsonl of one's own, first
    turns, a category filter; a malformed file is one clear error naming the flag."""
    path = tmp_path / "question.jsonl"
    rows = [{"question_id": 1, "category": "writing", "turns": ["Write a haiku.", "Now another."]},
            {"question_id": 2, "category": "qa", "turns": ["What is 2+2?"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert serve.questions(path=path) == [
        {"category": "writing", "messages": [{"role": "user", "content": "Write a haiku."}]},
        {"category": "qa", "messages": [{"role": "user", "content": "What is 2+2?"}]}]
    assert [q["category"] for q in serve.questions("qa", path)] == ["qa"]
    assert len(serve.questions()) == 240                                            # the bundled file
    path.write_text('{"question_id": 1, "category": "qa"}\n')
    with pytest.raises(ValueError, match="--dataset-path .*not a Spec-Bench question"):
        serve.questions(path=path)


def test_custom_requests_read_vllms_jsonl(tmp_path):
    good = tmp_path / "prompts.jsonl"
    good.write_text('{"prompt": "Say hi"}\n\n{"prompt": "Count to 3", "output_tokens": 9}\n')
    assert serve.custom_requests(good) == [
        {"category": "custom", "messages": [{"role": "user", "content": "Say hi"}]},
        {"category": "custom", "messages": [{"role": "user", "content": "Count to 3"}], "max_tokens": 9}]
    assert serve.custom_requests(good, skip_chat_template=True)[1] == {"category": "custom", "prompt": "Count to 3",
                                                                       "max_tokens": 9}
    for text, message in (('{"prompt": "a"}\nnot json\n', "line 2 is not JSON"), ('{"text": "a"}\n', "no \"prompt\""),
                          ('{"prompt": "a", "output_tokens": 0}\n', "output_tokens"), ("\n", "no prompts")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            serve.custom_requests(bad)
    with pytest.raises(ValueError, match="--dataset-path"):
        serve.custom_requests(tmp_path / "missing.jsonl")


def test_sharegpt_requests_follow_vllms_filters(tiny_pair, tmp_path):
    from specdec.tokenizer import Tokenizer

    target, _ = tiny_pair
    tok = Tokenizer(target)
    convs = [{"conversations": [{"from": "human", "value": "Tell me about the sea and the sky."},
                                {"from": "gpt", "value": "The sea is wide and blue under a bright sky today."}]},
             {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello to you, friend."}]},
             {"conversations": [{"from": "human", "value": "Only one turn here, no reply."}]},
             {"id": "no conversations"}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    pairs = serve.sharegpt_pairs(path)
    assert [a for a, _ in pairs] == ["Tell me about the sea and the sky.", "Hi"]       # two-turn conversations
    items = serve.sharegpt_requests(pairs, tok, seed=0)
    reply = len(tok.encode("The sea is wide and blue under a bright sky today.", add_special_tokens=False))
    # "Hi" is under 4 tokens: left out, as vLLM does; max_tokens is the reply's length
    assert items == [{"category": "sharegpt", "messages": [{"role": "user", "content": "Tell me about the sea and the sky."}],
                      "max_tokens": reply}]
    assert serve.sharegpt_requests(pairs, tok, output_len=9)[0]["max_tokens"] == 9
    for text, message in (("[1, 2", "not JSON"), ('{"a": 1}', "JSON list"), ("[]", "two turns")):
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            serve.sharegpt_pairs(path)
    with pytest.raises(ValueError, match="fits vLLM's bounds"):
        serve.sharegpt_requests([("Hi", "Hello to you, friend.")], tok)


def test_bench_serve_random_and_custom_datasets(tiny_pair, tmp_path):
    """--dataset-name random: token-id prompts of the lengths asked, through /v1/completions;
    prefix_repetition: prompts sharing prefixes, which the server's prefix cache then serves;
    spec_bench with --dataset-path: a question file's first turns; custom: a JSONL file's prompts,
    through the chat template or as they are; sharegpt: a conversation file's first turns."""
    import re
    import urllib.request

    def prefix_hits(url):
        text = urllib.request.urlopen(url + "/metrics").read().decode()
        return float(re.search(r"^specdec:prefix_cache_hits(?:_total)?(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE).group(1))

    target, _ = tiny_pair
    llm = LLM(target, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 4}, max_model_len=256,
              enable_prefix_caching=True)       # a draft model keeps per-prompt state: not with prefix caching
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello there"}\n{"prompt": "def f(x):", "output_tokens": 3}\n')
    questions = tmp_path / "question.jsonl"
    questions.write_text('{"question_id": 7, "category": "coding", "turns": ["Write a loop."]}\n')
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([{"conversations": [{"from": "human", "value": "Write a short line about rain."},
                                                       {"from": "gpt", "value": "x"}]}]))
    # --output-len, when given, overwrites each dataset's own output length (vLLM's): the custom runs only
    runs = {"random": ["--dataset-name", "random", "--random-input-len", "20", "--random-output-len", "5",
                       "--random-prefix-len", "4"],
            "prefix_repetition": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "20",
                                  "--prefix-repetition-suffix-len", "3", "--prefix-repetition-num-prefixes", "2",
                                  "--prefix-repetition-output-len", "4"],
            "spec_bench-file": ["--dataset-name", "spec_bench", "--dataset-path", str(questions),
                                "--spec-bench-output-len", "5"],
            "custom-once": ["--dataset-name", "custom", "--dataset-path", str(prompts), "--no-oversample",
                            "--disable-shuffle", "--output-len", "6"],
            "custom": ["--dataset-name", "custom", "--dataset-path", str(prompts), "--output-len", "6"],
            "custom-raw": ["--dataset-name", "custom", "--dataset-path", str(prompts), "--skip-chat-template", "--output-len", "6"],
            "sharegpt": ["--dataset-name", "sharegpt", "--dataset-path", str(sharegpt), "--sharegpt-output-len", "4"]}
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))) as live:
        for name, flags in runs.items():
            out = tmp_path / name
            hits = prefix_hits(live.url)
            rc = main(["bench", "serve", "--base-url", live.url, "--max-concurrency", "2", "--num-prompts", "4",
                       "--ignore-eos", "--warmup", "1", "--out", str(out), *flags])
            assert rc == 0, name
            results = json.loads((out / "results.json").read_text())
            (point,) = results["variants"][0]["points"]
            if name == "custom-once":   # the file's two prompts, once each, in its order: 6 then 3 tokens
                assert point["completed"] == point["num_prompts"] == 2 and point["total_output_tokens"] == 6 + 3
                assert results["settings"]["shuffled"] is False and results["settings"]["oversampled"] is False
                continue
            assert point["completed"] == point["num_prompts"] == 4 and point["failed"] == 0
            # the backend the prompts went through: random ids always to /v1/completions (it had said openai-chat)
            sent = "openai" if name in ("random", "prefix_repetition", "custom-raw") else "openai-chat"
            assert results["settings"]["backend"] == sent, name
            if name == "random":
                assert point["total_input_tokens"] == 4 * 24 and point["total_output_tokens"] == 4 * 5
                assert "random token ids after a shared random prefix of 4" in (out / "results.md").read_text()
            elif name == "prefix_repetition":
                assert point["total_input_tokens"] == 4 * 23 and point["total_output_tokens"] == 4 * 4
                assert "2 shared prefixes of 20 tokens" in (out / "results.md").read_text()
                assert prefix_hits(live.url) > hits          # a shared prefix's full block came from the cache
            elif name == "spec_bench-file":     # the file's one question, four times, 5 tokens each
                assert point["total_output_tokens"] == 4 * 5
                assert f"first turns from {questions}" in (out / "results.md").read_text()
            elif name == "sharegpt":    # one conversation, asked four times for 4 tokens
                assert point["total_output_tokens"] == 4 * 4
                assert "ShareGPT first turns from" in (out / "results.md").read_text()
            else:                       # two prompts drawn in turn: 6 and 3 tokens each
                assert point["total_output_tokens"] == 2 * 6 + 2 * 3
                assert ("as they are" in (out / "results.md").read_text()) == (name == "custom-raw")


def test_bench_serve_takes_vllms_flags(tiny_pair, tmp_path):
    """A vLLM command line: --backend openai (plain prompts, no chat template, to /v1/completions),
    --save-result --result-dir --result-filename (vLLM's result JSON), --percentile-metrics."""
    target, _ = tiny_pair
    llm = LLM(target, max_model_len=256)
    folder = tmp_path / "vllm-results"
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))) as live:
        rc = main(["bench", "serve", "--base-url", live.url, "--model", "tiny", "--num-warmups", "0",
                   "--served-model-name", "no-such-model", "--max-concurrency", "1", "--num-prompts", "2",
                   "--output-len", "3", "--out", str(tmp_path / "wrong-name")])
        assert rc == 2                                              # every request failed
        (wrong,) = json.loads((tmp_path / "wrong-name" / "results.json").read_text())["variants"][0]["points"]
        assert wrong["completed"] == 0 and wrong["failed"] == 2 and "404" in wrong["errors"][0]
        rc = main(["bench", "serve", "--base-url", live.url, "--model", "tiny", "--backend", "openai",
                   "--max-concurrency", "1",
                   "--num-prompts", "2", "--output-len", "3", "--ignore-eos", "--warmup", "0", "--save-result",
                   "--result-dir", str(folder), "--result-filename", "run-1.json", "--percentile-metrics", "ttft,e2el",
                   "--metric-percentiles", "50,99", "--ramp-up-strategy", "linear", "--ramp-up-start-rps", "5",
                   "--ramp-up-end-rps", "50", "--temperature", "0.7", "--top-p", "0.95", "--top-k", "20",
                   "--min-p", "0.01"])
    assert rc == 0
    results = json.loads((folder / "results.json").read_text())
    flat = json.loads((folder / "run-1.json").read_text())
    assert (flat["completed"], flat["backend"], flat["model_id"], flat["ramp_up_strategy"]) == (2, "openai", "tiny",
                                                                                                "linear")
    assert {"p99_ttft_ms", "p99_e2el_ms", "median_e2el_ms"} <= set(flat)
    assert not {"p99_tpot_ms", "mean_itl_ms"} & set(flat)            # only --percentile-metrics' metrics
    (point,) = results["variants"][0]["points"]
    assert point["completed"] == 2 and results["settings"]["backend"] == "openai"
    assert point["ramp"] == {"strategy": "linear", "start_rps": 5.0, "end_rps": 50.0}
    assert "| 5->50/s linear c=1 |" in (folder / "results.md").read_text()
    assert "temperature 0.7, top_p 0.95, top_k 20, min_p 0.01," in (folder / "results.md").read_text()
    assert serve._sampling(argparse.Namespace(output_len=3, temperature=0.7, seed=0, ignore_eos=False, top_p=0.95,
                                              top_k=20, min_p=None)) == {
        "max_tokens": 3, "temperature": 0.7, "top_p": 0.95, "extra_body": {"ignore_eos": False, "top_k": 20}}
    assert "p99" in point["ttft"] and "p99" in point["e2el"] and "p99" not in point["tpot"] and "median" in point["tpot"]
    assert "as plain prompts (no chat template) to /v1/completions" in (folder / "results.md").read_text()


def test_as_completions_keeps_the_question():
    items = [{"category": "qa", "messages": [{"role": "user", "content": "Why?"}], "max_tokens": 5},
             {"prompt_token_ids": [1, 2]}]
    assert serve.as_completions(items) == [{"category": "qa", "max_tokens": 5, "prompt": "Why?"},
                                           {"prompt_token_ids": [1, 2]}]


def test_bench_serve_starts_and_compares_variants(tiny_pair, tmp_path):
    target, draft = tiny_pair
    rc = main(["bench", "serve", "--model", str(target), "--speculative-config",
               json.dumps({"method": "draft_model", "model": str(draft)}), "--num-speculative-tokens", "0,2",
               "--server-args", "--max-model-len 256 --max-num-seqs 4", "--max-concurrency", "2",
               "--num-prompts", "2", "--output-len", "4", "--ignore-eos", "--warmup", "0", "--out", str(tmp_path),
               "--save-result"])
    assert rc == 0
    results = json.loads((tmp_path / "results.json").read_text())
    # vLLM's result file per variant, named as vLLM names it with the variant as its label
    (plain_file,) = tmp_path.glob(f"plain-infqps-concurrency2-{target.name}-*.json")
    (spec_file,) = tmp_path.glob(f"speculative-k-2-infqps-concurrency2-{target.name}-*.json")
    assert "spec_decode_acceptance_rate" not in json.loads(plain_file.read_text())
    flat = json.loads(spec_file.read_text())
    assert flat["label"] == "speculative K=2" and flat["model_id"] == str(target) and flat["completed"] == 2
    assert flat["spec_decode_draft_tokens"] > 0 and len(flat["spec_decode_per_position_acceptance_rates"]) == 2
    plain, spec = results["variants"]
    assert (plain["name"], spec["name"]) == ("plain", "speculative K=2")
    assert plain["points"][0]["completed"] == spec["points"][0]["completed"] == 2          # --num-prompts: exactly
    assert plain["points"][0]["speculation"]["acceptance_rate"] is None
    assert spec["points"][0]["speculation"]["draft_tokens"] > 0
    assert "Against plain batched decoding" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "server-plain.log").exists()


def test_bench_serve_rounds_interleave_the_variants(tiny_pair, tmp_path, capsys):
    """--rounds 3: each load point's 6 requests in rounds of 2 (twice the concurrency), the
    variants taking turns; every variant's point holds all of them."""
    target, _ = tiny_pair
    rc = main(["bench", "serve", "--model", str(target), "--num-speculative-tokens", "0,2", "--speculative-config",
               json.dumps({"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4}), "--server-args", "--max-model-len 256 --max-num-seqs 4",
               "--max-concurrency", "1", "--num-prompts", "6", "--output-len", "4", "--ignore-eos", "--warmup", "0",
               "--rounds", "3", "--out", str(tmp_path)])
    assert rc == 0
    err = capsys.readouterr().err
    turns = [line.split(":")[0] for line in err.splitlines() if ", round " in line]
    assert turns == ["plain", "speculative K=2"] * 3
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["settings"]["rounds"] == 3
    for v in results["variants"]:
        (point,) = v["points"]
        assert point["completed"] == point["num_prompts"] == 6 and point["total_output_tokens"] == 24
        assert len(point["rounds"]) == 3 and all(r["tpot_median_ms"] >= 0 and r["output_throughput"] > 0
                                                 for r in point["rounds"])
    # the report pairs each round's figures: plain's median TPOT over the variant's, round by round
    # (a round whose median rounds to 0 ms, a burst of a tiny model's tokens, has no ratio)
    plain, spec = (v["points"][0]["rounds"] for v in results["variants"])
    ratios = " / ".join(f"{a['tpot_median_ms'] / b['tpot_median_ms']:.2f}x" for a, b in zip(plain, spec)
                        if a["tpot_median_ms"] and b["tpot_median_ms"])
    report = (tmp_path / "results.md").read_text()
    assert "## Round by round" in report and f"| c=1 | speculative K=2 | {ratios} (spread " in report
    # no goodput SLO was given: no goodput ratio, a dash rather than "–x"
    assert "/ – /" in report and "–x" not in report


def test_bench_serve_bad_flags_exit_2(capsys, tmp_path):
    assert main(["bench", "serve", "--goodput", "latency:5", "--out", "/nonexistent/x"]) == 2
    assert "--goodput" in capsys.readouterr().err
    for flags, message in ((["--dataset-name", "custom"], "--dataset-path"),
                           (["--dataset-name", "custom", "--dataset-path", str(tmp_path / "none.jsonl")], "--dataset-path"),
                           (["--dataset-name", "random", "--dataset-path", "x.jsonl"], "--dataset-name spec_bench, custom"),
                           (["--dataset-path", str(tmp_path / "none.jsonl")], "--dataset-path"),
                           (["--dataset-name", "prefix_repetition", "--prefix-repetition-num-prefixes", "0"],
                            "--prefix-repetition-num-prefixes"),
                           (["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "0",
                             "--prefix-repetition-suffix-len", "0"], "not both 0"),
                           (["--dataset-name", "prefix_repetition", "--prefix-repetition-output-len", "0"],
                            "--prefix-repetition-output-len"),
                           (["--dataset-name", "sharegpt"], "--dataset-path"),
                           (["--dataset-name", "sharegpt", "--dataset-path", "x.json", "--sharegpt-output-len", "2"],
                            "--sharegpt-output-len"),
                           (["--dataset-name", "random", "--spec-bench-category", "qa"], "--spec-bench-category"),
                           (["--dataset-name", "random", "--random-range-ratio", "1.5"], "--random-range-ratio"),
                           (["--dataset-name", "random", "--random-input-len", "0"], "--random-input-len"),
                           (["--backend", "openai", "--endpoint", "/v1/chat/completions"], "--endpoint"),
                           (["--percentile-metrics", "ttft,latency"], "--percentile-metrics"),
                           (["--result-dir", str(tmp_path / "a"), "--out", str(tmp_path / "b")], "--result-dir"),
                           (["--result-filename", "x/y.json"], "--result-filename"),
                           (["--result-filename", "x.json"], "--save-result"),
                           (["--base-url", "http://127.0.0.1:9", "--port", "9"], "--host/--port"),
                           (["--input-len", "8"], "--input-len goes with --dataset-name random"),
                           (["--dataset-name", "sharegpt", "--dataset-path", "x.json", "--output-len", "2"],
                            "--output-len"),
                           (["--ramp-up-strategy", "linear"], "--ramp-up-start-rps"),
                           (["--ramp-up-end-rps", "4"], "--ramp-up-strategy"),
                           (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "4",
                             "--request-rate", "2"], "--request-rate"),
                           (["--ramp-up-strategy", "exponential", "--ramp-up-start-rps", "0", "--ramp-up-end-rps", "4"],
                            "start > 0")):
        out = [] if "--out" in flags or "--result-dir" in flags else ["--out", str(tmp_path / "out")]
        assert main(["bench", "serve", *flags, *out]) == 2, flags
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--num-speculative-tokens", "x"])


def test_a_terminated_bench_stops_the_servers_it_started(tiny_pair, tmp_path):
    """SIGTERM while the servers run (a load point that would take minutes): the benchmark exits
    and takes its servers with it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    target, _ = tiny_pair
    cmd = [sys.executable, "-m", "specdec", "bench", "serve", "--model", str(target), "--num-speculative-tokens", "0",
           "--server-args", "--max-model-len 256", "--max-concurrency", "1", "--num-prompts", "500",
           "--output-len", "200", "--ignore-eos", "--warmup", "0", "--out", str(tmp_path)]
    bench = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "starting plain" in bench.stderr.readline()
    log = tmp_path / "server-plain.log"
    deadline = time.monotonic() + 120
    while "plain:" not in bench.stderr.readline():       # measuring: the server is up
        assert time.monotonic() < deadline and bench.poll() is None
    children = _children(bench.pid)
    assert children, "the bench runs its server as a child process"
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=90) != 0
    for pid in children:
        for _ in range(100):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"server {pid} outlived the benchmark")
    assert log.exists()


def _children(pid: int) -> list[int]:
    """Processes whose parent is pid (from /proc: no procps needed)."""
    from pathlib import Path

    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def fake_vllm(root, bodies: list, models: bool = True):
    """An in-process stand-in for a vLLM server: /v1/models (the tiny target's files as its root, or
    no model), streams of max_tokens " x" chunks with usage (404 for a model other than "fake"),
    and /metrics with vLLM's labelled counters, split over two engines: per request 2 drafts,
    6 draft tokens, 4 accepted (2 at position 0, 1 at each of positions 1 and 2). Request bodies go
    to `bodies`."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    done = [0]

    async def listed(request):
        data = [{"id": "fake", "object": "model", "root": str(root), "max_model_len": 1024}] if models else []
        return JSONResponse({"object": "list", "data": data})

    async def complete(request):
        body = await request.json()
        bodies.append({"path": request.url.path, **body})
        if body.get("model") != "fake":
            return JSONResponse({"error": {"message": f"The model `{body.get('model')}` does not exist."}}, 404)
        chat = request.url.path.endswith("chat/completions")

        async def events():
            for _ in range(body["max_tokens"]):
                choice = {"index": 0, "delta": {"content": " x"}} if chat else {"index": 0, "text": " x"}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            done[0] += 1
            usage = {"prompt_tokens": 7, "completion_tokens": body["max_tokens"]}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    async def metrics(request):
        n, lines = done[0], []
        for engine in ("0", "1"):
            label = f'engine="{engine}",model_name="fake"'
            lines += [f"vllm:spec_decode_num_drafts_total{{{label}}} {1.0 * n}",
                      f"vllm:spec_decode_num_draft_tokens_total{{{label}}} {3.0 * n}",
                      f"vllm:spec_decode_num_accepted_tokens_total{{{label}}} {2.0 * n}",
                      *(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="{i}"}} {a * n}'
                        for i, a in enumerate((1.0, 0.5, 0.5)))]
        return PlainTextResponse("# TYPE vllm:spec_decode_num_drafts_total counter\n" + "\n".join(lines) + "\n")

    return Starlette(routes=[Route("/v1/models", listed), Route("/metrics", metrics),
                             Route("/v1/chat/completions", complete, methods=["POST"]),
                             Route("/v1/completions", complete, methods=["POST"])])


def test_counters_are_read_with_vllms_labels():
    """vLLM labels its counters (engine, model_name, position): each is summed over its label sets,
    as vLLM's own benchmark reads them; specdec's unlabelled ones read the same."""
    text = ('# HELP vllm:spec_decode_num_drafts_total Number of drafts.\n'
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 6.0\n'
            'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 4.0\n'
            'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 3.0\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 5.0\n'
            'specdec:spec_decode_num_draft_tokens_total 12.0\n')
    counters = serve.parse_counters(text)
    assert counters["spec_decode_num_drafts_total"] == 10.0 and counters["spec_decode_num_draft_tokens_total"] == 12.0
    assert serve.per_position(counters) == [5.0, 3.0]
    spec = serve.acceptance({}, {**counters, "spec_decode_num_accepted_tokens_total": 8.0})
    assert spec["acceptance_rate"] == pytest.approx(8 / 12, abs=1e-4)
    assert spec["per_position_acceptance_rates"] == [0.5, 0.3]


def test_bench_serve_against_a_vllm_server(tiny_pair, tmp_path, capsys):
    """--base-url against a vLLM-like server: its labelled counters give the acceptance, and
    --save-result writes vLLM's flat result JSON beside results.json."""
    target, _ = tiny_pair
    bodies = []
    with LiveServer(fake_vllm(target, bodies)) as live:
        rc = main(["bench", "serve", "--base-url", live.url, "--num-prompts", "3", "--max-concurrency", "1",
                   "--output-len", "5", "--warmup", "0", "--out", str(tmp_path), "--save-result",
                   "--result-filename", "vllm.json", "--metric-percentiles", "50,99.9", "--goodput", "ttft:60000"])
    assert rc == 0
    (point,) = json.loads((tmp_path / "results.json").read_text())["variants"][0]["points"]
    assert point["speculation"]["draft_tokens"] == 18 and point["speculation"]["accepted_tokens"] == 12
    assert point["speculation"]["num_drafts"] == 6
    assert point["speculation"]["acceptance_rate"] == pytest.approx(2 / 3, abs=1e-4)
    assert " Speculative Decoding " in capsys.readouterr().out
    flat = json.loads((tmp_path / "vllm.json").read_text())
    assert (flat["backend"], flat["model_id"], flat["tokenizer_id"], flat["label"]) == ("openai-chat", str(target),
                                                                                        str(target), None)
    assert (flat["num_prompts"], flat["completed"], flat["failed"], flat["max_concurrency"]) == (3, 3, 0, 1)
    assert (flat["request_rate"], flat["burstiness"], flat["total_output_tokens"]) == ("inf", 1.0, 15)
    assert flat["request_throughput"] == pytest.approx(3 / flat["duration"])
    assert flat["request_goodput"] == pytest.approx(flat["request_throughput"])
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert {f"mean_{metric}_ms", f"median_{metric}_ms", f"std_{metric}_ms", f"p50_{metric}_ms",
                f"p99.9_{metric}_ms"} <= set(flat)
    assert flat["spec_decode_acceptance_rate"] == pytest.approx(12 / 18 * 100)
    assert flat["spec_decode_acceptance_length"] == pytest.approx(1 + 12 / 6)
    assert (flat["spec_decode_num_drafts"], flat["spec_decode_draft_tokens"], flat["spec_decode_accepted_tokens"]) \
        == (6, 18, 12)
    assert flat["spec_decode_per_position_acceptance_rates"] == pytest.approx([1.0, 0.5, 0.5])   # 6, 3, 3 of 6
    assert "ttfts" not in flat and "generated_texts" not in flat         # vLLM keeps them with --save-detailed


def test_bench_serve_takes_vllms_lengths_host_and_port(tiny_pair, tmp_path):
    """vLLM's --host/--port name the running server; --input-len is random's prompt length; random
    requests ignore EOS; --output-len given is sharegpt's max_tokens, the replies' lengths if not;
    --burstiness inf; --save-result names each load point's file as vLLM does."""
    from specdec.tokenizer import Tokenizer

    target, _ = tiny_pair
    sharegpt = tmp_path / "sharegpt.json"
    reply = "The sea is wide and blue under a bright sky today."
    sharegpt.write_text(json.dumps([{"conversations": [{"from": "human", "value": "Write a short line about rain."},
                                                       {"from": "gpt", "value": reply}]}]))
    bodies = []
    common = ["--num-prompts", "2", "--max-concurrency", "1", "--warmup", "0"]
    with LiveServer(fake_vllm(target, bodies)) as live:
        port = live.url.rsplit(":", 1)[1]
        assert main(["bench", "serve", "--host", "127.0.0.1", "--port", port, "--dataset-name", "random",
                     "--input-len", "9", "--output-len", "3", *common, "--out", str(tmp_path / "r")]) == 0
        random_bodies, bodies[:] = list(bodies), []
        assert main(["bench", "serve", "--port", port, "--dataset-name", "sharegpt", "--dataset-path", str(sharegpt),
                     "--output-len", "5", *common, "--out", str(tmp_path / "s")]) == 0
        given, bodies[:] = list(bodies), []
        assert main(["bench", "serve", "--base-url", live.url, "--dataset-name", "sharegpt", "--dataset-path",
                     str(sharegpt), *common, "--request-rate", "500", "--burstiness", "inf",
                     "--out", str(tmp_path / "d")]) == 0
        default, bodies[:] = list(bodies), []
        assert main(["bench", "serve", "--base-url", live.url, "--num-prompts", "2", "--max-concurrency", "1,2",
                     "--output-len", "2", "--warmup", "0", "--save-result", "--label", "mine",
                     "--out", str(tmp_path / "v")]) == 0
    assert len(random_bodies) == 2 and all(len(b["prompt"]) == 9 and b["max_tokens"] == 3
                                           and b["ignore_eos"] is True for b in random_bodies)
    assert json.loads((tmp_path / "r" / "results.json").read_text())["settings"]["ignore_eos"] is True
    assert [b["max_tokens"] for b in given] == [5, 5]
    assert json.loads((tmp_path / "s" / "results.json").read_text())["settings"]["output_len"] == 5
    assert [b["max_tokens"] for b in default] == [len(Tokenizer(target).encode(reply, add_special_tokens=False))] * 2
    assert json.loads((tmp_path / "d" / "results.json").read_text())["settings"]["burstiness"] == "inf"
    assert "burstiness inf;" in (tmp_path / "d" / "results.md").read_text()
    names = sorted(p.name for p in (tmp_path / "v").glob("mine-*.json"))
    assert [n.rsplit("-", 2)[0] for n in names] == [f"mine-infqps-concurrency1-{target.name}",
                                                    f"mine-infqps-concurrency2-{target.name}"]
    assert json.loads((tmp_path / "v" / names[1]).read_text())["max_concurrency"] == 2


def test_bench_serve_one_line_errors_from_the_server(tiny_pair, tmp_path, capsys):
    """A server listing no model, and requests that all fail: one line and exit 2; the failed
    requests' errors printed as vLLM prints them."""
    target, _ = tiny_pair
    with LiveServer(fake_vllm(target, [], models=False)) as live:
        assert main(["bench", "serve", "--base-url", live.url, "--num-prompts", "2", "--max-concurrency", "1",
                     "--warmup", "0", "--out", str(tmp_path / "none")]) == 2
        err = capsys.readouterr().err
        assert "No models found on the server" in err and len(err.strip().splitlines()) == 1, err
    with LiveServer(fake_vllm(target, [])) as live:
        assert main(["bench", "serve", "--base-url", live.url, "--model", "nonexistent", "--num-prompts", "2",
                     "--max-concurrency", "1", "--warmup", "0", "--out", str(tmp_path / "fail")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Error 0: HTTP 404:" in "\n".join(err) and "All requests failed" in "\n".join(err)
    assert err[-1].startswith("specdec: error: every request of server, concurrency 1, failed")
    assert "does not exist" in err[-1]
    assert (tmp_path / "fail" / "results.json").exists()          # the run is still recorded


def test_a_server_that_does_not_start_is_one_line_error(tiny_pair, tmp_path, capsys):
    """A started server that exits (a bad --model, bad --server-args) or does not answer in time:
    one line naming the log's error and the log, exit 2, no process left behind."""
    import os

    target, _ = tiny_pair
    before = set(_children(os.getpid()))
    for flags, reason in ((["--model", str(tmp_path / "none")], "does not exist"),
                          (["--model", str(target), "--server-args", "--max-num-seqs abc"], "--max-num-seqs")):
        rc = main(["bench", "serve", *flags, "--num-speculative-tokens", "0", "--num-prompts", "2",
                   "--max-concurrency", "1", "--warmup", "0", "--out", str(tmp_path / "o")])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and err[-1].startswith("specdec: error: the server exited with status"), err
        assert reason in err[-1] and str(tmp_path / "o" / "server-plain.log") in err[-1]
    with pytest.raises(serve.ServerStartError, match="did not start within 0 s"), \
            serve.server(["--model", str(target)], tmp_path / "slow.log", startup_s=0):
        pass
    assert set(_children(os.getpid())) <= before


def test_burstiness_inf_gives_constant_gaps():
    """vLLM's get_request: as burstiness tends to infinity the gaps become 1/rate."""
    assert serve.arrival_gaps(4, 2.0, float("inf"), 0) == [0.5] * 4
    assert serve.arrival_gaps(3, float("inf"), float("inf"), 0, ramp=("linear", 1.0, 4.0)) == \
        pytest.approx([1.0, 1 / 2.5, 1 / 4.0])


def test_metric_percentiles_are_checked_when_parsed(capsys):
    for bad in ("99,150", "-1", "nan"):
        with pytest.raises(SystemExit):
            main(["bench", "serve", "--metric-percentiles", bad])
        assert "--metric-percentiles" in capsys.readouterr().err


def test_results_md_keeps_sub_10_ms_digits():
    from specdec.bench.serve_report import _ms

    assert [_ms({"x": v}, "x") for v in (2.5, 4.034, 24.66, 247.3)] == ["2.50", "4.03", "24.7", "247"]
    assert _ms({"x": None}, "x") == "–"


def test_bench_serve_servers_start_without_prefix_caching_unless_asked():
    """Every load point sends the same prompts: with the servers' default prefix caching the
    later points would find them cached (their TTFT and throughput measured on other work)."""
    from specdec.bench.serve_cli import variants

    def argvs(server_args: str) -> list[list[str]]:
        args = argparse.Namespace(model="m", server_args=server_args, num_speculative_tokens=[0, 2],
                                  speculative_config=None)
        return [v["argv"] for v in variants(args)]

    assert all("--no-enable-prefix-caching" in a for a in argvs("--max-num-seqs 4"))
    assert not any("--no-enable-prefix-caching" in a for a in argvs("--enable-prefix-caching"))
