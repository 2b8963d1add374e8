"""The run directory as a checked whole: what ``closedloop.training`` proves on every launch.

A run directory's parts are written in a fixed order within each RL step s (checkpoint s+1
commits, then the ledger marks the step's groups consumed at s+1, then v_{s+1} is staged and
published, then the step's ``rl_step`` metrics record is written). A crash can only stop that
sequence part way, so on every launch, before anything trains:

- **one process**: the directory is locked (``run.lock``, an ``flock`` the kernel releases
  when its process dies); a second launch on the same directory is refused.
- **config**: the resolved config equals ``config.json``'s, key for key. A change is refused
  (:class:`ConfigDriftError` naming the keys) unless declared: ``override`` (the CLI's
  ``--override-config REASON``) records the reason and the differences in ``launches.jsonl``
  and replaces ``config.json``. Every launch appends one line to ``launches.jsonl``. A run
  directory where every earlier launch stopped before its first piece of work (a factory that
  failed to load, a failed package check; ``work_products`` is empty) takes the new config as
  a first launch would (the reason is recorded), so a fixed relaunch never trips on it.
- **ledger** and **agreement**: the read-only proof every command that reads a run directory
  runs too (``closedloop.evaluate.run_integrity``: SQLite's integrity check, rows against
  their events and the checkpoint's digest; nothing shows progress past the newest verified
  checkpoint, nothing before it is missing).

Anything else raises a :class:`RunDirectoryError` that names the file that disagrees, what
was found and how to recover; the run never trains from a state it cannot prove. The one
disagreement the write order does produce, a checkpoint whose step record never reached
``metrics.jsonl``, is resolved by the caller (``closedloop.training.resume.resume``): that
checkpoint is set aside and its step is run again from the previous one (``ahead=1`` here).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from closedloop.contracts.metrics_log import MetricsLog
from closedloop.errors import (
    CheckpointCorruptError,
    ConfigDriftError,
    RunDirectoryError,
    RunLockedError,
    RunStateError,
)
from closedloop.evaluate.run_integrity import (
    NEW_RUN_DIR,
    CheckpointSurvey,
    RunProgress,
    check_agreement,
    restore_advice,
    resume_point,
    survey_checkpoints,
    verify_ledger,
    work_products,
)
from closedloop.learn.checkpoint import Checkpoint, list_checkpoints, load_checkpoint
from closedloop.policy.registry import fsync_dir
from closedloop.progress import log
from closedloop.rollout.ledger import Ledger

__all__ = ["CheckpointSurvey", "ConfigDriftError", "RunDirectoryError", "RunLock",
           "RunLockedError", "RunProgress", "RunStateError", "check_agreement", "check_config",
           "check_tasks", "config_differences", "prove_state", "recorded_meta", "require_complete",
           "supersede", "survey_checkpoints"]

# ----------------------------------------------------------------------------- lock
class RunLock:
    """An exclusive ``flock`` on ``<run_dir>/run.lock`` for the life of one launch."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "run.lock"
        self._fh: IO[str] | None = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115
        try:
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._fh.seek(0)
            holder = self._fh.read().strip() or "unknown"
            self._fh.close()
            self._fh = None
            raise RunLockedError(self.path, f"another launch (pid {holder}) is using this run "
                                 "directory", "wait for it to end, or stop it") from None
        self._fh.seek(0)
        self._fh.truncate()
        self._fh.write(f"{os.getpid()}\n")
        self._fh.flush()

    def release(self) -> None:
        """Give the lock up (idempotent)."""
        if self._fh is not None:
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None


# ----------------------------------------------------------------------------- config
def config_differences(recorded: Any, resolved: Any, prefix: str = "") -> list[str]:
    """``"key.path: old -> new"`` for every leaf that differs (keys added or removed too)."""
    if isinstance(recorded, Mapping) and isinstance(resolved, Mapping):
        out: list[str] = []
        for key in sorted(set(recorded) | set(resolved), key=str):
            where = f"{prefix}.{key}" if prefix else str(key)
            if key not in recorded:
                out.append(f"{where}: (absent) -> {json.dumps(resolved[key])}")
            elif key not in resolved:
                out.append(f"{where}: {json.dumps(recorded[key])} -> (absent)")
            else:
                out += config_differences(recorded[key], resolved[key], where)
        return out
    if recorded != resolved or type(recorded) is not type(resolved):
        return [f"{prefix or '<config>'}: {json.dumps(recorded)} -> {json.dumps(resolved)}"]
    return []


