"""vLLM's command-line flags that specdec honours (a flag auditor's findings): each observed taking
effect, on the parsed settings and on a real `specdec serve` process."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from specdec.cli import llm_kwargs, main
from specdec.server.cli import parse_args, server_config

from serve_helpers import wait_listening

TARGET = "models/target"


@contextlib.contextmanager
def served(tmp_path, args: list[str], env: dict | None = None, uds: str | None = None, listen_log=None):
    """`specdec serve TARGET *args` in a process of its own (on --port 0: a port the kernel picks and
    the server holds, read from its log, or on the Unix socket uds) -> an httpx client of it, once
    /health answers; the server is stopped afterwards. listen_log: the file uvicorn's "Uvicorn
    running on" line goes to, where a --log-config-file sends it elsewhere than the process's output."""
    where = ["--uds", uds] if uds else ["--port", "0"]
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "specdec", "serve", TARGET, *where, *args],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    client = None
    try:
        if uds:
            client = httpx.Client(transport=httpx.HTTPTransport(uds=uds), base_url="http://specdec", timeout=60)
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
                try:
                    if client.get("/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
        else:
            url = wait_listening(proc, listen_log or log, timeout=120)
            client = httpx.Client(base_url=url, timeout=60)
        yield client
    finally:
        if client is not None:
            client.close()
        proc.terminate()
        proc.wait(60)


def test_api_key_from_vllms_variable(monkeypatch):
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert server_config(parse_args([], "x")[0]).api_key == "from-vllm"
    monkeypatch.setenv("SPECDEC_API_KEY", "own")
    assert server_config(parse_args([], "x")[0]).api_key == "own"
    monkeypatch.setenv("SPECDEC_API_KEY", "")           # empty: no key (as vLLM reads an empty variable)
    monkeypatch.delenv("VLLM_API_KEY")
    assert server_config(parse_args([], "x")[0]).api_key is None


def test_engine_flags_reach_the_llm():
    args, ignored = parse_args(["m", "--kv-cache-memory-bytes", "2M", "--cuda-graph-sizes", "1", "2", "4",
                                "--max-cudagraph-capture-size", "4", "--rope-theta", "5e5",
                                "--rope-scaling", '{"rope_type": "linear", "factor": 2.0}'], "x")
    kw = llm_kwargs(args)
    assert not ignored and kw["kv_cache_memory"] == 2 * 2**20
    assert kw["compilation_config"] == {"cudagraph_capture_sizes": [1, 2, 4], "max_cudagraph_capture_size": 4}
    assert kw["hf_overrides"] == {"rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    args, _ = parse_args(["m", "--compilation-config", '{"cudagraph_mode": "FULL_DECODE_ONLY"}',
                          "--cuda-graph-sizes", "8", "--hf-overrides", '{"rope_theta": 1.0, "x": 1}', "--rope-theta", "2"],
                         "x")
    kw = llm_kwargs(args)
    assert kw["compilation_config"] == {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [8]}
    assert kw["hf_overrides"] == {"rope_theta": 2.0, "x": 1}


def test_ignored_vllm_flags_with_several_values_keep_the_command_line_whole():
    for argv in (["m", "--prompt-adapters", "a=/x", "b=/y"], ["--prompt-adapters", "a=/x", "b=/y", "--model", "m"],
                 ["--logits-processors", "p.A", "p.B", "--port", "8001", "m"]):
        args, ignored = parse_args(argv, "x")
        assert args.model == "m" and len(ignored) == 1 and ignored[0].startswith("--") and "a=/x" not in args.model


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_a_port_outside_the_range_is_refused(port, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["m", "--port", port], "x")
    assert e.value.code == 2


def test_optimisation_levels_above_three_are_refused():
    with pytest.raises(SystemExit):
        parse_args(["m", "-O7"], "x")
    assert parse_args(["m", "-O3"], "x")[0].compilation_config == 3


