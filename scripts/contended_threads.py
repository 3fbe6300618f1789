"""Decoding speed of the default model when other processes keep cores busy: the engine at each
thread count, with 0..N busy processes (pure-Python spin loops) beside it, each measurement in a
fresh process. On a small shared host a thread count equal to the cores loses badly once another
process wants one of them: every OpenMP barrier of a forward (a few hundred a token) waits for
the thread the OS has descheduled.

    python scripts/contended_threads.py --threads 1,2 --busy 0,1,2
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MEASURE = r"""
import json, random, sys, time, torch
from specdec import LLM, SamplingParams
torch.set_num_threads(int(sys.argv[1]))
llm = LLM(num_speculative_tokens=0, enable_prefix_caching=False)
prompt = {"prompt_token_ids": [random.Random(0).randrange(1000, 40000) for _ in range(20)]}
params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
llm.generate([prompt], params)
times = []
for _ in range(3):
    t0 = time.perf_counter(); llm.generate([prompt], params); times.append(time.perf_counter() - t0)
print(json.dumps({"ms_per_token": 1000 * min(times) / 64}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2", help="engine thread counts, comma-separated")
    ap.add_argument("--busy", default="0,1,2", help="busy processes beside it, comma-separated")
    args = ap.parse_args()
    for busy in [int(b) for b in args.busy.split(",")]:
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            time.sleep(0.5)
            for threads in [int(t) for t in args.threads.split(",")]:
                out = subprocess.run([sys.executable, "-c", MEASURE, str(threads)], capture_output=True, text=True,
                                     check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
                ms = json.loads(out.stdout.strip().splitlines()[-1])["ms_per_token"]
                print(f"{busy} busy processes, engine at {threads} threads: {ms:.2f} ms a token", flush=True)
        finally:
            for p in spinners:
                p.kill()
                p.wait()


if __name__ == "__main__":
    main()
