"""`specdec run-batch` (vLLM's run-batch): OpenAI Batch API JSONL files through the server's own
handlers in process; outputs in the input's order, each the body the server would have answered,
greedy completions identical to the offline LLM's."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import pytest

from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.server.run_batch import parse_lines

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


def _write(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_batch_file_runs_through_the_server(tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair
    prompts = ["def add(a, b):", "class Point:", "import os\n"]
    rows = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "m", "prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True}}
            for i, p in enumerate(prompts)]
    rows += [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}},
        {"custom_id": "bad-tokens", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "x", "max_tokens": -1}},
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/foo", "body": {}},
        {"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}},
        {"custom_id": "stream", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "x", "stream": True}},
        {"custom_id": "bad-model", "method": "POST", "url": "/v1/completions", "body": {"model": "other", "prompt": "x"}},
    ]
    src, out = _write(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", src, "-o", str(out), "--model", str(target), "--speculative-model", str(draft),
                 "--num-speculative-tokens", "3", "--served-model-name", "m", "--chat-template", TEMPLATE]) == 0
    err = capsys.readouterr().err
    assert "9 requests: 4 succeeded, 5 failed" in err and "speculative: acceptance rate" in err
    results = _read(out)
    assert [r["custom_id"] for r in results] == [r["custom_id"] for r in rows]          # the input's order
    assert len({r["id"] for r in results}) == len(rows)
    plain = LLM(model=str(target))
    expected = [o.outputs[0].text for o in plain.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))]
    for r, text in zip(results[:3], expected):
        assert r["error"] is None and r["response"]["status_code"] == 200
        body = r["response"]["body"]
        assert body["object"] == "text_completion" and body["choices"][0]["text"] == text   # lossless, as served
        assert body["usage"]["completion_tokens"] == 16
        assert r["response"]["request_id"].startswith("specdec-batch-")
    chat = results[3]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    status = {r["custom_id"]: (r["response"]["status_code"], r["error"]) for r in results[4:]}
    assert status["bad-tokens"][0] == 400 and "max_tokens" in status["bad-tokens"][1]["message"]
    assert status["bad-url"][0] == 400 and "not a batch endpoint" in status["bad-url"][1]["message"]
    assert status["get"][0] == 400
    assert status["stream"][0] == 400 and "stream" in status["stream"][1]["message"]
    assert status["bad-model"][0] == 404
    for r in results[4:]:       # the error answer is the server's OpenAI error JSON, whoever refused the line
        assert r["response"]["body"]["error"]["message"] == r["error"]["message"]
    kinds = {r["custom_id"]: r["response"]["body"]["error"]["type"] for r in results[4:]}
    assert kinds == {"bad-tokens": "invalid_request_error", "bad-url": "invalid_request_error",
                     "get": "invalid_request_error", "stream": "invalid_request_error", "bad-model": "not_found_error"}


@pytest.mark.parametrize("rows,message", [
    (["{not json"], "in.jsonl line 1: not JSON"),
    (["[1, 2]"], "in.jsonl line 1: expected a request object, got list"),
    ([{"custom_id": "a", "method": "POST", "url": "/v1/completions"}], "in.jsonl line 1: missing body"),
    ([{"custom_id": 1, "method": "POST", "url": "/v1/completions", "body": {}}], "custom_id must be a string"),
    ([{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}] * 2,
     "in.jsonl line 2: custom_id 'a' is already on line 1"),
])
def test_a_bad_input_file_is_one_line_before_the_model_loads(tmp_path, capsys, rows, message):
    src = _write(tmp_path / "in.jsonl", rows)
    # the model does not exist: the file's fault is what is reported
    assert main(["run-batch", "-i", src, "-o", str(tmp_path / "o.jsonl"), "--model", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_bad_paths_are_one_line(tmp_path, capsys):
    good = _write(tmp_path / "in.jsonl", [{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}])
    for argv, message in ((["-i", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "o.jsonl")], "No such file"),
                          (["-i", good, "-o", str(tmp_path / "no" / "o.jsonl")], "no folder"),
                          (["-i", good, "-o", str(tmp_path)], "is a folder"),
                          (["-i", good, "-o", str(tmp_path / "o.jsonl"), "--max-concurrent-requests", "0"],
                           "--max-concurrent-requests must be >= 1")):
        assert main(["run-batch", *argv, "--model", str(tmp_path / "none")]) == 2
        assert message in capsys.readouterr().err
    from specdec.entrypoints.openai.run_batch import PROG, main as module_main

    assert module_main(["-i", str(tmp_path / "none.jsonl"), "-o", "o.jsonl"]) == 2
    assert capsys.readouterr().err.startswith(f"{PROG}: error: --input-file")


def test_urls_in_and_out(tiny_pair, tmp_path):
    """-i from an http URL, -o PUT to one (a real HTTP server on 127.0.0.1)."""
    target, _ = tiny_pair
    payload = Path(_write(tmp_path / "in.jsonl", [{"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                                    "body": {"model": "m", "prompt": "def f", "max_tokens": 4}}])).read_bytes()
    received = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(payload)

        def do_PUT(self):
            received["body"] = self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(201)
            self.end_headers()

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert main(["run-batch", "-i", url + "/in.jsonl", "-o", url + "/out.jsonl", "--model", str(target),
                     "--served-model-name", "m"]) == 0
    finally:
        server.shutdown()
    (line,) = received["body"].decode().splitlines()
    r = json.loads(line)
    assert r["custom_id"] == "a" and r["response"]["status_code"] == 200
    assert r["response"]["body"]["usage"]["completion_tokens"] == 4


def test_parse_lines_skips_blank_lines():
    rows = parse_lines('\n{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n\n', "f")
    assert [(r.number, r.custom_id) for r in rows] == [(2, "a")]


def test_a_failed_upload_keeps_the_results_in_the_output_tmp_dir(tiny_pair, tmp_path, capsys):
    """-o to a URL that refuses the PUT: the run fails in one line naming the file the results
    were kept in, under --output-tmp-dir; --enable-metrics is taken with its warning."""
    target, _ = tiny_pair
    rows = [{"custom_id": "a", "method": "POST", "url": "/v1/completions",
             "body": {"model": "m", "prompt": "def f", "max_tokens": 3}}]

    class Refusing(http.server.BaseHTTPRequestHandler):
        def do_PUT(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(503)
            self.end_headers()

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    keep = tmp_path / "kept"
    keep.mkdir()
    try:
        code = main(["run-batch", "-i", _write(tmp_path / "in.jsonl", rows), "-o",
                     f"http://127.0.0.1:{server.server_address[1]}/out.jsonl", "--output-tmp-dir", str(keep),
                     "--model", str(target), "--served-model-name", "m", "--enable-metrics", "--port", "0"])
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    assert code != 0
    assert "the upload got HTTP 503" in err and str(keep) in err
    (kept,) = keep.glob("*.jsonl")
    (line,) = kept.read_text().splitlines()
    assert json.loads(line)["response"]["body"]["usage"]["completion_tokens"] == 3


def test_lines_end_at_newlines_only():
    """JSON allows U+2028, U+2029 and U+0085 unescaped inside strings (what json.dumps(...,
    ensure_ascii=False) writes): str.splitlines() cut such a line in two and refused the file;
    CRLF line ends are taken too."""
    body = {"model": "m", "prompt": "Line one\u2028line two\u2029three\x85four"}
    text = "\r\n".join(json.dumps({"custom_id": c, "method": "POST", "url": "/v1/completions", "body": body},
                                  ensure_ascii=False) for c in ("a", "b")) + "\r\n"
    rows = parse_lines(text, "f")
    assert [r.custom_id for r in rows] == ["a", "b"] and rows[0].body["prompt"] == body["prompt"]


def test_a_500_ends_no_run():
    """A line the app answers with a 500: Starlette raises the error again once it answered, which
    ended the whole run (exit 134, no output written); the line keeps its 500 and the run goes on."""
    import asyncio

    from fastapi import FastAPI

    from specdec.server.errors import install_error_handlers
    from specdec.server.run_batch import asgi_request

    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def boom():
        raise RuntimeError("planted")

    status, body = asyncio.run(asgi_request(app, "POST", "/v1/completions", b"{}", {}))
    assert status == 500 and json.loads(body)["error"]["message"] == "internal error: RuntimeError"


def test_a_background_response_runs_to_its_end(tiny_pair, tmp_path):
    """A /v1/responses line with background: true answered a "queued" stub (status 200, no output)
    whose generation died with the process; in a batch it runs in the foreground, its answer in
    the output. Without store it is still the server's 400."""
    target, _ = tiny_pair
    body = {"model": "m", "input": "hello", "max_output_tokens": 8, "temperature": 0}
    rows = [{"custom_id": c, "method": "POST", "url": "/v1/responses", "body": {**body, **extra}}
            for c, extra in (("fg", {}), ("bg", {"background": True, "store": True}),
                             ("bg-nostore", {"background": True, "store": False}))]
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", _write(tmp_path / "in.jsonl", rows), "-o", str(out), "--model", str(target),
                 "--served-model-name", "m", "--chat-template", TEMPLATE]) == 0
    fg, bg, nostore = _read(out)
    assert bg["error"] is None and bg["response"]["status_code"] == 200
    assert bg["response"]["body"]["status"] == fg["response"]["body"]["status"] != "queued"
    text = [[c["text"] for c in item["content"]] for r in (fg, bg) for item in r["response"]["body"]["output"]]
    assert len(text) == 2 and text[0] == text[1] and text[0][0]          # the same greedy answer, in full
    assert bg["response"]["body"]["usage"]["output_tokens"] == 8
    assert nostore["response"]["status_code"] == 400 and "store" in nostore["error"]["message"]


