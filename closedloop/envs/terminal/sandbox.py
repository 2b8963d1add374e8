"""Sandboxed execution of allowlisted Python commands over a workspace.

``run_command`` materializes the workspace files into a fresh private directory, runs the argv
for real in a child Python, and reads the regular files back, so the program's writes become
state. Layers, innermost first:

1. An audit hook installed by a bootstrap passed with ``-c`` (never a file in the workspace). It
   refuses socket use, process spawning (fork, exec, ``subprocess``, ``os.system``,
   ``posix_spawn``, signals to other processes), ``ctypes``, symlinks and hard links, opening
   or changing paths outside the workspace (writes: the workspace, ``HOME`` and ``TMPDIR`` in the
   private directory; reads: those plus the standard library), with symlinks resolved by the
   hook's own walk. Every refusal raises ``PermissionError("sandbox: ...")`` in the program and
   is reported in ``CommandResult.refusals``. The hook holds every function it calls as a default
   argument and refuses rebinding them, introspection through ``gc``, and rlimit changes.
2. Resource limits set in the child before the program runs: CPU seconds, address space, file
   size, open files, processes, no core dumps; as root the child also drops to ``nobody``.
3. A network namespace (``unshare -n``) when the machine allows it (root); optional.
4. A wall-clock timeout that kills the whole process group; output captured with a byte cap and
   an explicit ``[... output truncated at N bytes ...]`` label.

Determinism: a fixed ``PYTHONHASHSEED``, a scrubbed environment (``CLOSEDLOOP_SEED`` and
``CLOSEDLOOP_CLOCK`` carry the env's seed and mock clock), ``random`` seeded with the env seed,
no bytecode writes, and the private directory's real path rewritten to ``/sandbox`` in outputs
and files. The child runs with ``-S -P -s -B`` rather than ``-I`` because ``-I`` would ignore
``PYTHONHASHSEED``; the environment is built from scratch, which is what ``-E`` would protect.
Only ``python3 <script.py> ...`` and ``python3 -m <module> ...`` run; the standard library is
the only importable code besides the workspace.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from closedloop.envs.terminal.sandbox_child import BOOT_FAILURE_EXIT, world_accessible
from closedloop.envs.terminal.workspace import FileTree, WorkspaceLimits, normalize_path
from closedloop.errors import (
    SandboxCommandError,
    SandboxInfraError,
    WorkspaceLimitError,
    WorkspacePathError,
)

PYTHON_NAMES = ("python3", "python")
SANDBOX_PATH = "/sandbox"
MAX_REFUSALS = 20
_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def truncation_label(cap: int) -> str:
    """The label appended to any output cut at ``cap`` bytes."""
    return f"[... output truncated at {cap} bytes ...]"


@dataclass(frozen=True)
class SandboxConfig:
    """Limits of one command run.

    timeout_s: wall clock before the process group is killed; output_cap_bytes: per stream;
    cpu_s: CPU-seconds limit (default: the timeout rounded up, plus one); memory_bytes: address
    space; max_processes: RLIMIT_NPROC; network_namespace: ``None`` = use ``unshare -n`` when it
    works here, ``True`` = require it, ``False`` = never; drop_privileges: run as ``nobody``
    when started as root and ``nobody`` can read the standard library; scratch_dir: where the
    private directories go (default: the system temp dir; a tmpfs such as ``/dev/shm`` makes
    materializing and cleaning up ~10x faster, at the cost of RAM a runaway writer can fill).
    """

    timeout_s: float = 5.0
    output_cap_bytes: int = 8192
    cpu_s: int | None = None
    memory_bytes: int = 1024 * 1024 * 1024
    max_open_files: int = 64
    max_processes: int = 512
    network_namespace: bool | None = None
    drop_privileges: bool = True
    scratch_dir: str | None = None


@dataclass(frozen=True)
class CommandResult:
    """What one command run produced.

    exit_code: the process's status (negative: killed by that signal); stdout/stderr: decoded
    UTF-8 (invalid bytes replaced), each cut at the cap with the truncation label; truncated:
    either stream was cut; timed_out: killed at the wall-clock or CPU limit (then ``files_after``
    is ``None``: a killed program's partial writes are not deterministic and are discarded);
    files_after: the workspace read back; rejected: (path, reason) of files not read back;
    refusals: what the audit hook refused; elapsed_s: wall time (not deterministic).
    """

    exit_code: int
    stdout: str
    stderr: str
    truncated: bool
    timed_out: bool
    files_after: FileTree | None
    rejected: tuple[tuple[str, str], ...] = ()
    refusals: tuple[str, ...] = ()
    elapsed_s: float = 0.0


def check_argv(argv: Sequence[str]) -> None:
    """Raise ``SandboxCommandError`` unless argv is ``python3 <script> ...`` or ``python3 -m``.

    The script must be a normalized workspace path; arguments must be strings without NUL.
    """
    if not argv or not all(isinstance(a, str) and "\x00" not in a for a in argv):
        raise SandboxCommandError("argv must be a non-empty list of strings without NUL")
    if argv[0] not in PYTHON_NAMES:
        raise SandboxCommandError(f"only {PYTHON_NAMES} commands run in the sandbox, "
                                  f"got {argv[0]!r}")
    if len(argv) < 2:
        raise SandboxCommandError("a python command needs a script or -m module")
    if argv[1] == "-m":
        if len(argv) < 3 or not _MODULE_RE.match(argv[2]):
            raise SandboxCommandError("-m needs a dotted module name")
        return
    if argv[1].startswith("-"):
        raise SandboxCommandError(f"python option {argv[1]!r} is not allowed")
    try:
        if normalize_path(argv[1]) != argv[1]:
            raise SandboxCommandError(f"script path {argv[1]!r} is not normalized")
    except WorkspacePathError as exc:
        raise SandboxCommandError(f"script path {argv[1]!r}: {exc.reason}") from None


@functools.lru_cache(maxsize=1)
def network_namespace_available() -> bool:
    """Say whether ``unshare -n`` works here (checked once, on first use)."""
    exe = shutil.which("unshare")
    if exe is None:
        return False
    try:
        done = subprocess.run([exe, "-n", "true"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _use_netns(config: SandboxConfig) -> bool:
    if config.network_namespace is False:
        return False
    available = network_namespace_available()
    if config.network_namespace and not available:
        raise SandboxInfraError("network_namespace=True but 'unshare -n' does not work here")
    return available


def run_command(argv: Sequence[str], files: Mapping[str, str], *, timeout_s: float | None = None,
                output_cap_bytes: int | None = None, env_seed: int = 0, clock: int = 0,
                config: SandboxConfig | None = None,
                limits: WorkspaceLimits | None = None) -> CommandResult:
    """Run ``argv`` over ``files`` in a fresh sandbox directory and read the files back.

    ``timeout_s``/``output_cap_bytes`` override the config's. Raises ``SandboxCommandError`` for
    an argv that cannot run and ``SandboxInfraError`` when the sandbox itself fails.
    """
    check_argv(argv)
    cfg = config or SandboxConfig()
    if timeout_s is not None or output_cap_bytes is not None:
        cfg = SandboxConfig(**{**cfg.__dict__,
                               "timeout_s": cfg.timeout_s if timeout_s is None else timeout_s,
                               "output_cap_bytes": output_cap_bytes or cfg.output_cap_bytes})
    lim = limits or WorkspaceLimits()
    try:
        root = Path(tempfile.mkdtemp(prefix="closedloop-sbx-", dir=cfg.scratch_dir))
    except OSError as exc:
        raise SandboxInfraError(f"cannot create the sandbox directory: {exc}") from None
    try:
        dropping = _prepare_root(root, files, cfg)
        result = execute(argv, root, env_seed=env_seed, clock=clock, config=cfg, limits=lim,
                         drop_uid=65534 if dropping else -1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return result


@functools.lru_cache(maxsize=1)
def _stdlib_world_readable() -> bool:
    """Whether ``nobody`` could read the standard library (every ancestor world r-x)."""
    stdlib = sysconfig.get_path("stdlib")
    try:
        return world_accessible([stdlib, os.path.join(stdlib, "lib-dynload")])
    except OSError:
        return False


def _prepare_root(root: Path, files: Mapping[str, str], cfg: SandboxConfig) -> bool:
    dropping = cfg.drop_privileges and os.geteuid() == 0 and _stdlib_world_readable()
    try:
        for sub in ("ws", "home", "tmp"):
            (root / sub).mkdir()
        for path, text in files.items():
            target = root / "ws" / normalize_path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(text.encode("utf-8"))
        if dropping:
            os.chmod(root, 0o711)
            for dirpath, dirnames, filenames in os.walk(root):
                for d in dirnames:
                    os.chmod(os.path.join(dirpath, d), 0o777)
                for f in filenames:
                    os.chmod(os.path.join(dirpath, f), 0o666)
    except OSError as exc:
        raise SandboxInfraError(f"cannot materialize the workspace: {exc}") from None
    return dropping


def execute(argv: Sequence[str], root: Path, *, env_seed: int, clock: int,
            config: SandboxConfig, limits: WorkspaceLimits, drop_uid: int = -1) -> CommandResult:
    """Run ``argv`` with cwd ``root/ws`` in an existing sandbox directory and read it back.

    ``root`` must hold ``ws/``, ``home/`` and ``tmp/``. ``run_command`` is the public entry;
    this lower level exists so tests can prepare a crafted directory (e.g. a planted symlink).
    """
    check_argv(argv)
    ws = root / "ws"
    cmd = _child_command(argv, root, env_seed, config, limits, drop_uid)
    env = _child_env(root, env_seed, clock)
    started = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, cwd=ws, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, close_fds=True)
    except OSError as exc:
        raise SandboxInfraError(f"cannot start the sandboxed process: {exc}") from None
    out, err, timed_out = _collect(proc, started + config.timeout_s, config.output_cap_bytes)
    elapsed = time.monotonic() - started
    code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        timed_out = True
    if code == BOOT_FAILURE_EXIT:
        raise SandboxInfraError(f"sandbox bootstrap failed: {err[:500]!r}")
    scrub = _scrubber(root)
    cap = config.output_cap_bytes
    stdout, t_out = _decode_capped(out, cap, scrub)
    stderr, t_err = _decode_capped(err, cap, scrub)
    refusals = _read_refusals(root / "refusals.log", scrub)
    files_after: FileTree | None = None
    rejected: tuple[tuple[str, str], ...] = ()
    if not timed_out:
        files_after, rejected = read_back(ws, limits, scrub)
    return CommandResult(code, stdout, stderr, t_out or t_err, timed_out, files_after,
                         rejected, refusals, elapsed)


# The -c program: compile the bootstrap (argv[1], the source of ``sandbox_child``) under the name
# "<sandbox>", so its frames can be told apart from the program's and left out of tracebacks.
_STUB = "import sys; exec(compile(sys.argv[1], '<sandbox>', 'exec'))"


@functools.lru_cache(maxsize=1)
def _bootstrap_source() -> str:
    return Path(__file__).with_name("sandbox_child.py").read_text(encoding="utf-8")


def _child_command(argv: Sequence[str], root: Path, env_seed: int, config: SandboxConfig,
                   limits: WorkspaceLimits, drop_uid: int) -> list[str]:
    cpu = config.cpu_s if config.cpu_s is not None else math.ceil(config.timeout_s) + 1
    rlimits = (f"RLIMIT_CPU={cpu},RLIMIT_AS={config.memory_bytes},"
               f"RLIMIT_FSIZE={limits.max_total_bytes},RLIMIT_NOFILE={config.max_open_files},"
               f"RLIMIT_NPROC={config.max_processes},RLIMIT_CORE=0")
    real_root = os.path.realpath(root)
    cmd = [sys.executable, "-S", "-P", "-s", "-B", "-c", _STUB, _bootstrap_source(), real_root,
           str(env_seed & 0xFFFFFFFF), str(drop_uid), rlimits, *argv[1:]]
    if _use_netns(config):
        exe = shutil.which("unshare") or "unshare"
        cmd = [exe, "-n", "--", *cmd]
    return cmd


def _child_env(root: Path, env_seed: int, clock: int) -> dict[str, str]:
    real = os.path.realpath(root)
    return {
        "PATH": "/usr/bin:/bin", "HOME": f"{real}/home", "TMPDIR": f"{real}/tmp",
        "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONUTF8": "1",
        "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1",
        "CLOSEDLOOP_SEED": str(env_seed & 0xFFFFFFFF), "CLOSEDLOOP_CLOCK": str(clock),
        "CLOSEDLOOP_SANDBOX": "1",
    }


def _collect(proc: subprocess.Popen[bytes], deadline: float,
             cap: int) -> tuple[bytes, bytes, bool]:
    """Read both pipes until EOF or the deadline, keeping cap+1 bytes each; reap the group."""
    sel = selectors.DefaultSelector()
    out, err = bytearray(), bytearray()
    bufs: dict[int, bytearray] = {}
    timed_out = False
    try:
        for stream, buf in ((proc.stdout, out), (proc.stderr, err)):
            if stream is not None:
                sel.register(stream, selectors.EVENT_READ)
                bufs[stream.fileno()] = buf
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in sel.select(remaining):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = bufs[key.fd]
                if len(buf) <= cap:
                    buf += chunk[: cap + 1 - len(buf)]
        if not timed_out:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        sel.close()
        _kill_group(proc)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    return bytes(out), bytes(err), timed_out


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _scrubber(root: Path) -> tuple[tuple[str, str], ...]:
    real = os.path.realpath(root)
    pairs = [(real, SANDBOX_PATH)]
    if str(root) != real:
        pairs.append((str(root), SANDBOX_PATH))
    return tuple(pairs)


def _apply_scrub(text: str, scrub: tuple[tuple[str, str], ...]) -> str:
    for old, new in scrub:
        text = text.replace(old, new)
    return text


def _decode_capped(data: bytes, cap: int, scrub: tuple[tuple[str, str], ...]) -> tuple[str, bool]:
    cut = len(data) > cap
    text = _apply_scrub(data[:cap].decode("utf-8", errors="replace"), scrub)
    if cut:
        text += ("" if text.endswith("\n") or not text else "\n") + truncation_label(cap)
    return text, cut


def _read_refusals(path: Path, scrub: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    try:
        raw = path.read_bytes()[: 64 * 1024]
    except OSError:
        return ()
    lines = raw.decode("utf-8", errors="replace").splitlines()
    return tuple(_apply_scrub(line, scrub)[:300] for line in lines[:MAX_REFUSALS])


def read_back(ws: Path, limits: WorkspaceLimits,
              scrub: tuple[tuple[str, str], ...] = ()) -> tuple[FileTree, tuple[tuple[str, str],
                                                                                ...]]:
    """Read the regular files under ``ws`` into a ``FileTree``; return it and the rejections.

    Symlinks (to files or directories) are never followed and are rejected; so are special
    files, paths that are not valid workspace paths (reserved prefixes included), files over the
    per-file cap, and text that is not UTF-8. Files past the total or count cap, in sorted path
    order, are rejected too. Nothing outside ``ws`` is read.
    """
    found: dict[str, str] = {}
    rejected: list[tuple[str, str]] = []
    total = 0
    for rel, kind in sorted(_walk(ws, "")):
        if kind != "file":
            rejected.append((rel, kind))
            continue
        reason = _accept(ws, rel, limits, total, len(found))
        if isinstance(reason, str):
            rejected.append((rel, reason))
            continue
        text = _apply_scrub(reason[0], scrub)
        found[rel] = text
        total += len(text.encode("utf-8"))
    try:
        return FileTree(found, limits), tuple(rejected)
    except (WorkspacePathError, WorkspaceLimitError) as exc:  # pragma: no cover - guarded above
        raise SandboxInfraError(f"read-back produced an invalid tree: {exc}") from None


def _walk(base: Path, prefix: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    try:
        entries = list(os.scandir(base / prefix if prefix else base))
    except OSError:
        return out
    for entry in entries:
        rel = f"{prefix}/{entry.name}" if prefix else entry.name
        if entry.is_symlink():
            out.append((rel, "symlink"))
        elif entry.is_dir(follow_symlinks=False):
            out.extend(_walk(base, rel))
        elif entry.is_file(follow_symlinks=False):
            out.append((rel, "file"))
        else:
            out.append((rel, "special file"))
    return out


def _accept(ws: Path, rel: str, limits: WorkspaceLimits, total: int,
            count: int) -> str | tuple[str]:
    try:
        if normalize_path(rel) != rel:
            return "not a normalized path"
    except WorkspacePathError as exc:
        return exc.reason
    if count >= limits.max_files:
        return f"more than {limits.max_files} files"
    fd = None
    try:
        fd = os.open(ws / rel, os.O_RDONLY | os.O_NOFOLLOW)
        size = os.fstat(fd).st_size
        if size > limits.max_file_bytes:
            return f"larger than {limits.max_file_bytes} bytes"
        if total + size > limits.max_total_bytes:
            return f"workspace over {limits.max_total_bytes} bytes"
        data = os.read(fd, limits.max_file_bytes + 1)
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    finally:
        if fd is not None:
            os.close(fd)
    try:
        return (data.decode("utf-8"),)
    except UnicodeDecodeError:
        return "not UTF-8 text"
