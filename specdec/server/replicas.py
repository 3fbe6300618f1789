"""N engine replicas behind one OpenAI-compatible endpoint: a Ray Serve deployment.

Each replica is a Ray actor that loads its own LLM (its own engine, KV pool and "auto" K
state; with --tensor-parallel-size its own TP group) and serves the single-process server's
FastAPI app (app.py's build_app, unchanged: the same routes, errors, streaming and metrics).
Ray Serve's proxy owns the port and routes each request to a replica with a free seat; it
replaces a replica whose actor dies or whose health check fails.

Metrics: every replica also serves its own registry on a port of its own (on loopback with a
local cluster; its address is logged, and kept by a small `MetricsBoard` deployment of the same
application), and `GET
/metrics` on the shared endpoint answers with every live replica's metrics, each sample
labelled `replica="<id>"` (federate.py); a replica that does not answer a scrape in 2 s (busy,
frozen a moment) is left out of that one. Responses carry `x-specdec-replica: <id>`.

The board lists the live replicas: a replica leaves it when nothing listens on its ports any more
(its process is gone: Ray replaces it), and every replica registers again at each of Ray's health
checks (every 5 s), so one taken off by mistake comes back, with the drain, the runtime
adapters and the /pause or /resume it missed. A replica Ray starts while the service is paused
(a replacement, or one more under autoscaling) starts paused, as the others are, until /resume.

Stored responses (the Responses API's `GET`/`DELETE /v1/responses/{id}`, `.../input_items`,
`.../cancel`, `previous_response_id`) live in the replica that made them, as one server's do: a
replica that does not hold the response named asks the others (their direct ports) and passes
the request to the one that does, answer and stream as they come (marked with that replica), so
a follow-up is found whichever replica Ray picks, a background response shows its live status and
is cancelled where it runs, and a conversation continues where it is stored.

Control routes (control.py: /pause, /resume, /is_paused, /get_world_size, and with
VLLM_SERVER_DEV_MODE /reload_weights, /collective_rpc, /reset_prefix_cache, ...): act on every
replica, as vLLM's API server does on its data-parallel engines. Each replica also serves its app
on a direct port of its own (kept by the board); the replica a control request reaches sends it
to every live replica at once and answers with the combination: the first failure if any failed
(its message naming the replica, the others that failed and those where it was done), else /is_paused and /is_sleeping true when every replica is,
/get_world_size the sum over replicas (include_dp=false: one replica's), /collective_rpc every
replica's results in turn, the others the first answer. vLLM's runtime LoRA routes
(/v1/load_lora_adapter, /v1/unload_lora_adapter) go to every replica the same way; the board keeps
the adapters so loaded, and a replica Ray starts later (a replacement) loads them too.

Shutdown (SIGINT/SIGTERM; replicas_run.py, the driver): the replicas drain first, as one server does: every new request is
answered 503 while those in flight finish (a second signal stops at once); then the application
and, for a cluster of its own, Serve and Ray stop. The signal handlers are set before Ray starts,
so a signal during the start-up stops it too (after ray.init, which is not cut short: an
interrupted ray.init leaves its processes running).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
from urllib.parse import parse_qs, quote, unquote

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, start_http_server
from ray import serve
from ray.serve import Application

from .control import CONTROL_PATHS, LORA_PATHS, PAUSE_MODES
from .errors import APIError, error_body
from .federate import merge

log = logging.getLogger("specdec.server")
REPLICA_HEADER = b"x-specdec-replica"
APP_NAME, DEPLOYMENT = "specdec", "specdec"
PROXY_CALLBACK, PROXY_MIDDLEWARES = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "specdec.server.proxy:middlewares"


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
class MetricsBoard:
    """What the replicas share: where each one's own metrics are served ({replica id: URL}), its
    direct port, the adapters loaded at runtime, and whether the server drains."""

    def __init__(self, token: str | None = None):
        self.urls: dict[str, str] = {}
        self.direct: dict[str, str] = {}        # each replica's app on its own port (control routes)
        self.adapters: dict[str, str] = {}      # /v1/load_lora_adapter's: name -> path
        self.token, self.draining = token, False
        self.paused = False                     # /pause broadcast (and not /resume since)

    def register(self, replica: str, url: str, direct: str | None = None) -> tuple[bool, bool, dict[str, str], bool]:
        """A replica that starts, or checks in again (idempotent) -> (whether it was on the board,
        draining, the runtime adapters, paused)."""
        known = replica in self.urls
        self.urls[replica] = url
        if direct is not None:
            self.direct[replica] = direct
        return known, self.draining, dict(self.adapters), self.paused

    def set_paused(self, paused: bool) -> bool:
        """The service is paused (/pause) or not (/resume) -> what it was before."""
        before, self.paused = self.paused, paused
        return before

    def adapter(self, name: str, path: str | None) -> None:
        """An adapter every replica loaded (path) or dropped (None)."""
        if path is None:
            self.adapters.pop(name, None)
        else:
            self.adapters[name] = path

    async def drain(self) -> int:
        """Every replica refuses new requests from now on -> the requests still in flight."""
        self.draining = True
        headers = {TOKEN_HEADER: self.token} if self.token else {}
        async with httpx.AsyncClient(timeout=10, headers=headers) as client:
            replies = await asyncio.gather(*(client.post(u + DRAIN_PATH) for u in self.direct.values()),
                                           return_exceptions=True)
        return sum(r.json()["in_flight"] for r in replies if isinstance(r, httpx.Response) and r.status_code == 200)

    def drop(self, replica: str) -> None:
        self.urls.pop(replica, None)
        self.direct.pop(replica, None)

    def all(self) -> dict[str, str]:
        return dict(self.urls)

    def directs(self) -> dict[str, str]:
        return dict(self.direct)


@serve.ingress()
class EngineReplica:
    """One replica: the LLM of `argv` (the `specdec serve` flags) and the server's app around it."""

    def __init__(self, argv: list[str], board=None, token: str | None = None):
        """token: the deployment's secret, which a replica's direct port asks of every request."""
        import ray

        from .cli import build_llm, parse_args, server_config

        args, _ = parse_args(argv)
        self.config = server_config(args)
        self.middleware = args.middleware
        self.llm = build_llm(args)
        self.board, self.token = board, token
        self.id = serve.get_replica_context().replica_id.unique_id
        self.node = ray.util.get_node_ip_address()
        # the direct port: on loopback when the cluster is this machine's own, else where the
        # other replicas reach it (the node's address); either way only with the token
        self.direct_host = "127.0.0.1" if not args.ray_address else self.node
        self.server = None

    async def __serve_build_asgi_app__(self):
        from .app import build_app

        from .cli import add_middleware, load_middleware

        self.server = build_app(self.llm, self.config)
        add_middleware(self.server, load_middleware(self.middleware))      # --middleware, as one server's
        self.front = ReplicaApp(self.server, self.id, self.federated_metrics, self.broadcast, self.peers, self.token)
        registry = self.server.state.service.metrics.registry
        # where the direct port is: the metrics are the endpoint's (GET /metrics), not the whole network's
        server, _ = start_http_server(0, addr=self.direct_host, registry=registry)
        self.metrics_url = f"http://{self.direct_host}:{server.server_port}/metrics"
        log.info("replica %s: its own metrics at %s", self.id, self.metrics_url)
        self.direct_url = _serve_direct(self.server, self.direct_host, self.token, self.drain)
        if self.board is not None:
            _, draining, adapters, paused = await self.board.register.remote(self.id, self.metrics_url,
                                                                             self.direct_url)
            self.front.draining = draining
            await self._load_adapters(adapters)
            if paused and not draining:
                self._follow_pause(True)
        return self.front

    async def peers(self) -> dict[str, str]:
        """The other live replicas' direct URLs."""
        directs = await self.board.directs.remote() if self.board is not None else {}
        return {r: u for r, u in directs.items() if r != self.id}

    async def rejoin(self) -> None:
        """On the board again, if a scrape or a broadcast took this replica off while it lived (the
        board cannot tell a dead replica from one whose reply was lost): then it drains if the
        server does, pauses or resumes as the service did, and loads the runtime adapters loaded
        meanwhile (off the health check's time). A replica on the board pauses at a check-in too
        if it is not paused while the service is (a /pause broadcast that started before it
        registered did not reach it)."""
        try:
            known, draining, adapters, paused = await self.board.register.remote(self.id, self.metrics_url,
                                                                                 self.direct_url)
        except Exception as e:      # noqa: BLE001 - no board to tell (it restarts): the next check tries again
            log.warning("replica %s: could not check in with the board: %s", self.id, e)
            return
        if draining and not self.front.draining:
            self.drain()
        elif not draining and (paused or not known):
            self._follow_pause(paused)
        if known:
            return
        log.info("replica %s: back on the board", self.id)
        loaded = {card["id"] for card in self.server.state.service.adapters.cards()}
        missed = {name: path for name, path in adapters.items() if name not in loaded}
        if missed:
            self.catch_up = asyncio.ensure_future(self._load_adapters(missed))

    async def _load_adapters(self, adapters: dict[str, str]) -> None:
        """The adapters the other replicas loaded at runtime (this one replaces a replica, or
        joins an autoscaled deployment); the engine's worker has not started: they load here."""
        for name, path in adapters.items():
            try:
                await self.server.state.service.adapters.load(name, path)
            except APIError as e:       # the replica serves without it, as the log says
                log.warning("replica %s: LoRA adapter %s (%s) not loaded: %s", self.id, name, path, e)

    def _follow_pause(self, paused: bool) -> None:
        """Pause (mode keep: nothing of this replica's is aborted) or resume as the service did."""
        worker = self.server.state.service.worker
        if worker.paused == paused:
            return
        log.info("replica %s: %s, as the service is", self.id, "paused" if paused else "resumed")
        if not paused:
            worker.resume()
            return
        try:
            worker.pause("keep", False)
        except Exception as e:      # noqa: BLE001 - shutting down: it drains instead
            log.warning("replica %s: could not pause: %s", self.id, e)

    def drain(self) -> int:
        """The board's drain (from the driver, on SIGTERM): new requests get 503 -> those in
        flight; a paused engine resumes, as one server's SIGTERM does, or they never finish."""
        self.server.state.service.worker.unpause_for_shutdown()
        return self.front.drain()

    async def check_health(self) -> None:
        """Ray Serve's health check: the app's own /health (the engine worker runs, a TP
        group has not stopped); a failure gets the replica replaced. Ray calls it every few
        seconds while the replica lives: a healthy one checks in with the board (rejoin)."""
        self.llm.check_health()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.server), base_url="http://replica") as c:
            r = await c.get("/health")
        if r.status_code != 200:
            raise RuntimeError(f"replica {self.id} is unhealthy: {r.text}")
        if self.board is not None:
            await self.rejoin()

    async def federated_metrics(self) -> bytes:
        """Every live replica's metrics, labelled: those that answer within 2 s. One whose port
        refuses the connection is gone (its process died) and leaves the board; a slow or failed
        answer leaves its replica out of this scrape only."""
        own = self.server.state.service.metrics.render().decode()
        urls = await self.board.all.remote() if self.board is not None else {}
        texts = {self.id: own}
        async with httpx.AsyncClient(timeout=2.0) as client:
            others = [(r, u) for r, u in urls.items() if r != self.id]
            replies = await asyncio.gather(*(client.get(u) for _, u in others), return_exceptions=True)
        for (replica, _), reply in zip(others, replies):
            if isinstance(reply, httpx.Response) and reply.status_code == 200:
                texts[replica] = reply.text
            elif isinstance(reply, httpx.ConnectError):
                await self.board.drop.remote(replica)
        return merge(texts)

    async def broadcast(self, method: str, path: str, query: bytes, headers: list, body: bytes) -> tuple[int, bytes]:
        """A control request sent to every live replica (this one through its app, the others to
        their direct ports) at once -> the combined (status, JSON body)."""
        directs = await self.board.directs.remote() if self.board is not None else {}
        # the board knows the service pauses before any replica does (a replica that registers
        # meanwhile pauses at its next check-in), and that it resumes before any replica resumes
        # (none is paused again by a check-in); a /pause that failed is undone there
        before = None
        if path in PAUSE_PATHS and method == "POST" and self.board is not None and _pause_mode(query) in PAUSE_MODES:
            before = await self.board.set_paused.remote(path == "/pause")
        status, answer, gone = await broadcast(self.server, self.id, directs, method, path, query, headers, body,
                                               self.token)
        if before is not None and path == "/pause" and status != 200:
            await self.board.set_paused.remote(before)
        for replica in gone:                 # Ray replaces it; it is off the board (a live one checks in again)
            await self.board.drop.remote(replica)
        if path in LORA_PATHS and self.board is not None:
            await self._remember_adapter(path, status, body)
        return status, answer

    async def _remember_adapter(self, path: str, status: int, body: bytes) -> None:
        """A runtime adapter every replica loaded, or one unloaded (a 404: some replica had not
        got it), kept on the board for the replicas Ray starts later."""
        load = path == "/v1/load_lora_adapter"
        if not (status == 200 or (status == 404 and not load)):
            return
        try:
            request = json.loads(body)
            name, where = request["lora_name"], request["lora_path"] if load else None
        except (ValueError, KeyError, TypeError):        # not a request the routes took
            return
        await self.board.adapter.remote(name, where)


