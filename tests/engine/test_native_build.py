"""Native kernels: built once per host into a keyed cache, loaded with ctypes, or refused with a
reason (and the torch paths kept)."""

import shutil

import pytest

from closedloop.engine import native_build

pytestmark = pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")),
    reason="no C compiler on this host")

SOURCE = "int cl_add(int a, int b) { return a + b; }\n"


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path / "kernels"))
    monkeypatch.setattr(native_build, "_loaded", {})
    monkeypatch.setattr(native_build, "_reasons", {})


def test_builds_loads_and_reuses_the_cached_library(monkeypatch):
    lib = native_build.load_native("adder", SOURCE)
    assert lib is not None and lib.cl_add(2, 40) == 42
    built = list(native_build.cache_dir().glob("adder-*.so"))
    assert len(built) == 1
    monkeypatch.setattr(native_build, "_loaded", {})  # a new process: the cache, no compiler
    monkeypatch.setattr(native_build.subprocess, "run", _only_version(native_build.subprocess.run))
    assert native_build.load_native("adder", SOURCE).cl_add(1, 1) == 2
    assert list(native_build.cache_dir().glob("adder-*.so")) == built


def _only_version(run):
    def guarded(cmd, *a, **k):
        assert cmd[-1] == "--version", f"compiled again: {cmd}"
        return run(cmd, *a, **k)
    return guarded


def test_another_source_builds_its_own():
    native_build.load_native("one", SOURCE)
    native_build.load_native("two", SOURCE.replace("a + b", "a - b"))
    assert len(list(native_build.cache_dir().glob("*.so"))) == 2


def test_a_failed_build_is_none_with_the_compilers_reason():
    assert native_build.load_native("broken", "int f( {") is None
    reason = native_build.why_not("broken")
    assert reason and "failed" in reason
    assert not list(native_build.cache_dir().glob("broken-*.so"))


def test_no_compiler_is_none_with_a_reason(monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(native_build.shutil, "which", lambda name: None)
    assert native_build.load_native("adder", SOURCE) is None
    assert "no C compiler" in native_build.why_not("adder")


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(native_build.DISABLE_ENV, "0")
    assert native_build.load_native("adder", SOURCE) is None
    assert native_build.why_not("adder") == "CLOSEDLOOP_NATIVE=0"


def test_loading_a_library_keeps_subnormal_floats(monkeypatch):
    """The flags reassociate but never link ``crtfastmath.o`` (``-ffast-math`` does), which would
    set flush-to-zero/denormals-are-zero for the whole process on loading."""
    tiny = 2.2250738585072014e-308  # the smallest normal double
    assert tiny / 4 > 0.0
    lib = native_build.load_native("subnormal", SOURCE.replace("a + b", "a * b"))
    assert lib is not None and lib.cl_add(6, 7) == 42
    assert tiny / 4 > 0.0
    import torch

    assert float(torch.tensor(1e-40, dtype=torch.float32) * 1.0) > 0.0


def test_the_fast_math_flags_are_what_that_test_catches(tmp_path):
    """The check above can fail: a library linked with ``-ffast-math`` flushes subnormals."""
    import subprocess
    import sys

    src = tmp_path / "fm.c"
    src.write_text(SOURCE)
    lib = tmp_path / "fm.so"
    subprocess.run([native_build._compiler(), "-O2", "-ffast-math", "-fPIC", "-shared", "-o",
                    str(lib), str(src)], check=True)
    code = ("import ctypes, sys; t = 2.2250738585072014e-308; before = t / 4 > 0; "
            f"ctypes.CDLL({str(lib)!r}); sys.exit(0 if before and t / 4 == 0 else 3)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
