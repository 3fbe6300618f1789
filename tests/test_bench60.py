"""`specdec bench throughput` / `bench serve` against vLLM's benchmarks (vllm/benchmarks/throughput.py,
serve.py, lib/endpoint_request_func.py): which length flag wins, a ramp's rps_change_events, streams
with empty chunks, and no seed in the requests."""

from __future__ import annotations

import argparse
import asyncio
import json
from datetime import datetime

import pytest

from specdec.bench import serve
from specdec.bench.offline import check_throughput
from specdec.cli import build_parser, main
from test_bench_serve import fake_vllm
from test_server import LiveServer


def _throughput(*flags: str) -> argparse.Namespace:
    args = build_parser("bench").parse_args(["bench", "throughput", *flags])
    check_throughput(args)
    return args


def test_throughput_random_flags_win_with_vllms_warning(capsys):
    """vLLM's throughput.py prefers --random-input-len / --random-output-len / --random-prefix-len
    over --input-len / --output-len / --prefix-len, warning when both are given."""
    args = _throughput("--random-input-len", "16", "--input-len", "8", "--output-len", "5",
                       "--random-output-len", "7", "--random-prefix-len", "4", "--prefix-len", "9")
    assert (args.input_len, args.output_len, args.prefix_len) == (16, 7, 4)
    err = capsys.readouterr().err
    for flag, used in (("input-len", 16), ("output-len", 7), ("prefix-len", 4)):
        assert f"both --{flag} and --random-{flag} are given: --random-{flag} ({used}) is used" in err
    args = _throughput("--input-len", "8", "--prefix-len", "3")          # one of each: no warning
    assert (args.input_len, args.output_len, args.prefix_len) == (8, 128, 3) and capsys.readouterr().err == ""
    assert _throughput().prefix_len == 0


def test_rps_change_events_follow_vllms_rule():
    """The start rate when the point begins, then every whole rate passed, stamped by the request
    that reached it (two at once when a request jumps past two)."""
    events = serve.rps_change_events(("linear", 0.5, 3.0), [101.0, 102.0, 103.0], 100.0)
    assert [e["rps"] for e in events] == [0.5, 1, 2, 3]
    assert [datetime.fromisoformat(e["timestamp"]).timestamp() for e in events] == \
        pytest.approx([100.0, 102.0, 103.0, 103.0])
    assert [e["rps"] for e in serve.rps_change_events(("exponential", 2.0, 2.0), [1.0, 2.0], 0.0)] == [2]


def test_saved_result_has_the_ramps_rps_change_events(tiny_pair, tmp_path):
    """--save-result with a ramp: vLLM's result JSON has rps_change_events (without --save-detailed
    too); without a ramp it has none."""
    target, _ = tiny_pair
    common = ["--num-prompts", "3", "--max-concurrency", "3", "--output-len", "2", "--warmup", "0", "--save-result"]
    with LiveServer(fake_vllm(target, [])) as live:
        assert main(["bench", "serve", "--base-url", live.url, *common, "--burstiness", "inf",
                     "--ramp-up-strategy", "linear", "--ramp-up-start-rps", "20", "--ramp-up-end-rps", "22",
                     "--result-filename", "ramp.json", "--out", str(tmp_path)]) == 0
        assert main(["bench", "serve", "--base-url", live.url, *common, "--result-filename", "flat.json",
                     "--out", str(tmp_path)]) == 0
    ramp = json.loads((tmp_path / "ramp.json").read_text())
    assert [e["rps"] for e in ramp["rps_change_events"]] == [20, 21, 22]
    stamps = [datetime.fromisoformat(e["timestamp"]) for e in ramp["rps_change_events"]]
    assert stamps == sorted(stamps)
    assert "rps_change_events" not in json.loads((tmp_path / "flat.json").read_text())


def test_sampled_requests_carry_no_seed(tiny_pair, tmp_path):
    """vLLM's bench sends no seed in the request body (--seed seeds the dataset and the arrivals):
    one seed in every request would make a prompt's repeats draw the same sample."""
    target, _ = tiny_pair
    with LiveServer(fake_vllm(target, bodies := [])) as live:
        assert main(["bench", "serve", "--base-url", live.url, "--num-prompts", "3", "--max-concurrency", "3",
                     "--output-len", "2", "--warmup", "0", "--temperature", "0.8", "--seed", "5",
                     "--out", str(tmp_path)]) == 0
    assert len(bodies) == 3 and all("seed" not in b and b["temperature"] == 0.8 for b in bodies)


def _empty_chunks_app():
    """A server whose streams hold chunks without text: a role chunk with empty content, a
    "data:" line without its space, an SSE comment, a finishing chunk with an empty delta / text,
    a usage-only chunk; "/v1/completions" with prompt "special" streams only empty texts."""
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def complete(request):
        body = await request.json()
        chat = request.url.path.endswith("chat/completions")

        def choice(text, finish=None):
            if chat:
                return {"index": 0, "delta": {"content": text} if text is not None else {}, "finish_reason": finish}
            return {"index": 0, "text": text or "", "finish_reason": finish}

        async def events():
            head = {"id": "x", "model": "m", "created": 0,
                    "object": "chat.completion.chunk" if chat else "text_completion"}
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}} if chat else choice("")
            yield f"data: {json.dumps({**head, 'choices': [first]})}\n\n"
            yield ": ping\n\n"
            text = "" if body.get("prompt") == "special" else " x"
            yield f"data:{json.dumps({**head, 'choices': [choice(text)]})}\n\n"
            yield f"data: {json.dumps({**head, 'choices': [choice(None, 'length')]})}\n\n"
            usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", complete, methods=["POST"]),
                             Route("/v1/completions", complete, methods=["POST"])])


def test_chunks_without_text_are_tokens_not_failures():
    """vLLM's client: every chunk with choices is a token's arrival, its text possibly empty (a
    special token's), so a request whose text is all empty still completes; a usage-only chunk
    gives the counts and no arrival; "data:" with or without the space, comments skipped."""
    items = [{"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "hi"}, {"prompt": "special"}]
    sampling = {"max_tokens": 2, "temperature": 0.0, "extra_body": {}}
    with LiveServer(_empty_chunks_app()) as live:
        for client in serve.CLIENTS:
            results, _ = asyncio.run(serve.run_load(live.url, "m", items, serve.Load(float("inf"), None), 1.0,
                                                    sampling, 0, client))
            assert [(r.ok, r.error) for r in results] == [(True, "")] * 3, client
            assert [len(r.chunks) for r in results] == [3, 3, 3], client
            assert [r.text for r in results] == [" x", " x", ""], client
            assert all((r.output_tokens, r.prompt_tokens) == (2, 3) for r in results), client
    s = serve.summarize(results, 1.0, {}, [50])
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (3, 0, 6)