async def broadcast(own_app, own_id: str, directs: dict[str, str], method: str, path: str, query: bytes,
                    headers: list, body: bytes, token: str | None = None) -> tuple[int, bytes, list[str]]:
    """One control request to this replica's app and to every other replica's direct URL (with
    the deployment's token) at once -> (status, JSON body) combined, and the replicas that did
    not answer."""
    send = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers
            if k.lower() in (b"content-type", b"authorization")}
    url = path + ("?" + query.decode("latin-1") if query else "")

    async def one(client):
        return await client.request(method, url, headers=send, content=body)
    own = httpx.AsyncClient(transport=httpx.ASGITransport(app=own_app), base_url="http://replica", timeout=None)
    theirs = {TOKEN_HEADER: token} if token else {}
    others = {r: httpx.AsyncClient(base_url=u, timeout=None, headers=theirs) for r, u in directs.items() if r != own_id}
    try:
        replies = await asyncio.gather(one(own), *(one(c) for c in others.values()), return_exceptions=True)
    finally:
        await asyncio.gather(own.aclose(), *(c.aclose() for c in others.values()))
    answers, gone = {}, []
    for replica, reply in zip([own_id, *others], replies):
        if isinstance(reply, httpx.TransportError):
            gone.append(replica)
            continue
        if isinstance(reply, BaseException):
            raise reply
        answers[replica] = reply
    return *combine(path, query, answers), gone


