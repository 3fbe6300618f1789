"""The engine under torch.profiler, switched on and off while it runs (vLLM's start_profile /
stop_profile, `--profiler-config`, the older VLLM_TORCH_PROFILER_DIR).

    LLM(..., profiler_config={"profiler": "torch", "torch_profiler_dir": "./traces"})
    llm.start_profile(); llm.generate(...); llm.stop_profile()

    specdec serve --profiler-config '{"profiler": "torch", "torch_profiler_dir": "./traces"}'
    curl -X POST localhost:8000/start_profile ... curl -X POST localhost:8000/stop_profile

stop_profile writes a Chrome / Perfetto trace (`specdec-rank0.<time>.pt.trace.json[.gz]`, open it
in ui.perfetto.dev) and a table of the ops' self time (`profiler_out_0.txt`) into the folder. Each
engine step that runs a forward is one range ("specdec:step <n> running <m> waiting"), its phases inside it
(schedule, propose, forward, verify, commit, proposer update): the C kernels run outside torch's
ops, so these ranges are where their time shows. `delay_iterations` steps pass before recording
starts and recording stops by itself after `max_iterations` steps (0: until stop_profile); only
steps that run a forward count (an idle server's empty steps do not).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import logging
import os
import shutil
import time

log = logging.getLogger("specdec.profiler")

ENV_DIR = "VLLM_TORCH_PROFILER_DIR"
# vLLM's older environment switches beside the folder (names -> ProfilerConfig fields)
ENV_FLAGS = {"VLLM_TORCH_PROFILER_RECORD_SHAPES": "torch_profiler_record_shapes",
             "VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY": "torch_profiler_with_memory",
             "VLLM_TORCH_PROFILER_WITH_STACK": "torch_profiler_with_stack",
             "VLLM_TORCH_PROFILER_WITH_FLOPS": "torch_profiler_with_flops",
             "VLLM_TORCH_PROFILER_USE_GZIP": "torch_profiler_use_gzip"}
# vLLM's fields that only mean something on a GPU or in its front-end process: accepted, unused
_NO_MEANING = ("torch_profiler_dump_cuda_time_total", "capture_torch_profiler", "detailed_trace_annotation",
               "ignore_frontend", "warmup_iterations", "active_iterations", "wait_iterations")


class ProfilerNotEnabled(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class ProfilerConfig:
    """vLLM's ProfilerConfig, the fields a CPU engine uses ('cuda', NVTX ranges for nsys, is refused)."""
    profiler: str | None = None
    torch_profiler_dir: str = ""
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    delay_iterations: int = 0
    max_iterations: int = 0

    @classmethod
    def of(cls, value) -> "ProfilerConfig | None":
        """A dict, a JSON string, a ProfilerConfig, or None (then VLLM_TORCH_PROFILER_DIR, if
        set); one-line ValueError for anything vLLM would refuse. None: profiling is off."""
        if value is None:
            return cls.from_env()
        if isinstance(value, cls):
            return value if value.profiler else None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"profiler_config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"profiler_config must be an object, got {type(value).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names - set(_NO_MEANING))
        if unknown:
            raise ValueError(f"profiler_config: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(names))})")
        kept = {k: v for k, v in value.items() if k in names}
        for k in ("delay_iterations", "max_iterations"):
            v = kept.get(k, 0)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"profiler_config: {k} must be an integer >= 0, got {v!r}")
        for f in dataclasses.fields(cls):
            if f.type == "bool" and f.name in kept and not isinstance(kept[f.name], bool):
                raise ValueError(f"profiler_config: {f.name} must be true or false, got {kept[f.name]!r}")
        kind, folder = kept.get("profiler"), kept.get("torch_profiler_dir") or ""
        if kind not in (None, "torch", "cuda"):
            raise ValueError(f"profiler_config: profiler must be 'torch' or 'cuda', got {kind!r}")
        if kind == "cuda":
            raise ValueError("profiler_config: profiler 'cuda' (NVTX ranges for nsys) needs a GPU; use 'torch'")
        if folder and kind != "torch":
            raise ValueError("profiler_config: torch_profiler_dir is only applicable when profiler is 'torch'")
        if kind == "torch" and not folder:
            raise ValueError("profiler_config: torch_profiler_dir must be set when profiler is 'torch'")
        if kind is None:
            return None
        kept["torch_profiler_dir"] = os.path.abspath(os.path.expanduser(folder))
        return cls(**kept)

    @classmethod
    def from_env(cls) -> "ProfilerConfig | None":
        folder = os.environ.get(ENV_DIR)
        if not folder:
            return None
        flags = {}
        for name, field in ENV_FLAGS.items():
            if name in os.environ:
                flags[field] = os.environ[name].strip().lower() not in ("0", "false", "no", "")
        return cls(profiler="torch", torch_profiler_dir=os.path.abspath(os.path.expanduser(folder)), **flags)


