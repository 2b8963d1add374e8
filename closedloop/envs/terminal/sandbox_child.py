"""The child side of the sandbox: the bootstrap a sandboxed Python runs before the program.

``closedloop.envs.terminal.sandbox`` passes this file's source on the command line; the child
compiles it
under the name ``<sandbox>`` (so its frames can be dropped from tracebacks) and runs ``_boot``.
Importing this module does nothing; it is a module so that ruff and mypy check it.

argv after the source: root, env seed, uid to drop to (-1: none), rlimits
(``NAME=value,...``), then the program (``script.py args...`` or ``-m module args...``).

The bootstrap sets the resource limits, opens the refusal log, drops privileges when asked and
possible, seeds ``random``, neutralizes ``_posixsubprocess.fork_exec``, installs the audit hook
and runs the program. The hook binds every function it calls as a default argument, so a
program that rebinds ``os.path.realpath`` or ``builtins.isinstance`` cannot blind it.
"""

from __future__ import annotations

import os
import posix
import sys
from types import MappingProxyType
from typing import Any, NoReturn

BOOT_FAILURE_EXIT = 86
_PROCESS_EVENTS = ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                   "os.forkpty", "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg",
                   "signal.pthread_kill", "sqlite3.enable_load_extension")
_DENY: dict[str, str] = {
    **dict.fromkeys(_PROCESS_EVENTS, "process"),
    **dict.fromkeys(("os.symlink", "os.link"), "link"),
    **dict.fromkeys(("resource.setrlimit", "resource.prlimit"), "rlimit"),
    **dict.fromkeys(("gc.get_objects", "gc.get_referrers", "gc.get_referents"), "introspection"),
}
_WRITE_EVENTS = frozenset(("os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.truncate",
                           "os.chmod", "os.chown", "os.utime", "os.chflags", "os.lchmod",
                           "os.lchown", "os.setxattr", "os.removexattr", "sqlite3.connect"))
_READ_EVENTS = frozenset(("os.listdir", "os.scandir", "os.chdir", "os.listxattr",
                          "os.getxattr"))
