"""`specdec bench serve`: an OpenAI server under load, in the shape of vLLM's `vllm bench serve`.

For each variant (plain batched decoding, speculation with a fixed K, speculation with "auto"
K) it starts a server (or targets one with --base-url), then for each load point sends
Spec-Bench questions as streaming chat requests: Poisson arrivals at --request-rate (gaps from
a Gamma of shape --burstiness, as vLLM: 1 = Poisson, lower = burstier) and/or at most
--max-concurrency in flight. Per load point it reports, with vLLM's meanings:
- TTFT: request sent -> first chunk with choices (its text may be empty: a special token's);
- TPOT: per request (e2e - TTFT) / (output tokens - 1);
- ITL: gaps between chunks (with speculation one chunk may carry several tokens);
- E2EL: request sent -> last chunk;
- throughput: output tokens (and requests) per second of the load point's wall time;
- goodput (--goodput ttft:ms tpot:ms e2el:ms): requests per second meeting every SLO given;
- acceptance: from the server's /metrics counters over the load point (rate, mean length).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .spec_bench import read_questions

METRICS = ("ttft", "tpot", "itl", "e2el")
NUM_PROMPTS = 32            # a load point's requests without --num-prompts (point_size)
SPEC_COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "generation_tokens_total", "num_preemptions_total")
PER_POSITION = "spec_decode_num_accepted_tokens_per_pos_total"     # labelled position="i"


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    arrived: float = 0.0            # when it was due; sent - arrived: its wait for --max-concurrency
    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)     # arrival time of each chunk with choices
    output_tokens: int = 0
    prompt_tokens: int = 0
    usage: bool = False             # the stream carried usage (its completion_tokens, 0 included, stand)
    text: str = ""                  # the generated text, counted by a tokenizer when no usage came

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.sent

    @property
    def e2el(self) -> float:
        return self.chunks[-1] - self.sent

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None

    @property
    def itl(self) -> list[float]:
        return list(np.diff(self.chunks))


@dataclass(frozen=True)
class Load:
    """One load point: Poisson arrivals at `rate` requests/s (inf: all at once) with at most
    `concurrency` in flight (None: no cap); or, with `ramp` = (strategy, start, end), at a rate
    that goes from start to end requests/s over the point's requests (vLLM's --ramp-up-strategy:
    "linear" or "exponential")."""
    rate: float
    concurrency: int | None
    ramp: tuple[str, float, float] | None = None

    @property
    def name(self) -> str:
        if self.ramp:
            parts = [f"rate {self.ramp[1]:g}->{self.ramp[2]:g}/s ({self.ramp[0]})"]
        else:
            parts = [] if self.rate == float("inf") else [f"rate {self.rate:g}/s"]
        return ", ".join(parts + ([f"concurrency {self.concurrency}"] if self.concurrency else [])) or "all at once"


def ramp_rates(n: int, strategy: str, start: float, end: float) -> list[float]:
    """The request rate at each of n requests going from start to end: linearly, or by a constant
    factor per request (exponential; start > 0)."""
    if strategy not in ("linear", "exponential"):
        raise ValueError(f"--ramp-up-strategy {strategy!r}: linear or exponential")
    if not (start >= 0 and end > 0 and end >= start) or (strategy == "exponential" and start <= 0):
        raise ValueError("--ramp-up-start-rps and --ramp-up-end-rps: 0 <= start <= end, end > 0 "
                         "(start > 0 for exponential)")
    fractions = [i / (n - 1) if n > 1 else 1.0 for i in range(n)]
    if strategy == "linear":
        return [start + (end - start) * f for f in fractions]
    return [start * (end / start) ** f for f in fractions]


def questions(category: str | None = None, path: str | os.PathLike | None = None) -> list[dict]:
    """Spec-Bench's questions (first turns) as chat requests: {"category", "messages"}; the bundled
    240, or a Spec-Bench question.jsonl of one's own at path (its 480, say), as vLLM's spec_bench
    dataset reads it."""
    if path is None:
        rows = read_questions()
    else:
        try:
            rows = read_questions(Path(path))
        except OSError as e:
            raise ValueError(f"--dataset-path {path}: {e.strerror or e}") from None
        except ValueError as e:
            raise ValueError(f"--dataset-path {e}") from None
    qs = [{"category": q["category"], "messages": [{"role": "user", "content": q["prompt"]}]}
          for q in rows if category is None or q["category"] == category]
    if not qs:
        raise ValueError(f"--spec-bench-category {category!r} has no questions")
    return qs


def custom_requests(path: str | os.PathLike, skip_chat_template: bool = False) -> list[dict]:
    """vLLM's custom dataset: a JSON Lines file, one {"prompt": text} a line, optionally with
    "output_tokens" (that request's max_tokens). Sent as a user message through the chat template,
    or with skip_chat_template as a plain prompt to /v1/completions."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"--dataset-path {path}: {e.strerror or e}") from None
    items = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise ValueError(f"--dataset-path {path}: line {n} is not JSON") from None
        prompt = row.get("prompt") if isinstance(row, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f'--dataset-path {path}: line {n} has no "prompt" string')
        item = {"category": "custom", **({"prompt": prompt} if skip_chat_template
                                         else {"messages": [{"role": "user", "content": prompt}]})}
        out = row.get("output_tokens")
        if out is not None:
            if not isinstance(out, int) or isinstance(out, bool) or out < 1:
                raise ValueError(f'--dataset-path {path}: line {n}: "output_tokens" must be an integer >= 1')
            item["max_tokens"] = out
        items.append(item)
    if not items:
        raise ValueError(f"--dataset-path {path}: no prompts")
    return items


def sharegpt_pairs(path: str | os.PathLike) -> list[tuple[str, str]]:
    """(first human turn, the reply to it) of each conversation of a ShareGPT JSON file (a list of
    {"conversations": [{"from": ..., "value": ...}, ...]}), as vLLM's sharegpt dataset reads it."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--dataset-path {path}: {e.strerror or e}") from None
    except ValueError:
        raise ValueError(f"--dataset-path {path}: not JSON (a ShareGPT file is one JSON list)") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: a ShareGPT file is a JSON list of conversations")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, reply = (t.get("value") if isinstance(t, dict) else None for t in turns[:2])
        if isinstance(first, str) and isinstance(reply, str):
            pairs.append((first, reply))
    if not pairs:
        raise ValueError(f"--dataset-path {path}: no conversation with two turns")
    return pairs


def sharegpt_requests(pairs: list[tuple[str, str]], tokenizer, output_len: int | None = None,
                      seed: int = 0) -> list[dict]:
    """vLLM's sharegpt requests: the first turns in a seeded shuffle, each asking for as many tokens
    as its reply had (or output_len), without the pairs vLLM leaves out (a prompt or an output under
    4 tokens, a prompt over 1024, both over 2048)."""
    order = list(pairs)
    random.Random(seed).shuffle(order)
    items = []
    for prompt, reply in order:
        n_in = len(tokenizer.encode(prompt, add_special_tokens=False))
        n_out = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if n_in < 4 or n_out < 4 or n_in > 1024 or n_in + n_out > 2048:
            continue
        items.append({"category": "sharegpt", "messages": [{"role": "user", "content": prompt}], "max_tokens": n_out})
    if not items:
        raise ValueError("no ShareGPT conversation fits vLLM's bounds (prompt 4-1024 tokens, output >= 4, "
                         "both <= 2048)")
    return items


def as_completions(items: list[dict]) -> list[dict]:
    """The chat items as plain prompts for /v1/completions (vLLM's openai backend): the user's
    message as it is, no chat template; items already plain are kept."""
    return [{k: v for k, v in it.items() if k != "messages"} | {"prompt": it["messages"][-1]["content"]}
            if "messages" in it else it for it in items]


def length_range(length: int, ratio: float) -> tuple[int, int]:
    """vLLM's random lengths: uniform integers in [length * (1 - ratio), length * (1 + ratio)]."""
    return max(1, math.floor(length * (1 - ratio))), max(1, math.ceil(length * (1 + ratio)))


def random_requests(tokenizer, num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    prefix_len: int = 0, seed: int = 0) -> list[dict]:
    """vLLM's random dataset: prompts of random token ids (no special tokens), sent as token ids to
    /v1/completions so that their lengths are exact: a shared random prefix of prefix_len tokens,
    then input and output lengths drawn per request from length_range(length, range_ratio)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    if input_len < 1 or output_len < 1 or prefix_len < 0:
        raise ValueError("--random-input-len and --random-output-len must be >= 1, --random-prefix-len >= 0")
    allowed, rng = _plain_ids(tokenizer), np.random.default_rng(seed)
    prefix = rng.choice(allowed, prefix_len).tolist()
    (ilo, ihi), (olo, ohi) = length_range(input_len, range_ratio), length_range(output_len, range_ratio)
    items = []
    for _ in range(num):
        ids = prefix + rng.choice(allowed, int(rng.integers(ilo, ihi + 1))).tolist()
        items.append({"category": "random", "prompt_token_ids": ids, "max_tokens": int(rng.integers(olo, ohi + 1))})
    return items


def _plain_ids(tokenizer) -> np.ndarray:
    """The vocabulary without special tokens: what random prompts are drawn from."""
    special = tokenizer.special_ids | {i for i in (tokenizer.bos_token_id, *tokenizer.eos_token_ids) if i is not None}
    return np.setdiff1d(np.arange(tokenizer.vocab_size), np.fromiter(special, dtype=np.int64, count=len(special)))


def check_prefix_repetition(prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int) -> None:
    if prefix_len < 0 or suffix_len < 0 or prefix_len + suffix_len < 1:
        raise ValueError("--prefix-repetition-prefix-len and -suffix-len must be >= 0 (not both 0)")
    if num_prefixes < 1 or output_len < 1:
        raise ValueError("--prefix-repetition-num-prefixes and --prefix-repetition-output-len must be >= 1")


def prefix_repetition_requests(tokenizer, num: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                               output_len: int, seed: int = 0) -> list[dict]:
    """vLLM's prefix_repetition dataset: num_prefixes random prefixes of prefix_len tokens, each
    followed by random suffixes of suffix_len tokens in num // num_prefixes requests (at least
    one each), in a seeded random order; token ids to /v1/completions, max_tokens output_len.
    Requests that share a prefix are what prefix caching serves from its cache."""
    check_prefix_repetition(prefix_len, suffix_len, num_prefixes, output_len)
    allowed, rng = _plain_ids(tokenizer), np.random.default_rng(seed)
    per_prefix = max(1, num // num_prefixes)
    items = []
    for _ in range(num_prefixes):
        prefix = rng.choice(allowed, prefix_len).tolist()
        for _ in range(per_prefix):
            items.append({"category": "prefix_repetition", "max_tokens": output_len,
                          "prompt_token_ids": prefix + rng.choice(allowed, suffix_len).tolist()})
    order = rng.permutation(len(items))
    return [items[i] for i in order]


def served_tokenizer(base_url: str, path: str | None = None):
    """The tokenizer at path, else the served model's own (its files on this machine)."""
    from ..tokenizer import Tokenizer

    if path:
        try:
            return Tokenizer(path)
        except Exception as e:  # noqa: BLE001 - any unreadable folder or file: one line
            raise ValueError(f"--tokenizer {path}: {e}") from None
    root = first_model(base_url).get("root")
    if not root or not Path(root).exists():
        raise ValueError("--dataset-name random, prefix_repetition and sharegpt need the served model's tokenizer: "
                         "its files are not on this machine, pass --tokenizer PATH")
    return Tokenizer(root)


def prompt_length(tok, item: dict) -> int:
    """An item's prompt tokens as the server will count them."""
    if "prompt_token_ids" in item:
        return len(item["prompt_token_ids"])
    if "prompt" in item:
        return len(tok.encode(item["prompt"]))
    text = tok.apply_chat_template(item["messages"], tokenize=False, add_generation_prompt=True)
    return len(tok.encode(text, add_special_tokens=False))


def fitting(items: list[dict], base_url: str, output_len: int) -> list[dict]:
    """The items whose prompt (through the served model's chat template, if a chat) leaves room
    for its output tokens (output_len unless the item sets max_tokens) in its context, as vLLM's
    benchmark drops over-long prompts; all of them when the model's files are not on this machine."""
    from ..tokenizer import Tokenizer

    info = first_model(base_url)
    root, max_len = info.get("root"), info.get("max_model_len")
    if not root or not max_len or not Path(root).exists():
        return items
    tok = Tokenizer(root)
    keep = [it for it in items if prompt_length(tok, it) + it.get("max_tokens", output_len) <= max_len]
    if not keep:
        raise ValueError(f"no prompt leaves room for its output tokens ({output_len} unless given) in {max_len}")
    return keep


def sample(pool: list[dict], num: int, seed: int, shuffle: bool = True, oversample: bool = True) -> list[dict]:
    """num requests from the pool: a seeded shuffle (categories interleave; the pool's order with
    shuffle False), repeated as needed, or at most the pool once with oversample False (vLLM's
    --disable-shuffle and --no-oversample)."""
    order = list(pool)
    if shuffle:
        random.Random(seed).shuffle(order)
    if not oversample:
        num = min(num, len(order))
    return [order[i % len(order)] for i in range(num)]


def arrival_times(n: int, rate: float, burstiness: float, seed: int,
                  ramp: tuple[str, float, float] | None = None) -> list[float]:
    """Seconds from the load point's start at which each request is sent (vLLM's get_request):
    the running sum of Gamma(shape=burstiness, mean=1/rate) gaps, the first request's included,
    then, at a fixed rate, scaled so that the last goes at exactly n / rate: the sum of random gaps
    misses it by a seed-dependent share, and the rate offered would vary with --seed. All 0 at rate
    inf; burstiness inf: every gap 1/rate, the Gamma's limit. With a ramp, each gap's mean is
    1 / the rate at that request (a rate of 0: no gap), and nothing is scaled (vLLM's)."""
    rng = np.random.default_rng(seed)

    def gap(r: float) -> float:
        if r <= 0 or r == float("inf"):
            return 0.0
        if burstiness == float("inf"):
            return 1.0 / r
        return float(rng.gamma(burstiness, 1.0 / (r * burstiness)))

    rates = ramp_rates(n, *ramp) if ramp is not None else [rate] * n
    times = np.cumsum([gap(r) for r in rates]).tolist()
    if ramp is None and times and times[-1] > 0:
        scale = (n / rate) / times[-1]
        times = [t * scale for t in times]
    return times


def rps_change_events(ramp: tuple[str, float, float], arrived: list[float], began: float) -> list[dict]:
    """vLLM's rps_change_events of a ramp: its start rate, stamped when the load point began, then
    each whole rate it passes, stamped when the first request due at that rate (or above) went out.
    arrived: each request's due time, and began, on time.time()'s clock; stamps are ISO local times."""
    from datetime import datetime

    def stamp(t: float) -> str:
        return datetime.fromtimestamp(t).isoformat()

    start = ramp[1]
    last = int(start)
    events = [{"rps": last if last == start else start, "timestamp": stamp(began)}]
    for rate, at in zip(ramp_rates(len(arrived), *ramp), arrived):
        if int(rate) > last:
            events += [{"rps": rps, "timestamp": stamp(at)} for rps in range(last + 1, int(rate) + 1)]
            last = int(rate)
    return events


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int,
                 ramp: tuple[str, float, float] | None = None) -> list[float]:
    """The gaps before each request of arrival_times (the first: from the start)."""
    times = arrival_times(n, rate, burstiness, seed, ramp)
    return [t - before for t, before in zip(times, [0.0, *times])]


