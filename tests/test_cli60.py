"""The command line as a vLLM user meets it (tester cli60): inline chat templates' escapes, flag
values left whole, --revision / --download-dir over the Hugging Face cache, --dtype's aliases,
--help=KEYWORD, --middleware, run-batch's --url, `complete` without abbreviations, -O.<key>."""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest

from specdec.cli import _subparser, build_parser, dashed_flags, expand_argv, main
from specdec.server.cli import parse_args


def _sub(name: str):
    return _subparser(build_parser(name), name)


# -- 1. an inline --chat-template's backslash escapes are decoded (vLLM's codecs.decode) --------

def test_inline_chat_template_escapes_are_decoded_as_vllm_does(tmp_path):
    from specdec.tokenizer import load_chat_template

    typed = r"{% for m in messages %}<{{m.role}}>\n{{m.content}}\t\u00e9{% endfor %}é你"
    assert load_chat_template(typed) == "{% for m in messages %}<{{m.role}}>\n{{m.content}}\té{% endfor %}é你"
    file = tmp_path / "t.jinja"
    file.write_text(typed, encoding="utf-8")          # a file's text is the template as written
    assert load_chat_template(str(file)) == typed


# -- 2. only flag names lose their underscores, never values ------------------------------------

def test_flag_values_keep_their_underscores():
    spec = '--speculative-config {"method": "ngram", "num_speculative_tokens": 3}'
    words = ["bench", "serve", "--server-args", "--served-model-name my_model", "--server_args", spec,
             "--max_model_len=my_value", "--x", "--chat-template=/a_b/c d.jinja"]
    assert dashed_flags(words) == ["bench", "serve", "--server-args", "--served-model-name my_model",
                                   "--server-args", spec, "--max-model-len=my_value", "--x",
                                   "--chat-template=/a_b/c d.jinja"]


def test_bench_serve_hands_server_args_on_unchanged(tmp_path):
    from specdec.bench.serve_cli import variants

    template = tmp_path / "my_tpl.jinja"
    words = ["bench", "serve", "--num-speculative-tokens", "0",
             "--server-args", f"--chat-template {template} --served-model-name my_model"]
    args = build_parser("bench").parse_args(dashed_flags(words))
    (plain,) = variants(args)
    assert [str(template), "my_model"] == [plain["argv"][plain["argv"].index(f) + 1]
                                           for f in ("--chat-template", "--served-model-name")]


# -- 3. --revision / --download-dir pick the snapshot of a Hugging Face id ----------------------

MAIN, V2 = "a" * 40, "b" * 40


@pytest.fixture
def hub(tiny_pair, tmp_path):
    """A Hugging Face cache holding toy/target: refs/main -> the target, refs/v2 -> the draft."""
    repo = tmp_path / "hub" / "models--toy--target"
    for commit, folder in ((MAIN, tiny_pair[0]), (V2, tiny_pair[1])):
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        for f in folder.iterdir():
            (snap / f.name).symlink_to(f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v2").write_text(V2)
    return tmp_path / "hub", repo


def test_revision_and_download_dir_pick_the_snapshot(hub, monkeypatch):
    from specdec.llm import LLM

    cache, repo = hub
    for revision, commit in ((None, MAIN), ("v2", V2), (V2, V2)):
        llm = LLM("toy/target", num_speculative_tokens=0, revision=revision, download_dir=str(cache))
        assert llm.model_path == str(repo / "snapshots" / commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))          # no download_dir: the environment's cache
    assert LLM("toy/target", num_speculative_tokens=0, revision="v2").model_path == str(repo / "snapshots" / V2)
    with pytest.raises(ValueError, match="toy/target at revision 'v3'.* is not in the cache folder"):
        LLM("toy/target", num_speculative_tokens=0, revision="v3")
    monkeypatch.delenv("HF_HUB_CACHE")
    with pytest.raises(ValueError, match="is not in the cache folder /nowhere"):
        LLM("toy/target", num_speculative_tokens=0, download_dir="/nowhere")


def test_hf_config_path_id_is_read_at_the_revision_under_download_dir(hub):
    """vLLM reads hf_config_path at the model's revision: the model's own id at v2 names its own
    folder (no-op), not main's snapshot (which a folder model refuses as another config)."""
    from specdec.llm import LLM

    cache, repo = hub
    llm = LLM("toy/target", num_speculative_tokens=0, revision="v2", download_dir=str(cache),
              hf_config_path="toy/target")
    assert llm.model_path == str(repo / "snapshots" / V2) and llm.hf_config_path is None
    with pytest.raises(ValueError, match="runs with its own config.json"):
        LLM("toy/target", num_speculative_tokens=0, revision="v2", download_dir=str(cache),
            hf_config_path=str(repo / "snapshots" / MAIN))


def test_generate_runs_the_revision_it_names(hub, tiny_pair, capsys):
    cache, _ = hub

    def generate(*flags):
        code = main(["generate", *flags, "--max-tokens", "6", "--ignore-eos", "--json", "def f(x):"])
        out, err = capsys.readouterr()
        return code, out, err

    code, out, err = generate("--model", "toy/target", "--revision", "v2", "--download-dir", str(cache))
    assert code == 0 and "ignoring vLLM flag" not in err, err
    assert json.loads(out)["token_ids"] == json.loads(generate("--model", str(tiny_pair[1]))[1])["token_ids"]
    code, out, err = generate("--model", "toy/target", "--revision", "nope", "--download-dir", str(cache))
    assert code == 2 and "toy/target at revision 'nope'" in err
    args, ignored = parse_args(["--revision", "v2", "--tokenizer-revision", "v1", "--download-dir", "/d"])
    assert (args.revision, args.tokenizer_revision, args.download_dir, ignored) == ("v2", "v1", "/d", [])