def _pause_mode(query: bytes) -> str:
    """/pause's mode (vLLM's default abort); /resume has none."""
    return parse_qs(query.decode("latin-1")).get("mode", ["abort"])[-1]


def combine(path: str, query: bytes, answers: dict) -> tuple[int, bytes]:
    """Every replica's answer to one control request -> one answer (the module's docstring). A
    failure names its replica, the others that failed and those where the request succeeded."""
    failed = [replica for replica, r in answers.items() if r.status_code != 200]
    if failed:
        r = answers[failed[0]]
        done = [replica for replica in answers if replica not in failed]
        note = "".join([f"; failed on replica {', '.join(failed[1:])} too" if failed[1:] else "",
                        f"; done on replica {', '.join(done)}" if done else ""])
        try:
            err = r.json()
            err["error"]["message"] = f"replica {failed[0]}: {err['error']['message']}{note}"
            return r.status_code, json.dumps(err).encode()
        except (ValueError, KeyError, TypeError):
            return r.status_code, r.content
    if path not in ("/is_paused", "/is_sleeping", "/get_world_size", "/collective_rpc"):
        return 200, next(iter(answers.values())).content        # the first answer (a LoRA one is plain text)
    bodies = [r.json() for r in answers.values()]
    if path in ("/is_paused", "/is_sleeping"):
        key = path[1:]
        return 200, json.dumps({key: all(b[key] for b in bodies)}).encode()
    if path == "/get_world_size":
        one_only = b"include_dp=false" in query.lower()
        sizes = [b["world_size"] for b in bodies]
        return 200, json.dumps({"world_size": sizes[0] if one_only else sum(sizes)}).encode()
    return 200, json.dumps({"results": [x for b in bodies for x in b["results"]]}).encode()


