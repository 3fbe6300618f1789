"""`specdec bench serve` against vLLM's `vllm bench serve` (vllm/benchmarks/serve.py,
lib/endpoint_request_func.py): the metrics on recorded timings beside vLLM's calculate_metrics;
a stream whose usage says 0 completion tokens (or names none); --request-rate without
--max-concurrency; the goodput SLOs as recorded. Servers: uvicorn on 127.0.0.1, ports 19300-19399."""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

from specdec.bench import serve, serve_cli, serve_vllm
from specdec.cli import main


@contextmanager
def uvicorn_server(app):
    """uvicorn serving app from a thread on the first free port of 19300-19399."""
    import uvicorn

    sock = socket.socket()
    for port in range(19300, 19400):
        try:
            sock.bind(("127.0.0.1", port))
            break
        except OSError:
            continue
    else:
        pytest.skip("no free port in 19300-19399")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def fake_server(usage: dict | None, tokens: int | None = None):
    """A server whose model's files are not on this machine (its root does not exist): each stream
    is a role chunk (empty content), `tokens` " x" chunks (default: max_tokens), a finishing chunk,
    then a usage-only chunk with `usage` (None: max_tokens completion tokens, 5 prompt tokens)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    async def listed(request):
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model", "root": "/nonexistent/fake",
                                                          "max_model_len": 4096}]})

    async def complete(request):
        body = await request.json()
        chat = request.url.path.endswith("chat/completions")
        n = body["max_tokens"] if tokens is None else tokens

        def choice(text, role=None, finish=None):
            if chat:
                return {"index": 0, "delta": {**({"role": role} if role else {}), "content": text},
                        "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        async def events():
            yield f"data: {json.dumps({'choices': [choice('', role='assistant')]})}\n\n"
            for _ in range(n):
                yield f"data: {json.dumps({'choices': [choice(' x')]})}\n\n"
            yield f"data: {json.dumps({'choices': [choice('', finish='stop')]})}\n\n"
            given = usage if usage is not None else {"prompt_tokens": 5, "completion_tokens": body["max_tokens"]}
            yield f"data: {json.dumps({'choices': [], 'usage': given})}\n\ndata: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    async def metrics(request):
        return PlainTextResponse("")

    return Starlette(routes=[Route("/v1/models", listed), Route("/metrics", metrics),
                             Route("/v1/chat/completions", complete, methods=["POST"]),
                             Route("/v1/completions", complete, methods=["POST"])])


def _vllm_metrics(results, wall: float, slo_ms: dict, percentiles: list[float]) -> dict:
    """vLLM's calculate_metrics and process_one_metric, written out from their code over the same
    recorded requests: TTFT, ITL per chunk, E2EL to the last chunk with choices, TPOT of requests
    with more than one token, goodput with a TPOT of 0 for the others, np.* of an empty list as [0]."""
    ttfts, tpots, all_tpots, itls, e2els, out_lens, total_in, done = [], [], [], [], [], [], 0, 0
    for r in results:
        if not r.ok:
            out_lens.append(0)
            continue
        ttft, latency, n = r.chunks[0] - r.sent, r.chunks[-1] - r.sent, r.output_tokens
        tpot = (latency - ttft) / (n - 1) if n > 1 else 0.0
        tpots += [tpot] if n > 1 else []
        all_tpots.append(tpot)
        itls += [b - a for a, b in zip(r.chunks, r.chunks[1:])]
        ttfts.append(ttft)
        e2els.append(latency)
        out_lens.append(n)
        total_in, done = total_in + r.prompt_tokens, done + 1
    columns = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
    good = sum(all(x <= slo_ms[k] / 1000 for k, x in zip(slo_ms, row))
               for row in zip(*(columns[k] for k in slo_ms))) if slo_ms else 0
    out = {"completed": done, "failed": len(results) - done, "total_output_tokens": sum(out_lens),
           "request_throughput": done / wall, "output_throughput": sum(out_lens) / wall,
           "total_token_throughput": (total_in + sum(out_lens)) / wall,
           "request_goodput": good / wall if slo_ms else None}
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        out |= {f"mean_{name}_ms": np.mean(xs or 0) * 1000, f"median_{name}_ms": np.median(xs or 0) * 1000,
                f"std_{name}_ms": np.std(xs or 0) * 1000}
        out |= {f"p{int(p) if int(p) == p else p}_{name}_ms": np.percentile(xs or 0, p) * 1000 for p in percentiles}
    return out


def test_metrics_on_recorded_timings_are_vllms():
    """Requests of 0, 1, 2 and many tokens, multi-token chunks (a speculative step's), failures:
    the result file's figures are vLLM's calculate_metrics' to the float, results.json's the same
    rounded (its empty metrics None where vLLM's are 0)."""
    rng = np.random.default_rng(64)
    percentiles = [50.0, 90.0, 99.0, 99.9, 25.5]
    for trial in range(60):
        results = []
        for _ in range(int(rng.integers(1, 10))):
            if rng.random() < 0.2:
                results.append(serve.RequestResult(ok=False, error="HTTP 500: boom"))
                continue
            sent = float(rng.random() * 5)
            chunks = list(sent + rng.random() + np.cumsum([0.0, *rng.random(int(rng.integers(0, 8))) * 0.1]))
            extra = int(rng.choice([0, 0, 1, 3]))          # tokens beyond one a chunk: speculation's
            n = len(chunks) + extra if len(chunks) > 1 else int(rng.choice([0, 1, 1, 2]))
            results.append(serve.RequestResult(ok=True, sent=sent, arrived=sent, chunks=chunks, output_tokens=n,
                                               prompt_tokens=int(rng.integers(1, 50))))
        slo_ms = {k: v for k, v in {"ttft": 600.0, "tpot": 40.0, "e2el": 1200.0}.items() if rng.random() < 0.6}
        slo = {k: v / 1000 for k, v in slo_ms.items()}
        want = _vllm_metrics(results, 10.0, slo_ms, percentiles)
        args = argparse.Namespace(burstiness=1.0, metric_percentiles=percentiles, percentile_metrics=serve.METRICS)
        flat = serve_vllm.flat_result(serve.Measured(results=results, wall=10.0, load=serve.Load(float("inf"), None)),
                                      args, {}, slo)
        summary = serve.summarize(results, 10.0, slo, percentiles)
        for key, value in want.items():
            if value is None:               # goodput without SLOs (pytest 9.2's approx refuses None)
                assert flat[key] is None, (trial, key)
                continue
            assert flat[key] == pytest.approx(value, rel=1e-9, abs=1e-9), (trial, key)
            if key.endswith("_ms"):
                stat, name, _ = key.split("_")
                got = summary[name][stat]
                assert got == pytest.approx(value, abs=1e-3) if got is not None else not any(
                    want[f"{s}_{name}_ms"] for s in ("mean", "median")), (trial, key)
            elif value is not None:
                assert summary[key] == pytest.approx(value, rel=1e-3, abs=1e-3), (trial, key)


@pytest.mark.parametrize("client", serve.CLIENTS)
def test_a_zero_token_completion_with_usage_needs_no_tokenizer(client, tmp_path, capsys):
    """A reply that ended at once: chunks with choices (its role, its finish), usage saying 0
    completion tokens. It completed with 0 tokens (vLLM's, no TPOT); the usage stands, so a
    server whose files are not here needs no --tokenizer. It had been taken for a stream without
    usage: "pass --tokenizer PATH", exit 2, nothing recorded."""
    out = tmp_path / "out"
    with uvicorn_server(fake_server({"prompt_tokens": 5, "completion_tokens": 0}, tokens=0)) as url:
        rc = main(["bench", "serve", "--base-url", url, "--num-prompts", "2", "--max-concurrency", "1",
                   "--output-len", "4", "--warmup", "0", "--client", client, "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    (point,) = json.loads((out / "results.json").read_text())["variants"][0]["points"]
    assert (point["completed"], point["failed"], point["total_output_tokens"], point["total_input_tokens"]) == \
        (2, 0, 0, 10)
    assert point["tpot"]["median"] is None and point["ttft"]["median"] is not None


def test_usage_without_completion_tokens_counts_as_none_sent(tiny_pair, tmp_path):
    """usage naming no completion_tokens: vLLM's client reads usage.get("completion_tokens") and
    then counts the text with the tokenizer; it had failed the request (KeyError)."""
    import asyncio

    from specdec.tokenizer import Tokenizer

    target, _ = tiny_pair
    items = [{"prompt": "hi", "max_tokens": 3}]
    with uvicorn_server(fake_server({"prompt_tokens": 5})) as url:
        (r,), _ = asyncio.run(serve.run_load(url, "fake", items, serve.Load(float("inf"), 1), 1.0,
                                             {"max_tokens": 3, "temperature": 0.0, "extra_body": {}}, 0))
    assert r.ok and r.error == "" and not r.usage and r.text == " x x x", r.error
    serve.count_without_usage([r], items, "http://127.0.0.1:9", argparse.Namespace(tokenizer=str(target)))
    assert r.output_tokens == len(Tokenizer(target).encode(" x x x", add_special_tokens=False))


def test_a_rate_without_max_concurrency_is_an_open_load(tmp_path):
    """vLLM's `--request-rate R` alone caps nothing (its --max-concurrency defaults to none). It
    had run R under the concurrency sweep 1, 2, 4, 8, 16, 32: six load points, the first holding
    one request in flight, where vLLM's command measures one. The sweep stays the default of
    all-at-once arrivals; --max-concurrency given is kept."""
    out = tmp_path / "out"
    with uvicorn_server(fake_server(None)) as url:
        assert main(["bench", "serve", "--base-url", url, "--request-rate", "200", "--num-prompts", "3",
                     "--output-len", "2", "--warmup", "0", "--out", str(out)]) == 0
    (variant,) = json.loads((out / "results.json").read_text())["variants"]
    assert [(p["rate"], p["concurrency"]) for p in variant["points"]] == [(200.0, None)]

    def settled(*flags: str) -> list:
        p = argparse.ArgumentParser()
        serve_cli.add_arguments(p)
        args = p.parse_args(list(flags))
        serve_cli.concurrency(args)
        return args.max_concurrency

    assert settled() == [1, 2, 4, 8, 16, 32] and settled("--request-rate", "inf") == [1, 2, 4, 8, 16, 32]
    assert settled("--request-rate", "4,8") == [None] and settled("--max-concurrency", "2", "--request-rate", "4") == [2]
    assert settled("--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "4") == [None]


def test_goodput_slos_are_recorded_as_given(tmp_path):
    """results.json's goodput_slo_ms are the milliseconds given (1001, not 1000.9999999999999 from
    the seconds the comparison uses)."""
    out = tmp_path / "out"
    with uvicorn_server(fake_server(None)) as url:
        assert main(["bench", "serve", "--base-url", url, "--num-prompts", "2", "--max-concurrency", "1",
                     "--output-len", "2", "--warmup", "0", "--goodput", "ttft:1001", "tpot:1003", "e2el:60000",
                     "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["goodput_slo_ms"] == {"ttft": 1001, "tpot": 1003, "e2el": 60000}
    assert results["variants"][0]["points"][0]["request_goodput"] is not None


def test_counters_that_could_not_be_read_are_left_out(tmp_path, capsys):
    """/metrics answers before the load point and fails after it (or the other way round): the
    point's speculation counters are left out with a warning, as vLLM drops them; they had been
    recorded as negative increments (-40 draft tokens, -30 accepted)."""
    app, calls = fake_server(None), []
    counters = ("specdec:spec_decode_num_drafts_total 10\nspecdec:spec_decode_num_draft_tokens_total 40\n"
                "specdec:spec_decode_num_accepted_tokens_total 30\n")

    async def failing_metrics(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/metrics":
            calls.append(1)
            ok = len(calls) == 1
            await send({"type": "http.response.start", "status": 200 if ok else 500,
                        "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": counters.encode() if ok else b"oops"})
            return
        await app(scope, receive, send)

    out = tmp_path / "out"
    with uvicorn_server(failing_metrics) as url:
        assert main(["bench", "serve", "--base-url", url, "--num-prompts", "2", "--max-concurrency", "1",
                     "--output-len", "2", "--warmup", "0", "--out", str(out)]) == 0
    (point,) = json.loads((out / "results.json").read_text())["variants"][0]["points"]
    spec = point["speculation"]
    assert (spec["draft_tokens"], spec["accepted_tokens"], spec["acceptance_rate"]) == (0, 0, None), spec
    assert "did not answer after the load point" in capsys.readouterr().err
