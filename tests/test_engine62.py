"""Engine.add_request refuses a request id already waiting or running (vLLM's "already running"):
ids key the KV blocks, and a duplicate had jammed every later step."""

import pytest

from specdec import LLM, SamplingParams

TARGET = "models/target"


@pytest.fixture(scope="module")
def engine():
    return LLM(model=TARGET, max_model_len=128).engine


def _drain(engine):
    outs = {}
    for _ in range(200):
        for e in engine.step():
            outs.setdefault(e.request_id, []).extend(e.token_ids)
        if not engine.has_unfinished():
            return outs
    raise AssertionError("the engine did not finish")


def test_duplicate_request_id_refused(engine):
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.add_request([5, 6, 7, 8], sp, request_id="a")
    with pytest.raises(ValueError, match="'a' is already running"):
        engine.add_request([9, 10, 11], sp, request_id="a")
    engine.add_request([12, 13, 14], sp, request_id="b")
    outs = _drain(engine)
    assert sorted(outs) == ["a", "b"] and all(len(v) == 5 for v in outs.values())


def test_id_free_again_after_finish_and_abort(engine):
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request([5, 6, 7], sp, request_id="x")
    first = _drain(engine)["x"]
    engine.add_request([5, 6, 7], sp, request_id="x")          # finished: the id is free
    assert _drain(engine)["x"] == first
    engine.add_request([5, 6, 7], sp, request_id="y")
    assert engine.abort("y") is not None
    engine.add_request([5, 6, 7], sp, request_id="y")          # aborted: free too
    assert _drain(engine)["y"] == first