_DENY_IMPORTS = frozenset(("_ctypes", "ctypes"))
_GUARDED_ATTRS = frozenset(("__code__", "__defaults__", "__kwdefaults__", "__globals__"))
_WFLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _boot() -> None:
    root, seed, drop_uid, rlimits = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    prog = sys.argv[6:]
    try:
        import pathlib
        import random
        import resource
        import signal
        for item in rlimits.split(","):
            name, value = item.split("=")
            resource.setrlimit(getattr(resource, name), (int(value), int(value)))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        log_fd = posix.open(root + "/refusals.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                            0o666)
        if drop_uid >= 0 and world_accessible([p for p in sys.path if p]):
            os.setgroups([])
            os.setgid(drop_uid)
            os.setuid(drop_uid)
        random.seed(seed)
        _neutralize_fork_exec()
    except Exception as exc:
        sys.stderr.write(f"bootstrap: {exc!r}\n")
        os._exit(BOOT_FAILURE_EXIT)
    ws = root + "/ws"
    writable = (ws, root + "/home", root + "/tmp", "/dev/null")
    readable = writable + tuple(os.path.realpath(p) for p in sys.path if p) + ("/dev/urandom",)
    path_types = (pathlib.PurePosixPath, pathlib.PosixPath, posix.DirEntry)
    sys.addaudithook(_make_hook(log_fd, writable, readable, path_types))
    _run(prog, ws)


def _neutralize_fork_exec() -> None:
    try:
        import _posixsubprocess
    except ImportError:
        return

    def refuse(*args: Any, **kwargs: Any) -> int:
        raise PermissionError("sandbox: process spawning refused")

    setattr(_posixsubprocess, "fork_exec", refuse)  # noqa: B010 - typeshed pins the signature


def world_accessible(paths: list[str]) -> bool:
    """Whether ``nobody`` could read these directories: each one (links resolved) and every
    ancestor up to ``/`` is world r-x (mode & 0o005). A path that is not a directory is
    skipped; an ancestor that cannot be stat'ed raises ``OSError`` (the child's bootstrap then
    fails closed; the parent counts it as not accessible). The one copy of this walk: the
    parent (``sandbox``) imports it to decide whether to drop privileges, the child runs it
    again on its own ``sys.path`` before dropping them."""
    for top in paths:
        path = os.path.realpath(top)
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


def _make_hook(log_fd: int, writable: tuple[str, ...], readable: tuple[str, ...],
               path_types: tuple[type, ...]) -> Any:
    """Build the audit hook. No function here has free variables: everything each one uses is
    a default argument (immutable, rebinding refused) so frames and closures expose nothing a
    program could change. The hook refuses by event; paths go to ``check_path``."""
    deny_events = MappingProxyType(dict(_DENY))
    deny = _make_deny(log_fd)
    check_path = _make_check_path(writable, readable, path_types, _make_resolve(), deny)

    def hook(event: str, args: tuple[Any, ...], _type: Any = type, _int: Any = int,
             _str: Any = str, _len: Any = len, _check: Any = check_path, _deny: Any = deny,
             _deny_events: Any = deny_events, _write_events: Any = _WRITE_EVENTS,
             _read_events: Any = _READ_EVENTS, _deny_imports: Any = _DENY_IMPORTS,
             _guarded: Any = _GUARDED_ATTRS, _wflags: int = _WFLAGS) -> None:
        if event == "open":
            path, mode, flags = args
            write = (flags & _wflags) != 0 if _type(flags) is _int else (
                _type(mode) is _str and [c for c in "wax+" if c in mode] != [])
            _check(event, path, write)
        elif event.startswith("socket."):
            _deny("network", event)
        elif event.startswith("ctypes."):
            _deny("ctypes", event)
        elif event in _deny_events:
            _deny(_deny_events[event], event)
        elif event in _write_events:
            if event == "sqlite3.connect" and args and args[0] == ":memory:":
                return
            _check(event, args[0], True)
            if event == "os.rename":
                _check(event, args[1], True)
        elif event in _read_events:
            if args:
                _check(event, args[0], False)
        elif event == "import" and args and args[0] in _deny_imports:
            _deny("import", args[0])
        elif event == "object.__setattr__" and _len(args) > 1 and args[1] in _guarded:
            _deny("setattr", args[1])

    return hook


def _make_resolve() -> Any:
    """``resolve(p)``: ``os.path.realpath`` with captured primitives (None past 40 links)."""

    def resolve(p: str, _getcwd: Any = posix.getcwd, _lstat: Any = posix.lstat,
                _readlink: Any = posix.readlink, _os_error: Any = OSError) -> str | None:
        # realpath with captured primitives: follows symlinks, at most 40 of them.
        if not p.startswith("/"):
            p = _getcwd() + "/" + p
        parts = [x for x in p.split("/") if x and x != "."]
        out: list[str] = []
        links = 0
        while parts:
            name = parts.pop(0)
            if name == "..":
                if out:
                    out.pop()
                continue
            cand = "/" + "/".join([*out, name])
            try:
                st = _lstat(cand)
            except _os_error:
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

    return resolve


def _make_deny(log_fd: int) -> Any:
    """``deny(kind, what)``: log the refusal to ``log_fd`` and raise ``PermissionError``."""

    def deny(kind: str, what: str, _log_fd: int = log_fd, _write: Any = posix.write,
             _os_error: Any = OSError, _error: Any = PermissionError) -> NoReturn:
        line = f"{kind}: {what}"[:299] + "\n"
        try:  # noqa: SIM105 - contextlib would be a lookup a program could rebind
            _write(_log_fd, line.encode("utf-8", "replace"))
        except _os_error:
            pass
        raise _error(f"sandbox: {kind} refused: {what}")

    return deny


def _make_check_path(writable: tuple[str, ...], readable: tuple[str, ...],
                     path_types: tuple[type, ...], resolve: Any, deny: Any) -> Any:
    """``check_path(event, path, write)``: refuse a path outside the writable (or, for a read,
    the readable) roots once symlinks are resolved, or of a type other than str, bytes or
    ``path_types``."""

    def check_path(event: str, path: Any, write: bool, _type: Any = type, _int: Any = int,
                   _str: Any = str, _bytes: Any = bytes, _fspath: Any = posix.fspath,
                   _path_types: tuple[type, ...] = path_types, _resolve: Any = resolve,
                   _deny: Any = deny, _writable: tuple[str, ...] = writable,
                   _readable: tuple[str, ...] = readable) -> None:
        cls = _type(path)
        if path is None or cls is _int:
            return
        if cls is _str:
            p = path
        elif cls is _bytes or cls in _path_types:
            raw = path if cls is _bytes else _fspath(path)
            p = raw.decode("utf-8", "surrogateescape") if _type(raw) is _bytes else raw
        else:
            _deny("path", f"{event} with a path of type {cls.__name__}")
        real = _resolve(p)
        roots = _writable if write else _readable
        if real is None or not [r for r in roots if real == r or real.startswith(r + "/")]:
            _deny("path", f"{event} {p}{' (write)' if write else ''}")

    return check_path


def _run(prog: list[str], ws: str) -> None:
    import types
    sys.path.insert(0, ws)
    try:
        if prog[0] == "-m":
            sys.argv = [prog[1], *prog[2:]]
            import runpy
            runpy.run_module(prog[1], run_name="__main__", alter_sys=True)
            return
        sys.argv = list(prog)
        try:
            with open(prog[0], "rb") as fh:
                source = fh.read()
        except OSError as exc:
            sys.stderr.write(f"python3: can't open file {prog[0]!r}: "
                             f"[Errno {exc.errno}] {exc.strerror}\n")
            raise SystemExit(2) from None
        code = compile(source, prog[0], "exec")
        mod = types.ModuleType("__main__")
        mod.__file__ = prog[0]
        sys.modules["__main__"] = mod
        exec(code, mod.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        _report(exc)
        raise SystemExit(1) from None


def _report(exc: BaseException) -> None:
    """Print the traceback without the bootstrap's own frames."""
    import types
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


if __name__ == "__main__":
    _boot()
