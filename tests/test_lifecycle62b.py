"""Engine death and its neighbours (tester regress62): every control route of a dead engine is a 503
with the reason, a persistent fault on the decode path (or the drafter) kills the engine though each
request's first steps pass, a request failing past its first token on its own does not, and
run-batch's -o through a dangling symlink writes the link's target or fails before the model loads."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_server import LiveServer

from specdec import LLM
from specdec.cli import main
from specdec.defaults import BUNDLED_DRAFT, BUNDLED_TARGET
from specdec.server import ServerConfig, build_app

BODY = {"model": "toy", "prompt": "def f(x):", "max_tokens": 5}


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _completion_status(client) -> int:
    try:
        client.completions.create(model="toy", prompt=BODY["prompt"], max_tokens=BODY["max_tokens"])
    except openai.APIStatusError as e:
        return e.status_code
    return 200


def test_every_control_route_of_a_dead_engine_is_503_with_the_reason(monkeypatch):
    llm = LLM(BUNDLED_TARGET, num_speculative_tokens=0, max_model_len=128)
    real = llm.engine.step

    def step():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(llm.engine, "step", step)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("toy",), dev_mode=True))) as server:
        client = _client(server)
        assert [_completion_status(client) for _ in range(2)] == [500, 500]      # two failures, the probe too
        assert httpx.get(server.url + "/health").status_code == 503
        monkeypatch.setattr(llm.engine, "step", real)                            # dead stays dead
        for path, body in (("/collective_rpc", {"method": "echo"}), ("/reload_weights", {}),
                           ("/reset_prefix_cache", None), ("/resume", None), ("/pause", None)):
            r = httpx.post(server.url + path, json=body, timeout=60)
            assert r.status_code == 503, (path, r.text)
            message = r.json()["error"]["message"]
            assert "the engine is dead" in message and "illegal memory access" in message, (path, message)
        assert _completion_status(client) == 503


def _past_first_token(engine) -> bool:
    return any(len(r.seq) > len(r.prompt) for r in engine.scheduler.running)


def test_a_persistent_decode_fault_kills_the_engine(monkeypatch):
    """Every step holding a request past its first token fails (a decode-only CUDA graph that fails
    on every replay): each request's prompt and first token pass, yet the engine dies."""
    llm = LLM(BUNDLED_TARGET, num_speculative_tokens=0, max_model_len=128)
    real = llm.engine.step

    def step():
        if _past_first_token(llm.engine):
            raise RuntimeError("decode graph replay failed")
        return real()

    monkeypatch.setattr(llm.engine, "step", step)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("toy",)))) as server:
        client = _client(server)
        assert [_completion_status(client) for _ in range(2)] == [500, 500]
        r = httpx.get(server.url + "/health")
        assert r.status_code == 503 and "decode graph replay failed" in r.json()["error"]["message"], r.text
        assert _completion_status(client) == 503


def test_a_persistent_drafter_fault_kills_the_engine(monkeypatch):
    """The draft model's device is gone: every step that drafts fails, the prompt's steps pass."""
    llm = LLM(BUNDLED_TARGET, speculative_model=str(BUNDLED_DRAFT), num_speculative_tokens=2, max_model_len=128)

    def propose(asks):
        raise RuntimeError("draft device lost")

    monkeypatch.setattr(llm.engine.proposer, "propose", propose)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("toy",)))) as server:
        client = _client(server)
        assert [_completion_status(client) for _ in range(2)] == [500, 500]
        r = httpx.get(server.url + "/health")
        assert r.status_code == 503 and "draft device lost" in r.json()["error"]["message"], r.text


def test_a_request_failing_past_its_first_token_on_its_own_does_not_kill_the_engine(monkeypatch):
    """A poisoned request fails once it decodes, and the client retries it: the failures add up
    across its retries' passing first steps, yet the probe computes and the server goes on."""
    llm = LLM(BUNDLED_TARGET, num_speculative_tokens=0, max_model_len=128)
    real_add, real_step, real_abort, poisoned = llm.engine.add_request, llm.engine.step, llm.engine.abort, {}

    def add(prompt, *a, **kw):
        req = real_add(prompt, *a, **kw)
        if 7777 in prompt:
            poisoned[req.request_id] = req
        return req

    def abort(rid):
        poisoned.pop(rid, None)
        return real_abort(rid)

    def step():
        if any(len(r.seq) > len(r.prompt) for r in poisoned.values()):
            raise RuntimeError("a request's own fault")
        return real_step()

    for name, fn in (("add_request", add), ("step", step), ("abort", abort)):
        monkeypatch.setattr(llm.engine, name, fn)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("toy",)))) as server:
        client = _client(server)
        for _ in range(4):                                   # a client and its retries
            with pytest.raises(openai.InternalServerError, match="own fault"):
                client.completions.create(model="toy", prompt=[7777, 9], max_tokens=5)
        assert httpx.get(server.url + "/health").status_code == 200
        assert _completion_status(client) == 200


def _batch_input(tmp_path) -> str:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"model": "m", "prompt": "x", "max_tokens": 2}}) + "\n")
    return str(src)


def test_run_batch_output_through_a_dangling_symlink_creates_its_target(tmp_path):
    link, target = tmp_path / "link.jsonl", tmp_path / "made" / "out.jsonl"
    target.parent.mkdir()
    link.symlink_to(target)
    assert main(["run-batch", "-i", _batch_input(tmp_path), "-o", str(link), "--model", str(BUNDLED_TARGET),
                 "--served-model-name", "m"]) == 0
    assert link.is_symlink() and json.loads(target.read_text())["custom_id"] == "a"


def test_run_batch_output_through_a_dangling_symlink_into_no_folder_fails_before_loading(tmp_path, capsys):
    link = tmp_path / "link.jsonl"
    link.symlink_to(tmp_path / "no-such-folder" / "out.jsonl")
    # the model does not exist: the output's fault is what is reported, before anything loads
    assert main(["run-batch", "-i", _batch_input(tmp_path), "-o", str(link), "--model", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no folder" in err and "no-such-folder" in err, err
