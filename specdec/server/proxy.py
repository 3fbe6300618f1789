"""An ASGI middleware for Ray Serve's HTTP proxy: a request whose replica dies ends with an
OpenAI-style error instead of a bare 500 or a stream cut mid-body.

When a replica's process dies, Ray Serve's proxy ends the request without a response (the
client would get uvicorn's plain "Internal Server Error") or, for a response already streaming,
stops sending (the client sees a truncated chunked body). This middleware watches what the
proxy sends and finishes the exchange instead: a 503 with `{"error": {...}}` when nothing was
sent yet, or a last server-sent event `data: {"error": {...}}` and then `data: [DONE]` on a
stream, as one server's streams end (the openai client raises the error as an APIError). Ray
Serve replaces the replica meanwhile; a retry is answered by another one.

`specdec serve --replicas` installs it; with `serve run specdec.serve:app`, set
RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=specdec.server.proxy:middlewares.
"""

from __future__ import annotations

import json
import logging

log = logging.getLogger("specdec.server")

MESSAGE = ("the replica serving this request stopped before finishing it (Ray Serve is replacing it); "
           "retry the request")


def _error(status: int) -> dict:
    return {"error": {"message": MESSAGE, "type": "ServiceUnavailableError", "param": None, "code": status}}


class ReplicaLost:
    """ASGI middleware (see the module docstring)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "done": False, "stream": False}

        async def watch(message):
            if message["type"] == "http.response.start":
                state["started"] = True
                headers = dict(message.get("headers") or [])
                state["stream"] = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception:                 # the proxy's own failure: answered below all the same
            log.exception("request failed in the proxy")
        if not state["done"]:
            try:
                await self._finish(send, state)
            except Exception:             # the client has gone too
                pass
        return None

    @staticmethod
    async def _finish(send, state: dict) -> None:
        if not state["started"]:
            body = json.dumps(_error(503)).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
        elif state["stream"]:
            event = b"data: " + json.dumps(_error(503)).encode() + b"\n\ndata: [DONE]\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": False})
        else:                            # a JSON body cut short cannot be mended: end it
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def middlewares() -> list:
    """For RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH (Ray Serve calls it in the proxy)."""
    from starlette.middleware import Middleware

    return [Middleware(ReplicaLost)]
