"""A server under abuse: many streaming clients at once, some leaving mid-stream, bad requests
mixed in, for a fixed time (scripts/serve_stress.py runs it; tests run a short version).

Each client loops over random actions:
- greedy: a streamed greedy completion of one of a few prompts, checked against that prompt's
  solo output (the same request sent alone before the storm);
- leave: the same request, abandoned after a few chunks (the server must free its seat and
  blocks at once);
- bad: a malformed or invalid request, which must get a 4xx with OpenAI's error body;
- sampled: a seeded sampled completion (checked for completing only);
- tools: a streamed greedy call of a tool (`tool_choice` "required": the grammar makes the
  model call it), its name and arguments checked against the same request's solo output;
- responses: the greedy request through the Responses API, streamed (its typed events), its
  text checked against the chat endpoint's solo output.
With LoRA adapters (`models`: the adapters' names, and None for the base model), each valid
request names one of them at random, and solo outputs are kept per model.
Checks: no 5xx and no transport failure ever; every greedy completion equals its solo output;
at the end nothing is running and the KV pool is empty; the server's resident memory, sampled
every few seconds, is flat (second half against first half of the run).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

PROMPTS = ["Write a short poem about the sea.", "Explain what a hash table is.", "List three uses of copper.",
           "Summarize the plot of Hamlet in two sentences.", "How do I reverse a list in Python?",
           "What is the capital of France? Answer in one word.", "Give me a recipe for pancakes.",
           "Translate 'good morning' into German and Spanish."]
BAD = [b'{"messages": [{"role": "user", "content": "x"}], ', b'["not an object"]',
       json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": -1}).encode(),
       json.dumps({"messages": [], "max_tokens": 4}).encode(),
       json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9}).encode(),
       json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 10**4}).encode(),
       json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}).encode()]
ACTIONS = (("greedy", 0.4), ("leave", 0.2), ("bad", 0.1), ("sampled", 0.1), ("tools", 0.1), ("responses", 0.1))
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a topic up", "parameters": {
    "type": "object", "properties": {"topic": {"type": "string", "maxLength": 40}}, "required": ["topic"],
    "additionalProperties": False}}}]


@dataclass
class Report:
    counts: Counter = field(default_factory=Counter)        # action -> done
    status: Counter = field(default_factory=Counter)        # HTTP status -> responses
    mismatches: list = field(default_factory=list)
    failures: list = field(default_factory=list)            # 5xx, transport errors, wrong error bodies
    rss_mb: list = field(default_factory=list)              # (seconds since start, resident MiB)
    tokens: int = 0
    end_metrics: dict = field(default_factory=dict)

    def memory_growth(self) -> float | None:
        """Mean RSS of the run's second half over its first half, minus 1."""
        if len(self.rss_mb) < 4:
            return None
        half = len(self.rss_mb) // 2
        first = sum(m for _, m in self.rss_mb[:half]) / half
        second = sum(m for _, m in self.rss_mb[half:]) / (len(self.rss_mb) - half)
        return second / first - 1

    def ok(self, max_growth: float = 0.05) -> bool:
        growth = self.memory_growth()
        return (not self.failures and not self.mismatches and self.counts["greedy"] > 0
                and self.end_metrics.get("num_requests_running") == 0
                and self.end_metrics.get("kv_cache_usage_perc") == 0
                and (growth is None or growth < max_growth))

    def to_dict(self) -> dict:
        growth = self.memory_growth()
        return {"ok": self.ok(), "actions": dict(self.counts), "status": {str(k): v for k, v in self.status.items()},
                "tokens": self.tokens, "mismatches": self.mismatches[:5], "failures": self.failures[:5],
                "num_failures": len(self.failures), "memory_growth": None if growth is None else round(growth, 4),
                "rss_mb": [(round(t, 1), round(m, 1)) for t, m in self.rss_mb], "end_metrics": self.end_metrics}


def _body(prompt: str, max_tokens: int, model: str | None = None, **extra) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True,
            **({"model": model} if model is not None else {}), **extra}


def _tool_body(prompt: str, max_tokens: int, model: str | None = None) -> dict:
    return _body(prompt, max_tokens, model, temperature=0, tools=TOOLS, tool_choice="required",
                 parallel_tool_calls=False)