def _is_chat(item: dict) -> bool:
    return "messages" in item


def _prompt(item: dict):
    """A completion item's prompt: token ids, or text."""
    return item["prompt_token_ids"] if "prompt_token_ids" in item else item["prompt"]


async def _one(client, model: str, item: dict, sampling: dict, result: RequestResult) -> None:
    """One streamed request through the official openai client (--client openai): a chat, or a
    completion of a prompt (text or token ids)."""
    sampling = {**sampling, **({"max_tokens": item["max_tokens"]} if "max_tokens" in item else {})}
    model = item.get("model", model)
    result.sent = time.perf_counter()
    try:
        if _is_chat(item):
            stream = await client.chat.completions.create(model=model, messages=item["messages"], stream=True,
                                                          stream_options={"include_usage": True}, **sampling)
        else:
            stream = await client.completions.create(model=model, prompt=_prompt(item), stream=True,
                                                     stream_options={"include_usage": True}, **sampling)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None and chunk.usage.completion_tokens is not None:
                result.output_tokens, result.usage = chunk.usage.completion_tokens, True
                result.prompt_tokens = chunk.usage.prompt_tokens or 0
            if chunk.choices:           # vLLM's rule, as _one_raw's
                result.chunks.append(now)
                result.text += "".join((c.delta.content or getattr(c.delta, "reasoning_content", None)
                                        if _is_chat(item) else c.text) or "" for c in chunk.choices)
        result.ok = bool(result.chunks)
        result.error = "" if result.ok else "no tokens"
    except Exception as e:          # noqa: BLE001 - a failed request is a result, not a crash
        result.error = f"{type(e).__name__}: {e}"


