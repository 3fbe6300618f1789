"""`specdec run-batch -i requests.jsonl -o results.jsonl [serve's flags]`: vLLM's run-batch, the
OpenAI Batch API's file format run through the server's own handlers, offline.

Each input line is one request: `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions",
"body": {...}}` (url: one of URLS, vLLM's run_batch's score and rerank paths included). Each
output line, in the input's order, is `{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}`: the body a server would have answered (an OpenAI error JSON for a request it
refuses, with `error` then naming it). Every request goes through the app in this process (no
port), up to --max-concurrent-requests at a time (default 4 x --max-num-seqs) so the engine
batches them, speculation included.

A file that cannot be read, or a line that is not a request object, is one line on stderr and exit
status 2 before the model loads. -i and -o also take http(s) URLs (the output is PUT there).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass

from ..config import is_unicode_text

PROG = "specdec run-batch"
# vLLM's run_batch takes chat, embeddings and any url ending in /score or /rerank: those paths this
# server has, plus completions and responses
URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
        "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")


@dataclass
class BatchLine:
    number: int                  # 1-based, in the input file
    custom_id: str
    method: str
    url: str
    body: dict


def add_parser(sub) -> None:
    """Register `run-batch`; its flags (serve's and -i/-o) are parsed in run(), as serve's are."""
    p = sub.add_parser("run-batch", help="OpenAI Batch API files (JSONL) through the server's handlers, offline "
                                         "(vLLM's run-batch)", add_help=False, prefix_chars="\x00")
    p.add_argument("argv", nargs=argparse.REMAINDER)


def add_batch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run-batch")
    g.add_argument("-i", "--input-file", required=True,
                   help="the requests: a JSONL file of the OpenAI Batch API's request lines, or an http(s) URL")
    g.add_argument("-o", "--output-file", required=True,
                   help="where the results go: a JSONL file, or an http(s) URL that takes a PUT")
    g.add_argument("--output-tmp-dir", default=None,
                   help="where the output is written before it is uploaded to an URL (default: the system's)")
    g.add_argument("--max-concurrent-requests", type=int, default=None,
                   help="requests handed to the server at once (default: 4 x --max-num-seqs); the engine "
                        "batches up to --max-num-seqs of them")
    g.add_argument("--enable-metrics", action="store_true",
                   help="vLLM's: serve's Prometheus metrics at http://URL:PORT/metrics while the batch runs (--url, "
                        "--port); the run's speculative statistics are printed at the end either way")
    g.add_argument("--url", default=None,
                   help="vLLM's: the address the --enable-metrics server binds (default 127.0.0.1, loopback only, "
                        "as serve's --host; vLLM's binds every interface, 0.0.0.0)")
    # vLLM's run_batch has no HTTP body limit: serve's --max-request-bytes applies only when given
    p.set_defaults(max_request_bytes=None)


def parse_lines(text: str, source: str) -> list[BatchLine]:
    """The input file's requests; a ValueError naming the line for anything that is not one."""
    lines = []
    text = text.removeprefix("\ufeff")      # a BOM (Windows editors write one) from a URL: files are read as utf-8-sig
    # lines end at \n (JSONL's; str.splitlines() also split at U+2028, U+2029, U+0085 and the like,
    # which JSON allows unescaped inside strings)
    for number, raw in enumerate(text.split("\n"), 1):
        raw = raw.removesuffix("\r")
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source} line {number}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{source} line {number}: expected a request object, got {type(obj).__name__}")
        missing = [k for k in ("custom_id", "method", "url", "body") if k not in obj]
        if missing:
            raise ValueError(f"{source} line {number}: missing {', '.join(missing)} (a line is "
                             '{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}})')
        if not isinstance(obj["custom_id"], str):
            raise ValueError(f"{source} line {number}: custom_id must be a string")
        if not is_unicode_text(obj["custom_id"]):        # it is written back as UTF-8
            raise ValueError(f"{source} line {number}: custom_id must be valid Unicode text (no lone surrogates)")
        if not isinstance(obj["body"], dict):
            raise ValueError(f"{source} line {number}: body must be a JSON object")
        if not isinstance(obj["url"], str) or not isinstance(obj["method"], str):
            raise ValueError(f"{source} line {number}: method and url must be strings")
        lines.append(BatchLine(number, obj["custom_id"], obj["method"], obj["url"], obj["body"]))
    seen: dict[str, int] = {}
    for line in lines:       # results are matched by custom_id (OpenAI's Batch API refuses repeats too)
        if line.custom_id in seen:
            raise ValueError(f"{source} line {line.number}: custom_id {line.custom_id!r} is already on line "
                             f"{seen[line.custom_id]} (each request needs its own)")
        seen[line.custom_id] = line.number
    return lines


