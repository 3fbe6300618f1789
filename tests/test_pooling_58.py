"""Pooling as vLLM runs it (pool58): sentence_bert_config.json (max_seq_length, do_lower_case),
hf_overrides that reach the pooling head (matryoshka, problem_type, id2label, the Qwen3-Reranker
recipe), use_activation offline and on /classify, /score, /rerank, a client that leaves aborting
its pooling request, and vLLM's request and response shapes (score's field names, /classify
messages, embed_dtype, usage)."""

from __future__ import annotations

import base64
import json
import shutil
import socket
import threading
from urllib.parse import urlparse

import httpx
import numpy as np
import pytest
import torch
import transformers

from conftest import make_checkpoint
from specdec import LLM
from specdec.pooling import PoolerConfig, PoolingParams
from specdec.server import ServerConfig, build_app
from test_pooling import TEXTS, _classifier_folder, _logits, reference
from test_server import LiveServer


def test_sentence_bert_config_caps_the_context_and_lowercases(tiny_pair, tmp_path):
    """vLLM's encoder_config: max_seq_length is the context (a longer max_model_len refused, a
    longer input refused unless truncated), do_lower_case lowercases text as sentence-transformers."""
    folder = shutil.copytree(tiny_pair[0], tmp_path / "st")
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16, "do_lower_case": True}))
    llm = LLM(str(folder), convert="embed", dtype="float32")
    assert llm.engine.max_model_len == 16
    text = "Def ADD(a)"
    ids = transformers.AutoTokenizer.from_pretrained(folder)(text.lower())["input_ids"]
    assert len(ids) <= 16 and ids != transformers.AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
    out = llm.embed(text)[0]
    assert out.prompt_token_ids == ids
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), reference(folder, ids, "MEAN", normalize=False),
                               atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="maximum context length is 16"):
        llm.embed("def add(a, b):\n    return a + b\n")
    assert len(llm.embed("def add(a, b):\n    return a + b\n", truncate_prompt_tokens=-1)[0].prompt_token_ids) == 16
    with pytest.raises(ValueError, match="max_seq_length"):
        LLM(str(folder), convert="embed", max_model_len=32)


def test_hf_overrides_reach_the_pooling_head(tmp_path):
    """is_matryoshka / matryoshka_dimensions, problem_type and id2label given as hf_overrides act
    as they do in config.json (vLLM's documented way to enable Matryoshka on Qwen3-Embedding)."""
    src = make_checkpoint(tmp_path / "src", arch="qwen3", hidden=64, layers=2, seed=1)
    plain = LLM(str(src), convert="embed", dtype="float32")
    with pytest.raises(ValueError, match="does not support matryoshka"):
        plain.embed(TEXTS[0], PoolingParams(dimensions=32))
    full = plain.embed(TEXTS[0], PoolingParams(normalize=False))[0].outputs.embedding
    mrl = LLM(str(src), convert="embed", dtype="float32", hf_overrides={"is_matryoshka": True})
    short = mrl.embed(TEXTS[0], PoolingParams(dimensions=32))[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(short), torch.nn.functional.normalize(torch.tensor(full[:32]), dim=0),
                               atol=1e-6, rtol=0)
    listed = LLM(str(src), convert="embed", dtype="float32", hf_overrides={"matryoshka_dimensions": [16, 32]})
    assert len(listed.embed(TEXTS[0], PoolingParams(dimensions=16))[0].outputs.embedding) == 16
    with pytest.raises(ValueError, match="supports 16, 32"):
        listed.embed(TEXTS[0], PoolingParams(dimensions=24))

    folder, hf = _classifier_folder(tmp_path, "clf", 3, 6)
    llm = LLM(str(folder), hf_overrides={"problem_type": "multi_label_classification",
                                         "id2label": {"0": "A", "1": "B", "2": "C"}})
    out = llm.classify(TEXTS[0])[0]
    assert out.outputs.probs == pytest.approx(torch.sigmoid(_logits(hf, out.prompt_token_ids)).tolist(), abs=1e-5)
    assert llm.classifier.labels == ["A", "B", "C"]