def _reply(content: str | None, calls) -> str:
    """A reply as one string: its text, then each call's name and arguments."""
    return (content or "") + "".join(f"\n<call {c['function']['name']}>{c['function']['arguments']}" for c in calls or [])


async def _events(client: httpx.AsyncClient, path: str, body: dict, report: Report):
    """A streamed POST's data events, parsed; a single None when it failed (recorded). Iterate
    it inside contextlib.aclosing: leaving the loop early then closes the stream at once."""
    async with client.stream("POST", path, json=body) as r:
        report.status[r.status_code] += 1
        if r.status_code != 200:
            report.failures.append(f"status {r.status_code} for a valid {path} request: {(await r.aread())[:200]!r}")
            yield None
            return
        async for line in _sse_lines(r):
            if line.startswith("data: {"):
                yield json.loads(line[6:])


async def _sse_lines(response: httpx.Response):
    """A server-sent event stream's lines, ended by LF (CR LF) as SSE's are. httpx's aiter_lines
    splits as str.splitlines does, also at U+2028, U+0085, \x0b, ...: characters a JSON string
    carries raw, so a chunk whose text held one was cut in two (the stress run then failed)."""
    pending = ""
    async for text in response.aiter_text():
        pending += text
        *lines, pending = pending.split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending.removesuffix("\r")


async def _stream(client: httpx.AsyncClient, body: dict, report: Report, leave_after: int | None = None) -> str | None:
    """A streamed chat completion's text (None when left early or failed)."""
    text, chunks, calls = [], 0, {}
    async with contextlib.aclosing(_events(client, "/v1/chat/completions", body, report)) as events:
        async for event in events:
            if event is None:
                return None
            if "error" in event:
                report.failures.append(f"error event mid-stream: {event['error']}")
                return None
            for c in event.get("choices", []):
                text.append(c["delta"].get("content") or "")
                for d in c["delta"].get("tool_calls") or []:
                    call = calls.setdefault(d["index"], {"function": {"name": "", "arguments": ""}})
                    for key in ("name", "arguments"):
                        call["function"][key] += (d.get("function") or {}).get(key) or ""
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                return None                         # closing the stream disconnects
            if event.get("usage"):
                report.tokens += event["usage"]["completion_tokens"]
    return _reply("".join(text), [calls[i] for i in sorted(calls)])


async def _responses(client: httpx.AsyncClient, prompt: str, max_tokens: int, report: Report,
                     model: str | None = None) -> str | None:
    """A streamed Responses API reply's text (None when it failed)."""
    body = {"input": prompt, "max_output_tokens": max_tokens, "temperature": 0, "stream": True, "store": False,
            **({"model": model} if model is not None else {})}
    text, final = [], None
    async with contextlib.aclosing(_events(client, "/v1/responses", body, report)) as events:
        async for event in events:
            if event is None:
                return None
            if event["type"] == "error":
                report.failures.append(f"error event mid-stream: {event}")
                return None
            if event["type"] == "response.output_text.delta":
                text.append(event["delta"])
            elif event["type"] in ("response.completed", "response.incomplete"):
                final = event["response"]
                report.tokens += final["usage"]["output_tokens"]
    if final is None:
        report.failures.append("a responses stream ended without response.completed")
        return None
    return "".join(text)


async def _bad(client: httpx.AsyncClient, report: Report, rng: random.Random) -> None:
    r = await client.post("/v1/chat/completions", content=rng.choice(BAD), headers={"content-type": "application/json"})
    report.status[r.status_code] += 1
    try:
        body = r.json()
    except ValueError:
        body = {}
    if not 400 <= r.status_code < 500 or set(body.get("error", {})) != {"message", "type", "param", "code"}:
        report.failures.append(f"bad request answered {r.status_code}: {r.text[:200]}")