def test_score_and_rerank_lines(tiny_pair, tmp_path):
    """vLLM's run_batch takes urls ending in /score and /rerank: each path the server has runs
    through its handler, with the offline LLM's scores."""
    target, _ = tiny_pair
    texts = ["hello world", "abc", "def f(x):"]
    score = {"model": "m", "text_1": texts[0], "text_2": texts[1:]}
    rerank = {"model": "m", "query": texts[0], "documents": texts[1:]}
    urls = [("/score", score), ("/v1/score", score), ("/rerank", rerank), ("/v1/rerank", rerank), ("/v2/rerank", rerank)]
    rows = [{"custom_id": url, "method": "POST", "url": url, "body": body} for url, body in urls]
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", _write(tmp_path / "in.jsonl", rows), "-o", str(out), "--model", str(target),
                 "--served-model-name", "m", "--runner", "pooling"]) == 0
    want = [o.outputs.score for o in LLM(model=str(target), runner="pooling").score(texts[0], texts[1:])]
    for r in _read(out):
        assert r["error"] is None and r["response"]["status_code"] == 200, r
        body = r["response"]["body"]
        if "score" in r["custom_id"]:
            assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-6)
        else:
            assert {x["index"]: x["relevance_score"] for x in body["results"]} == pytest.approx(dict(enumerate(want)),
                                                                                                abs=1e-6)


