"""vLLM's priority scheduling (`scheduling_policy="priority"`, `--scheduling-policy priority`):
the queue is ordered by (priority, arrival), lower first; the least urgent running request is
the one preempted; outputs do not change; a priority without the policy is refused."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from specdec import LLM, SamplingParams
from specdec.server import ServerConfig, build_app

from test_engine import PROMPTS
from test_server import LiveServer, metric

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _llm(target, policy: str, **kw) -> LLM:
    return LLM(model=target, dtype="float32", num_speculative_tokens=0, scheduling_policy=policy, **kw)


def _finish_order(engine, reqs) -> list[int]:
    """Step until every request is done: the indices of reqs in the order they finished."""
    order = []
    while engine.has_unfinished():
        engine.step()
        order += [i for i, r in enumerate(reqs) if r.finished and i not in order]
    return order


@pytest.fixture(scope="module")
def solo(tiny_pair):
    llm = _llm(tiny_pair[0], "fcfs", max_num_seqs=1)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:5], GREEDY)]


def test_one_seat_serves_by_priority_then_arrival(tiny_pair, solo):
    """One seat, five queued requests: priority order, ties by arrival; fcfs keeps arrival order."""
    priorities = [3, 1, 2, 1, 0]
    for policy, want in (("priority", [4, 1, 3, 2, 0]), ("fcfs", [0, 1, 2, 3, 4])):
        engine = _llm(tiny_pair[0], policy, max_num_seqs=1).engine
        ids = [engine.tokenizer.encode(p) for p in PROMPTS[:5]]
        reqs = [engine.add_request(i, GREEDY, priority=p if policy == "priority" else 0)
                for i, p in zip(ids, priorities)]
        assert _finish_order(engine, reqs) == want, policy
        assert [r.out for r in reqs] == solo


def test_generate_takes_one_priority_per_prompt(tiny_pair, solo):
    llm = _llm(tiny_pair[0], "priority", max_num_seqs=2)
    outs = llm.generate(PROMPTS[:5], GREEDY, priority=[4, 3, 2, 1, 0])
    assert [o.outputs[0].token_ids for o in outs] == solo                 # outputs in prompt order
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(PROMPTS[:2], GREEDY, priority=[0])
    with pytest.raises(ValueError, match="priority must be an integer"):
        llm.generate(PROMPTS[:1], GREEDY, priority=[0.5])


def test_a_priority_without_the_policy_is_refused(tiny_pair):
    llm = _llm(tiny_pair[0], "fcfs")
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm.generate(PROMPTS[:1], GREEDY, priority=[1])
    llm.generate(PROMPTS[:1], GREEDY, priority=[0])                       # 0 is every request's default
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        _llm(tiny_pair[0], "lifo")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_takes_the_least_urgent_request(tiny_pair, policy):
    """A pool of 4 blocks (one full-length sequence): two growing sequences cannot both stay.
    fcfs preempts the newest; priority preempts the least urgent, here the older one. Outputs
    equal their solo runs either way."""
    probe = _llm(tiny_pair[0], policy, max_model_len=64)
    per_slot = probe.target.kv_bytes_per_slot()
    engine = _llm(tiny_pair[0], policy, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=256,
                  kv_cache_memory=4 * 16 * per_slot).engine
    assert engine.blocks.num_blocks == 4
    prompt = engine.tokenizer.encode(PROMPTS[0])[:20]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    urgent = policy == "priority"
    older = engine.add_request(prompt, params, priority=5 if urgent else 0)
    newer = engine.add_request(prompt, params, priority=0)
    while engine.has_unfinished():
        engine.step()
    victim, kept = (older, newer) if urgent else (newer, older)
    assert victim.num_preemptions > 0 and kept.num_preemptions == 0
    want = probe.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
    assert older.out == newer.out == want
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.fixture(scope="module")
def servers(tiny_pair):
    """A fcfs server and a priority server with one seat each (plain decoding). The priority
    server's steps take 20 ms more, so that a 200-token stream holds its seat for seconds while
    other requests queue (the tiny model would finish it in a fraction of a second)."""
    lives = {}
    for policy in ("fcfs", "priority"):
        llm = _llm(tiny_pair[0], policy, max_num_seqs=1, max_model_len=256)
        if policy == "priority":
            step = llm.engine.step
            llm.engine.step = lambda: (time.sleep(0.02), step())[1]
        lives[policy] = LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))).__enter__()
    yield lives
    for live in lives.values():
        live.__exit__(None, None, None)


def test_server_queues_by_the_priority_field(servers):
    """A long stream holds the only seat while three requests queue with priorities 2, 1, 0;
    once the stream is closed they are served lowest priority first (vLLM's `priority` field,
    through the official client's extra_body)."""
    live = servers["priority"]
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    done, lock = [], threading.Lock()

    def ask(priority: int) -> None:
        client.completions.create(model="tiny", prompt=PROMPTS[priority], max_tokens=4, temperature=0,
                                  extra_body={"priority": priority})
        with lock:
            done.append(priority)

    with httpx.Client(base_url=live.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": PROMPTS[3], "max_tokens": 200,
                                                           "temperature": 0, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()          # kept: a dropped iterator would close the stream
            next(lines)                                        # the seat is taken
            threads = [threading.Thread(target=ask, args=(p,)) for p in (2, 1, 0)]
            for t in threads:
                t.start()
                time.sleep(0.05)                               # arrival order 2, 1, 0
            deadline = time.monotonic() + 30
            while metric(http, "specdec:num_requests_waiting") < 3:
                assert time.monotonic() < deadline, "the requests did not queue"
                time.sleep(0.01)
        for t in threads:                                      # closing the stream freed the seat
            t.join(60)
    assert done == [0, 1, 2]


def test_server_refuses_a_priority_without_the_policy(servers):
    client = openai.OpenAI(base_url=servers["fcfs"].url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"priority": 1})
    assert e.value.body["param"] == "priority" and "--scheduling-policy priority" in e.value.body["message"]
    with httpx.Client(base_url=servers["priority"].url, timeout=60) as http:
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2, "priority": "high"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        r = http.post("/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 2, "priority": -3})
        assert r.status_code == 200, r.text