async def _client(url: str, until: float, solo: dict, max_tokens: int, report: Report, seed: int,
                  models: tuple = (None,)) -> None:
    rng = random.Random(seed)
    names, weights = zip(*ACTIONS)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        while time.monotonic() < until:
            action = rng.choices(names, weights)[0]
            prompt = rng.choice(PROMPTS)
            model = rng.choice(models)
            key = prompt if model is None else (model, prompt)
            try:
                if action == "bad":
                    await _bad(client, report, rng)
                elif action == "tools":
                    body = {**_tool_body(prompt, max_tokens, model), "stream_options": {"include_usage": True}}
                    text = await _stream(client, body, report)
                    if text is not None and text != solo["tools", key]:
                        report.mismatches.append({"prompt": prompt, "model": model, "tools": True, "got": text[:200],
                                                  "solo": solo["tools", key][:200]})
                elif action == "responses":
                    text = await _responses(client, prompt, max_tokens, report, model)
                    if text is not None and text != solo[key]:
                        report.mismatches.append({"prompt": prompt, "model": model, "responses": True,
                                                  "got": text[:200], "solo": solo[key][:200]})
                elif action == "sampled":
                    body = _body(prompt, max_tokens, model, temperature=0.8, seed=rng.randrange(1 << 30),
                                 stream_options={"include_usage": True})
                    await _stream(client, body, report)
                else:
                    body = _body(prompt, max_tokens, model, temperature=0, stream_options={"include_usage": True})
                    text = await _stream(client, body, report, rng.randint(1, 6) if action == "leave" else None)
                    if action == "greedy" and text is not None and text != solo[key]:
                        report.mismatches.append({"prompt": prompt, "model": model, "got": text[:200],
                                                  "solo": solo[key][:200]})
                if model is not None and action != "bad":
                    report.counts["lora"] += 1          # of them, valid requests naming an adapter
                report.counts[action] += 1
            except httpx.HTTPError as e:
                report.failures.append(f"{action}: {type(e).__name__}: {e}")


def _metrics(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                 "generation_tokens_total"):
        m = re.search(rf"^\w+:{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)     # labels: model_name
        out[name] = float(m.group(1)) if m else None
    return out


async def _sample_rss(rss, until: float, every: float, report: Report, start: float) -> None:
    while time.monotonic() < until:
        report.rss_mb.append((time.monotonic() - start, rss()))
        await asyncio.sleep(every)


def solo_outputs(url: str, max_tokens: int, models: tuple = (None,)) -> dict:
    """Each prompt's greedy output (key: the prompt, or (model, prompt) for an adapter) and greedy
    tool call (key: ("tools", that key)), requested alone and not streamed."""
    out = {}
    with httpx.Client(base_url=url, timeout=600) as c:
        for model in models:
            for p in PROMPTS:
                key = p if model is None else (model, p)
                r = c.post("/v1/chat/completions", json={**_body(p, max_tokens, model, temperature=0), "stream": False})
                r.raise_for_status()
                out[key] = r.json()["choices"][0]["message"]["content"]
                r = c.post("/v1/chat/completions", json={**_tool_body(p, max_tokens, model), "stream": False})
                r.raise_for_status()
                msg = r.json()["choices"][0]["message"]
                out["tools", key] = _reply(msg["content"], msg.get("tool_calls"))
    return out


def run(url: str, clients: int, seconds: float, max_tokens: int = 48, rss=None, every: float = 5.0,
        seed: int = 0, loras: tuple[str, ...] = ()) -> Report:
    """The storm against the server at `url`; rss(): its resident MiB (None: not sampled); loras:
    the server's adapters, which valid requests name at random beside the base model."""
    report = Report()
    models = (None, *loras)
    solo = solo_outputs(url, max_tokens, models)

    async def storm():
        start = time.monotonic()
        until = start + seconds
        tasks = [_client(url, until, solo, max_tokens, report, seed + i, models) for i in range(clients)]
        if rss is not None:
            tasks.append(_sample_rss(rss, until, every, report, start))
        await asyncio.gather(*tasks)

    asyncio.run(storm())
    deadline = time.monotonic() + 30           # abandoned streams are aborted between steps
    while True:
        report.end_metrics = _metrics(url)
        if report.end_metrics["num_requests_running"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if rss is not None:
        report.rss_mb.append((seconds, rss()))
    return report


def process_rss(pid: int):
    """A reader of process pid's resident memory in MiB (Linux /proc)."""
    def read() -> float:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return float("nan")
    return read
