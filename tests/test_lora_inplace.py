"""vLLM's LoRARequest(load_inplace=True) and /v1/load_lora_adapter's "load_inplace": the folder
of an id already loaded is read again, and new requests run its new weights, with no prefix-cache
block of the old ones (they had kept the old weights offline, and the server answered 400);
requests already running finish with the weights they started with. vLLM's --lora-dtype
float16 is taken: float32 slots on the CPU, whose forward reads no float16 (it was refused)."""

from __future__ import annotations

import logging
import shutil

import httpx
import openai
import pytest
import torch

from specdec import LLM
from specdec.lora import LoRARequest
from specdec.server import ServerConfig, build_app
from specdec.server.cli import build_llm, parse_args
from specdec.server.lora import LoRAModulePath

pytest.importorskip("peft")
from test_lora import GREEDY, IDS, make_adapter  # noqa: E402 - needs peft
from test_server import LiveServer  # noqa: E402

PROMPT = {"prompt_token_ids": IDS + IDS[:5]}       # whole 4-token blocks for the prefix cache


def engine_llm(target, **kw) -> LLM:
    return LLM(str(target), dtype="float32", num_speculative_tokens=0, enable_lora=True, max_loras=1,
               enable_prefix_caching=True, block_size=4, **kw)


@pytest.fixture(scope="module")
def folders(tiny_pair, tmp_path_factory):
    """Two adapters of the tiny target, and each one's greedy output (ids, text) from an engine of its own."""
    target, _ = tiny_pair
    root = tmp_path_factory.mktemp("inplace")
    found = {"a": make_adapter(target, root / "a", 21), "b": make_adapter(target, root / "b", 22)}
    expected = {}
    for name, folder in found.items():
        out = engine_llm(target).generate(PROMPT, GREEDY, lora_request=LoRARequest(name, 1, str(folder)))[0].outputs[0]
        expected[name] = (out.token_ids, out.text)
    assert expected["a"] != expected["b"]
    return found, expected