def test_an_empty_file_gives_an_empty_output(tiny_pair, tmp_path, capsys):
    """vLLM's run_batch writes an empty output for an empty input and exits 0 (sharded pipelines
    make empty shards); blank lines and a lone BOM are empty too."""
    target, _ = tiny_pair
    for i, text in enumerate(("", "\n\n", "\ufeff")):
        src, out = tmp_path / f"in{i}.jsonl", tmp_path / f"out{i}.jsonl"
        src.write_text(text, encoding="utf-8")
        assert main(["run-batch", "-i", str(src), "-o", str(out), "--model", str(target)]) == 0
        assert out.read_text() == ""
    assert "0 requests: 0 succeeded, 0 failed" in capsys.readouterr().err


def test_a_bom_is_taken():
    """A UTF-8 BOM at the start of the file (Windows editors write one) was 'not JSON'."""
    import asyncio
    import tempfile

    from specdec.server.run_batch import _read_input

    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}})
    with tempfile.NamedTemporaryFile("w", encoding="utf-8-sig", suffix=".jsonl", delete=False) as f:
        f.write(line + "\n")
    try:
        assert [r.custom_id for r in parse_lines(asyncio.run(_read_input(f.name)), f.name)] == ["a"]
    finally:
        Path(f.name).unlink()
    assert [r.custom_id for r in parse_lines("\ufeff" + line, "url")] == ["a"]      # an HTTP input's text