TOKEN_HEADER = "x-specdec-replica-token"
PAUSE_PATHS = ("/pause", "/resume")
DRAIN_PATH = "/specdec/drain"
HOLDS_PATH = "/specdec/holds"       # on a replica's direct port only: whether it stores a response       # on a replica's direct port only: the board's drain


class RequireToken:
    """ASGI middleware of a replica's direct port: a 403 unless the request carries the
    deployment's token (only the other replicas know it), so the port serves nobody else."""

    def __init__(self, app, token: str):
        self.app, self.token = app, token.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(TOKEN_HEADER.encode(), b"")
            if not secrets.compare_digest(given, self.token):
                body = json.dumps(error_body(403, "a replica's direct port answers only the other replicas")).encode()
                await send({"type": "http.response.start", "status": 403,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def direct_app(app, drain=None):
    """A replica's app as its direct port serves it: DRAIN_PATH (POST: drain() -> {"in_flight":
    its answer}) and HOLDS_PATH/<id> ({"held": whether it stores that response}) answered here,
    everything else by the app."""
    async def direct(scope, receive, send):
        internal = None
        if scope["type"] == "http" and scope["path"] == DRAIN_PATH and drain is not None:
            internal = {"in_flight": drain()}
        elif scope["type"] == "http" and scope["path"].startswith(HOLDS_PATH + "/"):
            internal = {"held": _holds(app, unquote(scope["path"][len(HOLDS_PATH) + 1:]))}
        if internal is None:
            return await app(scope, receive, send)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(internal).encode()})
    return direct