def put(src, dst) -> None:
    """The adapter at src written over the folder dst (a training loop pushing new weights)."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)


def test_load_inplace_reads_the_folder_again(tiny_pair, folders, tmp_path, monkeypatch):
    (target, _), (src, expected) = tiny_pair, folders
    llm = engine_llm(target)
    w = str(tmp_path / "w")

    def run(lora, prompts=PROMPT):
        return llm.generate(prompts, GREEDY, lora_request=lora)

    put(src["a"], w)
    assert run(LoRARequest("w", 1, w))[0].outputs[0].token_ids == expected["a"][0]
    put(src["b"], w)
    assert run(LoRARequest("w", 1, w))[0].outputs[0].token_ids == expected["a"][0]   # loaded once per id, as vLLM's
    out = run(LoRARequest("w", 1, w, load_inplace=True))[0]
    assert out.outputs[0].token_ids == expected["b"][0] and out.num_cached_tokens == 0   # no block of the old weights
    assert run(LoRARequest("w", 1, w))[0].outputs[0].token_ids == expected["b"][0]   # the id holds them now
    # the same request again after another rewrite: read again
    again = LoRARequest("w", 1, w, load_inplace=True)
    assert run(again)[0].outputs[0].token_ids == expected["b"][0]
    put(src["a"], w)
    assert run(again)[0].outputs[0].token_ids == expected["a"][0]
    # folder untouched: one generate() reads it once, and the same weights keep their cached blocks
    import specdec.lora as lora_module

    reads = []
    real = lora_module.load_adapter
    monkeypatch.setattr(lora_module, "load_adapter", lambda *a, **k: reads.append(a[1]) or real(*a, **k))
    outs = run(LoRARequest("w", 1, w, load_inplace=True), [PROMPT] * 3)
    assert reads == [w] and all(o.outputs[0].token_ids == expected["a"][0] for o in outs)
    assert outs[0].num_cached_tokens > 0
    # a folder that does not load any more: the request is refused, the loaded weights stay
    (tmp_path / "w" / "adapter_config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        run(LoRARequest("w", 1, w, load_inplace=True))
    assert run(LoRARequest("w", 1, w))[0].outputs[0].token_ids == expected["a"][0]


def test_running_requests_finish_with_their_weights(tiny_pair, folders, tmp_path):
    """vLLM rewrites the slot under running requests; here each request runs one set of
    weights from its first token to its last (the new ones wait for a slot: max_loras=1)."""
    (target, _), (src, expected) = tiny_pair, folders
    engine = engine_llm(target).engine
    w = str(tmp_path / "w")
    put(src["a"], w)
    old = engine.add_request(PROMPT["prompt_token_ids"], GREEDY, request_id="old", lora_request=LoRARequest("w", 1, w))
    engine.step()
    engine.step()
    put(src["b"], w)
    new = engine.add_request(PROMPT["prompt_token_ids"], GREEDY, request_id="new",
                             lora_request=LoRARequest("w", 1, w, load_inplace=True))
    while engine.has_unfinished():
        engine.step()
    assert (old.out[:16], new.out[:16]) == (expected["a"][0], expected["b"][0])


def test_server_load_inplace_replaces_the_named_adapter(tiny_pair, folders, tmp_path):
    (target, _), (src, expected) = tiny_pair, folders
    w = tmp_path / "w"
    put(src["a"], w)
    config = ServerConfig(served_model_names=("tiny",), allow_runtime_lora_updating=True,
                          lora_modules=(LoRAModulePath("w", str(w)),))
    with LiveServer(build_app(engine_llm(target), config)) as live:
        http = httpx.Client(base_url=live.url, timeout=60)
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def load(name, path, **kw):
            return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **kw})

        def text(model):
            return client.completions.create(model=model, prompt=PROMPT["prompt_token_ids"], max_tokens=16,
                                             temperature=0, extra_body={"ignore_eos": True}).choices[0].text

        assert text("w") == expected["a"][1]
        r = load("w", w)
        assert r.status_code == 400 and "has already been loaded" in r.json()["error"]["message"]
        assert "load_inplace" in r.json()["error"]["message"]
        put(src["b"], w)                                  # new weights in the same folder
        r = load("w", w, load_inplace=True)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'w' added successfully."
        assert text("w") == text("w") == expected["b"][1]
        r = load("w", src["a"], load_inplace=True)        # another folder under the name
        assert r.status_code == 200 and text("w") == expected["a"][1]
        cards = [m for m in http.get("/v1/models").json()["data"] if m["id"] == "w"]
        assert [(m["root"], m["parent"]) for m in cards] == [(str(src["a"]), "tiny")]
        (tmp_path / "empty").mkdir()
        r = load("w", tmp_path / "empty", load_inplace=True)   # refused: the adapter it had stays
        assert r.status_code == 400 and "no adapter_config.json" in r.json()["error"]["message"]
        assert text("w") == expected["a"][1]
        r = load("new", src["b"], load_inplace=True)       # a name not served yet: added (vLLM's)
        assert r.status_code == 200 and text("new") == expected["b"][1]
        http.close()


def test_lora_dtype_float16(tiny_pair, folders, caplog):
    """vLLM's values are auto, float16 and bfloat16: float16 is taken; on the CPU the slots are
    float32 (every float16 value exactly), with one warning, and the output is float32's."""
    (target, _), (src, expected) = tiny_pair, folders
    args, _ = parse_args(["m", "--enable-lora", "--lora-dtype", "float16"])
    args.model, args.num_speculative_tokens, args.dtype = str(target), 0, "float32"
    with caplog.at_level(logging.WARNING, logger="specdec.lora"):
        lora = build_llm(args).engine.lora
    assert lora.config.lora_dtype == "float16" and lora.stack.mats[0]["qkv"].a.dtype == torch.float32
    assert [r.getMessage() for r in caplog.records if r.name == "specdec.lora"] == [
        "lora_dtype float16: the CPU forward reads float32 or bfloat16 LoRA weights; using float32"]
    llm = engine_llm(target, lora_dtype="float16")
    assert llm.engine.lora.stack.dtype == torch.float32
    out = llm.generate(PROMPT, GREEDY, lora_request=LoRARequest("a", 1, str(src["a"])))[0].outputs[0]
    assert out.token_ids == expected["a"][0]


def test_a_request_routed_before_a_move_runs_on_the_new_weights(tiny_pair, folders, tmp_path):
    """An in-place load from another folder while requests are routed: one that still names the
    id's old folder reaches the engine after the load and runs on the id's new weights (vLLM
    looks adapters up by id); it had been refused ("lora_int_id 1 is already adapter ...")."""
    (target, _), (src, expected) = tiny_pair, folders
    engine = engine_llm(target).engine
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    put(src["a"], first)
    put(src["b"], second)
    routed = LoRARequest("w", 1, first)
    a = engine.add_request(PROMPT["prompt_token_ids"], GREEDY, request_id="a", lora_request=routed)
    b = engine.add_request(PROMPT["prompt_token_ids"], GREEDY, request_id="b",
                           lora_request=LoRARequest("w", 1, second, load_inplace=True))
    late = engine.add_request(PROMPT["prompt_token_ids"], GREEDY, request_id="late", lora_request=routed)
    while engine.has_unfinished():
        engine.step()
    assert (a.out[:16], b.out[:16], late.out[:16]) == (expected["a"][0], expected["b"][0], expected["b"][0])
    with pytest.raises(ValueError, match="already adapter"):       # another name on the id stays refused
        engine.add_request(PROMPT["prompt_token_ids"], GREEDY, request_id="x", lora_request=LoRARequest("v", 1, first))
