"""vLLM's hot weight reload (LLM.reload_weights, POST /reload_weights) and its RLHF control
routes (POST /pause, /resume, GET /is_paused) with the development routes of
VLLM_SERVER_DEV_MODE (/collective_rpc, /reset_prefix_cache, /sleep ...).

After a reload the engine answers exactly as one loaded from the new checkpoint (Hugging Face
folders and GGUF files, speculation included); a request in flight is recomputed with the new
weights (its continuation is the new model's continuation of what it had written); a paused
server admits nothing until /resume, and an aborted stream ends with finish_reason "abort"."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
import torch

from conftest import copy_tokenizer, make_checkpoint, perturbed_checkpoint
from specdec import LLM, SamplingParams
from specdec.server.app import build_app
from specdec.server.config import ServerConfig
from test_server import LiveServer

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = ["def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x",
           "import os\nimport sys\n"]


def _tokens(llm: LLM, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A target, a draft, and the target's weights perturbed, saved as a second checkpoint."""
    root = tmp_path_factory.mktemp("reload")
    target = make_checkpoint(root / "target", seed=0, layers=2)
    draft = make_checkpoint(root / "draft", seed=1, layers=1, hidden=32, tokenizer_from=target)
    updated = root / "updated"
    hf, _ = perturbed_checkpoint(target, updated)
    other = make_checkpoint(root / "other", seed=2, layers=3, tokenizer_from=target)     # another shape
    return target, draft, updated, hf, other


@pytest.mark.parametrize("spec", [{}, {"speculative_model": "draft", "num_speculative_tokens": 3}])
def test_reload_from_a_folder_equals_the_new_checkpoint_and_back(pair, spec):
    target, draft, updated, _, _ = pair
    spec = {k: str(draft) if v == "draft" else v for k, v in spec.items()}
    llm = LLM(model=str(target), dtype="float32", **spec)
    old = _tokens(llm)                          # fills the prefix cache with the old weights' KV
    llm.reload_weights(str(updated))
    new = _tokens(LLM(model=str(updated), dtype="float32"))
    assert _tokens(llm) == new != old
    llm.reload_weights()                        # the model's own path again
    assert _tokens(llm) == old


def test_reload_from_memory_checkpoint_names_and_own_names(pair):
    target, _, updated, hf, _ = pair
    new = _tokens(LLM(model=str(updated), dtype="float32"))
    llm = LLM(model=str(target), dtype="float32")
    old = _tokens(llm)
    llm.reload_weights(state_dict=hf)           # a transformers module: Hugging Face names
    assert _tokens(llm) == new
    fresh = LLM(model=str(target), dtype="float32")
    llm.reload_weights(state_dict={n: p.detach().clone() for n, p in fresh.target.named_parameters()},
                       is_checkpoint_format=False)     # the engine's own (fused) names
    assert _tokens(llm) == old
    with pytest.raises(ValueError, match="no 'model.layers.0.self_attn.q_proj.weight'"):
        llm.reload_weights(state_dict=hf.state_dict(), is_checkpoint_format=False)
    with pytest.raises(ValueError, match="not both"):
        llm.reload_weights(str(updated), state_dict=hf)


def test_another_model_is_refused_before_anything_is_written(pair):
    target, _, _, _, other = pair
    llm = LLM(model=str(target), dtype="float32")
    before = {n: p.detach().clone() for n, p in llm.target.named_parameters()}
    with pytest.raises(ValueError, match="differs from the engine's"):
        llm.reload_weights(str(other))
    with pytest.raises(ValueError, match="does not exist"):
        llm.reload_weights(str(target / "nowhere"))
    assert all(torch.equal(p, before[n]) for n, p in llm.target.named_parameters())


def test_reload_a_gguf_in_place(gguf_files, tmp_path):
    """Packed GGUF matrices (the kernels' panels) are written in place too."""
    from gguf_helpers import T, write_gguf

    hf = gguf_files["llama_q_hf"]
    perturbed = make_checkpoint(tmp_path / "hf", seed=11, hidden=256, layers=2, tokenizer_from=hf,
                                tie_word_embeddings=True)
    kinds = {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q4_K, "attn_output": T.Q4_0, "ffn_gate": T.Q4_1,
             "ffn_up": T.Q4_1, "ffn_down": T.Q8_0, "token_embd": T.Q8_0}
    new_gguf = write_gguf(perturbed, tmp_path / "new" / "model.gguf",
                          lambda name, ndim: next((v for k, v in kinds.items() if f".{k}." in name
                                                   or name.startswith(k + ".")), T.F32))
    llm = LLM(model=str(gguf_files["llama_q"]))
    old = _tokens(llm)
    llm.reload_weights(str(new_gguf))
    assert _tokens(llm) == _tokens(LLM(model=str(new_gguf))) != old
    with pytest.raises(ValueError, match="differs from the engine's"):
        llm.reload_weights(str(gguf_files["llama_mixed"]))      # other quantization types
    llm.reload_weights()
    assert _tokens(llm) == old