# -- 4. --dtype half / float in every spelling and subcommand -----------------------------------

def test_dtype_aliases_everywhere(tmp_path):
    assert parse_args(["--dtype=half"])[0].dtype == "float16"
    assert parse_args(["--dtype", "float"])[0].dtype == "float32"
    assert build_parser("generate").parse_args(["generate", "--dtype=half", "p"]).dtype == "float16"
    assert build_parser("chat").parse_args(["chat", "--dtype", "half"]).dtype == "float16"
    assert build_parser("bench").parse_args(["bench", "--dtype", "float"]).dtype == "float32"
    config = tmp_path / "c.yaml"
    config.write_text("dtype: half\n")
    words = expand_argv(["--config", str(config), "p"], _sub("generate"))
    assert build_parser("generate").parse_args(["generate", *words]).dtype == "float16"


# -- 5. --help=KEYWORD in every subcommand ------------------------------------------------------

@pytest.mark.parametrize("words, shown", [
    (["generate", "--help=max-num-seqs"], "Arguments matching 'max-num-seqs'"),
    (["chat", "--help=max_num_seqs"], "--max-num-seqs"),
    (["serve", "--help=max-num-seqs"], "--max-num-seqs"),
    (["run-batch", "--help=url"], "--url"),
    (["bench", "latency", "--help=num-iters"], "--num-iters-warmup"),
    (["serve", "--help=listgroup"], "LoRA adapters"),
    (["serve", "--help=LoRA adapters"], "--max-lora-rank"),
    (["generate", "--help=all"], "usage: specdec generate"),
    (["complete", "--help=ModelConfig"], "No group or arguments matching 'modelconfig'"),
])
def test_help_keyword(words, shown, capsys):
    assert main(words) == 0
    out = capsys.readouterr().out
    assert shown in out
    if "--help=max" in words[1] or "url" in words[1]:
        assert "--max-model-len" not in out            # only the matching flags


# -- 6. --middleware takes one value a flag -----------------------------------------------------

def test_middleware_takes_one_value_per_flag(tmp_path):
    args, _ = parse_args(["--middleware", "m.f", "/some/model", "--middleware", "m.g"])
    assert (args.middleware, args.model) == (["m.f", "m.g"], "/some/model")
    config = tmp_path / "c.yaml"
    config.write_text("middleware: [m.f, m.g]\n")
    assert parse_args(["--config", str(config), "/some/model"])[0].middleware == ["m.f", "m.g"]


# -- 7. run-batch --url: vLLM's metrics server address -------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_run_batch_metrics_server_binds_url_and_port(tiny_pair, tmp_path, capsys):
    from specdec.server.run_batch import add_batch_args

    args, ignored = parse_args(["-i", "a", "-o", "b", "--enable-metrics", "--url", "0.0.0.0", "--port", "9"],
                               "specdec run-batch", extra=add_batch_args)
    assert (args.url, args.port, ignored) == ("0.0.0.0", 9, [])
    (tmp_path / "in.jsonl").write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                                   "body": {"model": "m", "prompt": "x", "max_tokens": 2}}) + "\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                     "--model", str(tiny_pair[0]), "--enable-metrics", "--url", "127.0.0.1", "--port", str(port)])
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_metrics_server_serves_the_registry_it_is_given():
    from prometheus_client import CollectorRegistry, Counter

    from specdec.server.run_batch import _MetricsServer

    registry = CollectorRegistry()
    Counter("cli60_requests", "requests", registry=registry).inc(3)
    port = _free_port()
    server = _MetricsServer("127.0.0.1", port)
    try:
        server.source = registry
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        server.close()
    assert "cli60_requests_total 3.0" in text


# -- 8. complete takes no abbreviations -----------------------------------------------------------

@pytest.mark.parametrize("flag", ["--temp", "--model"])
def test_complete_refuses_abbreviated_flags(flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(["complete", "--url", "http://127.0.0.1:9/v1", "-q", "x", flag, "0"])
    assert e.value.code == 2 and f"unrecognized arguments: {flag}" in capsys.readouterr().err


# -- 9. -O.<key> is --compilation-config.<key> ----------------------------------------------------

def test_O_dot_key_is_a_compilation_config_key():
    assert parse_args(["-O.cudagraph_mode", "FULL_DECODE_ONLY"])[0].compilation_config == \
        {"cudagraph_mode": "FULL_DECODE_ONLY"}
    assert parse_args(["-O.cudagraph_mode=FULL_DECODE_ONLY", "-O.cudagraph_capture_sizes+", "1,2"])[0] \
        .compilation_config == {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2]}
    words = expand_argv(["-O.cudagraph_mode", "FULL_DECODE_ONLY", "p"], _sub("generate"))
    assert build_parser("generate").parse_args(["generate", *words]).compilation_config == \
        {"cudagraph_mode": "FULL_DECODE_ONLY"}