def _serve_direct(app, host: str, token: str | None, drain=None) -> str:
    """The app on a port of its own (uvicorn in a daemon thread, no lifespan: the replica's app
    runs it), behind the deployment's token -> its URL, for the control requests other replicas
    send it (direct_app)."""
    import socket
    import threading

    import uvicorn

    sock = socket.socket()
    sock.bind((host, 0))
    direct = direct_app(app, drain)
    guarded = RequireToken(direct, token) if token else direct
    server = uvicorn.Server(uvicorn.Config(guarded, lifespan="off", log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="specdec-direct").start()
    return f"http://{host}:{sock.getsockname()[1]}"


class ReplicaApp:
    """The server's app with GET /metrics answered for the whole deployment, control routes
    broadcast, a stored response found on the replica that holds it, every response marked with
    the replica that served it, and the requests in flight counted (drain).

    peers: async () -> {replica id: direct URL} of the other replicas (their apps behind the
    deployment's token); None: stored responses are this app's alone."""

    def __init__(self, app, replica: str, metrics, broadcast=None, peers=None, token: str | None = None):
        self.app, self.replica, self.metrics, self.broadcast = app, replica.encode(), metrics, broadcast
        self.peers, self.token = peers, token
        self.draining, self.in_flight = False, 0

    def add_exception_handler(self, *args, **kw):      # Ray Serve installs its own handlers
        self.app.add_exception_handler(*args, **kw)

    def drain(self) -> int:
        """From now on every request is answered 503 -> the requests still in flight."""
        self.draining = True
        return self.in_flight

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.draining:
            body = json.dumps(error_body(503, "the server is shutting down")).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (REPLICA_HEADER, self.replica)]})
            await send({"type": "http.response.body", "body": body})
            return None
        self.in_flight += 1
        try:
            return await self._serve(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _serve(self, scope, receive, send):
        if scope["path"] in CONTROL_PATHS and self.broadcast is not None:
            body = await _read_body(receive)
            if body is None:
                return None                     # the client left
            status, answer = await self.broadcast(scope["method"], scope["path"], scope.get("query_string", b""),
                                                  scope["headers"], body)
            # a LoRA update's success is vLLM's plain text; everything else is JSON
            kind = b"text/plain; charset=utf-8" if status == 200 and scope["path"] in LORA_PATHS else b"application/json"
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", kind), (REPLICA_HEADER, self.replica)]})
            await send({"type": "http.response.body", "body": answer})
            return None
        if scope["path"] == "/metrics" and scope["method"] == "GET":
            body = await self.metrics()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode()), (REPLICA_HEADER, self.replica)]})
            await send({"type": "http.response.body", "body": body})
            return None
        if self.peers is not None and scope["path"].startswith("/v1/responses"):
            return await self._responses(scope, receive, send)
        return await self.app(scope, receive, _marked(send, self.replica))

    async def _responses(self, scope, receive, send):
        """A Responses request naming a stored response (in its path, or previous_response_id):
        answered here, unless this replica does not hold it ("response_not_found") and another
        does: then that one answers it."""
        rid, body, given = None, b"", receive
        found = _RESPONSE_PATH.fullmatch(scope["path"])
        if found:
            rid = found[1]
        elif scope["path"] == "/v1/responses" and scope["method"] == "POST":
            body = await _read_body(receive)
            if body is None:
                return None                     # the client left
            rid, receive = _previous_id(body), _replay(body, receive)
        holder = None
        if rid is not None and not _holds(self.app, rid):
            holder = await find_holder(await self.peers(), rid, self.token)
        if holder is None:           # this replica's, or nobody's (this one's 404)
            return await self.app(scope, receive, _marked(send, self.replica))
        replica, url = holder
        return await forward(url, scope, body, given, _marked(send, replica.encode()), self.token)