def test_qwen3_reranker_recipe(tmp_path):
    """vLLM's Qwen3-Reranker recipe on a Qwen3ForCausalLM: a one-label classifier whose score is
    the softmax of the LM head's logits of (false, true) tokens at the last position, i.e. the
    causal LM's own probability ratio; runner "auto" picks pooling from the overridden
    architectures. A token outside the vocabulary is refused at load."""
    src = make_checkpoint(tmp_path / "src", arch="qwen3", hidden=64, layers=2, seed=4)
    tok = transformers.AutoTokenizer.from_pretrained(src)
    no, yes = [t for t in tok.get_vocab() if t.isalpha() and len(t) == 1][:2]
    recipe = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, yes],
              "is_original_qwen3_reranker": True}
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    for kw in ({"runner": "pooling"}, {}):
        llm = LLM(str(src), hf_overrides=recipe, dtype="float32", **kw)
        assert llm.runner == "pooling" and llm.classifier.labels and len(llm.classifier.labels) == 1
        outs = llm.score("query", ["doc one", "query"])
        for o in outs:
            with torch.inference_mode():
                logits = hf(torch.tensor([o.prompt_token_ids])).logits[0, -1]
            want = torch.softmax(logits[tok.convert_tokens_to_ids([no, yes])], -1)[1].item()
            assert o.outputs.score == pytest.approx(want, abs=1e-5)
    with pytest.raises(ValueError, match="not a token of the vocabulary"):
        LLM(str(src), hf_overrides={**recipe, "classifier_from_token": ["no-such-token", yes]}, runner="pooling")


def test_use_activation_offline(tmp_path):
    """PoolingParams(use_activation=False) (or its old names) gives the raw logits from classify and
    a cross-encoder's score; pooling_params is accepted by classify, score, encode; reward is refused."""
    folder, hf = _classifier_folder(tmp_path, "clf", 3, 6)
    llm = LLM(str(folder))
    for params in (PoolingParams(use_activation=False), PoolingParams(activation=False), PoolingParams(softmax=False)):
        out = llm.classify(TEXTS[0], pooling_params=params)[0]
        assert out.outputs.probs == pytest.approx(_logits(hf, out.prompt_token_ids).tolist(), abs=1e-5)
    out = llm.encode(TEXTS[0], PoolingParams(use_activation=False), pooling_task="classify")[0]
    assert out.outputs.probs == pytest.approx(_logits(hf, out.prompt_token_ids).tolist(), abs=1e-5)
    assert sum(llm.classify(TEXTS[0], pooling_params=PoolingParams())[0].outputs.probs) == pytest.approx(1)
    with pytest.raises(ValueError, match="applies to embeddings"):
        llm.classify(TEXTS[0], pooling_params=PoolingParams(dimensions=2))
    with pytest.raises(ValueError, match="token_classify"):
        llm.reward(TEXTS[0])
    ce, hf_ce = _classifier_folder(tmp_path, "ce", 1, 8)
    cross = LLM(str(ce))
    out = cross.score(TEXTS[0], TEXTS[1], pooling_params=PoolingParams(use_activation=False), lora_request=None)[0]
    assert out.outputs.score == pytest.approx(_logits(hf_ce, out.prompt_token_ids)[0].item(), abs=1e-5)
    assert cross.score(TEXTS[0], TEXTS[1])[0].outputs.score == pytest.approx(torch.sigmoid(
        _logits(hf_ce, out.prompt_token_ids)[0]).item(), abs=1e-5)


def test_pooler_config_object(tiny_pair):
    llm = LLM(str(tiny_pair[0]), runner="pooling", pooler_config=PoolerConfig(pooling_type="MEAN", normalize=False))
    assert (llm.pooler.pooling_type, llm.pooler.normalize) == ("MEAN", False)