def test_a_request_in_flight_is_recomputed_with_the_new_weights(pair):
    """reset_running_requests (vLLM's default): the output so far stays, the rest is what the new
    model writes after it (the request's KV recomputed, none of the old weights' read again)."""
    target, draft, updated, _, _ = pair
    llm = LLM(model=str(target), dtype="float32", speculative_model=str(draft), num_speculative_tokens=3)
    prompt = llm.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm.engine.add_request(prompt, params, request_id="r")
    out, swapped = [], False
    while llm.engine.has_unfinished():
        for ev in llm.engine.step():
            out += ev.token_ids
        if not swapped and len(out) >= 6:
            written, swapped = list(out), True
            llm.reload_weights(str(updated))
            assert llm.engine.num_running == 0 and llm.engine.num_waiting == 1      # preempted
    fresh = LLM(model=str(updated), dtype="float32")
    rest = fresh.generate({"prompt_token_ids": prompt + written},
                          SamplingParams(max_tokens=24 - len(written), temperature=0, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert out == written + list(rest)


# ---- the server ----

@pytest.fixture()
def live(pair):
    target, draft, _, _, _ = pair
    llm = LLM(model=str(target), dtype="float32", speculative_model=str(draft), num_speculative_tokens=3)
    app = build_app(llm, ServerConfig(served_model_names=("tiny",), dev_mode=True))
    with LiveServer(app) as server:
        server.llm = llm
        server.worker = app.state.service.worker
        yield server


def _until(condition, what: str, timeout: float = 60) -> None:
    """Poll condition() until it holds (a generous deadline: a loaded machine is slow, not wrong)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _complete(url: str, prompt: str, max_tokens: int = 16) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_pause_abort_ends_streams_and_holds_new_requests_until_resume(live):
    http = httpx.Client(base_url=live.url, timeout=60)
    aclient = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    assert http.get("/is_paused").json() == {"is_paused": False}

    async def stream_then_pause():
        chunks, paused = [], None
        async for ch in await aclient.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=150,
                                                         temperature=0, stream=True, extra_body={"ignore_eos": True}):
            chunks.append(ch)
            if len(chunks) == 3:
                paused = asyncio.create_task(asyncio.to_thread(http.post, "/pause", params={"mode": "abort"}))
        return chunks, await paused

    chunks, r = asyncio.run(stream_then_pause())
    assert r.status_code == 200 and r.json() == {"status": "paused"}
    assert chunks[-1].choices[0].finish_reason == "abort" and len(chunks) < 150
    assert http.get("/is_paused").json() == {"is_paused": True}
    # a request sent while paused waits; /resume lets it run
    result = {}
    waiter = threading.Thread(target=lambda: result.update(_complete(live.url, PROMPTS[1])))
    waiter.start()
    _until(lambda: live.worker.num_waiting == 1, "the request to reach the paused engine's queue")
    time.sleep(0.3)                          # arrived: it stays queued, nothing runs
    assert waiter.is_alive() and live.llm.engine.num_running == 0 and live.worker.num_waiting == 1
    assert http.post("/resume").json() == {"status": "resumed"}
    waiter.join(30)
    assert result["finish_reason"] == "length" and http.get("/is_paused").json() == {"is_paused": False}
    assert http.get("/health").status_code == 200
    r = http.post("/pause", params={"mode": "later"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"


def test_pause_keep_freezes_and_wait_drains(live):
    http = httpx.Client(base_url=live.url, timeout=60)
    # 150 tokens (the context holds 256): on a loaded machine the request must still run when /pause arrives
    solo = _complete(live.url, PROMPTS[0], 150)["text"]
    result = {}
    runner = threading.Thread(target=lambda: result.update(_complete(live.url, PROMPTS[0], 150)))
    runner.start()
    while live.llm.engine.num_running == 0:
        time.sleep(0.005)
    assert http.post("/pause", params={"mode": "keep"}).status_code == 200
    time.sleep(0.3)
    assert runner.is_alive() and live.llm.engine.num_running == 1          # frozen, not aborted
    http.post("/resume")
    runner.join(30)
    assert result["text"] == solo and result["finish_reason"] == "length"  # resumed where it was
    # wait: the request in flight finishes first, then the server is paused
    runner = threading.Thread(target=lambda: result.update(_complete(live.url, PROMPTS[1], 64)))
    runner.start()
    while live.llm.engine.num_running == 0:
        time.sleep(0.005)
    r = http.post("/pause", params={"mode": "wait"})
    assert r.status_code == 200 and live.llm.engine.num_running == 0 and not live.llm.engine.has_unfinished()
    runner.join(5)
    assert result["finish_reason"] == "length" and http.get("/is_paused").json()["is_paused"]
    http.post("/resume")


def test_reload_weights_over_http_equals_the_new_checkpoint(live, pair):
    _, _, updated, _, other = pair
    http = httpx.Client(base_url=live.url, timeout=60)
    old = [_complete(live.url, p)["text"] for p in PROMPTS]
    r = http.post("/reload_weights", json={"weights_path": str(updated)})
    assert r.status_code == 200, r.text
    fresh = LLM(model=str(updated), dtype="float32")
    want = [o.outputs[0].text for o in fresh.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert [_complete(live.url, p)["text"] for p in PROMPTS] == want != old
    r = http.post("/reload_weights", json={"weights_path": str(other)})
    assert r.status_code == 400 and "differs from the engine's" in r.json()["error"]["message"]
    r = http.post("/reload_weights", json={"weights_path": "/nowhere"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "weights_path"
    assert http.post("/reload_weights", json={}).status_code == 200     # the model's own path
    assert [_complete(live.url, p)["text"] for p in PROMPTS] == old


def test_dev_routes(live, pair):
    http = httpx.Client(base_url=live.url, timeout=60)
    r = http.post("/collective_rpc", json={"method": "load_weights", "args": [[]]})
    assert r.status_code == 200 and r.json() == {"results": ["set()"]}
    r = http.post("/collective_rpc", json={"method": "no_such_method"})
    assert r.status_code == 400 and "no method 'no_such_method'" in r.json()["error"]["message"]
    _complete(live.url, PROMPTS[0])
    assert http.post("/reset_prefix_cache").status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    r = http.post("/sleep")
    assert r.status_code == 400 and "sleep mode" in r.json()["error"]["message"]
    assert http.get("/get_world_size").json() == {"world_size": 1}


def test_dev_routes_need_dev_mode(pair):
    target = pair[0]
    app = build_app(LLM(model=str(target), dtype="float32"), ServerConfig(served_model_names=("tiny",)))
    with LiveServer(app) as server:
        http = httpx.Client(base_url=server.url, timeout=30)
        assert http.post("/reload_weights", json={}).status_code == 404
        assert http.post("/collective_rpc", json={"method": "x"}).status_code == 404
        assert http.get("/is_paused").json() == {"is_paused": False}      # the RLHF routes are always there


# ---- regressions found by a tester ----

def test_no_stale_kv_after_a_reload_that_keeps_running_requests(pair):
    """reset_running_requests=False: the request in flight goes on over its old KV, but the blocks
    it fills afterwards never become findable: a later prompt computes its own with the new weights."""
    target, _, updated, _, _ = pair
    llm = LLM(model=str(target), dtype="float32", enable_prefix_caching=True)
    prompt = llm.tokenizer.encode(PROMPTS[0])[:20]
    llm.engine.add_request(prompt, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True), request_id="A")
    out = []
    while len(out) < 10:
        for ev in llm.engine.step():
            out += ev.token_ids
    llm.reload_weights(str(updated), reset_running_requests=False)
    while llm.engine.has_unfinished():
        for ev in llm.engine.step():
            out += ev.token_ids
    q = {"prompt_token_ids": (prompt + out)[:70]}
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = LLM(model=str(updated), dtype="float32").generate(q, params)[0].outputs[0].token_ids
    for _ in range(3):       # the second and third find the first one's blocks: new weights' KV
        assert llm.generate(q, params)[0].outputs[0].token_ids == want


def test_reload_casts_float_weights_and_needs_no_tokenizer(pair, tmp_path):
    """A trainer's float32 save into a bf16 engine, a folder with config.json and weights only."""
    import transformers

    target, _, _, hf, _ = pair
    bare = tmp_path / "bare"
    hf.save_pretrained(bare)                 # float32, no tokenizer files
    half = tmp_path / "bf16"                 # the engine's model, saved in bfloat16: dtype "auto" is bf16
    transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).save_pretrained(half)
    copy_tokenizer(target, half)
    llm = LLM(model=str(half))
    assert llm.target.model.embed_tokens.weight.dtype == torch.bfloat16
    llm.reload_weights(str(bare))
    ref = LLM(model=str(half))
    ref.reload_weights(state_dict=hf)
    assert _tokens(llm) == _tokens(ref)
    with pytest.raises(ValueError, match="weights_path is empty"):
        llm.reload_weights("")


def test_pause_holds_embeddings_and_aborts_beams_and_responses(pair):
    http_timeout = 60
    target, draft, _, _, _ = pair
    # a pooling server: embeddings wait while paused
    app = build_app(LLM(model=str(target), dtype="float32", runner="pooling"), ServerConfig(served_model_names=("e",)))
    worker = app.state.service.worker
    with LiveServer(app) as server:
        http = httpx.Client(base_url=server.url, timeout=http_timeout)
        assert http.post("/pause", params={"mode": "keep"}).status_code == 200
        got = {}
        t = threading.Thread(target=lambda: got.update(r=http.post("/v1/embeddings", json={"model": "e", "input": "hi"})))
        t.start()
        # the embedding's work reached the engine's thread (a call that computes waits while paused) ...
        _until(lambda: any(work for _, _, work in list(worker._calls)), "the embedding to reach the worker")
        time.sleep(0.3)
        assert t.is_alive() and any(work for _, _, work in list(worker._calls))      # ... and is held there
        http.post("/resume")
        t.join(30)
        assert got["r"].status_code == 200
    # beam search and the Responses API cut by an aborting pause
    llm = LLM(model=str(target), dtype="float32")
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))) as server:
        http = httpx.Client(base_url=server.url, timeout=http_timeout)
        got = {}
        jobs = {"beam": ("/v1/completions", {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 150, "n": 3,
                                             "use_beam_search": True, "temperature": 0, "ignore_eos": True}),
                "resp": ("/v1/responses", {"model": "tiny", "input": PROMPTS[1], "max_output_tokens": 200,
                                           "temperature": 0})}
        for key, (path, body) in jobs.items():        # one at a time: each is running when the pause comes
            t = threading.Thread(target=lambda k=key, u=path, b=body: got.update({k: http.post(u, json=b)}))
            t.start()
            while llm.engine.num_running == 0:
                time.sleep(0.002)
            assert http.post("/pause", params={"mode": "keep"}).status_code == 200     # frozen where it is,
            assert http.post("/pause", params={"mode": "abort"}).status_code == 200    # then aborted
            t.join(30)
            http.post("/resume")
        beam = got["beam"].json()
        # the beams so far: as many as it had when the pause came (one before its first step ended)
        assert got["beam"].status_code == 200 and 1 <= len(beam["choices"]) <= 3
        assert {c["finish_reason"] for c in beam["choices"]} == {"abort"}
        resp = got["resp"].json()
        assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "abort"}