def _text_of(choice: dict, chat: bool):
    """A streamed choice's text; a chat delta's reasoning counts as output, as vLLM's client counts it."""
    if not chat:
        return choice.get("text")
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content")


async def _one_raw(session, base_url: str, model: str, item: dict, sampling: dict, result: RequestResult) -> None:
    """One streamed request over aiohttp, the server-sent events parsed by hand (--client aiohttp,
    the default; vLLM's `bench serve` client does the same). The openai client's typed chunks cost the
    client ~3x the CPU per chunk, which on a machine of a few cores it takes from the server."""
    chat = _is_chat(item)
    body = {"model": item.get("model", model), "stream": True, "stream_options": {"include_usage": True},
            **({"messages": item["messages"]} if chat else {"prompt": _prompt(item)}),
            **{k: v for k, v in sampling.items() if k != "extra_body"}, **sampling.get("extra_body", {}),
            **({"max_tokens": item["max_tokens"]} if "max_tokens" in item else {})}
    url = base_url + ("/v1/chat/completions" if chat else "/v1/completions")
    result.sent = time.perf_counter()
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                text = (await response.text())[:300]
                result.error = f"HTTP {response.status}: {text}"
                return
            async for line in response.content:         # one line at a time: "data: {...}" or blank
                if not line.startswith(b"data:"):      # blank lines, ": ping" comments, other fields
                    continue
                now = time.perf_counter()
                data = line[5:].strip()                 # "data:{...}" or "data: {...}", as vLLM reads both
                if data == b"[DONE]":
                    break
                if not data:
                    continue
                chunk = json.loads(data)
                if "error" in chunk:                    # an error after the status line went out
                    result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return
                usage = chunk.get("usage")
                # vLLM's client reads usage.get("completion_tokens"): one without it counts as none sent
                if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                    result.output_tokens, result.usage = usage["completion_tokens"], True
                    result.prompt_tokens = usage.get("prompt_tokens") or 0
                # vLLM's client: a chunk with choices is a token's arrival even when its text is empty
                # (a special token, a role chunk); a usage-only one is not
                if chunk.get("choices"):
                    result.chunks.append(now)
                    result.text += "".join(_text_of(c, chat) or "" for c in chunk["choices"])
        result.ok = bool(result.chunks)
        result.error = "" if result.ok else "no tokens"
    except Exception as e:          # noqa: BLE001 - a failed request is a result, not a crash
        result.error = f"{type(e).__name__}: {e}"