def test_no_body_limit_unless_asked(tiny_pair, tmp_path):
    """serve's --max-request-bytes (1 MiB by default) gave a line over it a 413; vLLM's run_batch has
    no body limit, so here the limit applies only when the flag is given."""
    target, _ = tiny_pair
    rows = [{"custom_id": "big", "method": "POST", "url": "/v1/completions",
             "body": {"model": "m", "prompt": "def f", "max_tokens": 2, "user": "x" * (1 << 20)}}]
    src = _write(tmp_path / "in.jsonl", rows)
    for extra, status in (([], 200), (["--max-request-bytes", "4096"], 413)):
        out = tmp_path / "out.jsonl"
        assert main(["run-batch", "-i", src, "-o", str(out), "--model", str(target), "--served-model-name", "m",
                     *extra]) == 0
        (r,) = _read(out)
        assert r["response"]["status_code"] == status, r["error"]


def test_the_output_is_written_through_its_path(tiny_pair, tmp_path):
    """As vLLM's open(path, "w"): a symlink's target gets the results (the link stays a link), a
    FIFO's reader reads them, and an existing file keeps its mode."""
    import os
    import stat

    target, _ = tiny_pair
    src = _write(tmp_path / "in.jsonl", [{"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                          "body": {"model": "m", "prompt": "x", "max_tokens": 2}}])
    run = ["run-batch", "-i", src, "--model", str(target), "--served-model-name", "m"]
    real, link = tmp_path / "real.jsonl", tmp_path / "link.jsonl"
    real.write_text("")
    real.chmod(0o640)
    link.symlink_to(real)
    assert main([*run, "-o", str(link)]) == 0
    assert link.is_symlink() and _read(real)[0]["custom_id"] == "a"
    assert stat.S_IMODE(real.stat().st_mode) == 0o640

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    assert main([*run, "-o", str(fifo)]) == 0
    reader.join(30)
    assert json.loads(got[0])["custom_id"] == "a"


def test_an_existing_output_in_a_read_only_folder_is_written(tiny_pair, tmp_path):
    import os

    target, _ = tiny_pair
    src = _write(tmp_path / "in.jsonl", [{"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                          "body": {"model": "m", "prompt": "x", "max_tokens": 2}}])
    run = ["run-batch", "-i", src, "--model", str(target), "--served-model-name", "m"]
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "out.jsonl").write_text("")
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):       # root writes anywhere: nothing to show then
            pytest.skip("this user writes into read-only folders")
        assert main([*run, "-o", str(locked / "out.jsonl")]) == 0
        assert _read(locked / "out.jsonl")[0]["custom_id"] == "a"
    finally:
        locked.chmod(0o700)


def test_a_lone_surrogate_custom_id_is_refused_and_the_old_output_kept(tmp_path, capsys):
    """A custom_id UTF-8 cannot carry is one line before the model loads (it had crashed the
    write, after the output file was opened and emptied)."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"custom_id": "a\\ud800b", "method": "POST", "url": "/v1/completions", "body": {}}\n')
    out = tmp_path / "out.jsonl"
    out.write_text("previous results\n")
    assert main(["run-batch", "-i", str(src), "-o", str(out), "--model", "/nonexistent"]) == 2
    assert "custom_id must be valid Unicode text" in capsys.readouterr().err
    assert out.read_text() == "previous results\n"


def test_an_output_line_holding_a_lone_surrogate_is_escaped():
    from specdec.server.run_batch import _line

    line = _line({"custom_id": "a", "error": {"message": "bad key 'x\ud800'"}})
    assert json.loads(line)["error"]["message"] == "bad key 'x\ud800'" and line.encode("utf-8")
    assert _line({"custom_id": "é"}) == '{"custom_id": "é"}\n'