def _marked(send, replica: bytes):
    async def marked(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, replica)]}
        await send(message)
    return marked


async def _read_body(receive) -> bytes | None:
    """A request's whole body (None: the client left first)."""
    body, more = b"", True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body


def _replay(body: bytes, receive):
    """An ASGI receive giving a body already read, then what `receive` gives (the disconnect)."""
    given = [False]

    async def again():
        if given[0]:
            return await receive()
        given[0] = True
        return {"type": "http.request", "body": body, "more_body": False}
    return again


_RESPONSE_PATH = re.compile(r"/v1/responses/([^/]+)(?:/input_items|/cancel)?")
# not passed on when a request goes to another replica (httpx and uvicorn set their own)
_HOP = frozenset({b"host", b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"upgrade",
                  b"te", b"trailer", b"date", b"server", TOKEN_HEADER.encode()})


def _previous_id(body: bytes) -> str | None:
    """A POST /v1/responses body's previous_response_id (None: none, or not a request body)."""
    if b"previous_response_id" not in body:             # most requests: not parsed twice
        return None
    try:
        rid = json.loads(body).get("previous_response_id")
    except (ValueError, AttributeError):
        return None
    return rid if isinstance(rid, str) and rid else None


def _holds(app, rid: str) -> bool:
    """Whether this replica's app stores response rid."""
    store = getattr(app.state, "responses", None)
    return store is not None and rid in store


