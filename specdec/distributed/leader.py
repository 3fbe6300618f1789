"""Rank 0's side of a tensor-parallel target: it decides, the workers repeat.

The engine on rank 0 schedules, drafts and verifies; the target it holds is a
`LeaderTransformer`, whose every forward (and every KV `move` of its caches) is first sent to
the workers as a `Command`, then run on rank 0's own shard: each worker runs the same forward on
its shard, in the same order, over a cache whose block tables follow rank 0's. Nothing else
crosses: logits reach rank 0 only (the vocabulary-parallel head gathers there), so sampling,
acceptance and K are decided once, on rank 0, and the ranks cannot diverge, seeded or not.

Failures: every collective has the group's timeout, a watchdog thread notices a worker that
exits, and whatever fails first turns into one `TensorParallelError` naming the rank; the
group is then stopped (the other workers are terminated) and every later call raises it.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass

import torch

from ..model.kv import BlockManager, KVCache
from ..model.llama import Transformer


class TensorParallelError(RuntimeError):
    """The tensor-parallel group has stopped; the message names the rank and the cause."""


@dataclass(frozen=True)
class Command:
    """What rank 0 tells the workers to do next (pickled over the control group)."""
    op: str                  # "new_kv" | "new_cache" | "forward" | "move" | "stop"
    cache: int | None = None
    args: tuple = ()
    tables: tuple = ()       # (sequence id, block-table row, blocks) of the sequences it touches
    free: tuple = ()         # caches rank 0 has dropped since the previous command


class Leader:
    """Sends commands, owns the worker processes (None under torchrun) and the failure state."""

    def __init__(self, comm, procs: list | None, store, poll_s: float = 0.2):
        self.comm, self.procs, self.store = comm, procs or [], store
        self.failure: TensorParallelError | None = None
        self._handles = iter(range(1 << 62))
        self._freed: list[int] = []
        self._lock = threading.Lock()
        self._stopping = False
        if self.procs:
            threading.Thread(target=self._watch, args=(poll_s,), name="specdec-tp-watchdog", daemon=True).start()

    def new_handle(self) -> int:
        return next(self._handles)

    def release(self, handle: int) -> None:
        """A cache was garbage-collected (any thread): its worker copies go with the next command."""
        with self._lock:
            self._freed.append(handle)

    def send(self, op: str, cache: int | None = None, args: tuple = (), tables: tuple = ()) -> None:
        with self._lock:
            freed, self._freed = tuple(self._freed), []
        self.call(self.comm.send_command, Command(op, cache, args, tables, freed))

    def call(self, fn, *args, **kw):
        """fn(*args, **kw), with any failure of the group turned into its TensorParallelError.
        Runs on the engine's thread: only there may the groups be released."""
        if self.failure is not None:
            self._close()
            raise self.failure
        try:
            return fn(*args, **kw)
        except RuntimeError as e:     # gloo reports a dead or silent peer as a RuntimeError
            failure = self.fail(self._silent(e))
            self._close()
            raise failure from e
        except BaseException as e:    # Ctrl-C in a collective: the workers are left mid-command
            self.fail(f"interrupted ({type(e).__name__}) while the ranks were in a collective; the group "
                      "cannot resume: make a new LLM")
            self._close()
            raise

    def _silent(self, e: RuntimeError) -> str:
        """The cause of a failed collective where no worker has exited (fail() looks for that
        first): past the timeout, a rank stopped answering (with two ranks, rank 1)."""
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "timed out" not in first.lower() and "timeout" not in first.lower():
            return f"rank 0: {type(e).__name__}: {first}"
        timeout = getattr(self.comm, "timeout_s", None)
        within = f" within {timeout:g} s" if timeout else ""
        if self.comm.world_size == 2:
            pid = f" (pid {self.procs[0].pid})" if self.procs else ""
            who = f"rank 1{pid} did not answer{within}"
        else:
            who = f"a rank among 1..{self.comm.world_size - 1} did not answer{within}"
        return f"{who} (gloo on rank 0: {first})"

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def fail(self, cause: str) -> TensorParallelError:
        """Stop the group: name the dead rank when there is one, terminate the others."""
        if self.failure is None:
            dead = self._dead(wait_s=1.0)
            reason = dead or cause
            self.failure = TensorParallelError(f"tensor-parallel group of {self.comm.world_size} ranks stopped: "
                                               f"{reason}")
            self._terminate()
        return self.failure

    def shutdown(self) -> None:
        """Stop the workers (after the current command) and release the groups; idempotent.
        The order avoids racing a peer's exit: "stop", a barrier (every worker has it), each
        rank releases its groups, rank 0 says so in the store, then the workers exit."""
        if self._stopping:
            return
        self._stopping = True
        if self.failure is None and self.comm.control is not None:
            try:
                self.comm.send_command(Command("stop"))
                self.comm.barrier()
            except RuntimeError:
                pass
        self._close()
        try:
            self.store.set("closed", "1")
        except RuntimeError:
            pass
        for p in self.procs:
            p.join(timeout=10)
        self._terminate()

    def _close(self) -> None:
        if self.comm.control is not None:
            self.comm.close()

    def _dead(self, wait_s: float) -> str | None:
        """'rank r (pid p) exited with ...' for a worker that has exited, waiting a little for
        the exit to show (a collective may fail a moment before the process is reaped)."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, p in enumerate(self.procs, start=1):
                if p.exitcode is not None:
                    return f"rank {rank} (pid {p.pid}) {_exit_text(p.exitcode)}{self._worker_error(rank)}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _worker_error(self, rank: int) -> str:
        try:
            if self.store.check([f"error/{rank}"]):
                return ": " + self.store.get(f"error/{rank}").decode()
        except RuntimeError:
            pass
        return ""

    def _watch(self, poll_s: float) -> None:
        while not self._stopping and self.failure is None:
            if any(p.exitcode is not None for p in self.procs):
                self.fail("a worker exited")
                return
            time.sleep(poll_s)

    def _terminate(self) -> None:
        for p in self.procs:
            if p.exitcode is None:
                p.kill()


def _exit_text(code: int) -> str:
    if code < 0:
        import signal
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class LeaderKVCache(KVCache):
    """Rank 0's cache of a tensor-parallel target: each worker holds the same cache over its
    own KV heads; moves are repeated there."""

    def __init__(self, blocks, num_layers, num_kv_heads, head_dim, dtype, device, leader: Leader, handle: int,
                 window: int | None = None, values_are_keys: bool = False):
        super().__init__(blocks, num_layers, num_kv_heads, head_dim, dtype, device, window, values_are_keys)
        self.leader, self.handle = leader, handle
        weakref.finalize(self, leader.release, handle)

    def move(self, seq, src, dst_start: int) -> None:
        self.leader.send("move", self.handle, (seq, list(src), dst_start), tables_of(self, [seq]))
        super().move(seq, src, dst_start)


def tables_of(kv: KVCache, seqs) -> tuple:
    blocks: BlockManager = kv.blocks
    return tuple((s, blocks.row(s), list(blocks.blocks(s))) for s in dict.fromkeys(seqs))


class LeaderTransformer(Transformer):
    """Rank 0's shard: every forward is announced to the workers, then run here."""

    def __init__(self, cfg, tp_size: int, leader: Leader):
        super().__init__(cfg, tp_size)
        self.leader = leader

    def forward(self, tokens, kv=None, batch=None, *, embeds=None, exit_layer=None, logits=True, hidden=False,
                graphs=None):       # graphs: always None here (new_kv refuses their spare block)
        cpu = lambda t: None if t is None else t.cpu()  # noqa: E731  (commands travel pickled, on the host)
        tables = tables_of(kv, batch.seqs) if kv is not None else ()
        self.leader.send("forward", kv.handle if kv is not None else None,
                         (cpu(tokens), batch, cpu(embeds), exit_layer, logits), tables)
        return self.leader.call(super().forward, tokens, kv, batch, embeds=embeds, exit_layer=exit_layer,
                                logits=logits, hidden=hidden)

    def new_kv(self, blocks: BlockManager, num_layers: int | None = None,
               dtype: torch.dtype | None = None, spare: bool = False) -> KVCache:
        if spare:
            raise ValueError("CUDA graphs are not supported with tensor parallelism")
        cfg = self.local_config
        n = cfg.num_hidden_layers if num_layers is None else num_layers
        dtype = dtype or self.dtype          # every rank's cache in the same dtype (--kv-cache-dtype)
        handle = self.leader.new_handle()
        self.leader.send("new_kv", handle, (blocks.num_blocks, blocks.block_size, blocks.table.shape[0],
                                            blocks.max_blocks_per_seq, n, dtype))
        return LeaderKVCache(blocks, n, cfg.num_key_value_heads, cfg.head_dim, dtype, self.device,
                             self.leader, handle, self.kv_window(n), self.values_are_keys)

    def new_cache(self, batch: int = 1, max_len: int | None = None, num_layers: int | None = None) -> KVCache:
        cfg = self.local_config
        max_len = max_len or cfg.max_position_embeddings
        n = cfg.num_hidden_layers if num_layers is None else num_layers
        handle = self.leader.new_handle()
        self.leader.send("new_cache", handle, (batch, max_len, n))
        return LeaderKVCache.dense(batch, max_len, n, cfg.num_key_value_heads, cfg.head_dim, self.dtype,
                                   self.device, leader=self.leader, handle=handle,
                                   values_are_keys=self.values_are_keys)
