"""Which build of the kernels this CPU runs: variants by instruction set, built and probed once.

Each variant is the same C sources compiled with its own -m flags into its own shared object
(cached per source hash and flags). /proc/cpuinfo says what the CPU claims; it is not trusted
alone (a listed feature can still fault: a hypervisor may not enable its register state, and
AMX faults until the process asks Linux for it with arch_prctl), so each
candidate first runs its self-test (`specdec_selftest`, every instruction family it uses) in a
child process: an illegal instruction kills the child, not us. The verdict is cached next to
the object, keyed by the CPU's model and flags. The best variant that passes is chosen;
`SPECDEC_ISA=<name>` forces one (a lower one, to test it; one that cannot run here is an error),
`SPECDEC_KERNELS=0` disables all.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

_DIR = Path(__file__).parent
SOURCES = [_DIR / n for n in ("skinny.c", "forward.c", "attention.c", "qgemm.c", "sampling.c", "lookup.c", "selftest.c")]
HEADERS = [_DIR / n for n in ("kernels.h", "forward.h", "qlanes.h", "vmath.h")]


@dataclass(frozen=True)
class Variant:
    name: str
    needs: tuple[str, ...]     # /proc/cpuinfo flags
    cflags: tuple[str, ...]    # gcc -m flags


_AVX2 = ("avx2", "fma", "f16c")
_AVX512 = (*_AVX2, "avx512f", "avx512bw", "avx512vl", "avx512dq")
_M_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_M_AVX512 = (*_M_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")

# Best first. No AVX-512-BF16 variant: `vdpbf16ps` (bf16 x bf16 pairs into fp32) measured slower
# than widening bf16 weights to fp32 FMAs on this project's Xeon (LM-head shape, 9 rows: 4.4 ms
# against 3.1, one thread), and it would round activations to bf16.
VARIANTS = (
    Variant("avx512_vnni", (*_AVX512, "avx512_vnni"), (*_M_AVX512, "-mavx512vnni")),
    Variant("avx512", _AVX512, _M_AVX512),
    Variant("avx_vnni", (*_AVX2, "avx_vnni"), (*_M_AVX2, "-mavxvnni")),
    Variant("avx2", _AVX2, _M_AVX2),
)
BY_NAME = {v.name: v for v in VARIANTS}

# -ffp-contract=off: gcc may otherwise fuse a separate multiply and add into an FMA in one
# inlined copy of a loop and not in another, and each output's sum must not depend on M.
_CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
_PROBE = "import ctypes, sys; sys.exit(ctypes.CDLL(sys.argv[1]).specdec_selftest())"


def cache_dir() -> Path:
    """Where the compiled kernels live: $SPECDEC_CACHE, else $XDG_CACHE_HOME/specdec or
    ~/.cache/specdec; where that cannot be written (a service user's HOME), a folder of this user's
    in the temporary directory, said once on stderr (without a cache the kernels cannot load, and
    PyTorch runs the model some 10x slower)."""
    global _fallback_said, _fallback
    base = _configured_cache()
    if base is not None and _writable(base):
        return base
    if _fallback is None:
        _fallback = _private_temp_folder()
    if not _fallback_said:
        _fallback_said = True
        where = f"the kernel cache {base} cannot be written" if base is not None else "this user has no home folder"
        print(f"specdec: {where}; compiling into {_fallback} (SPECDEC_CACHE names another)", file=sys.stderr)
    return _fallback


_fallback_said = False
_fallback: Path | None = None


def _configured_cache() -> Path | None:
    """$SPECDEC_CACHE, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec; None for a user with
    no home folder (a container's UID without a passwd entry, HOME unset)."""
    if os.environ.get("SPECDEC_CACHE"):
        return Path(os.environ["SPECDEC_CACHE"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "specdec"
    try:
        return Path.home() / ".cache" / "specdec"
    except RuntimeError:
        return None


def _private_temp_folder() -> Path:
    """A folder in the temporary directory that only this user can write: specdec-<uid>, reused
    only when this user owns it and nobody else may write it (another user could have made it,
    and planted a library there that the server would load), else a fresh one."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    path = Path(tempfile.gettempdir()) / f"specdec-{uid if uid is not None else 'user'}"
    try:
        path.mkdir(mode=0o700)
        return path
    except FileExistsError:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and (uid is None or st.st_uid == uid) and not st.st_mode & 0o077:
            return path
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix=f"specdec-{uid if uid is not None else 'user'}-"))


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK | os.X_OK)


def _cpuinfo(key: str) -> str | None:
    """The first processor's /proc/cpuinfo value for key, None where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip() == key:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_flags() -> set[str]:
    return set((_cpuinfo("flags") or "").split())


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD", ...), "" where it has none."""
    return _cpuinfo("vendor_id") or ""


def _cpu_fingerprint() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return hashlib.sha256("\n".join(keep).encode()).hexdigest()[:16]


def claimed(flags: set[str] | None = None) -> list[Variant]:
    """Variants whose instructions /proc/cpuinfo lists, best first."""
    flags = cpu_flags() if flags is None else flags
    return [v for v in VARIANTS if all(f in flags for f in v.needs)]


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")


def build(v: Variant) -> Path | None:
    """The variant's shared object, compiled on first use; None without a compiler or on failure."""
    cc = _compiler()
    if cc is None:
        return None
    h = hashlib.sha256(b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS)) + " ".join((*_CFLAGS, *v.cflags)).encode())
    path = cache_dir() / f"kernels-{v.name}-{h.hexdigest()[:16]}.so"
    if path.is_file():
        return path
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cc, *_CFLAGS, *v.cflags, *map(str, SOURCES), "-o", str(tmp), "-lm"]
    if sys.stderr.isatty():     # a person waiting at a terminal (never in a log or a test's capture)
        print(f"specdec: compiling the {v.name} kernels (first use on this machine, about 30 s) into {path.parent}",
              file=sys.stderr)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            tmp.unlink(missing_ok=True)
            return None
        os.replace(tmp, path)   # atomic: a concurrent build of the same variant is harmless
    except OSError:             # an unwritable cache: PyTorch it is
        return None
    return path


def probe(path: Path) -> bool:
    """Run the object's self-test in a child process once per CPU; the verdict is cached."""
    verdict = path.with_suffix(".probe")
    fp = _cpu_fingerprint()
    try:
        cached = json.loads(verdict.read_text())
        if cached.get("cpu") == fp:
            return bool(cached["ok"])
    except (OSError, ValueError, KeyError):
        pass
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE, str(path)], capture_output=True, timeout=120,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        ok = r.returncode == 0
    except subprocess.TimeoutExpired:
        ok = False
    tmp = verdict.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"cpu": fp, "ok": ok}))
        os.replace(tmp, verdict)
    except OSError:
        pass                    # not cached: probed again next time
    return ok