CLIENTS = ("aiohttp", "openai")


async def run_load(base_url: str, model: str, items: list[dict], load: Load, burstiness: float, sampling: dict,
                   seed: int, client: str = "aiohttp") -> tuple[list[RequestResult], float]:
    """Send every item at the load point's arrival times; (results, wall seconds)."""
    connections = max(64, load.concurrency or len(items))
    if client == "openai":
        try:
            import httpx
            import openai
        except ImportError:
            raise ValueError("--client openai needs the openai package (pip install openai)") from None

        api = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                                 max_retries=0, timeout=3600,
                                 http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=connections),
                                                               timeout=3600))

        def send(item, result):
            return _one(api, model, item, sampling, result)
        close = api.close
    elif client == "aiohttp":
        import aiohttp

        key = os.environ.get("OPENAI_API_KEY", "EMPTY")
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections),
                                        timeout=aiohttp.ClientTimeout(total=3600),
                                        headers={"Authorization": f"Bearer {key}"})

        def send(item, result):
            return _one_raw(session, base_url, model, item, sampling, result)
        close = session.close
    else:
        raise ValueError(f"client {client!r}: expected one of {', '.join(CLIENTS)}")
    gate = asyncio.Semaphore(load.concurrency) if load.concurrency else None
    results = [RequestResult() for _ in items]

    async def gated(item, result):
        if gate is None:
            return await send(item, result)
        async with gate:
            return await send(item, result)

    start, tasks = time.perf_counter(), []
    try:
        for item, result, at in zip(items, results, arrival_times(len(items), load.rate, burstiness, seed, load.ramp)):
            # to the absolute send time (vLLM's): sleeping gap after gap would add up each task's start-up
            if at > 0 and start + at > time.perf_counter():
                await asyncio.sleep(start + at - time.perf_counter())
            result.arrived = time.perf_counter()
            tasks.append(asyncio.create_task(gated(item, result)))
        await asyncio.gather(*tasks)
    finally:
        await close()
    return results, time.perf_counter() - start


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """vLLM's --goodput KEY:MS ... (ttft, tpot, e2el) -> {key: seconds}."""
    out = {}
    for spec in specs or []:
        key, _, value = spec.partition(":")
        if key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput {spec!r}: the metric must be ttft, tpot or e2el")
        try:
            out[key] = float(value) / 1000.0
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: the value must be milliseconds, e.g. tpot:50") from None
        if not out[key] > 0:
            raise ValueError(f"--goodput {spec!r}: the value must be > 0")
    return out


