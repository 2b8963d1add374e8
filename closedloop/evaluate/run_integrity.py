"""The read-only proof of a run directory: the checks ``closedloop train`` runs on every launch
before anything trains, shared by every command that reads a run directory (``gates``,
``report``, ``export``, ``reevaluate``, ``replay``), which stop naming the file that disagrees.

What is proved (:func:`verify_run_directory`; the run's write order is described in
``closedloop.training.integrity``, which adds the lock and the config check of a launch):

- **config**: ``config.json``, when present, is readable JSON with a ``config`` object;
- **metrics**: ``metrics.jsonl`` parses line by line, each key once, no torn last line
  (``MetricsFormatError`` naming the file and line);
- **checkpoints**: the newest checkpoint whose file hashes verify (:func:`survey_checkpoints`)
  and whether its step record reached ``metrics.jsonl`` (:func:`resume_point`: if not, the
  previous checkpoint stands and the parts may be one step ahead);
- **ledger**: SQLite's integrity check, every row decodable and consistent with its events,
  and the rows committed before that checkpoint equal to the digest it carries
  (``LedgerCorruptError`` naming ``ledger.sqlite``); a ledger deleted after a checkpoint
  recorded its digest is refused;
- **agreement** (:func:`check_agreement`): with c the newest checkpoint that verifies, nothing
  may show progress past it: no group consumed after step c, no registry version past v_c, no
  ``rl_step`` record for step c or later; every behaviour version v_0..v_{c-1}, every step
  trace and every ``rl_step`` record of steps 0..c-1 must exist. Without any checkpoint,
  nothing may have been consumed or published past v0000.

Nothing here writes: a reader never repairs (``closedloop train`` on the same directory sets
aside a checkpoint whose step record never reached the log, and repairs a torn metrics line).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from closedloop.contracts.metrics_log import read_metrics
from closedloop.errors import (
    CheckpointCorruptError,
    ClosedloopError,
    RegistryError,
    RunDirectoryError,
    RunStateError,
)
from closedloop.learn.checkpoint import Checkpoint, list_checkpoints, load_checkpoint
from closedloop.policy.registry import version_index, version_name
from closedloop.rollout.ledger import Ledger
from closedloop.rollout.ledger_check import LedgerDigest

__all__ = ["NEW_RUN_DIR", "CheckpointSurvey", "ResumePoint", "RunProgress", "RunProof",
           "check_agreement", "checkpoint_digest", "restore_advice", "resume_point",
           "staged_versions", "survey_checkpoints", "verify_ledger", "verify_run_directory",
           "verify_run_dirs", "work_products"]

NEW_RUN_DIR = "start a new run directory (--run-dir)"


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


def survey_checkpoints(directory: Path, *, tensors: bool = True) -> CheckpointSurvey:
    """Verify checkpoints from the newest down to the first that loads (``tensors=False``: the
    file hashes only, what a reader needs)."""
    corrupt: list[tuple[Path, str]] = []
    for path in reversed(list_checkpoints(directory)):
        try:
            return CheckpointSurvey(load_checkpoint(path, tensors=tensors), tuple(corrupt))
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
           metrics: Iterable[Mapping[str, Any]]) -> RunProgress:
        """Read what the ledger (``consumed_steps``), registry and files show."""
        logged = sorted(r["step"] for r in metrics
                        if r.get("kind") == "rl_step" and isinstance(r.get("step"), int))
        traces = sorted(int(p.stem.removeprefix("step-"))
                        for p in (run_dir / "traces").glob("step-*.jsonl")
                        if p.stem.removeprefix("step-").isdigit())
        return cls(tuple(consumed_steps), tuple(versions), tuple(logged), tuple(traces))


def restore_advice(what: str) -> str:
    """The recovery advice of a part that cannot be proved: restore it, or start anew."""
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
                                restore_advice(f"checkpoints/{path.name}"))
        raise RunStateError(past[0][0], f"{past[0][1]}, but checkpoints/ {held}: the weights "
                            "of that progress are gone", restore_advice("checkpoints/"))
    if ckpt is None:
        return
    missing_versions = sorted(set(range(c)) - set(staged))
    if missing_versions:
        v = version_name(missing_versions[0])
        raise RunStateError(run_dir / "registry" / "versions" / v, f"is missing, but "
                            f"checkpoint {ckpt.path.name} was trained on episodes it sampled",
                            restore_advice("registry/"))
    lost = sorted(set(range(c)) - set(progress.step_traces))
    if lost:
        trace = run_dir / "traces" / f"step-{lost[0]:04d}.jsonl"
        raise RunStateError(trace, f"is missing, but checkpoint {ckpt.path.name} committed "
                            f"step {lost[0]}", restore_advice(f"traces/{trace.name}"))
    lost = sorted(set(range(c)) - set(progress.rl_steps_logged))
    if lost:
        raise RunStateError(run_dir / "metrics.jsonl", f"has no rl_step record of step "
                            f"{lost[0]}, but checkpoint {ckpt.path.name} committed that step",
                            restore_advice("metrics.jsonl"))


# ----------------------------------------------------------------------------- resume point
@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a launch resumes from, how many steps the ledger and registry may be past
    it, and the newer checkpoint set aside (committed, but its step record never reached
    ``metrics.jsonl``), if any."""

    survey: CheckpointSurvey
    ahead: int
    superseded: Checkpoint | None

    @property
    def checkpoint(self) -> Checkpoint | None:
        """The checkpoint that stands."""
        return self.survey.latest


