"""GFLOP/s of a 4096x512 @ 512x1536 matmul in fp32 and bf16 with PyTorch on this CPU (1 thread).

On a CPU without native bf16 (AVX2 only) oneDNN emulates bf16, and fp32 is several times faster.
"""
import time

import torch

torch.set_num_threads(1)
print("native bf16 matmul:", bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
for dtype in (torch.float32, torch.bfloat16):
    a, w = torch.randn(4096, 512, dtype=dtype), torch.randn(1536, 512, dtype=dtype)
    torch.nn.functional.linear(a, w)
    t = time.perf_counter()
    for _ in range(5):
        torch.nn.functional.linear(a, w)
    dt = (time.perf_counter() - t) / 5
    print(f"{str(dtype):15s} {2 * 4096 * 512 * 1536 / dt / 1e9:6.1f} GFLOP/s")