METRICS = ("ttft", "tpot", "itl", "e2el")


def count_without_usage(results: list[RequestResult], items: list[dict], base_url: str, args) -> None:
    """Token counts for the requests whose stream carried no usage (servers that ignore
    stream_options, llama-cpp-python's among them): the generated text and the prompt through the
    tokenizer (--tokenizer, else the served model's), as vLLM's benchmark counts them then (an
    empty text counts 0 tokens and the request still completed, as vLLM's). A stream whose usage
    said 0 completion tokens (a reply that ended at once) keeps its 0: it needs no tokenizer."""
    missing = [(r, it) for r, it in zip(results, items) if r.ok and not r.usage and not r.output_tokens]
    if not missing:
        return
    try:
        tok = served_tokenizer(base_url, getattr(args, "tokenizer", None))
    except (ValueError, OSError, KeyError, IndexError):
        raise ValueError("the server sent no token usage in its streams: pass --tokenizer PATH to count "
                         "the tokens") from None
    for r, it in missing:
        r.output_tokens = len(tok.encode(r.text, add_special_tokens=False))
        r.prompt_tokens = r.prompt_tokens or prompt_length(tok, it)


def peaks(results: list[RequestResult]) -> tuple[float, int]:
    """vLLM's peak figures of a load point (calculate_metrics' max_output_tokens_per_s and
    max_concurrent_requests), over the successful requests: the most chunks with choices that
    arrived within one second, the seconds counted from the first request sent (vLLM counts each
    chunk as one token), and the most requests in flight at once, each over [sent, last chunk) so
    that one ending as another starts does not overlap it."""
    ok = [r for r in results if r.ok]
    if not ok:
        return 0.0, 0
    first = min(r.sent for r in ok)
    seconds = np.zeros(int(np.ceil(max(r.sent + r.e2el for r in ok) - first)) + 1)
    for r in ok:
        for t in r.chunks:
            if 0 <= int(t - first) < len(seconds):
                seconds[int(t - first)] += 1
    events = sorted([(r.sent, 1) for r in ok] + [(r.sent + r.e2el, -1) for r in ok])      # ends sort first
    in_flight = np.cumsum([step for _, step in events])
    return float(seconds.max()), int(in_flight.max())