async def find_holder(peers: dict[str, str], rid: str, token: str | None) -> tuple[str, str] | None:
    """The replica (id, direct URL) among peers that holds stored response rid, asked at once on
    their direct ports (HOLDS_PATH: a look in the store, which no API metric counts; the request
    itself then goes with the client's credentials); None: none does."""
    send = {TOKEN_HEADER: token} if token else {}

    async def holds(client, url: str) -> bool:
        r = await client.get(f"{url}{HOLDS_PATH}/{quote(rid, safe='')}")
        return r.status_code == 200 and r.json().get("held") is True
    async with httpx.AsyncClient(timeout=10, headers=send) as client:
        found = await asyncio.gather(*(holds(client, u) for u in peers.values()), return_exceptions=True)
    return next(((r, u) for (r, u), yes in zip(peers.items(), found) if yes is True), None)


async def forward(url: str, scope, body: bytes, receive, send, token: str | None = None) -> None:
    """The request of `scope` (its body already read) sent to the app at url (another replica's
    direct port), its answer passed on as it comes; a client that leaves closes that request
    (the other replica aborts its work, as for its own clients)."""
    headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
    if token:
        headers.append((TOKEN_HEADER.encode(), token.encode()))
    query = scope.get("query_string", b"").decode("latin-1")
    target = url + quote(scope["path"]) + ("?" + query if query else "")
    started = False

    async def relay():
        nonlocal started
        async with httpx.AsyncClient(timeout=None) as client, \
                client.stream(scope["method"], target, headers=headers, content=body) as r:
            await send({"type": "http.response.start", "status": r.status_code,
                        "headers": [(k, v) for k, v in r.headers.raw if k.lower() not in _HOP - {b"content-length"}]})
            started = True
            async for chunk in r.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def left():
        while (await receive())["type"] != "http.disconnect":
            pass
    work, gone = asyncio.ensure_future(relay()), asyncio.ensure_future(left())
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            task.cancel()
        await asyncio.gather(work, gone, return_exceptions=True)
    if work.cancelled() or work.exception() is None:
        return
    if not isinstance(work.exception(), httpx.TransportError):
        raise work.exception()
    if started:          # the holder died mid-answer: the answer ends there
        await send({"type": "http.response.body", "body": b""})
        return
    message = f"the replica holding this response stopped ({type(work.exception()).__name__}); retry the request"
    await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(error_body(503, message)).encode()})


def application(argv: list[str]) -> Application:
    """The Ray Serve application of a `specdec serve` command line (its replica flags decide
    the deployment's options; every replica parses the rest)."""
    from .cli import parse_args, server_config

    args, _ = parse_args(argv)
    server_config(args)                    # bad settings and models fail here, before any replica starts
    if getattr(args, "enable_lora", False) and args.tensor_parallel_size > 1:      # LLM()'s refusal, now
        raise ValueError("enable_lora: LoRA adapters are not supported with tensor parallelism")
    check_model(args.model, getattr(args, "hf_config_path", None), getattr(args, "revision", None),
                getattr(args, "download_dir", None), args.tensor_parallel_size)
    opts = deployment_options(args)
    replica = serve.deployment(EngineReplica, name=DEPLOYMENT).options(**opts)
    token = secrets.token_urlsafe(24)
    return replica.bind(absolute_paths(argv, args), MetricsBoard.bind(token), token)