def resume_point(run_dir: Path, metrics: Iterable[Mapping[str, Any]], *,
                 tensors: bool = True) -> ResumePoint:
    """Survey ``run_dir/checkpoints``; when the newest verified checkpoint's step record is not
    in ``metrics``, the previous checkpoint stands (``ahead=1``); ``RunStateError`` when that
    one does not verify."""
    survey = survey_checkpoints(run_dir / "checkpoints", tensors=tensors)
    ckpt = survey.latest
    logged = {r.get("step") for r in metrics if r.get("kind") == "rl_step"}
    if ckpt is None or ckpt.step == 0 or ckpt.step - 1 in logged:
        return ResumePoint(survey, 0, None)
    prev = ckpt.path.with_name(f"step-{ckpt.step - 1:06d}")
    try:
        previous = load_checkpoint(prev, tensors=tensors)
    except CheckpointCorruptError as exc:
        raise RunStateError(prev, f"cannot stand in for {ckpt.path.name}, whose step record "
                            f"never reached metrics.jsonl ({exc})",
                            restore_advice(f"checkpoints/{prev.name}")) from None
    return ResumePoint(CheckpointSurvey(previous, survey.corrupt), 1, ckpt)


def checkpoint_digest(ckpt: Checkpoint | None) -> LedgerDigest | None:
    """The ledger digest a checkpoint carries (``None`` without one)."""
    digest = ckpt.extra.get("ledger_digest") if ckpt is not None else None
    return LedgerDigest.from_dict(digest) if isinstance(digest, Mapping) else None


def verify_ledger(ledger: Ledger, ckpt: Checkpoint | None) -> list[int]:
    """``ledger.verify`` against ``ckpt``'s digest; return the consumed steps it records."""
    ledger.verify(checkpoint_digest(ckpt))
    return [s for s in (ledger.get(g).consumed_step for g in ledger.group_ids("consumed"))
            if s is not None]


def staged_versions(run_dir: Path) -> list[str]:
    """The policy versions staged under ``run_dir/registry/versions`` (read only)."""
    folder = run_dir / "registry" / "versions"
    names = []
    for p in sorted(folder.iterdir()) if folder.is_dir() else []:
        try:
            if p.is_dir() and version_name(version_index(p.name)) == p.name:
                names.append(p.name)
        except RegistryError:
            continue
    return sorted(names, key=version_index)


