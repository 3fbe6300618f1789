"""A worker rank: load the model, keep its shard, and repeat rank 0's commands until "stop".

It never decides anything: rank 0's engine schedules, drafts and verifies, and a worker only
runs the forwards (and KV moves) rank 0 announces, over caches whose block tables follow rank
0's (BlockManager.mirror). An error here is written to the store for rank 0's message, then
the process exits, which fails rank 0's next collective at once.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ..model.kv import BlockManager, KVCache
from ..model.llama import Transformer
from .comm import Collectives
from .leader import Command
from .shard import shard_model


class Worker:
    def __init__(self, model: Transformer, comm: Collectives):
        self.model, self.comm = model, comm
        self.caches: dict[int, KVCache] = {}
        self.ops = {"new_kv": self._new_kv, "new_cache": self._new_cache, "forward": self._forward, "move": self._move}

    @torch.inference_mode()
    def run(self) -> None:
        while True:
            cmd: Command = self.comm.receive_command()
            for handle in cmd.free:
                self.caches.pop(handle, None)
            if cmd.op == "stop":
                return
            self.ops[cmd.op](cmd)

    def _new_kv(self, cmd: Command) -> None:
        num_blocks, block_size, max_seqs, max_blocks, num_layers, dtype = cmd.args
        self.caches[cmd.cache] = self.model.new_kv(BlockManager(num_blocks, block_size, max_seqs, max_blocks),
                                                   num_layers, dtype)

    def _new_cache(self, cmd: Command) -> None:
        batch, max_len, num_layers = cmd.args
        self.caches[cmd.cache] = self.model.new_cache(batch, max_len, num_layers)

    def _forward(self, cmd: Command) -> None:
        tokens, batch, embeds, exit_layer, logits = cmd.args
        kv = self.caches[cmd.cache] if cmd.cache is not None else None
        if kv is not None:
            kv.blocks.mirror(cmd.tables)
        dev = self.model.device
        self.model(None if tokens is None else tokens.to(dev), kv, batch,
                   embeds=None if embeds is None else embeds.to(dev), exit_layer=exit_layer, logits=logits)

    def _move(self, cmd: Command) -> None:
        kv = self.caches[cmd.cache]
        kv.blocks.mirror(cmd.tables)
        kv.move(*cmd.args)


def serve(full: Transformer, comm: Collectives, store) -> None:
    """Shard `full` (then drop it) and serve rank 0's commands until it says stop; then the
    closing handshake of Leader.shutdown: a barrier, release the groups, wait for rank 0's."""
    model = shard_model(full, comm)
    del full
    Worker(model, comm).run()
    comm.barrier()
    comm.close()
    store.wait(["closed"], timedelta(seconds=30))


def exit_now(status: int) -> None:
    """End the process without interpreter teardown: destroying the groups' threads there can
    abort it (std::terminate) after the work is done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def worker_main(rank: int, world: int, port: int, spec, config) -> None:
    """The entry point of a spawned worker process (launch.start)."""
    from .. import kernels
    from ..model import load_model
    from .launch import _device, exit_with_parent

    # Ctrl-C in a terminal reaches the whole process group, this worker too: rank 0 alone handles
    # it (its shutdown, or its death, ends this process), so no second traceback is printed here
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(spec.threads)
    kernels.set_threads(spec.threads)
    exit_with_parent()
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=config.startup_timeout_s))
    device = _device(spec.device, rank)
    try:
        full = load_model(spec.model, spec.dtype, device, spec.quantization, spec.hf_overrides,
                          spec.disable_sliding_window, spec.max_model_len)
    except Exception as e:
        store.set(f"error/{rank}", f"{type(e).__name__}: {e}")
        sys.exit(1)
    store.set(f"ready/{rank}", "1")
    status = 0
    try:
        comm = Collectives(store, rank, world, device, config.timeout_s)
        serve(full, comm, store)
    except Exception as e:
        # rank 0 gone (its collectives fail first) or a failure here: say why, for rank 0's message
        status = 1
        try:
            store.set(f"error/{rank}", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        except RuntimeError:
            pass
    exit_now(status)
