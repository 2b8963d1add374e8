"""Read a run directory (``closedloop.training``) for the go/no-go gates and the core report.

Trace lines are read twice over: as raw JSON objects and as validated records. A gate must be
able to *see* a broken line (a shifted mask, a censored episode scored 0, a NaN log-prob) that
the record classes refuse to build, so nothing is dropped silently: every line is kept as a
:class:`TraceLine` with its record or the validation error. Episodes are assembled one
trajectory at a time, so one bad episode does not hide the rest of its file.

An *experiment* directory holds several run directories, one per arm (frozen, rloo,
shuffled, sft_only, ...): either ``experiment.json`` with ``{"arms": {name: relative_path}}``,
or one sub-folder per arm under ``arms/``. :func:`find_arms` returns them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from closedloop.contracts import (
    Episode,
    GroupLease,
    TrajectoryRecord,
    TurnRecord,
    assemble_episodes,
    record_from_line,
)
from closedloop.contracts.records import TraceRecord
from closedloop.errors import RunDirError, TraceFormatError
from closedloop.evaluate.heldout import EvalSummary, summarize_eval
from closedloop.evaluate.run_integrity import (
    RunProof,
    resume_point,
    verify_ledger,
    verify_run_directory,
)
from closedloop.policy.registry import PolicyRegistry
from closedloop.rollout.ledger import Ledger

__all__ = ["RunDir", "RunDirError", "TraceFile", "TraceLine", "arm_evaluation", "eval_summary",
           "experiment_of", "find_arms", "load_run", "read_trace_file", "runs_of",
           "verify_reading"]

TraceKind = Literal["demo", "step", "eval", "other"]
_STEP_RE = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class TraceLine:
    """One line of a trace: its raw JSON object (None if not JSON) and record or error."""

    lineno: int
    raw: dict[str, Any] | None
    record: TraceRecord | None
    error: str | None


@dataclass(frozen=True)
class TraceFile:
    """One trace file: every line, the valid leases and the episodes that assemble.

    kind: ``demo`` (sft-demos), ``step`` (step-NNNN, with ``step``), ``eval`` (eval-<label>,
    with ``label``) or ``other``. ``episode_errors`` names the trajectories whose turn records
    did not assemble (gap, bad threading, mixed versions) with the reason.
    """

    path: Path
    kind: TraceKind
    step: int | None
    label: str | None
    lines: tuple[TraceLine, ...]
    leases: tuple[GroupLease, ...]
    episodes: tuple[Episode, ...]
    episode_errors: tuple[str, ...]

    @property
    def name(self) -> str:
        """The file name without ``.jsonl``."""
        return self.path.stem

    def raw(self, record: str) -> list[dict[str, Any]]:
        """Raw objects of one record kind (``turn``, ``trajectory``, ``group``)."""
        return [ln.raw for ln in self.lines if ln.raw is not None and ln.raw.get("record") ==
                record]

    @property
    def invalid_lines(self) -> list[TraceLine]:
        """Lines that are not valid records."""
        return [ln for ln in self.lines if ln.record is None]


def _read_lines(path: Path) -> tuple[TraceLine, ...]:
    out = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            raw: dict[str, Any] | None = None
            try:
                parsed = json.loads(line)  # NaN/Infinity accepted here, so a gate can see them
                raw = parsed if isinstance(parsed, dict) else None
            except ValueError:
                raw = None
            try:
                out.append(TraceLine(lineno, raw, record_from_line(line, lineno), None))
            except TraceFormatError as exc:
                out.append(TraceLine(lineno, raw, None, str(exc)))
    return tuple(out)


def _assemble(lines: tuple[TraceLine, ...]) -> tuple[list[GroupLease], list[Episode], list[str]]:
    leases: list[GroupLease] = []
    turns: dict[str, list[TurnRecord]] = {}
    trajectories: list[TrajectoryRecord] = []
    for ln in lines:
        rec = ln.record
        if isinstance(rec, GroupLease):
            leases.append(rec)
        elif isinstance(rec, TurnRecord):
            turns.setdefault(rec.episode_id, []).append(rec)
        elif isinstance(rec, TrajectoryRecord):
            trajectories.append(rec)
    episodes: list[Episode] = []
    errors: list[str] = []
    for traj in trajectories:
        try:
            _, (ep,) = assemble_episodes([traj, *turns.get(traj.episode_id, [])])
            episodes.append(ep)
        except TraceFormatError as exc:
            errors.append(f"{traj.episode_id}: {exc}")
    return leases, episodes, errors


def read_trace_file(path: str | Path) -> TraceFile:
    """Read one trace file (see :class:`TraceFile`)."""
    p = Path(path)
    stem = p.stem
    kind: TraceKind = "other"
    step: int | None = None
    label: str | None = None
    if stem == "sft-demos":
        kind = "demo"
    elif (m := _STEP_RE.match(stem)) is not None:
        kind, step = "step", int(m.group(1))
    elif stem.startswith("eval-"):
        kind, label = "eval", stem[len("eval-"):]
    lines = _read_lines(p)
    leases, episodes, errors = _assemble(lines)
    return TraceFile(p, kind, step, label, lines, tuple(leases), tuple(episodes), tuple(errors))


def _json_or_none(path: Path) -> Any:
    try:
        return json.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise RunDirError(f"{path}: not valid JSON ({exc})") from None


@dataclass(frozen=True)
class RunDir:
    """A loaded run directory. Missing optional files are ``None`` / empty, never invented.

    config: the resolved run config (``config.json`` ``config``); config_meta: the rest of
    config.json (hash, git revision, versions). metrics: the lines of ``metrics.jsonl``.
    traces: every ``traces/*.jsonl`` by file stem, in name order.
    """

    path: Path
    config: dict[str, Any]
    config_meta: dict[str, Any]
    trainer: dict[str, Any] | None
    tasks: dict[str, Any] | None
    summary: dict[str, Any] | None
    audit: dict[str, Any] | None
    metrics: tuple[dict[str, Any], ...]
    traces: dict[str, TraceFile]

    def section(self, name: str) -> dict[str, Any]:
        """One config section (empty if absent)."""
        value = self.config.get(name)
        return value if isinstance(value, dict) else {}

    @property
    def precision(self) -> str | None:
        """The run's resolved matmul precision: the resolution config.json recorded, else the
        trainer's (trainer.json), else the config's own value when it names one."""
        recorded = self.config_meta.get("precision")
        if isinstance(recorded, dict) and recorded.get("precision"):
            return str(recorded["precision"])
        if self.trainer and self.trainer.get("precision"):
            return str(self.trainer["precision"])
        value = self.section("training").get("precision")
        return str(value) if value in ("float32", "bfloat16") else None

    def traces_of(self, kind: TraceKind) -> list[TraceFile]:
        """Trace files of one kind in name order (steps in step order)."""
        return [t for t in self.traces.values() if t.kind == kind]

    def eval_trace(self, label: str) -> TraceFile | None:
        """The held-out evaluation trace ``eval-<label>``, if present."""
        return self.traces.get(f"eval-{label}")

    def metrics_of(self, kind: str) -> list[dict[str, Any]]:
        """``metrics.jsonl`` lines of one kind (``sft``, ``eval``, ``rl_step``)."""
        return [m for m in self.metrics if m.get("kind") == kind]

    @property
    def has_ledger(self) -> bool:
        """Whether ``ledger.sqlite`` exists."""
        return (self.path / "ledger.sqlite").is_file()

    @contextmanager
    def ledger(self) -> Iterator[Ledger]:
        """Open the ledger, verified (``closedloop.evaluate.run_integrity.verify_ledger``:
        SQLite's check, every row readable and consistent with its events, the rows committed
        before the standing checkpoint equal to its digest); ``LedgerCorruptError`` naming the
        file otherwise, so a gate that reads a tampered ledger fails. ``RunDirError`` if the
        run has none; opening never creates one."""
        if not self.has_ledger:
            raise RunDirError(f"{self.path}: no ledger.sqlite")
        ledger = Ledger(self.path / "ledger.sqlite")
        try:
            verify_ledger(ledger, resume_point(self.path, self.metrics, tensors=False).checkpoint)
            yield ledger
        finally:
            ledger.close()

    def registry(self) -> PolicyRegistry | None:
        """The run's policy registry, or ``None`` when ``registry/versions`` is absent."""
        if not (self.path / "registry" / "versions").is_dir():
            return None
        return PolicyRegistry(self.path / "registry")


def _read_metrics(path: Path) -> tuple[dict[str, Any], ...]:
    if not path.is_file():
        return ()
    out = []
    for lineno, line in enumerate(path.read_text("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError as exc:
            raise RunDirError(f"{path}:{lineno}: not valid JSON ({exc})") from None
    return tuple(out)


def load_run(path: str | Path) -> RunDir:
    """Load a run directory; ``RunDirError`` if it has neither config.json nor traces/."""
    root = Path(path)
    config_json = _json_or_none(root / "config.json")
    if config_json is None and not (root / "traces").is_dir():
        raise RunDirError(f"{root} is not a run directory (no config.json, no traces/)")
    config_json = config_json or {}
    traces = {}
    for file in sorted((root / "traces").glob("*.jsonl")) if (root / "traces").is_dir() else []:
        tf = read_trace_file(file)
        traces[tf.name] = tf
    return RunDir(
        path=root, config=dict(config_json.get("config") or {}),
        config_meta={k: v for k, v in config_json.items() if k != "config"},
        trainer=_json_or_none(root / "trainer.json"), tasks=_json_or_none(root / "tasks.json"),
        summary=_json_or_none(root / "summary.json"), audit=_json_or_none(root / "audit.json"),
        metrics=_read_metrics(root / "metrics.jsonl"), traces=traces)


def find_arms(path: str | Path) -> dict[str, Path]:
    """The arms of an experiment directory (name -> run directory); empty for a plain run.

    ``experiment.json`` (``closedloop.experiments.controls``: ``{"arms": {name: {"run_dir":
    path}}}``, or
    ``{name: path}``) names the arms; each is ``arms/<name>`` inside the directory when that
    folder exists (so a moved or copied experiment reads its own arms), else the recorded path
    (relative to the directory). Without it: every sub-folder of ``arms/`` that holds a
    ``config.json`` or ``traces/``.
    """
    root = Path(path)
    spec = _json_or_none(root / "experiment.json")
    listed: dict[str, Path] = {}
    if isinstance(spec, dict) and isinstance(spec.get("arms"), dict):
        for name, entry in spec["arms"].items():
            where = entry.get("run_dir") if isinstance(entry, dict) else entry
            local = root / "arms" / str(name)
            if local.is_dir():
                listed[str(name)] = local.resolve()
            elif isinstance(where, str) and (root / where).is_dir():
                listed[str(name)] = (root / where).resolve()
    if listed:
        return listed
    arms_dir = root / "arms"
    if not arms_dir.is_dir():
        return {}
    return {p.name: p for p in sorted(arms_dir.iterdir())
            if p.is_dir() and ((p / "config.json").is_file() or (p / "traces").is_dir())}


def experiment_of(run_path: str | Path) -> Path | None:
    """The experiment directory a run belongs to (or is), or ``None``."""
    p = Path(run_path).resolve()
    if find_arms(p):
        return p
    for candidate in (p.parent.parent, p.parent):
        if any(arm.resolve() == p for arm in find_arms(candidate).values()):
            return candidate
    return None


def runs_of(path: str | Path) -> list[Path]:
    """The run directories a command reads at ``path``: the arms of an experiment, the arms of
    every ``replicate-<i>`` experiment of a replicates directory, else ``path`` itself."""
    root = Path(path)
    arms = find_arms(root)
    if arms:
        return [arms[name] for name in sorted(arms)]
    replicates = sorted(p for p in root.glob("replicate-*") if p.is_dir() and find_arms(p))
    if replicates:
        return [run for rep in replicates for run in runs_of(rep)]
    return [root]


def verify_reading(*paths: str | Path) -> list[RunProof]:
    """Before a command reads run directories: the read-only proof a launch of ``closedloop
    train`` runs (``closedloop.evaluate.run_integrity.verify_run_directory``) on every run
    directory under ``paths`` (``runs_of``); the first that fails raises its named error,
    which names the file."""
    return [verify_run_directory(run) for path in paths for run in runs_of(path)]


def arm_evaluation(run: RunDir) -> tuple[str, EvalSummary | None]:
    """An arm's held-out result: its ``final`` evaluation, else its ``start`` one (the frozen
    arm of ``closedloop.experiments.controls`` is never updated, so its result is the start
    evaluation).
    Returns (label used, summary)."""
    final = eval_summary(run, "final")
    return ("final", final) if final is not None else ("start", eval_summary(run, "start"))


def eval_summary(run: RunDir, label: str) -> EvalSummary | None:
    """Recompute the held-out summary of ``eval-<label>`` from its trace (None if absent)."""
    trace = run.eval_trace(label)
    if trace is None or not trace.episodes:
        return None
    ev = run.section("evaluation")
    k = int(ev.get("attempts_per_task", 1))
    seed = int(run.section("training").get("seed", 0))
    return summarize_eval(list(trace.episodes), k=k, seed=seed)
