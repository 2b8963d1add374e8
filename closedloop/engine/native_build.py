"""Compile a small C source for this host once, cache the library, load it with ctypes.

A few hot loops (``closedloop.engine.attention_loops``) run faster as plain C than as the
torch calls they replace. They are compiled on the machine that runs them, with the host's
instruction set (``-march=native``) and reassociation allowed (``FLAGS``: reductions may be
reordered and vectorized; the result then differs from a sequential sum by float rounding; no
``-ffast-math``, which would flush subnormals to zero process-wide), into a shared
library under a cache folder, and loaded through ``ctypes`` (which releases the GIL during the
call). No torch headers are involved: a library builds in well under a second. Parallel loops
use OpenMP (``-fopenmp``); the library's ``libgomp.so.1`` resolves to the one torch has already
loaded (same soname), so its loops run on torch's thread team, sized by
``torch.set_num_threads``, instead of a second team competing for the cores.

The cache key is a hash of the source, the compiler's identity, the flags and the CPU's flags,
so another CPU (a machine image moved to another host class) or another compiler builds its
own. The folder is ``$CLOSEDLOOP_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/closedloop/kernels``,
else ``~/.cache/closedloop/kernels``; a build writes a temporary file and renames it into
place, so concurrent processes never load half a library.

Where nothing can be built (no C compiler, a failed build, a libc ctypes cannot load, a
non-x86/ARM host whose ``-march=native`` the compiler refuses) ``load_native`` returns ``None``
with the reason in ``why_not(name)``, and callers keep their torch path. ``CLOSEDLOOP_NATIVE=0``
turns every native kernel off (the torch paths then run everywhere).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from closedloop.engine.host_precision import read_cpu_facts
from closedloop.errors import NativeBuildError

DISABLE_ENV = "CLOSEDLOOP_NATIVE"
CACHE_ENV = "CLOSEDLOOP_KERNEL_CACHE"
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-shared")
"""Reassociation lets reductions vectorize, but not ``-ffast-math``/``-Ofast``/
``-funsafe-math-optimizations``: linking a shared library with those adds ``crtfastmath.o``,
which on loading sets flush-to-zero and denormals-are-zero for the whole process (torch,
numpy, Python floats), changing every later result that passes through a subnormal."""
BUILD_TIMEOUT_S = 120

_loaded: dict[str, Any] = {}
_reasons: dict[str, str] = {}


def native_enabled() -> bool:
    """False when ``CLOSEDLOOP_NATIVE=0`` (or ``false``/``off``) turns native kernels off."""
    return os.environ.get(DISABLE_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def cache_dir() -> Path:
    """The folder compiled libraries are kept in (module doc)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "closedloop" / "kernels"


def load_native(name: str, source: str) -> Any | None:
    """The ``ctypes.CDLL`` of ``source`` built for this host, or ``None`` (``why_not(name)``).

    Built at most once per cache key and loaded once per process; later calls return the same
    handle (or ``None`` again without retrying a failed build).
    """
    if not native_enabled():
        _reasons[name] = f"{DISABLE_ENV}=0"
        return None
    if name in _loaded:
        return _loaded[name]
    lib = None
    try:
        lib = ctypes.CDLL(str(_built(name, source)))
    except (OSError, subprocess.SubprocessError, NativeBuildError) as exc:
        _reasons[name] = " ".join(str(exc).split())[:300] or type(exc).__name__
    _loaded[name] = lib
    return lib


def why_not(name: str) -> str | None:
    """Why ``load_native(name, ...)`` returned ``None`` (``None`` if it did not, or was not
    called)."""
    return _reasons.get(name)


def _compiler() -> str:
    found = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") \
        or shutil.which("clang")
    if not found:
        raise NativeBuildError("no C compiler (cc, gcc or clang) on PATH")
    return found


def _built(name: str, source: str) -> Path:
    """The path of the library for ``source``, compiling it if the cache lacks it."""
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             timeout=30).stdout.splitlines()[:1]
    facts = read_cpu_facts()
    key = hashlib.sha256("\0".join([source, cc, *version, *FLAGS, facts.arch,
                                    " ".join(sorted(facts.flags))]).encode()).hexdigest()[:20]
    target = cache_dir() / f"{name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / f"{name}.c"
        src.write_text(source)
        out = Path(tmp) / f"{name}.so"
        done = subprocess.run([cc, *FLAGS, "-o", str(out), str(src), "-lm"],
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            errors = [ln for ln in done.stderr.splitlines() if "error" in ln] or [done.stderr]
            raise NativeBuildError(f"{cc} failed ({done.returncode}): {errors[0].strip()}")
        os.replace(out, target)
    return target
