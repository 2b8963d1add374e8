"""Launch ``closedloop train`` many times cheaply: fork it from a process that imported it once.

A kill test relaunches the trainer after every SIGKILL, and a fresh interpreter spends seconds
importing torch and transformers each time. :class:`Zygote` starts one clean interpreter
(``python -m tests.forked_launch``, never pytest's own process) that imports the CLI and the
training loop and runs no torch op, so it holds no threads; each :meth:`Zygote.launch` forks a
child that puts itself in its own process group, sends its output to the log and runs
``closedloop.cli.main(["train", ...])``: the same code as ``python -m closedloop.cli``, only
imported earlier (peft and transformers' model classes included). The zygote reaps its children
and writes each exit status (negative: killed by that signal, as ``subprocess`` reports it) to
``<log>.<n>.rc``; :class:`ForkedLaunch` reads it. A launch may carry its own environment
(the uninterrupted reference runs without the checkpoint pause the killed launches get).
Before it forks, the zygote audits the terminal tasks' verifier once (``tests.shared_audit``),
so the report each completed launch writes does not audit it again.
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

from closedloop.learn.checkpoint import PAUSE_ENV

__all__ = ["ForkedLaunch", "KillBed", "Zygote", "child_env"]

REPO = Path(__file__).resolve().parent.parent


def child_env(checkpoint_pause_s: float | None) -> dict[str, str]:
    """One CPU thread (bit-identical runs, and no oversubscription of 2 shared cores)."""
    env = {k: v for k, v in os.environ.items() if k != PAUSE_ENV}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p))
    if checkpoint_pause_s is not None:
        env[PAUSE_ENV] = str(checkpoint_pause_s)  # widens the checkpoint write window only
    return env


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

        ``env``: the child's environment (default: the zygote's). It may differ from the
        zygote's only in what is read at run time (the checkpoint pause); what the imports
        read (``OMP_NUM_THREADS``, ``PYTHONPATH``) is the zygote's, imported once.
        """
        assert self._proc.stdin is not None and self._proc.stdout is not None
        rc_path = log.with_name(f"{log.name}.{time.monotonic_ns()}.rc")
        request: dict[str, Any] = {"argv": ["train", str(config), "--run-dir", str(run_dir)],
                                   "log": str(log), "rc": str(rc_path)}
        if env is not None:
            request["env"] = dict(env)
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


class KillBed:
    """What the kill tests share (``tests.test_chaos``, ``tests.test_crash_resume``): one
    zygote whose launches get the checkpoint pause, one run config, and that config's
    uninterrupted reference run, forked at once and left running beside the tests' own
    launches (one thread each). ``close`` kills a reference still running and ends the zygote.
    """

    def __init__(self, root: Path, config: dict[str, Any]) -> None:
        import yaml

        self.config = root / "run.yaml"
        self.config.write_text(yaml.safe_dump(config))
        self.reference_dir, self.reference_log = root / "reference", root / "reference.log"
        self.zygote = Zygote(child_env(checkpoint_pause_s=0.15))
        self.reference = self.zygote.launch(self.config, self.reference_dir,
                                            self.reference_log, child_env(None))

    def reference_rc(self, timeout: float) -> int:
        """Wait for the reference run; its exit status."""
        return self.reference.wait(timeout=timeout)

    def close(self) -> None:
        """Kill the reference if it still runs; end the zygote."""
        if self.reference.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.reference.pid, signal.SIGKILL)
            self.reference.wait(timeout=30)
        self.zygote.close()


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
        if "env" in request:
            os.environ.clear()
            os.environ.update(request["env"])
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
    from tests.shared_audit import audit_terminal_tasks, install

    install()
    audit_terminal_tasks()  # once, before any fork: every launch's report gate inherits it

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
