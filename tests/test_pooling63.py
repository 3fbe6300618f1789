"""Pooling fixes (review63): vLLM's use_activation turns an embedding's normalization off offline as
the server does (and in pooler_config, where it also sets a classifier's default); a
sentence-transformers Pooling config with several modes concatenates them as SentenceTransformer
does; vLLM's task names for pooling models map to the pooling runner."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest
import torch
from test_pooling import _classifier_folder, _hidden, _logits, reference
from test_pooling60 import embedder  # noqa: F401  (the fixture)
from test_server import LiveServer

from specdec import LLM, AsyncLLM
from specdec.pooling import PoolingParams
from specdec.server import ServerConfig, build_app
from specdec.server.cli import build_llm, parse_args

TEXT = "def add(a, b):\n    return a + b\n"


def _vec(out) -> torch.Tensor:
    return torch.tensor(out.outputs.embedding)


def test_use_activation_false_leaves_embeddings_unnormalized(embedder):  # noqa: F811
    """PoolingParams(use_activation=False) (and activation / softmax) was ignored by LLM.embed,
    LLM.encode and AsyncLLM.encode while /v1/embeddings honoured it; pooler_config's
    use_activation was refused as unknown."""
    llm = LLM(str(embedder), max_model_len=64, dtype="float32")
    ids = llm.embed(TEXT)[0].prompt_token_ids
    raw = reference(embedder, ids, normalize=False)
    assert raw.norm() > 1.5
    for params in (PoolingParams(use_activation=False), PoolingParams(activation=False),
                   PoolingParams(softmax=False)):
        torch.testing.assert_close(_vec(llm.embed(TEXT, params)[0]), raw, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(_vec(llm.encode(TEXT, params)[0]), raw, atol=1e-4, rtol=1e-5)
    # normalize, vLLM's older name, is read first (as the server reads it)
    assert _vec(llm.embed(TEXT, PoolingParams(normalize=True, use_activation=False))[0]).norm().item() == \
        pytest.approx(1, abs=1e-5)
    engine = AsyncLLM(llm=llm)
    try:
        (out,) = asyncio.run(_collect(engine.encode(TEXT, PoolingParams(use_activation=False), request_id="e")))
        torch.testing.assert_close(_vec(out), raw, atol=1e-4, rtol=1e-5)
    finally:
        engine.shutdown()
    offline = llm.embed(TEXT, PoolingParams(use_activation=False))[0].outputs.embedding
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("emb",)))) as live:
        r = httpx.post(live.url + "/v1/embeddings", json={"input": TEXT, "use_activation": False}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["data"][0]["embedding"] == pytest.approx(offline, abs=1e-6)
    off = LLM(str(embedder), max_model_len=64, dtype="float32", pooler_config={"use_activation": False})
    assert off.pooler.normalize is False
    torch.testing.assert_close(_vec(off.embed(TEXT)[0]), raw, atol=1e-4, rtol=1e-5)
    assert _vec(off.embed(TEXT, PoolingParams(use_activation=True))[0]).norm().item() == pytest.approx(1, abs=1e-5)


async def _collect(stream) -> list:
    return [o async for o in stream]


def test_pooler_config_use_activation_is_a_classifiers_default(tmp_path):
    """On a classifier, pooler_config's use_activation (or activation) is the default of the
    requests' use_activation: the raw logits, unless a request asks for the activation."""
    folder, hf = _classifier_folder(tmp_path, "clf", 3, 6)
    llm = LLM(str(folder), pooler_config={"use_activation": False})
    out = llm.classify(TEXT)[0]
    logits = _logits(hf, out.prompt_token_ids)
    assert out.outputs.probs == pytest.approx(logits.tolist(), abs=1e-5)
    probs = llm.classify(TEXT, pooling_params=PoolingParams(use_activation=True))[0].outputs.probs
    assert probs == pytest.approx(torch.softmax(logits, -1).tolist(), abs=1e-5)
    ce, hf_ce = _classifier_folder(tmp_path, "ce", 1, 8)
    out = LLM(str(ce), pooler_config={"activation": False}).score(TEXT, "add two numbers")[0]
    assert out.outputs.score == pytest.approx(_logits(hf_ce, out.prompt_token_ids)[0].item(), abs=1e-5)


