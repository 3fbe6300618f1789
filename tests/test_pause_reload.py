"""vLLM's hot weight reload (LLM.reload_weights, POST /reload_weights) and its RLHF control
routes (POST /pause, /resume, GET /is_paused) with the development routes of
VLLM_SERVER_DEV_MODE (/collective_rpc, /reset_prefix_cache, /sleep ...).

After a reload the engine answers exactly as one loaded from the new checkpoint (Hugging Face
folders and GGUF files, speculation included); a request in flight is recomputed with the new
weights (its continuation is the new model's continuation of what it had written); a paused
server admits nothing until /resume, and an aborted stream ends with finish_reason "abort"."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time

import httpx
import openai
import pytest
import torch

from conftest import make_checkpoint
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
    import transformers

    root = tmp_path_factory.mktemp("reload")
    target = make_checkpoint(root / "target", seed=0, layers=2)
    draft = make_checkpoint(root / "draft", seed=1, layers=1, hidden=32, tokenizer_from=target)
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    hf.load_state_dict({n: (t + 0.05 * torch.randn(t.shape, generator=gen)).to(t.dtype)
                        for n, t in hf.state_dict().items()})
    updated = root / "updated"
    hf.save_pretrained(updated)
    for f in target.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, updated / f.name)
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
        yield server


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
    time.sleep(0.5)
    assert waiter.is_alive() and live.llm.engine.num_running == 0
    assert http.post("/resume").json() == {"status": "resumed"}
    waiter.join(30)
    assert result["finish_reason"] == "length" and http.get("/is_paused").json() == {"is_paused": False}
    assert http.get("/health").status_code == 200
    r = http.post("/pause", params={"mode": "later"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"


def test_pause_keep_freezes_and_wait_drains(live):
    http = httpx.Client(base_url=live.url, timeout=60)
    solo = _complete(live.url, PROMPTS[0], 64)["text"]
    result = {}
    runner = threading.Thread(target=lambda: result.update(_complete(live.url, PROMPTS[0], 64)))
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
