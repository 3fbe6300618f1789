"""vLLM's own example patterns (a tester ran vLLM's examples/ with only the import changed):
EngineArgs.add_cli_args + LLM(**vars(args)), LLMEngine's add_request / step loop, the engine's
config objects, None as "the default", get_metrics()'s histograms, a chat template that fails
on its input (a 400, not a 500)."""

from __future__ import annotations

import argparse

import httpx
import pytest

from specdec import LLM, EngineArgs, SamplingParams
from specdec.metrics import Counter, Histogram

TARGET, DRAFT = "models/target", "models/draft"


def test_engine_args_cli_parser_feeds_llm():
    """vLLM's basic/generate.py: EngineArgs.add_cli_args(parser), then LLM(**vars(args))."""
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--model", TARGET, "--max-model-len", "128", "--rope-theta", "10000",
                              "--cuda-graph-sizes", "1", "2", "--guided-decoding-backend", "guidance"])
    llm = LLM(**vars(args))
    assert llm.engine.max_model_len == 128
    out = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_llm_engine_add_request_and_step(tmp_path):
    """vLLM's llm_engine_example.py: add_request(request_id, prompt, params) and step() until no
    request is left; each request's last output is finished and equals LLM.generate's."""
    llm = LLM(TARGET, speculative_model=DRAFT, num_speculative_tokens=3)
    engine = llm.llm_engine
    todo = [("To be or not to be,", SamplingParams(temperature=0, max_tokens=12)),
            ("What is the meaning of life?", SamplingParams(n=2, temperature=0.8, top_k=5, max_tokens=8, seed=3)),
            ("A robot may not injure", SamplingParams(n=2, best_of=3, temperature=0.8, max_tokens=6, seed=4))]
    finished, seen, latest, i = {}, {}, {}, 0
    while todo or engine.has_unfinished_requests():
        if todo:
            prompt, params = todo.pop(0)
            engine.add_request(str(i), prompt, params)
            i += 1
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out.finished)
            for c in out.outputs:         # n > 1: each output holds the completion that moved (vLLM v1's)
                latest.setdefault(out.request_id, {})[c.index] = c
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == ["0", "1", "2"] and all(v[-1] and not any(v[:-1]) for v in seen.values())
    ref = llm.generate(["To be or not to be,", "What is the meaning of life?"],
                       [SamplingParams(temperature=0, max_tokens=12),
                        SamplingParams(n=2, temperature=0.8, top_k=5, max_tokens=8, seed=3)])
    assert [o.token_ids for o in finished["0"].outputs] == [o.token_ids for o in ref[0].outputs]
    assert [latest["1"][i].token_ids for i in range(2)] == [o.token_ids for o in ref[1].outputs]
    assert len(finished["2"].outputs) == 2
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("x", "hi", SamplingParams(max_tokens=50))
        engine.add_request("x", "hi", SamplingParams(max_tokens=50))
    engine.abort_request("x")
    assert not engine.has_unfinished_requests()
    config = engine.vllm_config
    assert config.scheduler_config.max_num_seqs == 16 and engine.model_config.max_model_len == llm.engine.max_model_len
    assert engine.cache_config.block_size == 16 and engine.cache_config.num_gpu_blocks == llm.engine.blocks.num_blocks
    assert engine.get_model_config().get_vocab_size() == llm.target.config.vocab_size


def test_llm_engine_from_engine_args():
    """vLLM's llm_engine_example.py builds the engine with LLMEngine.from_engine_args(EngineArgs(...))."""
    from specdec import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=TARGET, max_model_len=128))
    engine.add_request("a", "def f(x):", SamplingParams(temperature=0, max_tokens=5))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].request_id == "a" and outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
    assert engine.vllm_config.model_config.max_model_len == 128


def test_llm_engine_step_honours_output_kind():
    """vLLM's LLMEngine.step by SamplingParams.output_kind, as AsyncLLM streams (step() gave every
    request its cumulative completion without logprobs): DELTA pieces add up to the completion,
    FINAL_ONLY is one output at the end, CUMULATIVE outputs carry the logprobs and
    cumulative_logprob so far, and with n = 2 each output holds the one completion that moved."""
    from specdec import RequestOutputKind as Kind

    llm = LLM(TARGET, max_model_len=128, num_speculative_tokens=0)
    engine, prompt = llm.llm_engine, "def f(x):"
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    ref = llm.generate(prompt, SamplingParams(**greedy))[0].outputs[0]
    n2 = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=4, ignore_eos=True)
    ref2 = llm.generate(prompt, n2)[0].outputs
    engine.add_request("delta", prompt, SamplingParams(**greedy, output_kind=Kind.DELTA))
    engine.add_request("final", prompt, SamplingParams(**greedy, output_kind=Kind.FINAL_ONLY))
    engine.add_request("cumulative", prompt, SamplingParams(**greedy))
    engine.add_request("n2", prompt, n2)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    delta = [o.outputs[0] for o in outs["delta"]]
    assert len(delta) == 6 and all(len(c.token_ids) == 1 and len(c.logprobs) == 1 for c in delta)
    assert "".join(c.text for c in delta) == ref.text and sum((c.token_ids for c in delta), []) == ref.token_ids
    assert [c.logprobs[0].logprob for c in delta] == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-5)
    final = outs["final"]
    assert [o.finished for o in final] == [True] and final[0].outputs[0].token_ids == ref.token_ids
    for o in outs["cumulative"]:
        c = o.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) and c.token_ids == ref.token_ids[:len(c.token_ids)]
        assert c.cumulative_logprob == pytest.approx(sum(e.logprob for e in c.logprobs))
    assert outs["cumulative"][-1].outputs[0].cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-4)
    assert all(len(o.outputs) == 1 for o in outs["n2"]) and [o.finished for o in outs["n2"]][-1]
    last = {o.outputs[0].index: o.outputs[0] for o in outs["n2"]}
    assert [last[i].token_ids for i in range(2)] == [c.token_ids for c in ref2]