def summarize(results: list[RequestResult], wall: float, slo: dict[str, float], percentiles: list[float],
              percentile_metrics: tuple[str, ...] = METRICS) -> dict:
    """vLLM's summary of one load point (times in ms): mean, median and std of every metric, the
    percentiles of those in percentile_metrics (vLLM's --percentile-metrics)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    per = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
           "itl": [g for r in ok for g in r.itl], "e2el": [r.e2el for r in ok]}
    good = [r for r in ok if all((getattr(r, k) or 0.0) <= v for k, v in slo.items())]
    summary = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": round(wall, 3),
               "total_input_tokens": sum(r.prompt_tokens for r in ok), "total_output_tokens": out_tokens,
               "request_throughput": round(len(ok) / wall, 4), "output_throughput": round(out_tokens / wall, 2),
               "total_token_throughput": round((out_tokens + sum(r.prompt_tokens for r in ok)) / wall, 2),
               "request_goodput": round(len(good) / wall, 4) if slo else None,
               **dict(zip(("max_output_tokens_per_s", "max_concurrent_requests"), peaks(results))),
               "errors": sorted({r.error for r in results if not r.ok})[:5]}
    for name, values in per.items():
        # ms to 0.1 us: a small model's streamed tokens can arrive microseconds apart (2 decimals
        # rounded such a median TPOT to 0.0)
        xs = np.array(values) * 1000.0
        summary[name] = {"mean": round(float(xs.mean()), 4) if len(xs) else None,
                         "median": round(float(np.median(xs)), 4) if len(xs) else None,
                         "std": round(float(xs.std()), 4) if len(xs) else None,
                         **{f"p{p:g}": round(float(np.percentile(xs, p)), 4) if len(xs) else None for p in percentiles
                            if name in percentile_metrics}}
    return summary


_SAMPLE = re.compile(r"^\w+:(\w+)(\{.*\})?\s+(\S+)(\s+\S+)?$")      # name{labels} value [timestamp]
_POSITION = re.compile(r'position="(\d+)"')


def parse_counters(text: str) -> dict[str, float]:
    """The speculative counters (and generated tokens, preemptions) of a /metrics text, each summed
    over its label sets (vLLM labels them by engine and model_name; specdec's are unlabelled), and
    the accepted tokens per draft position, keyed PER_POSITION + "[i]" (as vLLM's bench reads them)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m or (m.group(1) not in SPEC_COUNTERS and m.group(1) != PER_POSITION):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        key = m.group(1)
        if key == PER_POSITION:
            pos = _POSITION.search(m.group(2) or "")
            if not pos:
                continue
            key = f"{PER_POSITION}[{pos.group(1)}]"
        out[key] = out.get(key, 0.0) + value
    return out


def read_counters(base_url: str) -> dict[str, float]:
    """parse_counters of the server's /metrics ({} when it has none)."""
    try:
        return parse_counters(_get(base_url + "/metrics"))
    except OSError:             # urllib's URLError and HTTPError are OSErrors
        return {}


def per_position(counters: dict[str, float]) -> list[float]:
    """Accepted tokens at each draft position (0, 1, ...) in counters (parse_counters' keys)."""
    found = {int(k[len(PER_POSITION) + 1:-1]): v for k, v in counters.items() if k.startswith(PER_POSITION + "[")}
    return [found.get(i, 0.0) for i in range(max(found) + 1)] if found else []


def acceptance(before: dict, after: dict) -> dict:
    """The counters' increments: drafts, draft and accepted tokens, the acceptance rate (a fraction),
    the mean acceptance length (1 + accepted per draft) and the per-position acceptance rates
    (accepted at position i per draft, vLLM's)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(SPEC_COUNTERS) | set(before) | set(after)}
    drafted, accepted, drafts = (d["spec_decode_num_draft_tokens_total"], d["spec_decode_num_accepted_tokens_total"],
                                 d["spec_decode_num_drafts_total"])
    return {"draft_tokens": int(drafted), "accepted_tokens": int(accepted), "num_drafts": int(drafts),
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
            "per_position_acceptance_rates": [round(a / drafts, 4) for a in per_position(d)] if drafts else [],
            "preemptions": int(d["num_preemptions_total"])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Started:
    url: str
    pid: int


def unwind_on_sigterm() -> None:
    """A SIGTERM (a job runner, `kill`) unwinds like Ctrl-C, so that servers started by
    `server` blocks are stopped too instead of outliving the benchmark (main thread only)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


class ServerStartError(OSError):
    """A server that `server` started exited or did not answer in time: its reason (the log's last
    error line) and the log's path."""


def _last_error(log: Path) -> str:
    """The log's last line that reads as an error ("...: error: ...", "ValueError: ..."), if any."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return next((line.strip() for line in reversed(lines) if re.search(r"error", line, re.IGNORECASE)), "")


def without_prefix_caching(argv: list[str]) -> list[str]:
    """argv plus --no-enable-prefix-caching unless it names prefix caching already: a benchmark
    that sends the same prompts again (load points, a stress run's memory check) measures the
    server without the cache unless asked."""
    named = any("prefix-caching" in a or "prefix_caching" in a for a in argv)
    return argv if named else [*argv, "--no-enable-prefix-caching"]


@contextmanager
def server(argv: list[str], log: Path, startup_s: float = 600.0):
    """`specdec serve argv` on a free loopback port until the block ends (then SIGTERM, which
    drains it); yields its Started (base URL, process id). A server that exits or does not answer
    within startup_s raises ServerStartError, no process left behind."""
    port = free_port()
    cmd = [sys.executable, "-m", "specdec.entrypoints.openai.api_server", *argv, "--port", str(port),
           "--uvicorn-log-level", "warning"]
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + startup_s
            while True:
                if proc.poll() is not None:
                    reason = _last_error(log)
                    raise ServerStartError(f"the server exited with status {proc.returncode}"
                                           + (f": {reason}" if reason else "") + f" (log: {log})")
                if time.monotonic() > deadline:
                    raise ServerStartError(f"the server did not start within {startup_s:g} s (log: {log})")
                try:
                    _get(url + "/health", timeout=2)        # raises unless 200
                    break
                except OSError:
                    pass
                time.sleep(0.25)
            yield Started(url, proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def first_model(base_url: str) -> dict:
    """The first entry of the server's /v1/models (its "id", and "root", "max_model_len" where given);
    a server that cannot be reached or does not answer there: one line naming the URL (vLLM's
    get_first_model_from_server says what to check, too)."""
    url = f"{base_url}/v1/models"
    try:
        body = json.loads(_get(url))
    except ValueError:
        raise ValueError(f"{url} did not answer JSON") from None
    except OSError as e:            # urllib's URLError and HTTPError, a timeout
        why = getattr(e, "reason", None) if not hasattr(e, "code") else f"HTTP {e.code}"
        hint = " (the base URL is the server's root: drop the /v1)" if base_url.endswith("/v1") else ""
        raise ValueError(f"Failed to fetch models from the server at {url} ({why or e}): check that the server "
                         f"is running and that --base-url (or --host/--port) is correct{hint}") from None
    data = body.get("data") if isinstance(body, dict) else None
    if not data or not isinstance(data[0], dict) or "id" not in data[0]:
        raise ValueError(f"No models found on the server at {base_url} (its /v1/models lists none)")
    return data[0]


def served_model(base_url: str) -> str:
    return first_model(base_url)["id"]


def request_model(base_url: str, args) -> str:
    """The model the requests name: --served-model-name, or with --base-url the --model given
    (vLLM's meaning), else the server's first."""
    named = getattr(args, "served_model_name", None) or (getattr(args, "model", None) if getattr(args, "base_url", None)
                                                          else None)
    return named or served_model(base_url)


def _get(url: str, timeout: float = 30.0) -> str:
    """A GET's body (the benchmark's few plain requests: the standard library suffices)."""
    import urllib.request

    key = os.environ.get("OPENAI_API_KEY", "EMPTY")
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read().decode()


def profile(base_url: str, action: str) -> None:
    """POST /start_profile or /stop_profile (`--profile`, vLLM's): a server started without a
    profiler has no such route, which is said in one line."""
    import urllib.error
    import urllib.request

    key = os.environ.get("OPENAI_API_KEY", "EMPTY")
    request = urllib.request.Request(f"{base_url}/{action}_profile", data=b"", method="POST",
                                     headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            response.read()
    except urllib.error.HTTPError as e:
        if e.code == 404:
            raise ValueError(f"--profile: {base_url} has no /{action}_profile; start it with --profiler-config "
                             "'{\"profiler\": \"torch\", \"torch_profiler_dir\": DIR}' (or VLLM_TORCH_PROFILER_DIR)") from None
        raise ValueError(f"--profile: {base_url}/{action}_profile answered {e.code}") from None


def _sampling(args) -> dict:
    """Every request's sampling fields (top_k and min_p are vLLM's extensions: extra_body)."""
    extra = {"ignore_eos": args.ignore_eos, **{k: getattr(args, k) for k in ("top_k", "min_p")
                                               if getattr(args, k, None) is not None}}
    # no "seed": vLLM's bench sends none (--seed seeds the dataset and the arrivals); one seed in
    # every request would make the repeats of a prompt draw the same sample
    return {"max_tokens": args.output_len, "temperature": args.temperature,
            **({"top_p": args.top_p} if getattr(args, "top_p", None) is not None else {}), "extra_body": extra}


def with_lora(items: list[dict], names: list[str] | None, seed: int) -> list[dict]:
    """vLLM's --lora-modules: each request names one of the adapters, drawn at random (seeded)."""
    if not names:
        return items
    rng = np.random.default_rng(seed)
    return [{**item, "model": names[int(rng.integers(len(names)))]} for item in items]


def warm_up(base_url: str, pool: list[dict], args) -> None:
    if args.warmup:
        items = with_lora(sample(pool, args.warmup, args.seed + 999), getattr(args, "lora_modules", None), args.seed)
        asyncio.run(run_load(base_url, request_model(base_url, args), items,
                             Load(float("inf"), args.warmup), 1.0, _sampling(args), args.seed, args.client))


def point_size(load: Load, num_prompts: int | None) -> int:
    """A load point's requests: --num-prompts given, exactly (vLLM's); else NUM_PROMPTS, or
    twice the concurrency if more, so that its percentiles come from more than one wave."""
    return num_prompts if num_prompts is not None else max(NUM_PROMPTS, 2 * (load.concurrency or 0))


def point_requests(load: Load, pool: list[dict], args) -> list[dict]:
    """The requests of a load point (point_size's; no more than the dataset's prompts with
    --no-oversample), shuffled unless --disable-shuffle."""
    items = sample(pool, point_size(load, args.num_prompts), args.seed,
                   shuffle=not args.disable_shuffle, oversample=not args.no_oversample)
    return with_lora(items, getattr(args, "lora_modules", None), args.seed)


@dataclass
class Measured:
    """What one server did at one load point, possibly over several rounds."""
    results: list = field(default_factory=list)
    wall: float = 0.0
    counters: dict = field(default_factory=dict)     # the speculative counters' increments
    rounds: list = field(default_factory=list)       # per round: its median TPOT and output tok/s
    load: Load | None = None                         # set by point()
    rps_change_events: list = field(default_factory=list)    # a ramp's, each round's in turn
    scrape_failed: bool = False                      # a round's counters could not be read

    def run(self, base_url: str, items: list[dict], load: Load, args, seed: int) -> None:
        before = read_counters(base_url)
        began, began_perf = time.time(), time.perf_counter()
        results, wall = asyncio.run(run_load(base_url, request_model(base_url, args), items, load, args.burstiness,
                                             _sampling(args), seed, args.client))
        after = read_counters(base_url)
        if load.ramp:
            self.rps_change_events += rps_change_events(load.ramp, [began + r.arrived - began_perf for r in results],
                                                        began)
        count_without_usage(results, items, base_url, args)
        self.results += results
        self.wall += wall
        this = summarize(results, wall, {}, [])
        self.rounds.append({"tpot_median_ms": this["tpot"]["median"], "output_throughput": this["output_throughput"]})
        if bool(before) != bool(after):          # /metrics answered on one side only: no increments
            self.scrape_failed = True
            print(f"warning: {base_url}/metrics did not answer {'after' if before else 'before'} the load point: "
                  "its speculation counters are left out", file=sys.stderr)
        for k in set(before) | set(after):
            self.counters[k] = self.counters.get(k, 0.0) + after.get(k, 0.0) - before.get(k, 0.0)

    def point(self, load: Load, slo: dict, args) -> dict:
        self.load = load
        report_failures(self.results)
        point = {"rate": load.rate if load.rate != float("inf") else "inf", "concurrency": load.concurrency,
                 **({"ramp": {"strategy": load.ramp[0], "start_rps": load.ramp[1], "end_rps": load.ramp[2]}}
                    if load.ramp else {}),
                 "num_prompts": len(self.results),
                 **summarize(self.results, self.wall, slo, args.metric_percentiles, args.percentile_metrics),
                 "speculation": acceptance({}, {} if self.scrape_failed else self.counters), "rounds": self.rounds}
        print(f"  {load.name}: {point['output_throughput']:.1f} tok/s, median TPOT {point['tpot']['median']} ms, "
              f"median TTFT {point['ttft']['median']} ms, {point['failed']} failed", file=sys.stderr, flush=True)
        return point


def report_failures(results: list[RequestResult]) -> None:
    """vLLM's report of failed requests (the first 10 errors) and its warning when all failed."""
    failed = [r for r in results if not r.ok]
    if failed:
        print("Failed requests during benchmark run detected (capping to 10):", file=sys.stderr)
        for i, r in enumerate(failed[:10]):
            print(f"Error {i}: {one_line(r.error)}", file=sys.stderr)
    if results and len(failed) == len(results):
        print("WARNING: All requests failed. This is likely due to a misconfiguration on the benchmark arguments.",
              file=sys.stderr)
    sys.stderr.flush()


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def measure(base_url: str, loads: list[Load], pool: list[dict], args, slo: dict) -> list[tuple[dict, Measured]]:
    """Every load point against one server: warm-up requests first, then the measured ones;
    (its point, what was measured) per load point."""
    warm_up(base_url, pool, args)
    if getattr(args, "profile", False):
        profile(base_url, "start")
    out = []
    for load in loads:
        m = Measured()
        m.run(base_url, point_requests(load, pool, args), load, args, args.seed)
        out.append((m.point(load, slo, args), m))
    if getattr(args, "profile", False):
        profile(base_url, "stop")
    return out


def dump(obj, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=1) + "\n")
