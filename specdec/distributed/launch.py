"""Starting a tensor-parallel group: rank 0 is the process that builds the LLM; the others are
worker processes it spawns (torch.multiprocessing, as vLLM's multiproc executor does), or the
other ranks of a torchrun launch running the same command.

Start-up goes through a TCP store rank 0 hosts (port chosen by the OS): each worker loads the
model, then writes `ready/<rank>` (or `error/<rank>` with the reason); rank 0 polls the keys
and the processes, so a worker that cannot start is one clear error, never a wait. Then every
rank builds the groups (comm.py) and its shard (shard.py); the workers loop on rank 0's
commands (worker.py).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..model.llama import Transformer, shard_config
from .comm import Collectives
from .leader import Leader, LeaderTransformer, TensorParallelError
from .shard import shard_model


@dataclass(frozen=True)
class ParallelConfig:
    """tensor_parallel_size: ranks the target is split over; timeout_s: how long a collective
    may wait for a rank before the group is stopped; startup_timeout_s: for loading the model."""
    tensor_parallel_size: int = 1
    timeout_s: float = 120.0
    startup_timeout_s: float = 600.0

    def __post_init__(self):
        n = self.tensor_parallel_size
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {n!r}")
        for name in ("timeout_s", "startup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class TargetSpec:
    """What each worker loads: the same checkpoint, the same way as rank 0."""
    model: str
    dtype: str
    device: str
    quantization: str | None
    threads: int
    hf_overrides: dict | None = None
    disable_sliding_window: bool = False
    max_model_len: int | None = None


def start(full: Transformer, spec: TargetSpec, config: ParallelConfig) -> LeaderTransformer:
    """Rank 0's shard of `full`, its workers started and sharded alike. Under torchrun the
    other ranks never return: they serve rank 0's commands, then exit."""
    world = config.tensor_parallel_size
    shard_config(full.config, world)                    # the split must fit before anything starts
    launched = _torchrun(world, config)
    if launched is not None:
        store, rank = launched
        comm = Collectives(store, rank, world, _device(spec.device, rank), config.timeout_s)
        if rank != 0:
            from .worker import exit_now, serve
            serve(full, comm, store)
            exit_now(0)
        return shard_model(full, comm, LeaderTransformer, leader=Leader(comm, None, store))
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=config.startup_timeout_s))
    ctx = torch.multiprocessing.get_context("spawn")
    started = [ctx.Event() for _ in range(1, world)]
    procs = [ctx.Process(target=_worker_entry, args=(started[rank - 1], rank, world, store.port, spec, config),
                         daemon=True, name=f"specdec-tp-rank{rank}") for rank in range(1, world)]
    for p in procs:
        p.start()
    try:
        _wait_ready(store, procs, config.startup_timeout_s, started)
        comm = Collectives(store, 0, world, _device(spec.device, 0), config.timeout_s)
        return shard_model(full, comm, LeaderTransformer, leader=Leader(comm, procs, store))
    except BaseException:
        for p in procs:
            p.kill()
        raise


def _device(device: str, rank: int) -> torch.device:
    """Rank r's device: cuda:r on a GPU machine (one GPU per rank), else the CPU."""
    d = torch.device(device)
    return torch.device("cuda", rank) if d.type == "cuda" else d


def _worker_entry(started, *args) -> None:
    """A spawned rank: it got past its bootstrapping (re-importing the main module), then works."""
    started.set()
    from .worker import worker_main
    worker_main(*args)


def _not_guarded(rank: int, p) -> TensorParallelError:
    """A rank that died before its entry ran: while re-importing the parent's main module, as a
    spawned process does first. Where that script builds the LLM at its top level, the import
    builds it again and its own spawn fails (Python: "... before the current process has
    finished its bootstrapping phase"), or the script fails there some other way."""
    import sys

    script = getattr(sys.modules.get("__main__"), "__file__", None)
    where = f" ({script})" if script else ""
    return TensorParallelError(
        f"tensor-parallel rank {rank} (pid {p.pid}) exited with status {p.exitcode} while re-importing the main "
        f"module{where}, as a spawned worker does first: a script that builds LLM(tensor_parallel_size > 1) at its "
        f"top level must do it under `if __name__ == \"__main__\":`, else every worker runs the script again "
        f"(see the worker's traceback above for what failed there)")


def _wait_ready(store, procs, timeout_s: float, started=None) -> None:
    """started: per worker, an event its entry sets (None: no such check)."""
    deadline = time.monotonic() + timeout_s
    waiting = dict(enumerate(procs, start=1))
    while waiting:
        for rank, p in list(waiting.items()):
            if store.check([f"error/{rank}"]):
                raise TensorParallelError(f"tensor-parallel rank {rank} could not start: "
                                          f"{store.get(f'error/{rank}').decode()}")
            if store.check([f"ready/{rank}"]):
                del waiting[rank]
            elif p.exitcode is not None:
                if started is not None and not started[rank - 1].is_set():
                    raise _not_guarded(rank, p)
                raise TensorParallelError(f"tensor-parallel rank {rank} (pid {p.pid}) exited with status "
                                          f"{p.exitcode} while starting")
        if time.monotonic() > deadline:
            raise TensorParallelError(f"tensor-parallel ranks {sorted(waiting)} did not start within {timeout_s:.0f} s")
        time.sleep(0.05)


def under_torchrun() -> bool:
    """This process is one rank of a torchrun (or any env://) launch."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def _torchrun(world: int, config: ParallelConfig):
    """(store, rank) when this process is one rank of a torchrun (or any env://) launch."""
    env = os.environ
    if not under_torchrun():
        return None
    if int(env["WORLD_SIZE"]) != world:
        raise ValueError(f"tensor_parallel_size {world} differs from the launch's WORLD_SIZE {env['WORLD_SIZE']}")
    rank = int(env["RANK"])
    # torchrun's agent hosts the store at MASTER_PORT; a plain env:// launch has rank 0 host it
    host = rank == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=host,
                          timeout=timedelta(seconds=config.startup_timeout_s))
    return dist.PrefixStore("specdec/", store), rank


def exit_with_parent(poll_s: float = 1.0) -> None:
    """A spawned worker ends when rank 0's process is gone (even one killed without a word)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="specdec-parent-watch", daemon=True).start()