# ----------------------------------------------------------------------------- work
def work_products(run_dir: Path) -> list[Path]:
    """What a launch produced beyond its set-up files (config.json, launches.jsonl, run.lock,
    tasks.json, template.json, trainer.json, package_check.json): a checkpoint, a trace, a
    staged version, a metrics record, a warm-start file, a ledger row. Empty means every launch
    so far stopped before its first piece of work, so nothing a relaunch would repeat or
    contradict exists (a ledger that cannot be read counts as work: it is then proved)."""
    found: list[Path] = []
    for sub in ("checkpoints", "traces", "registry/versions", "sft"):
        folder = run_dir / sub
        if folder.is_dir():
            found += sorted(p for p in folder.iterdir() if not p.name.startswith(".trash-"))
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(metrics)
    ledger = run_dir / "ledger.sqlite"
    if ledger.is_file():
        try:
            with Ledger(ledger) as opened:
                if opened.group_ids():
                    found.append(ledger)
        except ClosedloopError:
            found.append(ledger)
    return found


# ----------------------------------------------------------------------------- the proof
@dataclass(frozen=True)
class RunProof:
    """What :func:`verify_run_directory` proved: the checkpoint that stands (None: none yet),
    how many steps the parts may be past it, and how many groups the ledger consumed."""

    run_dir: Path
    checkpoint_step: int | None
    ahead: int
    consumed_groups: int


def _check_config_json(run_dir: Path) -> None:
    path = run_dir / "config.json"
    if not path.exists():
        return
    try:
        data = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise RunDirectoryError(path, f"cannot be read ({exc})",
                                "restore config.json from a backup") from None
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict):
        raise RunDirectoryError(path, "holds no 'config' object",
                                "restore config.json from a backup")


def verify_run_directory(run_dir: str | Path) -> RunProof:
    """Prove a run directory read-only (module docstring); raise the named error
    (``RunDirectoryError``, ``LedgerCorruptError``, ``MetricsFormatError``) naming the file."""
    root = Path(run_dir)
    _check_config_json(root)
    metrics = read_metrics(root / "metrics.jsonl")
    point = resume_point(root, metrics, tensors=False)
    ckpt = point.checkpoint
    ledger_path = root / "ledger.sqlite"
    consumed: list[int] = []
    if ledger_path.is_file():
        with Ledger(ledger_path) as ledger:
            consumed = verify_ledger(ledger, ckpt)
    elif checkpoint_digest(ckpt) is not None and ckpt is not None:
        raise RunStateError(ledger_path, f"is missing, but checkpoint {ckpt.path.name} "
                            "recorded the digest of its rows", restore_advice("ledger.sqlite"))
    progress = RunProgress.of(root, consumed, staged_versions(root), metrics)
    if any(r.get("kind") == "sft_only" for r in metrics):
        _check_sft_only(root, progress)
    else:
        check_agreement(root, point.survey, progress, point.ahead)
    return RunProof(root, None if ckpt is None else ckpt.step, point.ahead, len(consumed))


def _check_sft_only(run_dir: Path, progress: RunProgress) -> None:
    """An SFT-only control (an experiment arm with an ``sft_only`` metrics record) trains no RL
    step: it consumes no group, logs no ``rl_step``, and stages v0000 and the one final version
    it publishes (``training.rl_steps`` of its config), nothing else."""
    if progress.consumed_steps or progress.rl_steps_logged:
        what = ("ledger.sqlite", "records consumed groups") if progress.consumed_steps else (
            "metrics.jsonl", "holds rl_step records")
        raise RunStateError(run_dir / what[0], f"{what[1]}, but the run is an SFT-only "
                            "control, which trains no RL step", restore_advice(what[0]))
    try:
        final = int(json.loads((run_dir / "config.json").read_text("utf-8"))["config"]
                    ["training"]["rl_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        final = None
    extra = [v for v in progress.versions if version_index(v) not in (0, final)]
    if extra:
        raise RunStateError(run_dir / "registry" / "versions" / extra[0], "is staged, but an "
                            "SFT-only control publishes only v0000 and its final version",
                            restore_advice("registry/"))


def verify_run_dirs(paths: Iterable[str | Path]) -> list[RunProof]:
    """``verify_run_directory`` on each path (the arms of an experiment), in order."""
    return [verify_run_directory(p) for p in paths]
