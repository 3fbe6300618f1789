"""The same requests through `specdec serve` and through the offline LLM, interleaved request by
request so that both see the same machine (a 2-core VM's speed drifts by 20%+ between runs):
per-token time (TPOT) of each, from the engine's own timings (each response's `speculative` field,
each RequestOutput's metrics), and the median of the per-request ratio server / offline.

    PYTHONPATH=. python scripts/serve_vs_offline.py 16 3                      # the default model and method
    PYTHONPATH=. python scripts/serve_vs_offline.py 16 3 --num-speculative-tokens 0

Spec-Bench questions (every 10th, first turn through the chat template), greedy, 128 tokens with
ignore_eos; the prefix cache off on both sides; the first round is a warm-up. AMD EPYC Zen 5 (2
vCPUs, 2026-12-06, default SmolLM2 + suffix K=2): the same target forwards on both sides (97 a
request), server 2.54 against offline 2.32 ms a token, median ratio 1.12.
"""
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from specdec import LLM, SamplingParams
from specdec.bench import serve

N, ROUNDS, EXTRA = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
OUT = 128


def tpot(ttft: float, wall: float, n: int) -> float:
    return (wall - ttft) / max(n - 1, 1) * 1000


def main() -> None:
    questions = serve.questions()[::10][:N]
    kwargs = {}
    if "--num-speculative-tokens" in EXTRA:
        kwargs["num_speculative_tokens"] = int(EXTRA[EXTRA.index("--num-speculative-tokens") + 1])
    if "--speculative-config" in EXTRA:
        kwargs["speculative_config"] = json.loads(EXTRA[EXTRA.index("--speculative-config") + 1])
    llm = LLM(**kwargs, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=OUT, ignore_eos=True)
    rows = {"offline": [], "server": []}
    with serve.server(serve.without_prefix_caching(EXTRA), Path("serve_vs_offline.server.log")) as started:
        client = httpx.Client(timeout=120)
        model = client.get(started.url + "/v1/models").json()["data"][0]["id"]
        for r in range(ROUNDS):
            for q in questions:
                s = llm.chat(q["messages"], params, use_tqdm=False)[0].metrics
                rows["offline"].append(dict(round=r, forwards=s.target_forward_passes,
                                            tpot=tpot(s.time_to_first_token_s, s.wall_time_s, s.output_tokens)))
                time.sleep(0.05)
                body = {"model": model, "messages": q["messages"], "max_tokens": OUT, "temperature": 0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                stats = None
                with client.stream("POST", started.url + "/v1/chat/completions", json=body) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            if chunk.get("usage") and "speculative" in chunk:
                                stats = chunk["speculative"]
                rows["server"].append(dict(round=r, forwards=stats["target_forward_passes"],
                                           tpot=tpot(stats["time_to_first_token_s"], stats["wall_time_s"],
                                                     stats["output_tokens"])))
                time.sleep(0.05)
    for side, got in rows.items():
        kept = [x for x in got if x["round"] >= 1] or got
        print(f"{side:8s} median TPOT {statistics.median(x['tpot'] for x in kept):.3f} ms, "
              f"target forwards a request {statistics.median(x['forwards'] for x in kept):.0f}")
    pairs = [b["tpot"] / a["tpot"] for a, b in zip(rows["offline"], rows["server"]) if a["round"] >= 1]
    same = all(a["forwards"] == b["forwards"] for a, b in zip(rows["offline"], rows["server"]))
    print(f"median server / offline TPOT ratio {statistics.median(pairs):.3f}; same forwards: {same}")


if __name__ == "__main__":
    main()
