"""The collectives of one tensor-parallel group, on process groups of its own.

Two groups over one store: `data` carries the tensors of a forward (gloo on the CPU, nccl on
CUDA) with the group's timeout, so a rank that stops answering fails the collective instead of
hanging it; `control` (gloo) carries rank 0's commands to the workers, who may wait for the
next one as long as the server idles.

The groups are built directly (`ProcessGroupGloo(store, rank, size, timeout)`), not through
torch.distributed's default group: a process may hold several LLMs, each with its own group,
and nothing global is set.

Reductions are batch-invariant on the CPU: with two ranks a sum is a + b on either rank (IEEE
addition commutes); with more, gloo's ring would add an element's parts in an order that
depends on the tensor's size (the chunk it falls in), so the parts are gathered and added in
rank order instead. A token's result then does not depend on the rows around it, which keeps
greedy speculative output equal to plain output (README: losslessness under batching).
"""

from __future__ import annotations

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

HEADER = 16384                 # bytes of a command sent in the first broadcast; longer ones take two
IDLE = timedelta(days=365)     # how long a worker waits for rank 0's next command


class Collectives:
    """rank, world_size, and the operations the shard's layers and rank 0's leader use."""

    def __init__(self, store, rank: int, world_size: int, device: torch.device, timeout_s: float):
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.timeout_s = timeout_s
        timeout = timedelta(seconds=timeout_s)
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control/", store), rank, world_size, timeout)
        if self.device.type == "cuda":      # not run in this project's CI (no GPU there)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.data = dist.ProcessGroupNCCL(dist.PrefixStore("data/", store), rank, world_size, opts)
        else:
            self.data = dist.ProcessGroupGloo(dist.PrefixStore("data/", store), rank, world_size, timeout)

    def all_reduce(self, x: Tensor) -> Tensor:
        """x [..., D] this rank's partial sums -> the sum over ranks (the same bits on every rank)."""
        x = x.contiguous()
        if self.world_size == 2 or self.device.type == "cuda":
            self.data.allreduce([x]).wait()
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.data.allgather([parts], [x]).wait()
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return total

    def gather_columns(self, x: Tensor, widths: list[int]) -> Tensor | None:
        """x [R, w] this rank's columns (padded to max(widths)) -> on rank 0 [R, sum(widths)],
        the ranks' columns side by side; None on the others."""
        x = x.contiguous()
        outs = [[torch.empty_like(x) for _ in range(self.world_size)]] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self.data.gather(outs, [x], opts).wait()
        if self.rank != 0:
            return None
        return torch.cat([part[:, :w] for part, w in zip(outs[0], widths)], dim=-1)

    def send_command(self, command) -> None:
        """Rank 0: one pickled command to every worker (see receive_command)."""
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        head = torch.zeros(HEADER, dtype=torch.uint8)
        head[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        first = data[:HEADER - 8]
        head[8:8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        self.control.broadcast(head, 0).wait()
        if len(data) > len(first):
            rest = torch.frombuffer(bytearray(data[len(first):]), dtype=torch.uint8)
            self.control.broadcast(rest, 0).wait()

    def receive_command(self):
        """A worker: rank 0's next command; waits as long as rank 0 idles, fails when it dies."""
        head = torch.empty(HEADER, dtype=torch.uint8)
        self.control.broadcast(head, 0, IDLE).wait()
        n = int(head[:8].view(torch.int64)[0])
        data = head[8:8 + min(n, HEADER - 8)].numpy().tobytes()
        if n > HEADER - 8:
            rest = torch.empty(n - (HEADER - 8), dtype=torch.uint8)
            self.control.broadcast(rest, 0).wait()
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def close(self) -> None:
        """Release both groups now, while the interpreter is whole (a group destroyed during
        interpreter teardown, racing its peer's exit, can abort the process)."""
        self.data = self.control = None

    def barrier(self) -> None:
        """Every rank has reached this point (on the control group, with the group's timeout)."""
        self.control.allreduce([torch.zeros(1)]).wait()