def usable(v: Variant) -> Path | None:
    """The variant's object if this CPU claims its instructions, it builds, and its self-test passes."""
    if v not in claimed():
        return None
    path = build(v)
    return path if path is not None and probe(path) else None


def requested() -> str | None:
    """SPECDEC_ISA, validated: a clear error for a name that is not a variant."""
    name = os.environ.get("SPECDEC_ISA", "").strip().lower()
    if not name or name == "auto":
        return None
    if name not in BY_NAME:
        raise ValueError(f"SPECDEC_ISA={name!r}: not a kernel variant (choose from auto, {', '.join(BY_NAME)})")
    return name


def enabled() -> bool:
    return os.environ.get("SPECDEC_KERNELS", "1") != "0" and sys.platform == "linux"


def choose() -> tuple[Variant, Path] | None:
    """The variant to use: SPECDEC_ISA's if set (a clear error where it cannot run here: the user
    asked for that code, not PyTorch's), else the best that runs."""
    if not enabled():
        return None
    name = requested()
    if name:
        v = BY_NAME[name]
        path = usable(v)
        if path is None:
            raise ValueError(f"SPECDEC_ISA={name!r}: {_why_not(v)}; unset it to use the best variant that runs here")
        return v, path
    for v in VARIANTS:
        path = usable(v)
        if path is not None:
            return v, path
    return None


def _why_not(v: Variant) -> str:
    """Why usable(v) is None, in words."""
    missing = [f for f in v.needs if f not in cpu_flags()]
    if missing:
        return f"this CPU cannot run the {v.name} kernels (it lacks {', '.join(missing)})"
    if _compiler() is None:
        return f"no C compiler (gcc, or $CC) to build the {v.name} kernels"
    if build(v) is None:
        return f"the {v.name} kernels did not compile"
    return f"the {v.name} kernels fail their self-test on this CPU"