def test_a_port_in_use_fails_before_the_model_loads(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "specdec", "serve", "--model", str(tmp_path / "nothing-here"),
                              "--port", str(port)], capture_output=True, text=True, timeout=120)
    # the socket is bound first: the (missing) model is never reached
    assert run.returncode != 0 and f"cannot listen on 127.0.0.1:{port}" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and time.monotonic() - start < 60


def test_generate_refuses_abbreviations_and_takes_vllm_flags(capsys):
    assert main(["generate", "--model", TARGET, "--max-num-seq", "4", "--max-tokens", "2", "hi"]) == 2
    assert "did you mean --max-num-seqs?" in capsys.readouterr().err
    assert main(["generate", "--model", TARGET, "--swap-space", "4", "--max-tokens", "2",
                 "--temperature", "0", "hi"]) == 0
    assert "ignoring vLLM flag (specdec does not use it): --swap-space 4" in capsys.readouterr().err


def test_generate_samples_the_same_text_run_to_run(capsys):
    """As vLLM's LLM (seed 0): without --seed, two runs at temperature 1 sample the same text."""
    outs = []
    for _ in range(2):
        assert main(["generate", "--model", TARGET, "--max-tokens", "16", "--temperature", "1", "--json",
                     "def f(x):"]) == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"])
    assert outs[0] == outs[1]


