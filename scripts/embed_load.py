"""Load on the pooling server: C concurrent clients post /v1/embeddings (1-8 Spec-Bench texts
each, some with `dimensions` on a model without matryoshka, some empty or with ids outside the
vocabulary: the bad ones must get a 400) for S seconds against `specdec serve --runner pooling`;
reports requests/s, texts/s, status counts, every good answer's vectors against the same texts
embedded offline (cosine), and the server's memory every 5 s (the largest of each half).

    PYTHONPATH=. python scripts/embed_load.py --clients 16 --seconds 120 --out bench/embed/xeon-avx512vnni/embed-load.json

The model is the default one used as an embedding model (`--convert embed`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import tempfile
import time
from pathlib import Path

import httpx


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def client(url: str, texts: list[str], until: float, rng: random.Random, log: list) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while time.perf_counter() < until:
            kind = rng.random()
            if kind < 0.1:
                body, bad = {"input": []}, True
            elif kind < 0.15:
                body, bad = {"input": [[1, 10 ** 7]]}, True
            elif kind < 0.2:
                body, bad = {"input": texts[0], "dimensions": 7}, True
            else:
                body, bad = {"input": rng.sample(texts, rng.randint(1, 8))}, False
            t = time.perf_counter()
            r = await http.post("/v1/embeddings", json=body)
            log.append((body, bad, r.status_code, r.json() if r.headers.get("content-type", "").startswith(
                "application/json") else None, time.perf_counter() - t))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from specdec import LLM
    from specdec.bench.serve import server
    from specdec.bench.spec_bench import read_questions
    from specdec.defaults import smollm2_gguf

    torch.set_num_threads(args.threads)
    gguf = str(smollm2_gguf())
    texts = [q["prompt"][:400] for q in read_questions()][:48]
    offline = LLM(gguf, convert="embed", max_model_len=2048, enable_prefix_caching=False)
    solo = {t: torch.tensor(o.outputs.embedding) for t, o in zip(texts, offline.embed(texts))}
    del offline
    with tempfile.TemporaryDirectory() as tmp, server(["--model", gguf, "--convert", "embed", "--max-model-len", "2048"],
                                                      Path(tmp) / "server.log") as started:
        url, pid = started.url, started.pid
        start_mb = rss_mb(pid)
        log: list = []
        until = time.perf_counter() + args.seconds
        t0 = time.perf_counter()
        samples: list[tuple[float, float]] = []

        async def sample():
            while time.perf_counter() < until:
                samples.append((time.perf_counter() - t0, rss_mb(pid)))
                await asyncio.sleep(5)

        async def run():
            rngs = [random.Random(i) for i in range(args.clients)]
            await asyncio.gather(sample(), *(client(url, texts, until, rngs[i], log) for i in range(args.clients)))

        asyncio.run(run())
        wall = time.perf_counter() - t0
        end_mb = rss_mb(pid)
    statuses: dict[str, int] = {}
    worst, wrong_status, good_texts, identical = 1.0, 0, 0, 0
    for body, bad, status, payload, _ in log:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
        if bad != (status == 400) or status >= 500:
            wrong_status += 1
        if status == 200:
            for text, d in zip(body["input"], payload["data"]):
                good_texts += 1
                identical += torch.equal(torch.tensor(d["embedding"]), solo[text])
                worst = min(worst, torch.nn.functional.cosine_similarity(torch.tensor(d["embedding"]), solo[text],
                                                                         dim=0).item())
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    result = {"cpu": cpu, "clients": args.clients, "seconds": wall, "requests": len(log),
              "requests_s": len(log) / wall, "texts_s": good_texts / wall, "statuses": statuses,
              "wrong_status": wrong_status, "min_cosine_vs_offline": worst,
              "texts_identical_to_offline": f"{identical}/{good_texts}", "rss_mb_start": start_mb,
              "rss_mb_end": end_mb, "rss_mb_max_first_half": max((m for t, m in samples if t < wall / 2), default=start_mb),
              "rss_mb_max_second_half": max((m for t, m in samples if t >= wall / 2), default=end_mb), "rss_samples": samples}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
