"""Launch ``closedloop train`` many times cheaply: fork it from a process that imported it once.

A kill test relaunches the trainer after every SIGKILL, and a fresh interpreter spends seconds
importing torch and transformers each time. :class:`Zygote` starts one clean interpreter
(``python -m tests.forked_launch``, never pytest's own process) that imports the CLI and the
training loop and runs no torch op, so it holds no threads; each :meth:`Zygote.launch` forks a
child that puts itself in its own process group, sends its output to the log and runs
``closedloop.cli.main(["train", ...])``: the same code as ``python -m closedloop.cli``, only
imported earlier (peft and transformers' model classes included). The zygote reaps its children
and writes each exit status (negative: killed by that signal, as ``subprocess`` reports it) to
``<log>.<n>.rc``; :class:`ForkedLaunch` reads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import IO, Any

__all__ = ["ForkedLaunch", "Zygote"]

REPO = Path(__file__).resolve().parent.parent


class ForkedLaunch:
    """A forked ``closedloop train`` as ``run_with_kills`` drives it (``subprocess.Popen``'s
    ``pid``, ``poll``, ``wait`` and ``returncode``); ``pid`` is also its process group."""

    def __init__(self, pid: int, rc_path: Path) -> None:
        self.pid = pid
        self.rc_path = rc_path
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit status once the zygote reaped the process, else ``None``."""
        if self.returncode is None and self.rc_path.is_file():
            self.returncode = int(self.rc_path.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until the process ended; ``subprocess.TimeoutExpired`` past ``timeout``."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode


class Zygote:
    """The forking server (see the module docstring); a context manager."""

    def __init__(self, env: dict[str, str]) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.forked_launch"], cwd=REPO,
                                      env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True)
        assert self._proc.stdout is not None
        ready = self._proc.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"the zygote did not start: {ready!r}")

    def launch(self, config: Path, run_dir: Path, log: Path,
               env: dict[str, str] | None = None) -> ForkedLaunch:
        """Fork one ``closedloop train CONFIG --run-dir RUN_DIR`` writing to ``log``.

        ``env`` must be the zygote's own environment (children inherit it).
        """
        assert self._proc.stdin is not None and self._proc.stdout is not None
        rc_path = log.with_name(f"{log.name}.{time.monotonic_ns()}.rc")
        request = {"argv": ["train", str(config), "--run-dir", str(run_dir)], "log": str(log),
                   "rc": str(rc_path)}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        return ForkedLaunch(int(json.loads(self._proc.stdout.readline())["pid"]), rc_path)

    def close(self) -> None:
        """End the zygote (its children are the caller's to have ended)."""
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait(timeout=30)
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------- the server
_RC_PATHS: dict[int, str] = {}


def _reap(signum: int, frame: Any) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = _RC_PATHS.pop(pid, None)
        if path is not None:
            tmp = f"{path}.tmp"
            Path(tmp).write_text(str(os.waitstatus_to_exitcode(status)))
            os.replace(tmp, path)


def _child(request: dict[str, Any]) -> None:
    code = 1
    try:
        os.setpgid(0, 0)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, f"\n=== launch at {time.time():.3f} (forked)\n".encode())
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        from closedloop.cli import main

        code = int(main(request["argv"]))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(stdin: IO[str], stdout: IO[str]) -> None:
    """Read launch requests (JSON lines) and answer each with the forked child's pid."""
    import transformers

    import closedloop.cli
    import closedloop.training.loop  # noqa: F401 - the heavy imports happen here, once
    from closedloop.training.run_directory import library_versions

    library_versions()  # peft and transformers' lazy modules (config.json records their versions)
    for name in ("AutoModelForCausalLM", "AutoTokenizer", "LlamaForCausalLM"):
        getattr(transformers, name)

    signal.signal(signal.SIGCHLD, _reap)
    stdout.write("ready\n")
    stdout.flush()
    for line in stdin:
        request = json.loads(line)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        pid = os.fork()
        if pid == 0:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            _child(request)
        _RC_PATHS[pid] = request["rc"]
        with contextlib.suppress(PermissionError, ProcessLookupError):
            os.setpgid(pid, pid)  # the child does it too: whoever is first, its group is pid
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        stdout.write(json.dumps({"pid": pid}) + "\n")
        stdout.flush()


if __name__ == "__main__":
    serve(sys.stdin, sys.stdout)
