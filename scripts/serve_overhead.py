"""What Ray Serve adds per request: the same model behind `specdec serve` (one process) and
behind `specdec serve --replicas 1` (Ray Serve's proxy, router and one replica), both running
at once; requests alternate between them, one at a time, so load hits both alike.

Each round sends the same completion to each server (non-streaming, greedy); the table gives
the median and 90th percentile latency over the rounds and the difference. max_tokens=1 is
mostly overhead (routing, HTTP, tokenization, one forward); a longer one shows it against
generation.

    python scripts/serve_overhead.py --model models/target --rounds 60 --max-tokens 1 32
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = _port()
    proc = subprocess.Popen([sys.executable, "-m", "specdec", "serve", "--model", model, "--served-model-name", "m",
                             "--port", str(port), "--uvicorn-log-level", "warning", "--no-enable-prefix-caching", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, f"http://127.0.0.1:{port}"


def wait(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server {url} exited"
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/target")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[1, 32])
    args = ap.parse_args()
    servers = {"single process": start(args.model, []), "Ray Serve, 1 replica": start(args.model, ["--replicas", "1"])}
    try:
        for name, (proc, url) in servers.items():
            wait(url, proc)
        clients = {name: httpx.Client(base_url=url, timeout=60) for name, (_, url) in servers.items()}
        print(f"model {args.model}; {args.rounds} rounds, requests alternating between the servers\n")
        print("| max_tokens | server | median ms | p90 ms | median - single process |")
        print("|---|---|---|---|---|")
        for n in args.max_tokens:
            body = {"model": "m", "prompt": "def fibonacci(n):", "max_tokens": n, "temperature": 0, "ignore_eos": True}
            lat = {name: [] for name in clients}
            for i in range(args.rounds + 5):
                for name, client in clients.items():
                    t0 = time.perf_counter()
                    r = client.post("/v1/completions", json=body)
                    dt = time.perf_counter() - t0
                    r.raise_for_status()
                    if i >= 5:                       # the first rounds warm both up
                        lat[name].append(dt)
            base = statistics.median(lat["single process"])
            for name, xs in lat.items():
                med, p90 = statistics.median(xs), statistics.quantiles(xs, n=10)[-1]
                print(f"| {n} | {name} | {1000 * med:.1f} | {1000 * p90:.1f} | {1000 * (med - base):+.1f} |")
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in servers.values():
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
