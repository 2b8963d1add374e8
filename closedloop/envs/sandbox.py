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
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from closedloop.envs.errors import (
    SandboxCommandError,
    SandboxInfraError,
    WorkspaceLimitError,
    WorkspacePathError,
)
from closedloop.envs.workspace import FileTree, WorkspaceLimits, normalize_path

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
    when started as root.
    """

    timeout_s: float = 5.0
    output_cap_bytes: int = 8192
    cpu_s: int | None = None
    memory_bytes: int = 1024 * 1024 * 1024
    max_open_files: int = 64
    max_processes: int = 512
    network_namespace: bool | None = None
    drop_privileges: bool = True


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
        root = Path(tempfile.mkdtemp(prefix="closedloop-sbx-"))
    except OSError as exc:
        raise SandboxInfraError(f"cannot create the sandbox directory: {exc}") from None
    try:
        dropping = _prepare_root(root, files, cfg)
        result = execute(argv, root, env_seed=env_seed, clock=clock, config=cfg, limits=lim,
                         drop_uid=65534 if dropping else -1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return result


def _prepare_root(root: Path, files: Mapping[str, str], cfg: SandboxConfig) -> bool:
    dropping = cfg.drop_privileges and os.geteuid() == 0
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
    if code == _BOOT_FAILURE:
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


_BOOT_FAILURE = 86


def _child_command(argv: Sequence[str], root: Path, env_seed: int, config: SandboxConfig,
                   limits: WorkspaceLimits, drop_uid: int) -> list[str]:
    cpu = config.cpu_s if config.cpu_s is not None else math.ceil(config.timeout_s) + 1
    rlimits = (f"RLIMIT_CPU={cpu},RLIMIT_AS={config.memory_bytes},"
               f"RLIMIT_FSIZE={limits.max_total_bytes},RLIMIT_NOFILE={config.max_open_files},"
               f"RLIMIT_NPROC={config.max_processes},RLIMIT_CORE=0")
    real_root = os.path.realpath(root)
    cmd = [sys.executable, "-S", "-P", "-s", "-B", "-c", _STUB, _BOOTSTRAP, real_root,
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


# The -c program: compile the bootstrap (argv[1]) under the name "<sandbox>", so its frames can be
# told apart from the program's and left out of the tracebacks the agent sees.
_STUB = "import sys; exec(compile(sys.argv[1], '<sandbox>', 'exec'))"

_BOOTSTRAP = r'''
import os, sys, posix
def _boot():
    root, seed, drop_uid, rlimits = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    prog = sys.argv[6:]
    try:
        import resource, signal, random, pathlib
        for item in rlimits.split(","):
            name, value = item.split("=")
            resource.setrlimit(getattr(resource, name), (int(value), int(value)))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        log_fd = posix.open(root + "/refusals.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        if drop_uid >= 0 and _world_accessible([p for p in sys.path if p]):
            os.setgroups([]); os.setgid(drop_uid); os.setuid(drop_uid)
        random.seed(seed)
        try:
            import _posixsubprocess
            def _no_fork_exec(*a, **k):
                raise PermissionError("sandbox: process spawning refused")
            _posixsubprocess.fork_exec = _no_fork_exec
        except ImportError:
            pass
    except Exception as exc:
        sys.stderr.write("bootstrap: %r\n" % (exc,))
        os._exit(86)
    ws = root + "/ws"
    writable = (ws, root + "/home", root + "/tmp", "/dev/null")
    readable = writable + tuple(_real(p) for p in sys.path if p) + ("/dev/urandom",)
    path_types = (pathlib.PurePosixPath, pathlib.PosixPath, posix.DirEntry)
    sys.addaudithook(_make_hook(log_fd, writable, readable, path_types))
    _run(prog, ws)

def _real(p):
    return os.path.realpath(p)

def _world_accessible(paths):
    # Dropping to nobody only works if nobody can still read the standard library.
    for path in paths:
        path = _real(path)
        if not os.path.isdir(path):
            continue
        while True:
            if (os.stat(path).st_mode & 0o005) != 0o005:
                return False
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent
    return True

def _make_hook(log_fd, writable, readable, path_types, _type=type, _str=str, _bytes=bytes,
               _int=int, _any=any, _len=len, _PermissionError=PermissionError, _OSError=OSError,
               _getcwd=posix.getcwd, _lstat=posix.lstat, _readlink=posix.readlink,
               _fspath=posix.fspath, _write=posix.write,
               _WFLAGS=os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND):
    deny_events = {}
    for kind, names in (
            ("process", ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                         "os.forkpty", "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg",
                         "signal.pthread_kill", "sqlite3.enable_load_extension")),
            ("link", ("os.symlink", "os.link")),
            ("rlimit", ("resource.setrlimit", "resource.prlimit")),
            ("introspection", ("gc.get_objects", "gc.get_referrers", "gc.get_referents"))):
        for name in names:
            deny_events[name] = kind
    write_events = frozenset(("os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.truncate",
        "os.chmod", "os.chown", "os.utime", "os.chflags", "os.lchmod", "os.lchown",
        "os.setxattr", "os.removexattr", "sqlite3.connect"))
    read_events = frozenset(("os.listdir", "os.scandir", "os.chdir", "os.listxattr",
        "os.getxattr"))
    deny_imports = frozenset(("_ctypes", "ctypes"))
    guarded = frozenset(("__code__", "__defaults__", "__kwdefaults__", "__globals__"))

    def resolve(p):
        if not p.startswith("/"):
            p = _getcwd() + "/" + p
        parts = [x for x in p.split("/") if x and x != "."]
        out = []
        links = 0
        while parts:
            name = parts.pop(0)
            if name == "..":
                if out:
                    out.pop()
                continue
            cand = "/" + "/".join(out + [name])
            try:
                st = _lstat(cand)
            except _OSError:
                out.append(name)
                continue
            if (st.st_mode & 0o170000) == 0o120000:
                links += 1
                if links > 40:
                    return None
                target = _readlink(cand)
                if target.startswith("/"):
                    out = []
                parts = [x for x in target.split("/") if x and x != "."] + parts
                continue
            out.append(name)
        return "/" + "/".join(out)

    def under(p, roots):
        for r in roots:
            if p == r or p.startswith(r + "/"):
                return True
        return False

    def deny(kind, what):
        line = ("%s: %s\n" % (kind, what))[:300]
        try:
            _write(log_fd, line.encode("utf-8", "replace"))
        except _OSError:
            pass
        raise _PermissionError("sandbox: %s refused: %s" % (kind, what))

    def check_path(event, path, write):
        if path is None or _type(path) is _int:
            return
        cls = _type(path)
        if cls is _str:
            p = path
        elif cls is _bytes:
            p = path.decode("utf-8", "surrogateescape")
        elif cls in path_types:
            p = _fspath(path)
            if _type(p) is _bytes:
                p = p.decode("utf-8", "surrogateescape")
        else:
            deny("path", "%s with a path of type %s" % (event, cls.__name__))
        real = resolve(p)
        ok = real is not None and under(real, writable if write else readable)
        if not ok:
            deny("path", "%s %s%s" % (event, p, " (write)" if write else ""))

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            write = (flags & _WFLAGS) != 0 if _type(flags) is _int else (
                _type(mode) is _str and _any(c in mode for c in "wax+"))
            check_path(event, path, write)
        elif event.startswith("socket."):
            deny("network", event)
        elif event.startswith("ctypes."):
            deny("ctypes", event)
        elif event in deny_events:
            deny(deny_events[event], event)
        elif event in write_events:
            if event == "sqlite3.connect" and args and args[0] == ":memory:":
                return
            check_path(event, args[0], True)
            if event == "os.rename":
                check_path(event, args[1], True)
        elif event in read_events:
            if args:
                check_path(event, args[0], False)
        elif event == "import" and args and args[0] in deny_imports:
            deny("import", args[0])
        elif event == "object.__setattr__" and _len(args) > 1 and args[1] in guarded:
            deny("setattr", args[1])
    return hook

def _run(prog, ws):
    sys.path.insert(0, ws)
    if prog[0] == "-m":
        sys.argv = [prog[1]] + prog[2:]
        import runpy
        runpy.run_module(prog[1], run_name="__main__", alter_sys=True)
        return
    sys.argv = list(prog)
    import types
    with open(prog[0], "rb") as fh:
        source = fh.read()
    code = compile(source, prog[0], "exec")
    mod = types.ModuleType("__main__")
    mod.__file__ = prog[0]
    sys.modules["__main__"] = mod
    try:
        exec(code, mod.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        kept = []
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename != "<sandbox>":
                kept.append((tb.tb_frame, tb.tb_lasti, tb.tb_lineno))
            tb = tb.tb_next
        new_tb = None
        for frame, lasti, lineno in reversed(kept):
            new_tb = types.TracebackType(new_tb, frame, lasti, lineno)
        exc = exc.with_traceback(new_tb)
        sys.excepthook(type(exc), exc, new_tb)
        raise SystemExit(1) from None

_boot()
'''
