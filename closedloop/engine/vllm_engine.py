"""The client of a vLLM engine process (``vllm_server.py`` under the vLLM environment's python).

``VLLMEngine`` starts the process, reads its ``ready`` line (the checksum of the weights it was
started on), then sends one JSON request per line and waits for the reply with the same id.
Every call has a timeout: a process that dies raises ``EngineProcessError`` and one that does
not answer in time is killed and raises ``EngineTimeoutError`` (both ``InfrastructureError``:
the collector ends the episodes ``infra_abort``), never a hang. An error reply (the engine
refused the request) raises ``EngineRequestError``; one the engine did not survive raises
``EngineProcessError``. The process and the engine processes vLLM
spawns run in their own process group, killed together on ``close``.

The vLLM environment is found by ``vllm_python``: ``$CLOSEDLOOP_VLLM_PYTHON``, else
``.vllm-venv/bin/python`` at the repository root (made by ``scripts/setup-vllm``).
``vllm_unavailable_reason`` says exactly why it cannot run, or None.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from closedloop.errors import (
    EngineProcessError,
    EngineRequestError,
    EngineTimeoutError,
    EngineUnavailableError,
)

SERVER = Path(__file__).with_name("vllm_server.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
PYTHON_ENV = "CLOSEDLOOP_VLLM_PYTHON"
VENV_NAME = ".vllm-venv"


def vllm_python() -> Path:
    """The python of the vLLM environment (``$CLOSEDLOOP_VLLM_PYTHON`` or ``.vllm-venv``)."""
    override = os.environ.get(PYTHON_ENV)
    return Path(override) if override else REPO_ROOT / VENV_NAME / "bin" / "python"


def vllm_unavailable_reason() -> str | None:
    """Why the vLLM engine cannot run here, or None when its environment is set up.

    Reads what ``scripts/setup-vllm`` left: its ``UNAVAILABLE`` note (the failed step), or its
    stamp (written only after ``from vllm import LLM`` worked).
    """
    python = vllm_python()
    venv = python.parent.parent
    note = venv / "UNAVAILABLE"
    if note.is_file():
        return f"vLLM is unavailable here: {note.read_text('utf-8').strip()}"
    if not python.exists():
        return (f"no vLLM environment at {venv} (run scripts/setup-vllm, or set "
                f"{PYTHON_ENV})")
    if os.environ.get(PYTHON_ENV) is None and not (venv / ".closedloop-vllm-setup").is_file():
        return f"{venv} is not set up completely (re-run scripts/setup-vllm)"
    return None


@dataclass(frozen=True)
class EngineConfig:
    """How an engine process is started.

    model: a local model folder (config.json + safetensors) the engine serves, float32.
    threads: OMP threads of the engine (default: the caller's torch threads). kv_cache_gib:
    vLLM's CPU KV-cache space. max_loras: adapters resident at once (one per version that open
    sessions still pin, plus the next); adapter_name: the peft adapter name the policy's tensors
    carry (``...lora_A.<name>.weight``).
    """

    model: str
    seed: int = 0
    max_model_len: int = 2048
    max_lora_rank: int = 16
    max_loras: int = 2
    adapter_name: str = "default"
    threads: int | None = None
    kv_cache_gib: int = 1
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 600.0

    def server_args(self) -> dict[str, Any]:
        """The JSON the server reads from argv."""
        return {"model": self.model, "seed": self.seed, "max_model_len": self.max_model_len,
                "max_lora_rank": self.max_lora_rank, "max_loras": self.max_loras,
                "adapter_name": self.adapter_name}


class VLLMEngine:
    """A running engine process (see the module doc). ``hello`` is its ``ready`` record:
    ``base_checksum``/``base_digests`` hash the weights files it was started on."""

    def __init__(self, config: EngineConfig, log_path: str | Path | None = None,
                 python: str | Path | None = None) -> None:
        if python is None:
            reason = vllm_unavailable_reason()
            if reason is not None:
                raise EngineUnavailableError(reason)
        self.config = config
        self.log_path = Path(log_path) if log_path else None
        self._ids = itertools.count(1)
        self._lora_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._log: IO[bytes] | None = None
        self._pump_thread: threading.Thread | None = None
        self.proc = self._spawn(Path(python) if python else vllm_python())
        t0 = time.perf_counter()
        self.hello = self._read(config.startup_timeout_s, "start")
        if not self.hello.get("ready"):
            self._kill()
            raise EngineProcessError(f"the engine did not start: {self.hello}")
        self.startup_s = time.perf_counter() - t0

    def _spawn(self, python: Path) -> subprocess.Popen[str]:
        import torch

        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        threads = self.config.threads or torch.get_num_threads()
        env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
                   VLLM_CPU_KVCACHE_SPACE=str(self.config.kv_cache_gib))
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in close()
        proc = subprocess.Popen(
            [str(python), str(SERVER), json.dumps(self.config.server_args())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log if self._log is not None else subprocess.DEVNULL,
            text=True, bufsize=1, env=env, start_new_session=True)
        self._pump_thread = threading.Thread(target=self._pump, args=(proc,), daemon=True,
                                             name=f"vllm-engine-{proc.pid}")
        self._pump_thread.start()
        return proc

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        with proc.stdout:
            for line in proc.stdout:
                self._lines.put(line)
        self._lines.put(None)

    @property
    def base_checksum(self) -> str:
        """The checksum of the weights files the engine was started on (hashed by the engine
        process itself)."""
        return str(self.hello["base_checksum"])

    @property
    def base_digests(self) -> dict[str, str]:
        """Per-tensor digests of those weights."""
        return dict(self.hello["base_digests"])

    def new_lora_id(self) -> int:
        """An adapter id this engine has never been given: vLLM caches adapters by int id,
        so an id used before would serve whatever weights it first loaded under it."""
        with self._lock:
            return next(self._lora_ids)

    @property
    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.proc.poll() is None

    def call(self, cmd: str, timeout_s: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send one request and return its reply (module doc for the errors raised); ``id``
        and ``cmd`` are the protocol's own fields."""
        if "id" in fields or "cmd" in fields:
            raise EngineRequestError("a request field may not be named 'id' or 'cmd'")
        with self._lock:
            if not self.alive:
                raise EngineProcessError(f"the engine process has exited "
                                         f"(code {self.proc.returncode}){self._log_tail()}")
            rid = next(self._ids)
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(json.dumps({"id": rid, "cmd": cmd, **fields}) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                raise EngineProcessError(f"cannot write to the engine process: {exc}"
                                         f"{self._log_tail()}") from exc
            reply = self._read(timeout_s or self.config.request_timeout_s, cmd)
        if reply.get("id") != rid:
            raise EngineProcessError(f"reply {reply.get('id')} to request {rid}: the protocol "
                                     "is out of step")
        if "error" in reply and reply.get("fatal"):
            self._kill()
            raise EngineProcessError(f"the engine died during {cmd}: {reply['error']}"
                                     f"{self._log_tail()}")
        if "error" in reply:
            raise EngineRequestError(f"the engine refused {cmd}: {reply['error']}\n"
                                     f"{reply.get('trace', '')}")
        return reply

    def _read(self, timeout_s: float, what: str) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            self._kill()
            raise EngineTimeoutError(f"the engine gave no answer to {what} within {timeout_s:g}"
                                     f" s and was killed{self._log_tail()}") from None
        if line is None:
            code = self.proc.wait(timeout=30)
            raise EngineProcessError(f"the engine process exited (code {code}) during {what}"
                                     f"{self._log_tail()}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def _log_tail(self, lines: int = 15) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        tail = self.log_path.read_text("utf-8", errors="replace").splitlines()[-lines:]
        return f"; engine log {self.log_path}:\n" + "\n".join(tail)

    def _kill(self) -> None:
        """Kill the process group this engine started (the server and vLLM's processes)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        if self._pump_thread is not None:
            self._pump_thread.join(timeout=5)
        if self._log is not None:
            self._log.close()
            self._log = None

    def close(self, timeout_s: float = 60.0) -> None:
        """Ask the engine to shut down, then kill its process group if anything remains."""
        if self.alive:
            try:
                with self._lock:
                    assert self.proc.stdin is not None
                    self.proc.stdin.write(json.dumps({"id": 0, "cmd": "shutdown"}) + "\n")
                    self.proc.stdin.flush()
                    self.proc.stdin.close()
                self.proc.wait(timeout=timeout_s)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
        self._kill()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def describe(hello: Mapping[str, Any]) -> str:
    """One line naming the engine: its vLLM version, log-prob mode, python and startup time."""
    return (f"vllm {hello.get('vllm_version')} ({hello.get('logprobs_mode')}, pid "
            f"{hello.get('pid')}, started in {float(hello.get('startup_s', 0)):.0f} s) "
            f"from {vllm_python()}")