def _append_line(path: Path, record: Mapping[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record, sort_keys=True, default=str) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def recorded_config(run_dir: Path, unreadable: str) -> Any:
    """The config ``run_dir/config.json`` recorded (its ``config`` object, as JSON data);
    ``ConfigDriftError`` (recovery: ``unreadable``) when it cannot be read."""
    path = run_dir / "config.json"
    try:
        return json.loads(path.read_text("utf-8"))["config"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigDriftError(path, f"cannot read the recorded config ({exc!r})",
                               unreadable) from None


def recorded_meta(run_dir: Path) -> dict[str, Any]:
    """What ``run_dir/config.json`` recorded beside the config (hash, git revision, versions,
    the resolved precision); empty when there is no readable config.json yet."""
    try:
        data = json.loads((run_dir / "config.json").read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if k != "config"} if isinstance(data, dict) else {}


def recorded_config_differences(run_dir: Path, config: Mapping[str, Any],
                                unreadable: str) -> list[str]:
    """``config_differences`` between the config ``run_dir/config.json`` recorded and
    ``config``; ``ConfigDriftError`` (recovery: ``unreadable``) when it cannot be read."""
    return config_differences(recorded_config(run_dir, unreadable), dict(config))


def check_config(run_dir: Path, config: Mapping[str, Any], meta: Mapping[str, Any],
                 override: str | None = None) -> list[str]:
    """Check the resolved ``config`` against ``config.json`` (written on the first launch,
    with ``meta``: hash, git revision, versions) and log the launch; return the differences
    an ``override`` accepted (see the module docstring)."""
    path = run_dir / "config.json"
    differences: list[str] = []
    if path.exists() and not work_products(run_dir):
        override = override or ("every earlier launch stopped before its first piece of work "
                                "(no checkpoint, trace, version, metrics or ledger row)")
    if path.exists():
        differences = recorded_config_differences(
            run_dir, config, "restore config.json from a backup, or " + NEW_RUN_DIR)
        if differences and not override:
            shown = "; ".join(differences[:6]) + ("; ..." if len(differences) > 6 else "")
            raise ConfigDriftError(path, f"the resolved config differs from the one this run "
                                   f"recorded in {len(differences)} keys ({shown})",
                                   "launch with the recorded config, or declare the change "
                                   "with --override-config REASON")
    if not path.exists() or differences:
        tmp = path.with_name(".config.json.tmp")
        tmp.write_text(json.dumps({"config": dict(config), **meta}, indent=2, sort_keys=True,
                                  default=str) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    _append_line(run_dir / "launches.jsonl", {
        "time": time.time(), "pid": os.getpid(), **meta,
        "config_override": ({"reason": override, "differences": differences}
                            if differences else None)})
    return differences


def supersede(path: Path) -> None:
    """Set a committed checkpoint aside (an atomic rename to ``.trash-*``, which the next
    checkpoint write deletes): its step will run again."""
    os.rename(path, path.with_name(f".trash-{path.name}-{os.getpid()}-{time.monotonic_ns()}"))
    fsync_dir(path.parent)


def prove_state(run_dir: Path, ledger: Ledger, versions: Sequence[str],
                metrics: MetricsLog) -> tuple[Checkpoint | None, int]:
    """The checkpoint to resume from and how many steps the ledger and registry may be past it
    (0, or 1 when a checkpoint's step record never reached ``metrics.jsonl``: that checkpoint
    is set aside and the previous one returned). Raises ``RunStateError`` or
    ``LedgerCorruptError`` (naming the file) when the parts cannot be reconciled; nothing is
    changed before every check has passed. The checks are the read-only proof every reader
    runs (``closedloop.evaluate.run_integrity``), here on the launch's open ledger."""
    point = resume_point(run_dir, metrics)
    ckpt = point.checkpoint
    consumed = verify_ledger(ledger, ckpt)
    check_agreement(run_dir, point.survey, RunProgress.of(run_dir, consumed, versions, metrics),
                    point.ahead)
    if point.superseded is not None and ckpt is not None:
        log(f"{point.superseded.path.name} committed but its step record never reached "
            f"metrics.jsonl: step {point.superseded.step - 1} runs again from {ckpt.path.name}")
        supersede(point.superseded.path)
    return ckpt, point.ahead


def require_complete(run_dir: Path, rl_steps: int, metrics: MetricsLog) -> None:
    """Before a summary: every RL step committed (the newest checkpoint is step ``rl_steps``)
    and logged; ``RunStateError`` otherwise (a run never ends well having trained less)."""
    latest = None
    for path in reversed(list_checkpoints(run_dir / "checkpoints")):
        with contextlib.suppress(CheckpointCorruptError):
            latest = load_checkpoint(path, tensors=False)
            break
    if rl_steps > 0 and (latest is None or latest.step != rl_steps):
        raise RunStateError(run_dir / "checkpoints", f"the newest checkpoint is step "
                            f"{None if latest is None else latest.step}, the config asks for "
                            f"{rl_steps} RL steps", "resume the run (the same command)")
    lost = [s for s in range(rl_steps) if ("rl_step", s, None) not in metrics]
    if lost:
        raise RunStateError(run_dir / "metrics.jsonl", f"has no rl_step record of steps {lost}",
                            restore_advice("metrics.jsonl"))


def check_tasks(path: Path, recorded: bytes | None, built: Mapping[str, Sequence[str]],
                override: str | None) -> None:
    """The task ids built now must be those ``tasks.json`` recorded (``recorded``: its bytes
    before this launch rewrote it, restored on a refusal) unless a config override is
    declared."""
    if recorded is None or override or not work_products(path.parent):
        return
    try:
        old = json.loads(recorded)
    except ValueError:
        old = None
    changed = [k for k, ids in built.items()
               if not isinstance(old, dict) or old.get(k) != list(ids)]
    if changed:
        path.write_bytes(recorded)
        raise ConfigDriftError(path, f"the {', '.join(changed)} task ids built by this code "
                               "differ from those the run recorded", "launch with the code "
                               "that started the run, or declare the change with "
                               "--override-config REASON")