def test_cross_encoder_endpoints_as_vllm(tmp_path):
    """use_activation (and activation / softmax) on /score, /rerank, /classify; score's
    queries/documents and data_1/data_2 forms; /classify messages; vLLM's usage fields."""
    ce, hf = _classifier_folder(tmp_path, "ce", 1, 8)
    llm = LLM(str(ce), max_model_len=64)
    docs = ["class Point:", "import os"]
    want = {d: o.outputs.score for d, o in zip(docs, llm.score(TEXTS[0], docs))}
    raw = {d: o.outputs.score for d, o in zip(docs, llm.score(TEXTS[0], docs,
                                                             pooling_params=PoolingParams(use_activation=False)))}
    assert raw != pytest.approx(want)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("ce",)))) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http:
        for extra, expect in (({}, want), ({"use_activation": False}, raw), ({"activation": False}, raw),
                              ({"softmax": False}, raw)):
            for body in ({"text_1": TEXTS[0], "text_2": docs}, {"queries": TEXTS[0], "documents": docs},
                         {"data_1": TEXTS[0], "data_2": docs}):
                r = http.post("/score", json={**body, **extra})
                assert r.status_code == 200, r.text
                assert [d["score"] for d in r.json()["data"]] == pytest.approx([expect[d] for d in docs], abs=1e-6)
                usage = r.json()["usage"]
                assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == usage["total_tokens"] > 0
            r = http.post("/rerank", json={"query": TEXTS[0], "documents": docs, **extra}).json()
            assert {docs[x["index"]]: x["relevance_score"] for x in r["results"]} == pytest.approx(expect, abs=1e-6)
            assert r["usage"]["prompt_tokens"] == r["usage"]["total_tokens"] > 0
        assert http.post("/score", json={"queries": TEXTS[0]}).status_code == 400
        r = http.post("/invocations", json={"queries": TEXTS[0], "documents": docs})      # SageMaker's route
        assert [d["score"] for d in r.json()["data"]] == pytest.approx([want[d] for d in docs], abs=1e-6)
        r = http.post("/classify", json={"messages": [{"role": "user", "content": "hi"}], "use_activation": False})
        assert r.status_code == 200, r.text
        ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                                     tokenize=False), add_special_tokens=False)
        assert r.json()["data"][0]["probs"] == pytest.approx(_logits(hf, ids).tolist(), abs=1e-5)


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory):
    """A bare Qwen3 embedder with small forwards (many per big request), its forwards counted."""
    root = tmp_path_factory.mktemp("p58")
    src = make_checkpoint(root / "src", arch="qwen3", hidden=64, layers=2, seed=1)
    llm = LLM(str(src), convert="embed", max_model_len=64, max_num_batched_tokens=64)
    solo = llm.embed(TEXTS[0])[0].outputs.embedding
    forwards, started = [0], threading.Event()

    def count(*_):
        forwards[0] += 1
        started.set()
    llm.target.register_forward_hook(count)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("embedder",)))) as live:
        live.solo, live.forwards, live.started, live.llm = solo, forwards, started, llm
        yield live


def test_embed_dtype_and_usage(embed_server):
    with httpx.Client(base_url=embed_server.url, timeout=60) as http:
        for dtype, np_dtype in (("float32", "<f4"), ("float16", "<f2"), (">float16", ">f2")):
            big = dtype.startswith(">")
            r = http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64",
                                                  "embed_dtype": dtype.lstrip(">"),
                                                  "endianness": "big" if big else "little"}).json()
            got = np.frombuffer(base64.b64decode(r["data"][0]["embedding"]), dtype=np_dtype)
            assert got.tolist() == np.array(embed_server.solo, dtype=np_dtype).tolist()
            assert r["usage"]["completion_tokens"] == 0
        r = http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64",
                                              "embed_dtype": "bfloat16"}).json()
        bits = torch.from_numpy(np.frombuffer(base64.b64decode(r["data"][0]["embedding"]), dtype="<i2").copy())
        assert bits.view(torch.bfloat16).tolist() == torch.tensor(embed_server.solo).bfloat16().tolist()
        r = http.post("/pooling", json={"input": TEXTS[0]}).json()
        assert r["usage"]["completion_tokens"] == 0


def test_a_client_that_leaves_aborts_its_pooling_request(embed_server):
    """The client closes its connection once the big request's first forward has run: the server
    stops it before the next forward (vLLM aborts it), so the engine never runs the rest and the
    next request is not queued behind it."""
    n = 2000
    body = json.dumps({"input": [TEXTS[0]] * n}).encode()
    total = -(-n * len(embed_server.llm.tokenizer.encode(TEXTS[0])) // 64)      # forwards it would take
    url = urlparse(embed_server.url)
    embed_server.started.clear()
    before = embed_server.forwards[0]
    with socket.create_connection((url.hostname, url.port)) as s:
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert embed_server.started.wait(60)
    r = httpx.post(embed_server.url + "/v1/embeddings", json={"input": TEXTS[0]}, timeout=120)
    assert r.status_code == 200 and r.json()["data"][0]["embedding"] == pytest.approx(embed_server.solo, abs=1e-6)
    assert embed_server.forwards[0] - before < total / 2


def test_offline_metrics_count_pooled_inputs(tmp_path):
    """get_metrics counts each pooled input as a finished request with its prompt tokens, as the
    server's /metrics does (pooling ran beside the engine and was not counted)."""
    src = make_checkpoint(tmp_path / "src", arch="qwen3", hidden=64, layers=2, seed=1)
    llm = LLM(str(src), convert="embed")
    outs = llm.embed(TEXTS)
    got = {(m.name, m.labels.get("finished_reason")): m for m in llm.get_metrics()}
    assert got[("vllm:request_success", "stop")].value == 3
    assert got[("vllm:prompt_tokens", None)].value == sum(len(o.prompt_token_ids) for o in outs)
    assert got[("vllm:e2e_request_latency_seconds", None)].count == 3
