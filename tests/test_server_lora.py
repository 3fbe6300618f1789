"""vLLM-style multi-LoRA serving through the OpenAI-compatible server: adapters written by the
real `peft` package for the tiny target, served by name (--lora-modules), a real uvicorn on a
loopback port and the official openai client. Through the server an adapter's greedy output is
the offline LLM(enable_lora=True)'s; base and adapter requests mixed in one batch each get
their solo output; /v1/models lists the adapters; runtime load and unload (vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING) answer with vLLM's status codes; bad flags fail in one line."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from specdec import LLM, SamplingParams
from specdec.server import ServerConfig, build_app
from specdec.server.cli import build_llm, parse_args, server_config
from specdec.server.lora import LoRAModulePath

pytest.importorskip("peft")
from test_lora import make_adapter  # noqa: E402 - needs peft
from test_server import PROMPTS, LiveServer  # noqa: E402

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
NAMES = ("sql", "code")           # served with lora_int_id 1 and 2, in this order
CHAT = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def adapters(tiny_pair, tmp_path_factory) -> dict[str, Path]:
    target, _ = tiny_pair
    root = tmp_path_factory.mktemp("server_lora")
    return {"sql": make_adapter(target, root / "sql", 1), "code": make_adapter(target, root / "code", 2),
            "rank32": make_adapter(target, root / "rank32", 3, r=32, lora_alpha=32, target_modules=["q_proj"])}


def lora_request(adapters, name: str):
    from specdec.lora import LoRARequest

    return LoRARequest(name, NAMES.index(name) + 1, str(adapters[name]))


@pytest.fixture(scope="module")
def server(tiny_pair, adapters):
    """One server: the base model as "tiny", adapters "sql" and "code", runtime updates on.
    server.solo[(model, prompt)]: the offline greedy text, computed before the worker owns the engine."""
    target, _ = tiny_pair
    llm = LLM(str(target), num_speculative_tokens=0, max_model_len=128, max_num_seqs=8, enable_lora=True, max_loras=2)
    solo = {}
    for model in ("tiny", *NAMES):
        lora = None if model == "tiny" else lora_request(adapters, model)
        for prompt, out in zip(PROMPTS[:3], llm.generate(PROMPTS[:3], GREEDY, lora_request=lora)):
            solo[model, prompt] = out.outputs[0].text
        solo[model, "chat"] = llm.chat(CHAT, GREEDY, lora_request=lora)[0].outputs[0].text
    config = ServerConfig(served_model_names=("tiny",), allow_runtime_lora_updating=True,
                          lora_modules=tuple(LoRAModulePath(n, str(adapters[n])) for n in NAMES))
    with LiveServer(build_app(llm, config)) as live:
        live.solo = solo
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def complete(client, model: str, prompt: str, **kw):
    kw = {"max_tokens": MAX_TOKENS, **kw}
    return client.completions.create(model=model, prompt=prompt, temperature=0, extra_body={"ignore_eos": True}, **kw)


def test_models_lists_the_adapters_after_the_base(server, adapters):
    data = httpx.get(server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["tiny", "sql", "code"]
    assert data[0]["parent"] is None and data[0]["max_model_len"] == 128
    for card in data[1:]:
        assert card["object"] == "model" and card["parent"] == "tiny" and card["root"] == str(adapters[card["id"]])


def test_an_adapter_gives_the_offline_output_and_not_the_base_models(server, client):
    prompt = PROMPTS[0]
    for model in ("tiny", *NAMES):
        r = complete(client, model, prompt)
        assert r.choices[0].text == server.solo[model, prompt]
        assert r.model == model                      # vLLM reports the adapter's name
    assert len({server.solo[m, prompt] for m in ("tiny", *NAMES)}) == 3
    assert complete(client, None, prompt).choices[0].text == server.solo["tiny", prompt]   # no model: the base


def test_chat_and_responses_route_by_model(server, client):
    for model in ("tiny", *NAMES):
        chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body={"ignore_eos": True})
        assert chat.model == model and chat.choices[0].message.content == server.solo[model, "chat"]
    assert server.solo["sql", "chat"] != server.solo["tiny", "chat"]
    # the Responses API has no ignore_eos: it matches the chat endpoint without it
    chat = client.chat.completions.create(model="sql", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    resp = client.responses.create(model="sql", input=CHAT, max_output_tokens=MAX_TOKENS, temperature=0)
    assert resp.model == "sql" and resp.output_text == chat.choices[0].message.content


def test_mixed_concurrent_requests_each_get_their_solo_output(server):
    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
            jobs = [(m, p) for p in PROMPTS[:3] for m in ("tiny", *NAMES)]
            outs = await asyncio.gather(*(c.completions.create(model=m, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                                               extra_body={"ignore_eos": True}) for m, p in jobs))
            return {job: out.choices[0].text for job, out in zip(jobs, outs)}

    assert asyncio.run(run()) == {job: text for job, text in server.solo.items() if job[1] != "chat"}


def test_unknown_model_is_404(client):
    for call in (lambda: complete(client, "nope", "x"),
                 lambda: client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}]),
                 lambda: client.responses.create(model="nope", input="x")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "model_not_found" and "`nope`" in e.value.body["message"]


def lora_info(metrics_text: str) -> tuple[dict, float]:
    line = next(x for x in metrics_text.splitlines() if x.startswith("specdec:lora_requests_info{"))
    return dict(re.findall(r'(\w+)="([^"]*)"', line)), float(line.rsplit(" ", 1)[1])


def test_metrics_name_the_running_and_waiting_adapters(server, tiny_pair, adapters):
    labels, value = lora_info(httpx.get(server.url + "/metrics").text)
    assert labels == {"model_name": "tiny", "max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert value > 1e9                                     # vLLM's value: the time of the sample
    # with one adapter slot, "code" waits while "sql" runs (an engine of its own, stepped by hand)
    from specdec.server.metrics import ServerMetrics

    llm = LLM(str(tiny_pair[0]), num_speculative_tokens=0, max_model_len=64, enable_lora=True, max_loras=1)
    metrics = ServerMetrics(llm.engine)
    for name in ("sql", "sql", "code"):
        llm.engine.add_request([5, 6, 7], GREEDY, lora_request=lora_request(adapters, name))
    llm.engine.add_request([5, 6, 7], GREEDY)
    llm.engine.step()
    labels, _ = lora_info(metrics.render().decode())
    assert labels == {"model_name": "specdec", "max_lora": "1", "running_lora_adapters": "sql",
                      "waiting_lora_adapters": "code"}


def test_runtime_load_and_unload(server, adapters, tmp_path):
    http = httpx.Client(base_url=server.url, timeout=60)
    load = lambda name, path: http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})  # noqa: E731
    r = load("sql2", adapters["sql"])                    # sql's folder under another name (a new id)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql2' added successfully."
    assert [m["id"] for m in http.get("/v1/models").json()["data"]][-1] == "sql2"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert complete(client, "sql2", PROMPTS[0]).choices[0].text == server.solo["sql", PROMPTS[0]]
    # errors: vLLM's codes and messages, in this server's OpenAI error shape
    for name, path, status, message in [("sql2", adapters["sql"], 400, "The lora adapter 'sql2' has already been loaded."),
                                        ("tiny", adapters["sql"], 400, "'tiny' is the name of a served base model"),
                                        ("bad", tmp_path, 400, "no adapter_config.json"),
                                        ("big", adapters["rank32"], 400, "rank"),
                                        ("", adapters["sql"], 400, "Both 'lora_name' and 'lora_path' must be provided.")]:
        r = load(name, path)
        assert r.status_code == status and message in r.json()["error"]["message"], (name, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert "bad" not in [m["id"] for m in http.get("/v1/models").json()["data"]]
    r = load("gone", tmp_path / "no-such-folder")           # vLLM: 404 for an adapter it cannot find
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
    # unloading while a request runs with the adapter: it finishes with it (the same text as
    # "sql", the same folder); new requests get 404
    body = {"model": "sql2", "prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        first = next(x for x in lines if x.startswith("data: "))
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql2"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql2' removed successfully."
        rest = [x for x in lines if x.startswith("data: {")]
    text = "".join(json.loads(x[6:])["choices"][0]["text"] for x in [first, *rest])
    assert text == complete(client, "sql", PROMPTS[0], max_tokens=100).choices[0].text
    with pytest.raises(openai.NotFoundError):
        complete(client, "sql2", PROMPTS[0])
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql2"})
    assert r.status_code == 404 and r.json()["error"]["message"] == "The lora adapter 'sql2' cannot be found."
    # the startup adapters still serve
    assert complete(client, "code", PROMPTS[0]).choices[0].text == server.solo["code", PROMPTS[0]]
    http.close()


def test_without_the_variable_or_lora_there_are_no_adapters(tiny_pair, adapters):
    """LoRA off and runtime updates off: the update routes are absent (404, as in vLLM); an
    adapter name is an unknown model; --lora-modules is refused."""
    target, _ = tiny_pair
    llm = LLM(str(target), num_speculative_tokens=0, max_model_len=64)
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        build_app(llm, ServerConfig(lora_modules=(LoRAModulePath("sql", str(adapters["sql"])),)))
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))) as live:
        r = httpx.post(live.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapters["sql"])})
        assert r.status_code == 404
        r = httpx.post(live.url + "/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_flags(tiny_pair, adapters, monkeypatch, capsys):
    sql, code = str(adapters["sql"]), str(adapters["code"])
    argv = ["m", "--enable-lora", "--lora-modules", f"sql={sql}", f'{{"name": "code", "path": "{code}", '
            f'"base_model_name": "m"}}', "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", f"more={sql}", "--lora-dtype", "bfloat16"]
    args, ignored = parse_args(argv)
    assert not ignored and (args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras,
                            args.lora_dtype) == (True, 2, 8, None, "bfloat16")
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.setenv("SPECDEC_ALLOW_RUNTIME_LORA_UPDATING", "0")
    config = server_config(args)
    assert config.lora_modules == (LoRAModulePath("sql", sql), LoRAModulePath("code", code, "m"),
                                   LoRAModulePath("more", sql))
    assert not config.allow_runtime_lora_updating
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert server_config(args).allow_runtime_lora_updating
    args.model, args.num_speculative_tokens = str(tiny_pair[0]), 0
    lora = build_llm(args).engine.lora                  # the flags reach LLM(...)
    assert (lora.max_loras, lora.config.max_lora_rank, lora.config.lora_dtype) == (2, 8, "bfloat16")
    for bad in (["--lora-modules", "sql"], ["--lora-modules", '{"name": "x"}'], ["--max-loras", "0"]):
        with pytest.raises(SystemExit) as e:
            parse_args(["m", "--enable-lora", *bad])
        assert e.value.code == 2
    capsys.readouterr()
    from specdec.cli import main

    for flags, message in ([f"sql={sql}"], "--lora-modules needs --enable-lora"), \
                          (["--enable-lora", "--lora-modules", "sql=/no/such/folder"], "/no/such/folder is neither a folder"):
        flags = flags if flags[0] == "--enable-lora" else ["--lora-modules", *flags]
        assert main(["serve", "m", *flags, "--port", "0"]) == 2          # before the model loads
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err


def test_a_folder_that_is_no_adapter_exits_with_one_line(tiny_pair, tmp_path):
    """Found only once the model has loaded (the engine reads the folder): still one line, status 2."""
    target, _ = tiny_pair
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run([sys.executable, "-m", "specdec", "serve", str(target), "--num-speculative-tokens", "0",
                           "--enable-lora", "--lora-modules", f"x={tmp_path}", "--port", "0"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    err = [line for line in proc.stderr.strip().splitlines() if " INFO " not in line and not line.startswith("INFO")]
    assert len(err) == 1 and err[0].startswith("specdec: error: ") and "adapter_config.json" in err[0], proc.stderr


def test_bench_serve_draws_vllms_lora_modules(server, tmp_path):
    """`specdec bench serve --lora-modules A B`: each request names one of the adapters (seeded
    draw, both used); through the live server every one completes; a name the server does not
    serve fails every request (so the requests did carry the names)."""
    from specdec.bench.serve import with_lora
    from specdec.cli import main

    items = with_lora([{"prompt": "x"}] * 32, list(NAMES), seed=0)
    assert {i["model"] for i in items} == set(NAMES) and items == with_lora([{"prompt": "x"}] * 32, list(NAMES), 0)
    for names, failed in ((list(NAMES), 0), (["nope"], 6)):
        out = tmp_path / names[0]
        rc = main(["bench", "serve", "--base-url", server.url, "--lora-modules", *names, "--max-concurrency", "2",
                   "--num-prompts", "6", "--output-len", "4", "--ignore-eos", "--warmup", "0", "--out", str(out)])
        results = json.loads((out / "results.json").read_text())
        (point,) = results["variants"][0]["points"]
        assert results["settings"]["lora_modules"] == names
        assert point["failed"] == failed and point["completed"] == 6 - failed
        if not failed:
            assert rc == 0


def test_lora_modules_take_llama_cpp_gguf_files(tmp_path):
    """--lora-modules names a PEFT folder or a llama.cpp LoRA .gguf (the README's two formats; a
    .gguf was refused as "not a folder" while /v1/load_lora_adapter took it); other files are refused."""
    from specdec.server.cli import _lora_modules

    gguf, other = tmp_path / "a.gguf", tmp_path / "a.bin"
    gguf.write_bytes(b"GGUF")
    other.write_bytes(b"x")
    args, _ = parse_args(["m", "--enable-lora", "--lora-modules", f"g={gguf}", f"d={tmp_path}"])
    assert [m.name for m in _lora_modules(args)] == ["g", "d"]
    args, _ = parse_args(["m", "--enable-lora", "--lora-modules", f"x={other}"])
    with pytest.raises(ValueError, match="is neither a folder .* nor a .gguf file"):
        _lora_modules(args)
