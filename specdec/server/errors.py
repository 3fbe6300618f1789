"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every way a request can go wrong ends here, so clients (and the official openai package, which
reads these fields) see one shape: FastAPI's 422 validation answers become 400, unknown routes
404, oversized bodies 413, and an unexpected exception 500 without taking the server down.
"""

from __future__ import annotations

import logging
import hashlib
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..config import SamplingParams

log = logging.getLogger("specdec.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def clipped(text: str, limit: int = 100) -> str:
    """A client's name, path or key as an error message echoes it: its first `limit` characters."""
    return text if len(text) <= limit else text[:limit] + "..."


def bad_value(e: ValueError, default_param: str | None = None) -> APIError:
    """A ValueError from SamplingParams or the engine; its message starts with the field's name."""
    msg = str(e).splitlines()[0] if str(e) else "invalid request"
    first = msg.split(" ", 1)[0]
    param = first if first in SamplingParams.__dataclass_fields__ else default_param
    return APIError(400, msg, param)


def install_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's body (metrics.RequestCounter counts the answers by their status)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error_response(400, *_describe(exc.errors()))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail), None, None, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        # Starlette raises the error again after this answer and uvicorn then closes the
        # connection: say so, or a client's pool sends its next request down a closed socket
        headers = {"Connection": "close"}
        if getattr(request.state, "echo_request_id", False):
            headers["X-Request-Id"] = request.state.request_id
        return error_response(500, f"internal error: {type(exc).__name__}", headers=headers)


def _describe(errors) -> tuple[str, str | None]:
    """FastAPI's list of validation errors -> one message and the top-level field it is about."""
    if not errors:
        return "invalid request body", None
    err = errors[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    if not loc and err.get("type") == "value_error":      # a whole-body check (protocol._Body's)
        message = str(err.get("ctx", {}).get("error", err.get("msg")))
        return message, message.split(" ", 1)[0].split(".", 1)[0].split("[", 1)[0] or None
    if not loc:
        return "request body must be a JSON object, sent with Content-Type: application/json", None
    return f"{'.'.join(loc)}: {err.get('msg', 'invalid value')}", loc[0]


class ApiKeyGuard:
    """ASGI middleware: 401 for /v1/*, /invocations (SageMaker's route to them) and `paths` (the
    control routes that change the server's state) unless the request carries `Authorization:
    Bearer <key>`.

    Checked before the body is read or parsed, so a client without the key learns nothing else
    (not even that its JSON was malformed). /health, /version and /metrics stay open, as in vLLM.
    """

    # vLLM's guarded prefixes (/v2/rerank runs the model as /v1/rerank does), and /invocations
    GUARDED = ("/v1", "/v2", "/inference", "/invocations")

    def __init__(self, app, key: str | tuple[str, ...], paths: frozenset[str] = frozenset()):
        keys = (key,) if isinstance(key, str) else tuple(key)
        self.app, self.expected = app, tuple(hashlib.sha256(k.encode()).digest() for k in keys)
        self.paths = paths

    async def __call__(self, scope, receive, send):
        path = app_path(scope) if scope["type"] == "http" else ""
        if (path.startswith(self.GUARDED) or path in self.paths) and not self._allowed(scope):
            response = error_response(401, "missing or incorrect API key (send 'Authorization: Bearer <key>')",
                                      None, "invalid_api_key", {"www-authenticate": "Bearer"})
            return await response(scope, receive, send)
        await self.app(scope, receive, send)

    def _allowed(self, scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, given = header.partition(b" ")
        # compare_digest over every key (vLLM's --api-key k1 k2: any of them): the answer time must
        # not reveal how much of a key was right, nor which one
        given = hashlib.sha256(given.strip()).digest()       # hashed first, as vLLM's: nor its length
        matches = [secrets.compare_digest(given, k) for k in self.expected]
        return scheme.lower() == b"bearer" and any(matches)


def app_path(scope) -> str:
    """The request's path within the app: uvicorn's --root-path (a proxy's prefix) stays in
    scope["path"], so /api/v1/models is /v1/models here (as vLLM strips it before its key check)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class BodyLimit:
    """ASGI middleware: refuse request bodies over `max_bytes` with 413 before anything parses them.

    The body is read here (at most max_bytes are held) and replayed to the app; later receive()
    calls go straight through, so the app still sees the client's disconnect.
    """

    # Before answering 413 the rest of the body is read and dropped (up to this many times the
    # limit): closing a socket with unread data resets it, and the client would see a reset
    # instead of the answer.
    DRAIN_FACTOR = 16

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return              # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send, size, more)
        buffered = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return buffered.pop() if buffered else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send, size: int, more: bool):
        while more and size <= self.DRAIN_FACTOR * self.max_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        response = error_response(413, f"request body is larger than {self.max_bytes} bytes")
        if more:
            response.headers["connection"] = "close"
        await response(scope, receive, send)
