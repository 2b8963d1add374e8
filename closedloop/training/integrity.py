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
  and replaces ``config.json``. Every launch appends one line to ``launches.jsonl``.
- **ledger**: SQLite's integrity check, every row consistent with its events, and the rows
  committed before the restored checkpoint equal to the digest that checkpoint carries.
- **agreement** (:func:`check_agreement`): with c the newest checkpoint that verifies, nothing
  may show progress past it: no group consumed after step c, no registry version past v_c, no
  ``rl_step`` record for step c or later; every behaviour version v_0..v_{c-1}, every step
  trace and every ``rl_step`` record of steps 0..c-1 must exist. Without any checkpoint,
  nothing may have been consumed or published past v0000.

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
from dataclasses import dataclass
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
from closedloop.learn.checkpoint import Checkpoint, list_checkpoints, load_checkpoint
from closedloop.policy.registry import fsync_dir, version_index, version_name
from closedloop.progress import log
from closedloop.rollout.ledger import Ledger
from closedloop.rollout.ledger_check import LedgerDigest

__all__ = ["CheckpointSurvey", "ConfigDriftError", "RunDirectoryError", "RunLock",
           "RunLockedError", "RunProgress", "RunStateError", "check_agreement", "check_config",
           "check_tasks", "config_differences", "prove_state", "recorded_meta", "require_complete",
           "supersede", "survey_checkpoints"]

NEW_RUN_DIR = "start a new run directory (--run-dir)"


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


# ----------------------------------------------------------------------------- checkpoints
@dataclass(frozen=True)
class CheckpointSurvey:
    """The newest checkpoint that verifies (loaded) and the newer ones that do not."""

    latest: Checkpoint | None
    corrupt: tuple[tuple[Path, str], ...]

    def newer_corrupt(self) -> tuple[tuple[Path, str], ...]:
        """The corrupt checkpoints past ``latest`` (all of them when there is none)."""
        floor = -1 if self.latest is None else self.latest.step
        return tuple((p, why) for p, why in self.corrupt
                     if int(p.name.removeprefix("step-")) > floor)


def survey_checkpoints(directory: Path) -> CheckpointSurvey:
    """Verify checkpoints from the newest down to the first that loads."""
    corrupt: list[tuple[Path, str]] = []
    for path in reversed(list_checkpoints(directory)):
        try:
            return CheckpointSurvey(load_checkpoint(path), tuple(corrupt))
        except CheckpointCorruptError as exc:
            corrupt.append((path, str(exc)))
    return CheckpointSurvey(None, tuple(corrupt))


# ----------------------------------------------------------------------------- agreement
@dataclass(frozen=True)
class RunProgress:
    """How far each part of a run directory got.

    consumed_steps: the ledger's step of every consumed group; versions: the registry's
    staged versions; rl_steps_logged: steps with an ``rl_step`` metrics record; step_traces:
    steps with a complete ``traces/step-NNNN.jsonl``.
    """

    consumed_steps: Sequence[int]
    versions: Sequence[str]
    rl_steps_logged: Sequence[int]
    step_traces: Sequence[int]

    @classmethod
    def of(cls, run_dir: Path, consumed_steps: Sequence[int], versions: Sequence[str],
           metrics: MetricsLog) -> RunProgress:
        """Read what the ledger (``consumed_steps``), registry and files show."""
        logged = sorted(r["step"] for r in metrics
                        if r.get("kind") == "rl_step" and isinstance(r.get("step"), int))
        traces = sorted(int(p.stem.removeprefix("step-"))
                        for p in (run_dir / "traces").glob("step-*.jsonl")
                        if p.stem.removeprefix("step-").isdigit())
        return cls(tuple(consumed_steps), tuple(versions), tuple(logged), tuple(traces))


def _restore(what: str) -> str:
    return f"restore {what} from a backup, or {NEW_RUN_DIR}; the run will not train from a " \
           "state it cannot prove"