def test_bench_honours_the_model_flags(tmp_path, capsys):
    assert main(["bench", "--model", TARGET, "--tokenizer", str(tmp_path / "none"), "--out", str(tmp_path / "b"),
                 "--max-tokens", "2", "--limit-prompts", "1"]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err
    assert main(["bench", "--model", TARGET, "--runner", "pooling", "--out", str(tmp_path / "b")]) == 2
    assert "measures generation" in capsys.readouterr().err


def test_run_batch_says_serves_http_flags_do_nothing(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "1", "method": "POST", "url": "/v1/completions",
                               "body": {"model": "m", "prompt": "hi", "max_tokens": 2}}) + "\n")
    run = subprocess.run([sys.executable, "-m", "specdec", "run-batch", "--model", TARGET, "--served-model-name", "m",
                          "-i", str(src), "-o", str(tmp_path / "out.jsonl"), "--port", "9", "--ssl-keyfile", "/x",
                          "--uds", str(tmp_path / "s.sock"), "--disable-uvicorn-access-log",
                          "--speculative-model", "models/draft", "--num-speculative-tokens", "3",
                          "--metrics-prefix", "vllm"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "ignoring serve's HTTP flags (no server here): --port, --ssl-keyfile, --uds, " \
           "--disable-uvicorn-access-log" in run.stderr
    assert "speculative: acceptance rate" in run.stderr         # read under the vllm: names too


def test_serve_with_vllms_frontend_flags(tmp_path):
    """One real server: --middleware (a class and a function, imported by path), --default-chat-
    template-kwargs (under each request's own), --enable-force-include-usage, VLLM_API_KEY."""
    (tmp_path / "mw.py").write_text('''
class Tag:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-tag", b"class")]}
            await send(message)
        await self.app(scope, receive, tagged)


async def stamp(request, call_next):
    response = await call_next(request)
    response.headers["x-stamp"] = "function"
    return response
''')
    template = "{% for m in messages %}{{ m['content'] }}|{{ greeting }}|{% endfor %}"
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "VLLM_API_KEY": "k",
           "SPECDEC_API_KEY": ""}
    with served(tmp_path, ["--served-model-name", "m", "--middleware", "mw.Tag", "--middleware", "mw.stamp", "--chat-template", template,
                           "--default-chat-template-kwargs", '{"greeting": "HELLO"}', "--enable-force-include-usage"],
                env) as http:
        assert http.get("/v1/models").status_code == 401            # VLLM_API_KEY guards /v1
        auth = {"authorization": "Bearer k"}
        r = http.get("/v1/models", headers=auth)
        assert r.status_code == 200 and r.headers["x-tag"] == "class" and r.headers["x-stamp"] == "function"
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        r = http.post("/tokenize", json=body)
        assert r.status_code == 200
        own = http.post("/tokenize", json={**body, "chat_template_kwargs": {"greeting": "BYE"}})
        text = http.post("/detokenize", json={"model": "m", "tokens": r.json()["tokens"]}).json()["prompt"]
        mine = http.post("/detokenize", json={"model": "m", "tokens": own.json()["tokens"]}).json()["prompt"]
        assert "hi|HELLO|" in text and "hi|BYE|" in mine
        with http.stream("POST", "/v1/completions", headers=auth, json={
                "model": "m", "prompt": "x", "max_tokens": 3, "stream": True, "ignore_eos": True}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert chunks[-1]["usage"]["completion_tokens"] == 3 and chunks[-1]["choices"] == []


def test_tokenizer_info_endpoint(tiny_pair):
    """vLLM's --enable-tokenizer-info-endpoint: GET /tokenizer_info is the tokenizer's configuration
    (what transformers reads from the folder), with the chat template the server uses; 404 without it."""
    import transformers

    from specdec.llm import LLM
    from specdec.server import ServerConfig, build_app
    from tests.test_server import LiveServer

    target = tiny_pair[0]
    hf = transformers.AutoTokenizer.from_pretrained(target)
    llm = LLM(target, max_model_len=64)
    with LiveServer(build_app(llm, ServerConfig(enable_tokenizer_info_endpoint=True,
                                                chat_template="{{ messages[0]['content'] }}"))) as on:
        info = httpx.get(on.url + "/tokenizer_info").json()
    assert info["eos_token"] == hf.eos_token and info["bos_token"] == hf.bos_token
    assert info["chat_template"] == "{{ messages[0]['content'] }}" and info["tokenizer_class"]
    added = {int(i): t["content"] for i, t in info["added_tokens_decoder"].items()}
    assert added == {i: t.content for i, t in hf.added_tokens_decoder.items()}
    with LiveServer(build_app(llm, ServerConfig())) as off:
        assert httpx.get(off.url + "/tokenizer_info").status_code == 404
    assert server_config(parse_args(["--enable-tokenizer-info-endpoint"], "x")[0]).enable_tokenizer_info_endpoint


@pytest.mark.parametrize("flags, logged", [(["--disable-access-log-for-endpoints", "/health,/metrics"], {"/v1/models"}),
                                           (["--disable-uvicorn-access-log"], set())])
def test_access_log_flags(tmp_path, flags, logged):
    with served(tmp_path, flags) as http:
        for path in ("/health", "/metrics", "/v1/models"):
            assert http.get(path).status_code == 200
    out = tmp_path / "serve.log"
    lines = [ln for ln in out.read_text().splitlines() if '" 200' in ln and "GET " in ln]
    assert {p for p in ("/health", "/metrics", "/v1/models") if any(f"GET {p} " in ln for ln in lines)} == logged


def test_unix_socket_and_worker_extension(tmp_path):
    """vLLM's --uds (the server on a Unix domain socket) and --worker-extension-cls (its methods
    reachable through POST /collective_rpc in development mode)."""
    (tmp_path / "ext.py").write_text('''
class Ext:
    def vocab_rows(self):
        return int(self.get_model().config.vocab_size)
''')
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "VLLM_SERVER_DEV_MODE": "1"}
    with served(tmp_path, ["--worker-extension-cls", "ext.Ext", "--uvicorn-log-level", "warning"], env,
                uds=str(tmp_path / "specdec.sock")) as http:
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        r = http.post("/collective_rpc", json={"method": "vocab_rows"})
        assert r.status_code == 200 and r.json() == {"results": [16384]}


LOOPING = "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
PLAIN = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"


@pytest.mark.parametrize("template, fmt, want_str, want_parts", [
    (LOOPING, "auto", "[hi]", "[a][b]"),          # a template that loops over content gets OpenAI's parts
    (PLAIN, "auto", "<hi>", "<a\nb>"),            # one that prints it gets the text, parts one per line
    (PLAIN, "openai", None, None),                # forced: the list itself reaches the template
    (LOOPING, "string", "[][]", None)])           # forced: a string's characters, as vLLM would give it
def test_chat_template_content_format(tiny_pair, template, fmt, want_str, want_parts):
    from specdec.llm import LLM
    from specdec.server import ServerConfig, build_app
    from tests.test_server import LiveServer

    llm = LLM(tiny_pair[0], max_model_len=64)
    config = ServerConfig(chat_template=template, chat_template_content_format=fmt)
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    with LiveServer(build_app(llm, config)) as live:
        def rendered(content):
            ids = httpx.post(live.url + "/tokenize", json={"messages": [{"role": "user", "content": content}],
                                                            "add_generation_prompt": False}).json()["tokens"]
            return httpx.post(live.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
        got_str, got_parts = rendered("hi"), rendered(parts)
    if want_str is not None:
        assert got_str == want_str
        offline = llm.chat([{"role": "user", "content": "hi"}], chat_template=template,
                           chat_template_content_format=fmt, add_generation_prompt=False)[0].prompt
        assert offline == want_str
    else:
        assert "'type': 'text'" in got_str and "'text': 'hi'" in got_str
    if want_parts is not None:
        assert got_parts == want_parts
    assert server_config(parse_args(["--chat-template-content-format", "openai"], "x")[0]) \
        .chat_template_content_format == "openai"


def test_data_parallel_size_is_replicas():
    """vLLM's --data-parallel-size / -dp N: N engines behind one endpoint, --replicas N here."""
    assert parse_args(["m", "-dp", "2"], "x")[0].replicas == 2
    assert parse_args(["m", "--data-parallel-size", "3", "--replicas", "3"], "x")[0].replicas == 3
    assert parse_args(["m", "--data-parallel-size", "1"], "x")[0].replicas is None
    with pytest.raises(ValueError, match="disagree"):
        parse_args(["m", "-dp", "2", "--replicas", "4"], "x")


@pytest.mark.parametrize("flag, refused", [(["--pipeline-parallel-size", "2"], True), (["-pp", "1"], False),
                                           (["--tokenizer-mode", "mistral"], True), (["--tokenizer-mode", "auto"], False),
                                           (["--enable-sleep-mode"], True), (["--load-format", "dummy"], True),
                                           (["--trust-remote-code"], False)])
def test_vllm_flags_that_would_change_what_runs_are_refused(flag, refused, capsys):
    """As LLM(...) refuses them: a vLLM value specdec cannot honour is a one-line error, not a
    warning followed by a run that does something else."""
    rc = main(["generate", "--model", TARGET, "--max-tokens", "2", "--temperature", "0", *flag, "hi"])
    err = capsys.readouterr().err
    assert (rc, "not supported" in err) == ((2, True) if refused else (0, False)), err
    if not refused:
        assert "ignoring vLLM flag" in err


def test_log_config_file(tmp_path):
    """vLLM's --log-config-file: specdec's and uvicorn's loggers as the JSON file says."""
    out = tmp_path / "all.log"
    config = {"version": 1, "disable_existing_loggers": False,
              "formatters": {"f": {"format": "CUSTOM|%(name)s|%(message)s"}},
              "handlers": {"h": {"class": "logging.FileHandler", "filename": str(out), "formatter": "f"}},
              "loggers": {"specdec": {"handlers": ["h"], "level": "INFO"},
                          "uvicorn.access": {"handlers": ["h"], "level": "INFO", "propagate": False},
                          "uvicorn.error": {"handlers": ["h"], "level": "INFO", "propagate": False}}}
    path = tmp_path / "logging.json"
    path.write_text(json.dumps(config))
    with served(tmp_path, ["--log-config-file", str(path), "--enable-log-requests"], listen_log=out) as http:
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    lines = out.read_text().splitlines()
    assert any(ln.startswith("CUSTOM|specdec.server|Received request") for ln in lines)
    assert any(ln.startswith("CUSTOM|uvicorn.access|") and "/v1/completions" in ln for ln in lines)
    path.write_text("{not json")
    run = subprocess.run([sys.executable, "-m", "specdec", "serve", TARGET, "--log-config-file", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "--log-config-file" in run.stderr and "Traceback" not in run.stderr


def test_num_gpu_blocks_override_sizes_the_pool(tiny_pair):
    """vLLM's num_gpu_blocks_override: the KV pool has that many blocks; too few for one sequence
    of max_model_len is a one-line error; requests beyond it wait or are preempted, outputs unchanged."""
    from specdec import LLM, SamplingParams

    args, _ = parse_args(["m", "--num-gpu-blocks-override", "12"], "x")
    assert llm_kwargs(args)["num_gpu_blocks_override"] == 12
    llm = LLM(tiny_pair[0], max_model_len=64, num_gpu_blocks_override=8, max_num_seqs=8)
    assert llm.engine.blocks.num_blocks == 8
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = ["def f(x):", "class A:", "import os", "x = 1", "for i in y:", "while True:"]
    roomy = LLM(tiny_pair[0], max_model_len=64, max_num_seqs=8)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    # 6 sequences of over 40 tokens (3 or more blocks of 16 each) do not fit 8 blocks at once:
    # some were preempted (and recomputed) on the way, with the outputs unchanged
    assert llm.engine.num_preemptions > 0 and roomy.engine.num_preemptions == 0
    with pytest.raises(ValueError, match="num_gpu_blocks_override 2 holds 32 token slots"):
        LLM(tiny_pair[0], max_model_len=64, num_gpu_blocks_override=2)


def test_a_vllm_flag_inside_an_options_value_stays_there():
    """`bench serve --server-args "--trust-remote-code --max-num-seqs 4"`: the value of one of
    specdec's own options is not taken for a vLLM flag to drop."""
    from specdec.cli import build_parser, own_options
    from specdec.vllm_flags import drop_vllm_flags

    own, valued = own_options(build_parser("bench"))
    words = ["bench", "serve", "--server-args", "--trust-remote-code --max-num-seqs 4", "--swap-space", "4"]
    kept, dropped = drop_vllm_flags(words, set(own), valued)
    assert kept == words[:4] and dropped == ["--swap-space 4"]
    args = build_parser("bench").parse_args(kept)
    assert args.server_args == "--trust-remote-code --max-num-seqs 4"


def test_serve_says_where_it_listens(tmp_path):
    """The socket is bound before the model loads; the log still says where (a --port 0 run finds its port)."""
    import re

    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "specdec", "serve", TARGET, "--port", "0"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not (m := re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+) ", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        assert httpx.get(f"http://127.0.0.1:{m.group(1)}/health", timeout=10).status_code == 200
    finally:
        proc.terminate()
        proc.wait(60)


def test_a_live_unix_socket_is_not_taken_over(tmp_path):
    """A second server on a --uds path a live server listens on fails in one line (as a TCP port in
    use does); a clean shutdown leaves no socket file; a stale one (a killed server's) is replaced."""
    uds = tmp_path / "s.sock"
    with served(tmp_path, [], uds=str(uds)) as http:
        run = subprocess.run([sys.executable, "-m", "specdec", "serve", TARGET, "--uds", str(uds)],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode != 0 and "a server is listening there already" in run.stderr
        assert http.get("/health").status_code == 200            # the first one still answers
    assert not uds.exists()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(uds))
    stale.close()                                                 # a socket file nobody listens on
    with served(tmp_path, [], uds=str(uds)) as http:
        assert http.get("/health").status_code == 200


def test_vllm_logging_level_and_an_empty_api_key(tmp_path, monkeypatch):
    with served(tmp_path, ["--enable-log-requests", "--api-key", ""], {"VLLM_LOGGING_LEVEL": "WARNING"}) as http:
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200   # no key
    log = (tmp_path / "serve.log").read_text()
    assert "Received request" not in log                         # INFO lines are below WARNING
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "LOUD")
    run = subprocess.run([sys.executable, "-m", "specdec", "serve", TARGET], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0 and "VLLM_LOGGING_LEVEL='LOUD'" in run.stderr and "Traceback" not in run.stderr
