"""qgemm.c's products for M rows, timed in C (no Python call overhead, ~20 us per call, which
hides what a few rows cost): SmolLM2-135M's fused shapes in Q4_1 and its tied LM head in Q8_0,
and (--shapes oss_...) one gpt-oss-20b expert's gate/up and down in MXFP4 and, for comparison,
Q4_0; one thread, the process's CPU time, the best of --repeats.

"hot": the same weights every call (from L2/L3); "cold": cycling through 96 MiB of copies (from
memory, as in a forward). Prints µs per call and the cost of M rows over one row.

    python scripts/qgemm_rows.py --isa avx2
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from specdec import kernels
from specdec.kernels import isa, qformats

HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "kernels.h"
static double now(void) { struct timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char **argv) {
    int fmt = atoi(argv[1]), N = atoi(argv[2]), K = atoi(argv[3]), repeats = atoi(argv[4]);
    FILE *f = fopen(argv[5], "rb");
    int nM = argc - 6, Ms[32];
    for (int i = 0; i < nM && i < 32; i++) Ms[i] = atoi(argv[6 + i]);
    int maxM = 1;
    for (int i = 0; i < nM; i++) if (Ms[i] > maxM) maxM = Ms[i];
    long pb = quant_panel_bytes(fmt, K) * ((N + 15) / 16);
    int copies = (int)(96l * 1024 * 1024 / pb) + 1;
    unsigned char *w = malloc(pb * copies);
    if (!f || fread(w, 1, pb, f) != (size_t)pb) return 1;
    for (int c = 1; c < copies; c++) memcpy(w + pb * c, w, pb);
    float *x = malloc((long)maxM * K * 4), *out = malloc((long)maxM * N * 4);
    for (long i = 0; i < (long)maxM * K; i++) x[i] = (rand() % 1000) / 500.0f - 1;
    for (int mi = 0; mi < nM; mi++) {
        int M = Ms[mi], R = M > 64 ? 5 : M > 16 ? 20 : 100;
        double hot = 1e9, cold = 1e9;
        for (int t = 0; t < repeats; t++) {
            double t0 = now();
            for (int r = 0; r < R; r++) quant_linear(x, w, fmt, NULL, out, M, N, K);
            double dt = (now() - t0) / R; if (dt < hot) hot = dt;
            t0 = now();
            for (int r = 0; r < R; r++) quant_linear(x, w + pb * (r % copies), fmt, NULL, out, M, N, K);
            dt = (now() - t0) / R; if (dt < cold) cold = dt;
        }
        printf("%d %.2f %.2f\n", M, hot * 1e6, cold * 1e6);
    }
    return 0;
}
"""
SHAPES = [("qkv", "Q4_1", 960, 576), ("o", "Q4_1", 576, 576), ("gate_up", "Q4_1", 3072, 576),
          ("down", "Q4_1", 576, 1536), ("lm_head", "Q8_0", 49152, 576)]
OSS = [("oss_gate_up_mxfp4", "MXFP4", 5760, 2880), ("oss_gate_up_q4_0", "Q4_0", 5760, 2880),
       ("oss_down_mxfp4", "MXFP4", 2880, 2880), ("oss_down_q4_0", "Q4_0", 2880, 2880)]


def prepared(fmt: str, n: int, k: int, path: Path) -> None:
    """Random GGUF rows with realistic f16 scales (no denormals), in the kernel's layout."""
    rng = np.random.default_rng(0)
    block = {"Q4_1": 20, "Q8_0": 34, "Q4_0": 18, "MXFP4": 17}[fmt]
    raw = rng.integers(0, 256, size=(n, k // 32, block), dtype=np.uint8)
    if fmt == "MXFP4":
        raw[:, :, 0] = 120                          # E8M0 2^-7
    else:
        raw[:, :, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if fmt == "Q4_1":
        raw[:, :, 2:4] = np.frombuffer(np.float16(-0.05).tobytes(), np.uint8)
    prep = kernels.prepare_quant(torch.from_numpy(raw.reshape(n, -1).copy()), fmt)
    path.write_bytes(prep.data.numpy().tobytes())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", default="avx2", choices=sorted(isa.BY_NAME))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", default="1,2,3,5,9,16,64", help="row counts M, comma-separated")
    ap.add_argument("--source", type=Path, default=None, help="a qgemm.c to time instead of the package's (A/B runs)")
    ap.add_argument("--shapes", default="", help="products to time (default: all of " + ",".join(s[0] for s in SHAPES)
                    + "; also " + ",".join(s[0] for s in OSS) + ")")
    args = ap.parse_args()
    v = isa.BY_NAME[args.isa]
    kdir = Path(isa.__file__).parent
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "rows.c", Path(tmp) / "rows"
        src.write_text(HARNESS)
        subprocess.run(["gcc", "-O3", "-ffp-contract=off", "-fopenmp", *v.cflags, f"-I{kdir}", str(args.source or kdir / "qgemm.c"),
                        str(src), "-o", str(exe), "-lm"], check=True)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        print(f"qgemm.c rows, variant {args.isa}, one thread, CPU time, best of {args.repeats}: µs per call "
              "hot / cold (cost over one row, cold)\n")
        rows = []
        shapes = [s for s in SHAPES + OSS if (s in SHAPES and not args.shapes) or s[0] in args.shapes.split(",")]
        for name, fmt, n, k in shapes:
            wfile = Path(tmp) / f"{name}.bin"
            prepared(fmt, n, k, wfile)
            out = subprocess.run([str(exe), str(qformats.FORMATS[fmt]), str(n), str(k), str(args.repeats), str(wfile),
                                  *args.rows.split(",")], env=env,
                                 capture_output=True, text=True, check=True).stdout
            rows.append((name, fmt, n, k, [tuple(float(t) for t in line.split()) for line in out.splitlines()]))
        Ms = [int(m) for m, _, _ in rows[0][4]]
        print("| product | format | N x K | " + " | ".join(f"M={m}" for m in Ms) + " |")
        print("|---|---|---|" + "---|" * len(Ms))
        for name, fmt, n, k, res in rows:
            one = res[0][2]
            cells = [f"{h:.0f} / {c:.0f} ({c / one:.2f}x)" for _, h, c in res]
            print(f"| {name} | {fmt} | {n} x {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