def check_agreement(run_dir: Path, survey: CheckpointSurvey, progress: RunProgress,
                    ahead: int = 0) -> None:
    """Raise ``RunStateError`` unless the parts agree with the newest verified checkpoint
    (module docstring); ``ahead=1`` allows the ledger and registry one step past it."""
    ckpt = survey.latest
    c = 0 if ckpt is None else ckpt.step
    limit = c + ahead
    past = [(run_dir / "ledger.sqlite", f"records groups consumed at step "
             f"{max(progress.consumed_steps)}")] if progress.consumed_steps and (
        ckpt is None or max(progress.consumed_steps) > limit) else []
    staged = sorted(version_index(v) for v in progress.versions)
    if staged and staged[-1] > (limit if ckpt is not None else 0):
        past.append((run_dir / "registry" / "versions" / version_name(staged[-1]),
                     "is staged"))
    logged_past = [s for s in progress.rl_steps_logged if ckpt is None or s >= c]
    if logged_past:
        past.append((run_dir / "metrics.jsonl", f"holds the rl_step record of step "
                     f"{logged_past[-1]}"))
    if past:
        newer = survey.newer_corrupt()
        held = (f"holds {ckpt.path.name} as its newest checkpoint" if ckpt is not None
                else "holds no checkpoint")
        if newer:
            path, why = newer[0]
            fallback = (f"the newest that does is {ckpt.path.name}" if ckpt is not None
                        else "no checkpoint does")
            raise RunStateError(path, f"does not verify ({why.removeprefix(f'{path}: ')}); "
                                f"{fallback}, but {past[0][0].name} {past[0][1]}",
                                _restore(f"checkpoints/{path.name}"))
        raise RunStateError(past[0][0], f"{past[0][1]}, but checkpoints/ {held}: the weights "
                            "of that progress are gone", _restore("checkpoints/"))
    if ckpt is None:
        return
    missing_versions = sorted(set(range(c)) - set(staged))
    if missing_versions:
        v = version_name(missing_versions[0])
        raise RunStateError(run_dir / "registry" / "versions" / v, f"is missing, but "
                            f"checkpoint {ckpt.path.name} was trained on episodes it sampled",
                            _restore("registry/"))
    lost = sorted(set(range(c)) - set(progress.step_traces))
    if lost:
        trace = run_dir / "traces" / f"step-{lost[0]:04d}.jsonl"
        raise RunStateError(trace, f"is missing, but checkpoint {ckpt.path.name} committed "
                            f"step {lost[0]}", _restore(f"traces/{trace.name}"))
    lost = sorted(set(range(c)) - set(progress.rl_steps_logged))
    if lost:
        raise RunStateError(run_dir / "metrics.jsonl", f"has no rl_step record of step "
                            f"{lost[0]}, but checkpoint {ckpt.path.name} committed that step",
                            _restore("metrics.jsonl"))


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
    changed before every check has passed."""
    survey = survey_checkpoints(run_dir / "checkpoints")
    ckpt, ahead = survey.latest, 0
    superseded: Checkpoint | None = None
    if ckpt is not None and ckpt.step > 0 and ("rl_step", ckpt.step - 1, None) not in metrics:
        prev = ckpt.path.with_name(f"step-{ckpt.step - 1:06d}")
        try:
            superseded, ckpt = ckpt, load_checkpoint(prev)
        except CheckpointCorruptError as exc:
            raise RunStateError(prev, f"cannot stand in for {ckpt.path.name}, whose step "
                                f"record never reached metrics.jsonl ({exc})",
                                _restore(f"checkpoints/{prev.name}")) from None
        survey, ahead = CheckpointSurvey(ckpt, survey.corrupt), 1
    digest = ckpt.extra.get("ledger_digest") if ckpt is not None else None
    ledger.verify(LedgerDigest.from_dict(digest) if isinstance(digest, Mapping) else None)
    consumed = [ledger.get(g).consumed_step for g in ledger.group_ids("consumed")]
    check_agreement(run_dir, survey, RunProgress.of(
        run_dir, [s for s in consumed if s is not None], versions, metrics), ahead)
    if superseded is not None and ckpt is not None:
        log(f"{superseded.path.name} committed but its step record never reached "
            f"metrics.jsonl: step {superseded.step - 1} runs again from {ckpt.path.name}")
        supersede(superseded.path)
    return ckpt, ahead


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
                            _restore("metrics.jsonl"))


def check_tasks(path: Path, recorded: bytes | None, built: Mapping[str, Sequence[str]],
                override: str | None) -> None:
    """The task ids built now must be those ``tasks.json`` recorded (``recorded``: its bytes
    before this launch rewrote it, restored on a refusal) unless a config override is
    declared."""
    if recorded is None or override:
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
