"""Scale-out fixes (review 63), `--replicas` on Ray Serve: a replica slow to answer one /metrics
scrape stays on the board (only a replica whose port refuses connections leaves it), and a live
replica taken off checks in again at its next health check, catching up on the drain and the
runtime adapters; the Responses API's stored responses are found whichever replica a follow-up
reaches (GET, input_items, previous_response_id, a background response's live status, cancel,
its stream, DELETE).

The tests here take seconds (real apps on 127.0.0.1, the board's own class); the end-to-end one
on Ray Serve is in tests/test_replicas.py, on that module's cluster."""

from __future__ import annotations

import asyncio
import json
import socket
import types

import httpx
import openai
import pytest

pytest.importorskip("ray.serve")

from specdec import LLM  # noqa: E402
from specdec.server import ServerConfig, build_app  # noqa: E402
from specdec.server.replicas import (TOKEN_HEADER, EngineReplica, MetricsBoard, ReplicaApp, RequireToken,  # noqa: E402
                                      direct_app)

from test_replicas import _replicas_in  # noqa: E402
from test_server import LiveServer  # noqa: E402

TOKEN = {TOKEN_HEADER: "tok"}


class _Handle:
    """The board's class behind Ray's handle shape: board.method.remote(...) awaited."""

    def __init__(self, board):
        self.board = board

    def __getattr__(self, name):
        method = getattr(self.board, name)

        async def remote(*args):
            out = method(*args)
            return await out if asyncio.iscoroutine(out) else out
        return types.SimpleNamespace(remote=remote)


class _Replica:
    """EngineReplica's own methods on a plain object (Ray's ingress class expects its actor)."""
    federated_metrics, check_health, rejoin = EngineReplica.federated_metrics, EngineReplica.check_health, EngineReplica.rejoin
    drain, broadcast, peers, _load_adapters = (EngineReplica.drain, EngineReplica.broadcast, EngineReplica.peers,
                                               EngineReplica._load_adapters)
    _follow_pause = EngineReplica._follow_pause


def _board() -> tuple:
    board = MetricsBoard.func_or_class("tok")
    return board, _Handle(board)


def _live_replica(llm) -> tuple:
    """A board and replica "me" serving llm's app (its ports made up: nothing dials them)."""
    board, handle = _board()
    me = _Replica()
    me.id, me.board, me.llm, me.token = "me", handle, llm, "tok"
    me.server = build_app(llm, ServerConfig(served_model_names=("tiny",)))
    me.front = ReplicaApp(me.server, "me", me.federated_metrics, me.broadcast)
    me.metrics_url, me.direct_url = "http://127.0.0.1:1/metrics", "http://127.0.0.1:1"
    return board, me




# --- 1. the board keeps a replica slow to answer a scrape; a live one taken off comes back --------

def test_a_slow_or_failing_scrape_leaves_its_replica_out_of_that_scrape_only():
    slow = [True]

    async def metrics_app(scope, receive, send):       # a replica's metrics port, busy a while
        if slow[0]:
            await asyncio.sleep(2.5)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"# TYPE x counter\nx_total 1.0\n"})

    async def failing_app(scope, receive, send):
        await send({"type": "http.response.start", "status": 500, "headers": []})
        await send({"type": "http.response.body", "body": b"oops"})

    with socket.socket() as s:          # a port nothing listens on: a replica whose process is gone
        s.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{s.getsockname()[1]}"
    board, handle = _board()
    me = _Replica()
    me.id, me.board = "me", handle
    me.server = types.SimpleNamespace(state=types.SimpleNamespace(service=types.SimpleNamespace(
        metrics=types.SimpleNamespace(render=lambda: b"# TYPE x counter\nx_total 2.0\n"))))
    with LiveServer(metrics_app) as busy, LiveServer(failing_app) as failing:
        for replica, url in (("me", "http://unused"), ("busy", busy.url), ("failing", failing.url), ("gone", gone)):
            board.register(replica, url + "/metrics", url)
        first = asyncio.run(me.federated_metrics()).decode()
        after_first = set(board.all())
        slow[0] = False
        second = asyncio.run(me.federated_metrics()).decode()
    assert _replicas_in(first) == {"me"}
    assert after_first == {"me", "busy", "failing"} and set(board.directs()) == after_first
    assert _replicas_in(second) == {"me", "busy"}