def test_llm_engine_request_ids_are_strings():
    """vLLM v1's LLMEngine refuses a request id that is not a string at add_request (an int was
    stored as its str, so abort_request(7) matched nothing and the request ran on)."""
    from specdec import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=TARGET, max_model_len=128))
    with pytest.raises(TypeError, match="request_id must be a string"):
        engine.add_request(7, "Hello", SamplingParams(max_tokens=100))
    assert not engine.has_unfinished_requests()
    engine.add_request("7", "Hello", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    engine.step()
    engine.abort_request(["7"])
    assert not engine.has_unfinished_requests() and engine.step() == []


def test_none_means_the_default():
    """vLLM's EngineArgs fields are Optional (its spec_decode.py passes max_num_seqs=None)."""
    llm = LLM(TARGET, max_num_seqs=None, max_num_batched_tokens=None, block_size=None)
    assert (llm.engine.config.max_num_seqs, llm.engine.config.max_num_batched_tokens,
            llm.engine.config.block_size) == (16, 2048, 16)


def test_get_metrics_has_vllms_histograms():
    """vLLM's metrics.py / spec_decode.py read histograms from get_metrics(): count, sum, cumulative buckets."""
    llm = LLM(TARGET, speculative_model=DRAFT, num_speculative_tokens=3)
    outs = llm.generate(["def f(x):", "class A:", "import os"], SamplingParams(temperature=0, max_tokens=10,
                                                                               ignore_eos=True))
    metrics = {m.name: m for m in llm.get_metrics()}
    gen = metrics["vllm:request_generation_tokens"]
    assert isinstance(gen, Histogram) and gen.count == 3 and gen.sum == 30
    assert gen.buckets["10.0"] == 3 and gen.buckets["5.0"] == 0 and gen.buckets["+Inf"] == 3
    ttft, e2e = metrics["vllm:time_to_first_token_seconds"], metrics["vllm:e2e_request_latency_seconds"]
    assert ttft.count == e2e.count == 3 and 0 < ttft.sum <= e2e.sum
    assert metrics["vllm:request_prompt_tokens"].sum == sum(len(o.prompt_token_ids) for o in outs)
    assert isinstance(metrics["vllm:generation_tokens"], Counter) and metrics["vllm:generation_tokens"].value == 30


def test_a_template_that_fails_on_its_input_is_a_400(tiny_pair):
    """A template that adds a message's content to a string, given OpenAI's parts
    (--chat-template-content-format openai): vLLM answers 400; offline, one ValueError."""
    from specdec.server import ServerConfig, build_app
    from tests.test_server import LiveServer

    template = "{% for m in messages %}{{ 'User: ' + m['content'] }}{% endfor %}"
    llm = LLM(tiny_pair[0], max_model_len=64)
    with pytest.raises(ValueError, match="chat template failed: TypeError"):
        llm.chat([{"role": "user", "content": "hi"}], chat_template=template, chat_template_content_format="openai")
    config = ServerConfig(chat_template=template, chat_template_content_format="openai")
    with LiveServer(build_app(llm, config)) as live:
        r = httpx.post(live.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "chat template failed" in r.json()["error"]["message"]


def test_pooling_calls_on_a_generative_model_name_themselves():
    llm = LLM(TARGET)
    for call, name in ((lambda: llm.classify(["x"]), "LLM.classify()"), (lambda: llm.score("a", "b"), "LLM.score()"),
                       (lambda: llm.encode(["x"]), "LLM.encode()")):
        with pytest.raises(ValueError, match=name.replace("(", r"\(").replace(")", r"\)")):
            call()


def test_engine_args_reads_as_a_dataclass():
    """vLLM's examples: LLM(**(asdict(EngineArgs(model=..., ...)) | {...}))."""
    from dataclasses import asdict, fields, is_dataclass, replace

    args = EngineArgs(model=TARGET, max_model_len=128)
    assert is_dataclass(args) and {"model", "max_model_len", "speculative_config"} <= {f.name for f in fields(args)}
    llm = LLM(**(asdict(args) | {"max_num_seqs": 4}))
    assert (llm.engine.max_model_len, llm.engine.config.max_num_seqs) == (128, 4)
    assert replace(args, max_model_len=64).max_model_len == 64


def test_a_hugging_face_id_reads_from_the_local_cache(tiny_pair, tmp_path, monkeypatch, capsys):
    """`--model org/name` (vLLM's usual spelling) finds the model in the local Hugging Face cache
    (HF_HOME), downloading nothing; one not there is a one-line error that says so."""
    import shutil

    from specdec.cli import main

    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_pair[0], snapshot)
    (tmp_path / "hub" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llm = LLM("acme/tiny")
    assert llm.model_path == str(snapshot)
    want = LLM(str(tiny_pair[0])).generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=5))
    got = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=5))
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert main(["generate", "--model", "acme/missing", "--max-tokens", "2", "hi"]) == 2
    assert "not in the local cache" in capsys.readouterr().err