def absolute_paths(argv: list[str], args) -> list[str]:
    """argv for the replicas, with --config read here and every relative path it names (model,
    tokenizer, draft, LoRA adapters, chat template file, TLS and logging files) made absolute: a
    replica runs in the cluster's working directory, not this one (--ray-address). The model keeps
    its name: --served-model-name defaults to the path as given."""
    from .cli import build_parser, expand_argv

    spec = dict(args.speculative_config or {})
    named = [args.model, args.tokenizer, getattr(args, "speculative_model", None), spec.get("model"),
             args.chat_template, args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.log_config_file,
             getattr(args, "hf_config_path", None), getattr(args, "download_dir", None),
             *(m.path for m in getattr(args, "lora_modules", None) or [])]
    if args.generation_config not in ("auto", "vllm"):
        named.append(args.generation_config)
    paths = {p: os.path.abspath(p) for p in named
             if isinstance(p, str) and p and not os.path.isabs(p) and os.path.exists(p)}
    words, flag = [], None
    for word in expand_argv(list(argv), build_parser("specdec serve"), positional_model=True):
        if word.startswith("--"):
            flag = word.partition("=")[0]
        if flag == "--served-model-name" or not paths:      # a name, even one spelled as a path
            words.append(word)
        elif word in paths:
            words.append(paths[word])
        elif word.lstrip().startswith("{"):        # --speculative-config's model, --lora-modules' path
            try:
                obj = json.loads(word)
            except json.JSONDecodeError:
                obj = None
            if isinstance(obj, dict):
                word = json.dumps({k: paths.get(v, v) if k in ("model", "path") and isinstance(v, str) else v
                                   for k, v in obj.items()})
            words.append(word)
        else:                                      # --model=PATH, NAME=PATH
            head, eq, tail = word.partition("=")
            words.append(head + eq + paths[tail] if eq and tail in paths else word)
    if args.model in paths and not args.served_model_name:
        words += ["--served-model-name", args.model]
    return words


def check_model(path: str | None, hf_config_path: str | None = None, revision: str | None = None,
                download_dir: str | None = None, tensor_parallel_size: int = 1) -> None:
    """What can be checked without loading weights: the folder's config.json, or the GGUF's
    header and tensor table (CheckpointError naming the file), against --hf-config-path's
    config.json when given, as the replicas will load it."""
    from ..distributed.launch import ParallelConfig
    from ..llm import _hf_config_path
    from ..model.checkpoint import CheckpointError, read_config
    from ..model.config import ModelConfig
    from ..model.gguf import GGUFError, GGUFFile, check_tensors, find_gguf

    if path is None:
        return
    try:
        found = find_gguf(path)
        if found is not None:
            g = GGUFFile(found)
            folder = _hf_config_path(path, hf_config_path, ParallelConfig(tensor_parallel_size), revision,
                                     download_dir)
            if folder is None:
                check_tensors(g, g.config())
            else:
                check_tensors(g, g.config_from(folder), os.path.join(folder, "config.json"))
        else:
            ModelConfig.from_hf(read_config(path))
    except (GGUFError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}" if str(path) not in str(e) else str(e)) from None


def deployment_options(args) -> dict:
    """--replicas, --autoscale MIN,MAX, --replica-cpus as Ray Serve deployment options. A
    replica decodes up to --max-num-seqs requests at once; more wait in Ray's queue for the
    first replica with a free seat. Autoscaling aims at half that many per replica."""
    tp = args.tensor_parallel_size
    cpus = args.replica_cpus if args.replica_cpus is not None else float(tp)
    opts = {"ray_actor_options": {"num_cpus": cpus, "num_gpus": tp if args.device.startswith("cuda") else 0},
            "max_ongoing_requests": args.max_num_seqs, "health_check_period_s": 5.0, "health_check_timeout_s": 30.0}
    if args.autoscale is None:
        opts["num_replicas"] = args.replicas or 1
        return opts
    lo, hi = args.autoscale
    start = min(max(args.replicas or lo, lo), hi)
    opts["autoscaling_config"] = {"min_replicas": lo, "max_replicas": hi, "initial_replicas": start,
                                  "target_ongoing_requests": max(1, args.max_num_seqs // 2)}
    return opts