@pytest.fixture(scope="module")
def two_apps(tiny_pair):
    llms = [LLM(str(tiny_pair[0]), num_speculative_tokens=0, max_model_len=256) for _ in range(2)]
    config = ServerConfig(served_model_names=("tiny",))
    yield [build_app(llm, config) for llm in llms]
    for llm in llms:
        llm.shutdown()


def test_a_live_replica_taken_off_the_board_checks_in_again_and_catches_up(tiny_pair, two_apps, tmp_path):
    """Taken off (a lost reply), the replica registers again at Ray's next health check: later
    scrapes, broadcasts and the drain reach it; it drains if the server does meanwhile, and loads
    the runtime adapters the others loaded meanwhile."""
    pytest.importorskip("peft")
    from test_lora import make_adapter

    adapter = make_adapter(tiny_pair[0], tmp_path / "three", 3)
    llm = LLM(str(tiny_pair[0]), num_speculative_tokens=0, max_model_len=128, enable_lora=True)
    board, me = _live_replica(llm)
    with LiveServer(me.server):          # its lifespan runs the engine, as in the replica
        board.register("me", me.metrics_url, me.direct_url)
        asyncio.run(me.check_health())              # on the board: nothing to catch up
        assert set(board.all()) == {"me"} and not me.front.draining and not hasattr(me, "catch_up")
        board.drop("me")
        board.adapter("three", str(adapter))        # meanwhile: the others loaded an adapter, SIGTERM came
        board.draining = True

        async def check():
            await me.check_health()
            assert board.all() == {"me": me.metrics_url} and board.directs() == {"me": me.direct_url}
            assert me.front.draining
            await me.catch_up
        asyncio.run(check())
        assert [card["id"] for card in me.server.state.service.adapters.cards()] == ["three"]
    llm.shutdown()


def test_a_replica_that_missed_a_pause_or_a_resume_follows_the_service(tiny_pair):
    """The board keeps whether the service is paused: a replica on the board that is not paused
    while the service is (it registered while the /pause went out) pauses at its next check-in, and
    one taken off the board meanwhile resumes if it missed the /resume; a /pause refused (a bad
    mode) leaves the service unpaused."""
    llm = LLM(str(tiny_pair[0]), num_speculative_tokens=0, max_model_len=128)
    board, me = _live_replica(llm)
    worker = me.server.state.service.worker
    with LiveServer(me.front) as front:     # its lifespan is the app's: the engine runs
        board.register("me", me.metrics_url, me.direct_url)
        assert httpx.post(front.url + "/pause", params={"mode": "bogus"}, timeout=30).status_code == 400
        assert not board.paused and not worker.paused
        board.paused = True                     # a /pause that went out before "me" registered
        asyncio.run(me.check_health())
        assert worker.paused
        done = []

        def ask():
            done.append(httpx.post(front.url + "/v1/completions", timeout=60,
                                   json={"model": "tiny", "prompt": "hi", "max_tokens": 2}).status_code)
        import threading
        t = threading.Thread(target=ask)
        t.start()
        t.join(1.0)
        assert done == []                       # it waits, as on the replicas the /pause reached
        assert httpx.post(front.url + "/resume", timeout=30).status_code == 200
        t.join(60)
        assert done == [200] and not board.paused and not worker.paused
        asyncio.run(me.check_health())          # on the board and not paused: nothing changes
        assert not worker.paused

        assert httpx.post(front.url + "/pause", params={"mode": "keep"}, timeout=30).status_code == 200
        assert board.paused and worker.paused
        board.drop("me")                        # taken off; meanwhile the service resumed without it
        board.paused = False
        asyncio.run(me.check_health())
        assert not worker.paused and set(board.all()) == {"me"}
    llm.shutdown()