class StepProfiler:
    """torch.profiler around engine steps. start() / stop() are called on the engine's thread
    (the server hands them to it between two steps); after_step() counts steps for the delay
    and the limit. `ranges` is True while recording: the engine then names its steps' phases."""

    def __init__(self, config: ProfilerConfig, rank: int = 0):
        self.config, self.rank = config, rank
        self._prof = None
        self._wait = None         # steps still to pass before recording (delay_iterations), or None
        self._steps = 0           # steps recorded
        self.ranges = False
        self._ended = False       # max_iterations ended the recording: the stop_profile after it is expected
        self.last_trace: str | None = None

    @property
    def active(self) -> bool:
        return self._prof is not None or self._wait is not None

    def start(self) -> None:
        self._ended = False
        if self.active:
            log.warning("start_profile: the profiler is already running")
            return
        os.makedirs(self.config.torch_profiler_dir, exist_ok=True)
        if self.config.delay_iterations > 0:
            self._wait = self.config.delay_iterations
            log.info("profiler: recording starts %d engine steps from now", self._wait)
        else:
            self._record()

    def _record(self) -> None:
        import torch.profiler as tp

        c = self.config
        self._wait, self._steps = None, 0
        self._prof = tp.profile(activities=[tp.ProfilerActivity.CPU], record_shapes=c.torch_profiler_record_shapes,
                                profile_memory=c.torch_profiler_with_memory, with_stack=c.torch_profiler_with_stack,
                                with_flops=c.torch_profiler_with_flops)
        self._prof.start()
        self.ranges = True
        log.info("profiler: recording into %s", c.torch_profiler_dir)

    def stop(self) -> str | None:
        """End recording and write the trace; its path (None if nothing was recorded)."""
        if self._prof is None:
            if self._wait is None and not self._ended:
                log.warning("stop_profile: the profiler is not running")
            self._ended = False
            self._wait = None
            return None
        prof, self._prof, self.ranges = self._prof, None, False
        prof.stop()
        c = self.config
        stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{time.time_ns() % 1_000_000_000:09d}"
        path = os.path.join(c.torch_profiler_dir, f"specdec-rank{self.rank}.{stamp}.pt.trace.json")
        prof.export_chrome_trace(path)
        if c.torch_profiler_use_gzip:
            with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(path)
            path += ".gz"
        try:
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=50)
        except Exception as e:          # noqa: BLE001 - the trace is written; the table is extra
            # torch's Python tracer (with_stack) keeps raw pointers to frame names: a code object
            # freed while recording (a template compiled per request, say) leaves a name that no
            # longer decodes (pytorch#64345, #113564); the table is lost, not the trace
            table = f"no table: torch could not read back every event name ({type(e).__name__}: {e}); " \
                    "the trace holds the events (torch_profiler_with_stack false avoids it)"
            log.warning("profiler: %s", table)
        with open(os.path.join(c.torch_profiler_dir, f"profiler_out_{self.rank}.txt"), "w") as f:
            f.write(table + "\n")
        log.info("profiler: %d steps recorded, trace %s", self._steps, path)
        self.last_trace = path
        return path

    def after_step(self) -> None:
        if self._wait is not None:
            self._wait -= 1
            if self._wait <= 0:
                self._record()
            return
        if self._prof is not None:
            self._steps += 1
            if self.config.max_iterations and self._steps >= self.config.max_iterations:
                self.stop()
                self._ended = True

    def range(self, name: str):
        """A named range while recording, else nothing (no cost on the engine's usual path)."""
        if not self.ranges:
            return _NO_RANGE
        import torch.autograd.profiler as ap

        return ap.record_function(name)


_NO_RANGE = contextlib.nullcontext()       # reusable: entering it does nothing


def range_of(profiler: StepProfiler | None, name: str):
    """A named range while `profiler` records, else a shared no-op (the engine's usual path)."""
    return _NO_RANGE if profiler is None or not profiler.ranges else profiler.range(name)