async def asgi_request(app, method: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    """One HTTP request through the ASGI app, in process: (status, response body)."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 0), "server": ("run-batch", 80),
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in
                         {"content-type": "application/json", "content-length": str(len(body)), **headers}.items()]}
    sent, done = False, asyncio.Event()
    status, chunks = 500, []

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()                        # the client never goes away before its answer
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    try:
        await app(scope, receive, send)
    except Exception:       # noqa: BLE001 - Starlette raises a 500's error again once it answered (a server's
        if not chunks:      # uvicorn logs it and goes on): the answer stands, one bad line ends no run
            raise
    done.set()
    return status, b"".join(chunks)


def _error_body(status: int, message: str, param: str | None = None) -> dict:
    """A line run-batch refuses itself, in the body the server's routes give the other lines."""
    from .errors import error_body

    return error_body(status, message, param)


async def run_lines(app, lines: list[BatchLine], api_key: str | None, concurrency: int, progress=None) -> list[dict]:
    """Every line through the app, `concurrency` at a time; the output records, in the input's order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(line: BatchLine) -> dict:
        request_id = f"specdec-batch-{uuid.uuid4().hex}"
        if line.url not in URLS or line.method.upper() != "POST":
            status = 400
            body = _error_body(400, f"{line.method} {line.url} is not a batch endpoint: POST to one of "
                                    f"{', '.join(URLS)}")
        elif line.body.get("stream"):
            status, body = 400, _error_body(400, "stream is not supported in a batch: leave it out or false", "stream")
        else:
            request = line.body
            if line.url == "/v1/responses" and request.get("background") and request.get("store") is not False:
                # a background answer is a "queued" stub whose generation dies with this process: the
                # batch is itself the background run, so the line runs to its end and the output holds it
                request = {**request, "background": False}
            headers = {"x-request-id": request_id}
            if api_key:
                headers["authorization"] = f"Bearer {api_key if isinstance(api_key, str) else api_key[0]}"
            async with gate:
                status, raw = await asgi_request(app, "POST", line.url, json.dumps(request).encode(), headers)
            try:
                body = json.loads(raw)
            except json.JSONDecodeError:
                body = _error_body(status, raw.decode("utf-8", "replace")[:500])
        if progress is not None:
            progress.update(1)
        error = None
        if status >= 400:
            err = body.get("error") if isinstance(body, dict) else None
            error = {"code": str((err or {}).get("code") or status), "message": (err or {}).get("message", str(body))}
        return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
                "response": {"status_code": status, "request_id": request_id, "body": body}, "error": error}

    return await asyncio.gather(*(one(line) for line in lines))


async def _read_input(path: str) -> str:
    if path.startswith(("http://", "https://")):
        import aiohttp

        try:
            async with aiohttp.ClientSession() as session, session.get(path) as r:
                if r.status != 200:
                    raise ValueError(f"--input-file {path}: HTTP {r.status}")
                return await r.text()
        except aiohttp.ClientError as e:
            raise ValueError(f"--input-file {path}: {type(e).__name__}: {e}") from None
        except UnicodeDecodeError as e:     # the text in the charset the server names, else UTF-8
            raise ValueError(f"--input-file {path}: not {e.encoding.upper()} text") from None
    try:
        with open(path, encoding="utf-8-sig") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"--input-file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"--input-file {path}: not UTF-8 text") from None


def _check_output(path: str, tmp_dir: str | None) -> None:
    """Before the model loads: an output file that could not be written fails now, not after the run."""
    if path.startswith(("http://", "https://")):
        if tmp_dir is not None and not os.path.isdir(tmp_dir):
            raise ValueError(f"--output-tmp-dir {tmp_dir}: not a folder")
        return
    # written through the path, as vLLM's open(path, "w"): an existing file (a symlink, a FIFO,
    # /dev/stdout) needs write access to itself, a new one to its folder; a dangling symlink's
    # target is the new file (resolved only then: /dev/stdout's would be a pipe's name)
    target = os.path.realpath(path) if os.path.islink(path) and not os.path.exists(path) else path
    folder = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(folder):
        raise ValueError(f"--output-file {path}: no folder {folder}")
    if os.path.isdir(target):
        raise ValueError(f"--output-file {path}: is a folder")
    if not (os.access(target, os.W_OK) if os.path.exists(target) else os.access(folder, os.W_OK)):
        raise ValueError(f"--output-file {path}: not writable")


def _line(record: dict) -> str:
    """One output line: UTF-8 text, or JSON's \\u escapes where a string holds a lone surrogate
    (a client's text echoed in an error) that UTF-8 cannot carry."""
    line = json.dumps(record, ensure_ascii=False) + "\n"
    return line if is_unicode_text(line) else json.dumps(record) + "\n"


async def _write_output(path: str, records: list[dict], tmp_dir: str | None) -> None:
    text = "".join(_line(r) for r in records)
    if not path.startswith(("http://", "https://")):
        # through the path, as vLLM writes it: a symlink's target, a FIFO's reader, /dev/stdout and a
        # file's permissions and links stay what they are (the text is whole before the first byte)
        data = text.encode("utf-8")       # before the file is opened (and emptied): a failing encode keeps it
        with open(path, "wb") as f:
            f.write(data)
        return
    import aiohttp

    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=tmp_dir, suffix=".jsonl", delete=False) as f:
        f.write(text)                                         # kept if the upload fails
    try:
        async with aiohttp.ClientSession() as session, session.put(path, data=text.encode()) as r:
            if r.status >= 300:
                raise ValueError(f"--output-file {path}: the upload got HTTP {r.status} (the results are in {f.name})")
    except aiohttp.ClientError as e:
        raise ValueError(f"--output-file {path}: {type(e).__name__}: {e} (the results are in {f.name})") from None
    os.unlink(f.name)


# serve's flags about its HTTP listener, which run-batch (no listener) does not use: (flag, dest, default)
_HTTP_FLAGS = (("--host", "host", "127.0.0.1"), ("--port", "port", 8000), ("--ssl-keyfile", "ssl_keyfile", None),
               ("--ssl-certfile", "ssl_certfile", None), ("--ssl-ca-certs", "ssl_ca_certs", None),
               ("--root-path", "root_path", ""), ("--uvicorn-log-level", "uvicorn_log_level", "info"),
               ("--disable-fastapi-docs", "disable_fastapi_docs", False), ("--middleware", "middleware", []),
               ("--uds", "uds", None), ("--disable-uvicorn-access-log", "disable_uvicorn_access_log", False),
               ("--disable-access-log-for-endpoints", "disable_access_log_for_endpoints", ()))


def run(args, prog: str = PROG) -> int:
    """`args` from `specdec run-batch` (its words in args.argv) or a namespace holding argv."""
    from ..cli import help_keyword, keyword_help
    from .cli import _logging_level, build_llm, build_parser, parse_args, server_config

    keyword = help_keyword(args.argv)
    if keyword is not None or "-h" in args.argv or "--help" in args.argv:
        p = build_parser(prog)
        p.description = ("Run a batch file of OpenAI requests (vLLM's run_batch) through the server's routes in this "
                         "process, with speculative decoding. MODEL, first or after the options, is --model. The "
                         "HTTP flags (--host, --ssl-*, --root-path, CORS) are serve's and do nothing here; --port "
                         "is the metrics server's with --enable-metrics, as vLLM's.")
        add_batch_args(p)
        print(keyword_help(p, keyword) if keyword is not None else p.format_help(), end="")
        return 0
    args, ignored = parse_args(args.argv, prog, extra=add_batch_args)
    from ..vllm_flags import check_refused

    check_refused(ignored)
    for flag in ignored:
        print(f"{prog}: warning: ignoring vLLM flag (specdec does not use it): {flag}", file=sys.stderr)
    metrics_flags = ("--port",) if args.enable_metrics else ()           # vLLM's: the metrics server's
    unused = [flag for flag, dest, default in _HTTP_FLAGS
              if getattr(args, dest, default) != default and flag not in metrics_flags]
    if args.url is not None and not args.enable_metrics:
        unused.append("--url (the --enable-metrics server's)")
    if unused:
        print(f"{prog}: warning: ignoring serve's HTTP flags (no server here): {', '.join(unused)}", file=sys.stderr)
    if args.replicas or args.autoscale or args.ray_address:
        raise ValueError("run-batch runs in this process: --replicas / --autoscale / --ray-address are serve's")
    if args.max_concurrent_requests is not None and args.max_concurrent_requests < 1:
        raise ValueError("--max-concurrent-requests must be >= 1")
    text = asyncio.run(_read_input(args.input_file))
    lines = parse_lines(text, args.input_file)                   # before the model loads
    _check_output(args.output_file, args.output_tmp_dir)
    if args.max_request_bytes is None:      # no HTTP client here: a long prompt or inline image is no 413
        args.max_request_bytes = sys.maxsize
    config = server_config(args)
    if config.log_config is None:        # serve's log lines (--enable-log-requests' too, as vLLM's run-batch)
        logging.basicConfig(level=_logging_level(), format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                            datefmt="%m-%d %H:%M:%S")
    exporter = _MetricsServer(args.url or "127.0.0.1", args.port) if args.enable_metrics else None
    try:
        llm = build_llm(args)
        concurrency = args.max_concurrent_requests or 4 * llm.engine.config.max_num_seqs
        records, metrics, elapsed = asyncio.run(_run_app(llm, config, lines, concurrency, exporter))
    finally:
        if exporter is not None:
            exporter.close()
    asyncio.run(_write_output(args.output_file, records, args.output_tmp_dir))
    ok = sum(r["error"] is None for r in records)
    tokens = sum((r["response"]["body"].get("usage") or {}).get("completion_tokens") or
                 (r["response"]["body"].get("usage") or {}).get("output_tokens") or 0
                 for r in records if r["error"] is None)
    print(f"{len(records)} requests: {ok} succeeded, {len(records) - ok} failed, in {elapsed:.1f} s "
          f"({tokens} output tokens, {tokens / max(elapsed, 1e-9):.1f} tok/s); results in {args.output_file}",
          file=sys.stderr)
    from .metrics import PREFIXES

    prefix = PREFIXES[config.metrics_prefix]
    drafts, drafted, accepted = (metrics.get(f"{prefix}spec_decode_num_{name}_total", 0.0)
                                 for name in ("drafts", "draft_tokens", "accepted_tokens"))
    if drafted:
        print(f"speculative: acceptance rate {accepted / drafted:.3f} ({accepted:.0f}/{drafted:.0f} drafted), "
              f"mean accepted length {1 + accepted / drafts:.2f}", file=sys.stderr)
    return 0


def _samples(text: str) -> dict[str, float]:
    """Prometheus text: each metric's samples summed over their labels, by name."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        name = sample.split("{")[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            pass
    return out


class _MetricsServer:
    """vLLM's run-batch --enable-metrics: a Prometheus endpoint at --url:--port, bound before the
    model loads (a port in use is a one-line error then); it serves the app's /metrics families
    once run() hands it the app's registry."""

    def __init__(self, host: str, port: int):
        from prometheus_client import CollectorRegistry, start_http_server

        self.source = None
        registry = CollectorRegistry()
        registry.register(self)
        try:
            self.httpd, _ = start_http_server(port, addr=host, registry=registry)
        except OSError as e:
            raise ValueError(f"--enable-metrics: cannot listen on {host}:{port}: {e.strerror or e}") from None

    def collect(self):
        return self.source.collect() if self.source is not None else []

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


async def _run_app(llm, config, lines: list[BatchLine], concurrency: int, exporter: _MetricsServer | None = None):
    from tqdm import tqdm

    from .app import build_app

    app = build_app(llm, config)
    if exporter is not None:
        exporter.source = app.state.service.metrics.registry
    with tqdm(total=len(lines), desc="requests", unit="req", file=sys.stderr,
              disable=not sys.stderr.isatty()) as progress:
        async with app.router.lifespan_context(app):
            try:
                start = time.perf_counter()
                records = await run_lines(app, lines, config.api_key, concurrency, progress)
                elapsed = time.perf_counter() - start
                _, metrics = await asgi_request(app, "GET", "/metrics", b"", {})
            except BaseException:        # Ctrl-C (asyncio.run cancels this task) or a failure
                await _wind_down(app.state.service)
                raise
    return records, _samples(metrics.decode()), elapsed


async def _wind_down(service) -> None:
    """Every other task cancelled and awaited, then the engine's thread ended. A request's
    handler runs its generation in a task of its own that outlives the request's cancellation,
    and cancelling that one starts its Generation's drain: left to asyncio.run's teardown, those
    were destroyed pending ("Task was destroyed", "Event loop is closed"), and the engine thread,
    still inside torch at interpreter exit, aborted the process (std::terminate)."""
    me = asyncio.current_task()
    while tasks := [t for t in asyncio.all_tasks() if t is not me]:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.to_thread(service.worker.stop)     # its jobs were all cancelled: it ends after this step
    service.close()