def _st_folder(tiny_pair, tmp_path, modes: dict, dense: tuple | None = None):
    folder = shutil.copytree(tiny_pair[0], tmp_path / "st")
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"}]
    if dense is not None:
        w, b = dense
        modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
        (folder / "2_Dense").mkdir()
        torch.save({"linear.weight": w, "linear.bias": b}, folder / "2_Dense" / "pytorch_model.bin")
        (folder / "2_Dense" / "config.json").write_text(json.dumps({
            "in_features": w.shape[1], "out_features": w.shape[0], "bias": True,
            "activation_function": "torch.nn.modules.linear.Identity"}))
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(modes))
    return folder


def test_sentence_transformers_pooling_modes_concatenate(tiny_pair, tmp_path):
    """Several pooling_mode_* flags were reduced to one mode (mean + max gave the mean); SentenceTransformer
    concatenates them in its order: cls, max, mean, mean_sqrt_len, lasttoken; a Dense module
    after it takes the concatenated size."""
    hidden = json.loads((tiny_pair[0] / "config.json").read_text())["hidden_size"]
    torch.manual_seed(0)
    w, b = torch.randn(16, 2 * hidden) * 0.2, torch.randn(16) * 0.1
    cases = [({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}, None,
              lambda h: torch.cat([h.max(0).values, h.mean(0)])),
             ({"pooling_mode_lasttoken": True, "pooling_mode_cls_token": True}, (w, b),
              lambda h: torch.cat([h[0], h[-1]]) @ w.T + b)]
    for i, (modes, dense, want) in enumerate(cases):
        folder = _st_folder(tiny_pair, tmp_path / str(i), modes, dense)
        llm = LLM(str(folder), convert="embed", dtype="float32", max_model_len=64)
        out = llm.embed(TEXT)[0]
        expected = torch.nn.functional.normalize(want(_hidden(folder, out.prompt_token_ids)), dim=0)
        assert len(out.outputs.embedding) == len(expected) == (16 if dense else 2 * hidden)
        torch.testing.assert_close(_vec(out), expected, atol=1e-5, rtol=0)
    # pooler_config's pooling_type replaces the folder's modes
    mean = LLM(str(_st_folder(tiny_pair, tmp_path / "over", cases[0][0])), convert="embed", dtype="float32",
               max_model_len=64, pooler_config={"pooling_type": "MEAN"}).embed(TEXT)[0]
    torch.testing.assert_close(_vec(mean), reference(tmp_path / "over" / "st", mean.prompt_token_ids, "MEAN"),
                               atol=1e-5, rtol=0)
    # a mode it cannot run is refused even beside one it can (it had been skipped)
    folder = _st_folder(tiny_pair, tmp_path / "bad", {"pooling_mode_mean_tokens": True,
                                                      "pooling_mode_weightedmean_tokens": True})
    with pytest.raises(ValueError, match="pooling_mode_weightedmean_tokens is not supported"):
        LLM(str(folder), convert="embed")


def test_vllm_task_names_select_the_pooling_runner(embedder, tmp_path):  # noqa: F811
    """task="score" / "classify" / "embedding" and convert="classify" were refused; they run the
    pooling runner as vLLM's do. classify on a model without a score head and reward (per-token,
    which specdec lacks) are one-line errors."""
    ce, hf_ce = _classifier_folder(tmp_path, "ce", 1, 8)
    for kw in ({"task": "score"}, {"task": "classify"}, {"convert": "classify"}):
        llm = LLM(str(ce), max_model_len=64, **kw)
        assert llm.runner == "pooling" and llm.classifier is not None, kw
        out = llm.score(TEXT, "add two numbers")[0]
        assert out.outputs.score == pytest.approx(torch.sigmoid(_logits(hf_ce, out.prompt_token_ids)[0]).item(),
                                                  abs=1e-5)
    for task in ("embedding", "score"):
        llm = LLM(str(embedder), max_model_len=64, dtype="float32", task=task)
        out = llm.embed(TEXT)[0]
        torch.testing.assert_close(_vec(out), reference(embedder, out.prompt_token_ids), atol=1e-5, rtol=0)
    for kw in ({"task": "classify"}, {"convert": "classify"}):
        with pytest.raises(ValueError, match="needs a sequence classifier .* has Qwen3Model"):
            LLM(str(embedder), **kw)
    for kw in ({"task": "reward"}, {"convert": "reward"}):
        with pytest.raises(ValueError, match="'reward' .* is not supported"):
            LLM(str(ce), **kw)
    with pytest.raises(ValueError, match="task must be one of"):
        LLM(str(ce), task="rerank")
    args, unknown = parse_args(["--model", str(ce), "--task", "score", "--max-model-len", "64"])
    assert not unknown and build_llm(args).runner == "pooling"