def test_calls_while_paused_step_nothing(live):
    """keep freezes: a control call served while paused (which wakes the engine's thread) must not
    move the frozen request one step forward."""
    http = httpx.Client(base_url=live.url, timeout=60)
    got = {}
    t = threading.Thread(target=lambda: got.update(r=_complete(live.url, PROMPTS[0], 150)))
    t.start()
    while live.llm.engine.num_running == 0:
        time.sleep(0.002)
    assert http.post("/pause", params={"mode": "keep"}).status_code == 200
    # a step under way when the pause came ends: a call runs on the engine's thread only between steps
    live.worker.call(lambda engine: None).result(timeout=60)
    (req,) = live.llm.engine.scheduler.running
    before = len(req.out)
    try:
        for _ in range(5):
            assert http.post("/collective_rpc", json={"method": "load_weights", "args": [[]]}).status_code == 200
            assert http.post("/reset_prefix_cache", params={"reset_running_requests": False}).status_code in (200, 409)
        assert len(req.out) == before
    finally:
        http.post("/resume")
    t.join(30)
    assert got["r"]["finish_reason"] == "length"


def test_collective_rpc_bad_arguments_are_a_400(live):
    http = httpx.Client(base_url=live.url, timeout=60)
    r = http.post("/collective_rpc", json={"method": "load_weights", "args": [1, 2, 3]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "args"
    r = http.post("/reload_weights", json={"weights_path": ""})
    assert r.status_code == 400 and "empty" in r.json()["error"]["message"]


def test_replicas_send_control_routes_to_every_replica(pair):
    """With --replicas, a control request reaching one replica acts on every one (vLLM's API server
    on its data-parallel engines): two real apps, one behind its own port as a direct URL."""
    pytest.importorskip("ray")
    from specdec.server.replicas import TOKEN_HEADER, ReplicaApp, RequireToken, broadcast

    async def metrics():
        return b""

    llms = [LLM(model=str(pair[0]), dtype="float32") for _ in range(2)]
    apps = [build_app(llm, ServerConfig(dev_mode=True)) for llm in llms]
    # each replica's direct port answers only requests with the deployment's token
    with LiveServer(RequireToken(apps[0], "tok")) as a, LiveServer(RequireToken(apps[1], "tok")) as b:
        assert httpx.post(b.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 403
        assert httpx.get(b.url + "/is_paused", headers={TOKEN_HEADER: "nope"}).status_code == 403
        directs = {"a": a.url, "b": b.url, "gone": "http://127.0.0.1:9"}
        dropped = []

        async def fan_out(*request):
            status, body, gone = await broadcast(apps[0], "a", directs, *request, "tok")
            dropped.extend(gone)
            return status, body
        front = ReplicaApp(apps[0], "a", metrics, fan_out)

        async def main():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front), base_url="http://x",
                                         timeout=60) as c:
                out = {"pause": await c.post("/pause", params={"mode": "keep"}), "paused": await c.get("/is_paused"),
                       "each": [llm.engine.owner.paused for llm in llms],
                       "size": await c.get("/get_world_size"),
                       "one": await c.get("/get_world_size", params={"include_dp": "false"}),
                       "resume": await c.post("/resume"), "resumed": await c.get("/is_paused"),
                       "rpc": await c.post("/collective_rpc", json={"method": "get_model"}),
                       "bad": await c.post("/reload_weights", json={"weights_path": "/nonexistent"})}
                return out
        out = asyncio.run(main())
    assert out["pause"].status_code == 200 and out["pause"].json() == {"status": "paused"}
    assert out["paused"].json() == {"is_paused": True} and out["each"] == [True, True]
    assert out["size"].json() == {"world_size": 2} and out["one"].json() == {"world_size": 1}
    assert out["resume"].status_code == 200 and out["resumed"].json() == {"is_paused": False}
    results = out["rpc"].json()["results"]          # each replica's model (its repr), in turn
    assert out["rpc"].status_code == 200 and len(results) == 2 and all("Transformer" in r for r in results)
    assert out["bad"].status_code == 400 and out["bad"].json()["error"]["message"].startswith("replica a: ")
    assert out["bad"].headers["x-specdec-replica"] == "a"
    assert set(dropped) == {"gone"}


def test_sigterm_while_paused_drains_and_exits(pair, tmp_path):
    """A paused engine holds requests that uvicorn waits for before shutting down: SIGTERM resumes it."""
    import signal
    import subprocess
    import sys

    from serve_helpers import wait_listening

    target = pair[0]
    log = open(tmp_path / "server.log", "w")
    # --port 0: the port the server holds from the start, read from its log (no race for a free one)
    proc = subprocess.Popen([sys.executable, "-m", "specdec", "serve", "--model", str(target), "--port", "0",
                             "--served-model-name", "tiny", "--enable-server-load-tracking"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        url = wait_listening(proc, tmp_path / "server.log", timeout=120)
        assert httpx.post(url + "/pause", params={"mode": "keep"}).status_code == 200
        got = {}
        held = threading.Thread(target=lambda: got.update(r=httpx.post(
            url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 5}, timeout=60)))
        held.start()
        # GET /load counts the requests in flight: the held one has reached the server before SIGTERM
        _until(lambda: httpx.get(url + "/load", timeout=10).json()["server_load"] == 1, "the request to arrive")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)       # uvicorn raises the signal again once drained
        held.join(10)
        assert got["r"].status_code == 200 and got["r"].json()["choices"][0]["finish_reason"] == "length"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