# --- 2. a stored response is found on the replica that holds it ---------------------------------

def test_a_stored_response_is_found_whichever_replica_gets_the_follow_up(two_apps):
    """Replica a (the one reached, through the official client) and replica b (behind its direct
    port) : what b stores is read, continued, listed, cancelled, streamed again and deleted
    through a, and a's own answers stay a's."""
    a, b = two_apps

    async def metrics():
        return b""

    def invalid(app) -> float:          # specdec:requests_total{outcome="invalid"}
        for line in app.state.service.metrics.render().decode().splitlines():
            if line.startswith("specdec:requests_total{") and 'outcome="invalid"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0
    before = invalid(a), invalid(b)

    with LiveServer(RequireToken(direct_app(b), "tok")) as direct_b:
        async def peers():
            return {"b": direct_b.url}
        with LiveServer(ReplicaApp(a, "a", metrics, None, peers, "tok")) as front:
            client = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0, timeout=60)
            on_b = httpx.Client(base_url=direct_b.url, headers=TOKEN, timeout=60)
            kw = {"model": "tiny", "max_output_tokens": 4, "temperature": 0}
            first = on_b.post("/v1/responses", json={**kw, "input": "hello"}).json()

            got = client.responses.with_raw_response.retrieve(first["id"])
            assert got.headers["x-specdec-replica"] == "b" and got.http_response.json() == first
            items = client.responses.input_items.list(first["id"])
            assert [i.content[0].text for i in items.data] == ["hello"]

            follow = client.responses.with_raw_response.create(input="more", previous_response_id=first["id"], **kw)
            second = follow.parse()
            assert follow.headers["x-specdec-replica"] == "b" and second.status in ("completed", "incomplete")
            assert on_b.get(f"/v1/responses/{second.id}").status_code == 200        # the chain stays on b
            own = client.responses.with_raw_response.create(input="mine", **kw)
            assert own.headers["x-specdec-replica"] == "a"
            assert client.responses.with_raw_response.retrieve(own.parse().id).headers["x-specdec-replica"] == "a"

            # a background response queued on b (its engine paused): its live status, cancelled through a
            assert on_b.post("/pause?mode=keep").status_code == 200
            queued = on_b.post("/v1/responses", json={**kw, "input": "later", "background": True}).json()
            assert client.responses.retrieve(queued["id"]).status == "queued"
            assert client.responses.cancel(queued["id"]).status == "cancelled"
            assert on_b.get(f"/v1/responses/{queued['id']}").json()["status"] == "cancelled"
            assert on_b.post("/resume").status_code == 200

            # a streamed background response's events, read again through a
            events = [e for e in on_b.post("/v1/responses", json={**kw, "input": "s", "background": True,
                                                                   "stream": True}).text.split("\n\n") if e]
            rid = json.loads(events[0].split("data: ", 1)[1])["response"]["id"]
            again = httpx.get(f"{front.url}/v1/responses/{rid}", params={"stream": "true", "starting_after": 1},
                              timeout=60)
            assert again.headers["content-type"].startswith("text/event-stream")
            assert [e for e in again.text.split("\n\n") if e] == events[2:]

            deleted = httpx.delete(f"{front.url}/v1/responses/{first['id']}", timeout=60)
            assert deleted.json() == {"id": first["id"], "object": "response", "deleted": True}
            assert on_b.get(f"/v1/responses/{first['id']}").status_code == 404
            with pytest.raises(openai.NotFoundError) as e:
                client.responses.retrieve(first["id"])
            assert e.value.response.headers["x-specdec-replica"] == "a"
            assert e.value.body["code"] == "response_not_found"
            with pytest.raises(openai.NotFoundError):
                client.responses.create(input="x", previous_response_id="resp_nowhere", **kw)
            # the metrics count what the clients got: two 404s on a, one on b (looking for the
            # holder and passing a follow-up on count nothing: they had counted 9 on a, 3 on b)
            assert (invalid(a) - before[0], invalid(b) - before[1]) == (2, 1)
            on_b.close()
