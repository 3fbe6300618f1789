"""What one client can do to everyone else on a shared server (a tester's abuse report, #1-#2):
the Responses store is bounded in bytes as well as in count and holds OpenAI's metadata limits,
and preparing a big request (tokenizing, the chat template, tools, a grammar) runs off the event
loop, so other users' streams keep flowing while it is prepared."""

from __future__ import annotations

import functools
import gc
import json
import random
import threading
import time
import tracemalloc

import httpx
import pytest

from specdec import LLM
from specdec.defaults import BUNDLED_TARGET
from specdec.server import ServerConfig, build_app
from specdec.server.responses_api import ResponseStore

from test_server import LiveServer

MiB = 2**20


@pytest.fixture(scope="module")
def live():
    llm = LLM(BUNDLED_TARGET, max_model_len=1024, max_num_seqs=4)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("toy",)))) as server:
        yield server


# --- 1. the Responses store ---------------------------------------------------------------------

def _respond(live, **fields) -> httpx.Response:
    return httpx.post(live.url + "/v1/responses", json={"model": "toy", "input": "hi", "max_output_tokens": 2,
                                                        **fields}, timeout=60)


@pytest.mark.parametrize("metadata, param", [
    ({f"k{i}": "v" for i in range(17)}, "metadata"),           # at most 16 pairs
    ({"k" * 65: "v"}, "metadata"),                              # keys of at most 64 characters
    ({"note": "v" * 513}, "metadata.note"),                     # values of at most 512 characters
    ({"count": 3}, "metadata.count"),                           # values are strings
    ({"deep": {"a": "b"}}, "metadata.deep"),
])
def test_metadata_past_openais_limits_is_a_400_naming_the_field(live, metadata, param):
    r = _respond(live, metadata=metadata)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_metadata_at_openais_limits_is_kept(live):
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    r = _respond(live, metadata=metadata)
    assert r.status_code == 200, r.text
    stored = httpx.get(f"{live.url}/v1/responses/{r.json()['id']}", timeout=60)
    assert stored.status_code == 200 and stored.json() == r.json()
    assert stored.json()["metadata"] == metadata


def test_a_stored_response_reads_back_as_answered(live):
    first = _respond(live, input="Say something.", instructions="Be brief.", reasoning={"effort": "low"})
    assert first.status_code == 200, first.text
    assert httpx.get(f"{live.url}/v1/responses/{first.json()['id']}", timeout=60).json() == first.json()
    second = _respond(live, input="And again.", previous_response_id=first.json()["id"])
    assert second.status_code == 200, second.text


def _body(tag: str, size: int) -> dict:
    return {"id": tag, "output": [], "user": "x" * size}


def test_store_is_bounded_by_bytes_oldest_first():
    one = len(json.dumps(_body("r0", 1000), separators=(",", ":"))) + len(b"[]")
    store = ResponseStore(max_items=100, max_bytes=3 * one + 10)
    for i in range(5):
        store.put(f"r{i}", [], _body(f"r{i}", 1000))
        assert store.bytes <= store.max_bytes
    for gone in ("r0", "r1"):
        with pytest.raises(Exception) as e:
            store.get(gone)
        assert e.value.status == 404
    assert [json.loads(store.get(f"r{i}")[1])["id"] for i in (2, 3, 4)] == ["r2", "r3", "r4"]
    store.delete("r3")
    assert store.bytes == 2 * one
    store.put("big", [], _body("big", 10 * one))        # larger than the whole budget: not kept
    assert store.bytes <= store.max_bytes
    assert store.get("r4")[1] and "big" not in store._items


def test_store_default_budget_and_count():
    store = ResponseStore()
    assert (store.max_items, store.max_bytes) == (1024, 256 * MiB)


def test_store_holds_about_the_json_size_in_memory():
    """A response echoes its request's fields (reasoning, text, tools...): ~1 MiB of small keys
    took ~8 MiB as Python objects. The store keeps the JSON."""
    store = ResponseStore()
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        body = {"id": "r", "output": [], "reasoning": {f"k{i}": i for i in range(70_000)}}
        size = len(json.dumps(body, separators=(",", ":")))
        store.put("r", [{"role": "user", "content": "hi"}], body)
        del body
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert size < store.bytes < size + 1000
    assert held < 1.5 * size, f"the store holds {held / MiB:.1f} MiB for {size / MiB:.1f} MiB of JSON"


# --- 2. preparation off the event loop ------------------------------------------------------------

@functools.lru_cache(1)
def _words() -> str:
    return "".join(random.Random(0).choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(1_000_000))


def _heavy(case: str) -> tuple[str, bytes, int]:
    """(path, body, the status it gets): ~1 MB requests whose cost is all preparation (the
    prompts that do not fit the context are refused before the engine sees them)."""
    words = _words()
    turns = [{"role": "user", "content": "hi"}] * 30_000
    path, body, status = {
        "tokenize 1 MB": ("/tokenize", {"prompt": words}, 200),         # no API key needed on a real server
        "completion 1 MB": ("/v1/completions", {"model": "toy", "prompt": words, "max_tokens": 1}, 400),
        "chat 30000 messages": ("/v1/chat/completions", {"model": "toy", "messages": turns, "max_tokens": 1}, 400),
        "responses 30000 items": ("/v1/responses", {"model": "toy", "input": turns, "max_output_tokens": 1}, 400),
    }[case]
    return path, json.dumps(body, separators=(",", ":")).encode(), status


def _read_stream(url: str, times: list[float], stop: threading.Event) -> None:
    body = {"model": "toy", "prompt": "hello", "max_tokens": 1000, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=120) as client, client.stream("POST", url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                times.append(time.perf_counter())
            if stop.is_set():
                return          # leaving closes the stream: the server cancels it


@pytest.mark.parametrize("case", ["tokenize 1 MB", "completion 1 MB", "chat 30000 messages", "responses 30000 items"])
def test_a_stream_keeps_flowing_while_a_big_request_is_prepared(live, case):
    """The victim's longest pause between chunks while the heavy request is in flight stays far
    below that request's time (it was about all of it: the loop was busy preparing)."""
    path, raw, status = _heavy(case)
    times: list[float] = []
    stop = threading.Event()
    reader = threading.Thread(target=_read_stream, args=(live.url, times, stop), daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while len(times) < 20:
        assert time.monotonic() < deadline and reader.is_alive(), "the stream did not start"
        time.sleep(0.01)
    t0 = time.perf_counter()
    r = httpx.post(live.url + path, content=raw, headers={"content-type": "application/json"}, timeout=120)
    t1 = time.perf_counter()
    time.sleep(0.05)
    stop.set()
    reader.join(60)
    assert r.status_code == status, r.text[:300]
    assert times[-1] > t1, "the stream ended before the heavy request did (make it longer)"
    gaps = [b - a for a, b in zip(times, times[1:]) if b > t0 and a < t1]
    assert max(gaps) < (t1 - t0) / 2, f"a {max(gaps):.3f} s pause in a stream during a {t1 - t0:.3f} s request"
