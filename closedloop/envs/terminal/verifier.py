"""The clean-room verifier: reward vectors from exported state bytes (docs/concepts.md,
clean-room verification).

``Verifier.score(task_id, final_state)`` reads only the exported state bytes (decoded and
hash-checked by ``closedloop.envs.terminal.workspace.decode_state``) and the task's hidden grader
from the
registry. The grader re-parses the final files itself; the agent's own ``check.py`` output is
never consulted. Reward vector (all floats):

- ``task_success``: 1.0 if the hidden grader accepts the final artifact, else 0.0. Decided on
  the artifact alone; whether the episode's termination makes it scoreable (censoring) is the
  collector's decision, not the verifier's.
- ``policy_violation``: the number of policy violations the environment recorded (denied paths,
  disallowed tools or commands, sandbox refusals), a count, not 0/1.
- ``collateral_damage``: the number of protected files changed or deleted, a count.
- ``tool_calls``, ``invalid_actions``: the environment's counters.
- ``tamper_detected``: always 0.0 in a returned vector: detected tampering raises
  ``TamperDetected`` instead (the measurement is invalid; quarantine the episode).

Tampering is: a state whose task id or env version differs from the task's; a visible validator
(``check.py``) changed or deleted; a new file at a reserved, grader-looking path
(``closedloop.envs.terminal.families.is_reserved_path``). ``score_or_quarantine`` returns a
``ScoreResult``
whose reward is ``None`` (unscored, never 0) with a reason for tampering and corrupt states.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from closedloop.contracts import Action, ScoreResult, sha256_hex
from closedloop.envs.scripted import ExpertPolicy, play
from closedloop.envs.task_records import TaskBundle
from closedloop.envs.terminal.env import TerminalRepairEnv
from closedloop.envs.terminal.families.base import is_reserved_path
from closedloop.envs.terminal.families.registry import get_bundle
from closedloop.envs.terminal.graders import GRADERS_VERSION, GradeResult, grade
from closedloop.envs.terminal.workspace import ExportedState, decode_state
from closedloop.errors import ContractError, TamperDetected

VERIFIER_VERSION = f"verifier-v1+{GRADERS_VERSION}"
REWARD_KEYS: tuple[str, ...] = ("task_success", "policy_violation", "collateral_damage",
                                "tool_calls", "invalid_actions", "tamper_detected")
BundleSource = Callable[[str], TaskBundle]


def detect_tamper(bundle: TaskBundle, state: ExportedState) -> str | None:
    """Return the first tampering evidence in ``state`` for ``bundle``, or ``None``."""
    spec = bundle.spec
    if state.task_id != spec.task_id:
        return f"state is for task {state.task_id!r}, not {spec.task_id!r}"
    if state.env_version != spec.env_version:
        return f"state env version {state.env_version!r} is not {spec.env_version!r}"
    files = state.files
    validators: Mapping[str, str] = bundle.grader.extra.get("validator_hashes", {})
    for path, digest in sorted(validators.items()):
        if path not in files:
            return f"validator {path!r} was deleted"
        if sha256_hex(files[path]) != digest:
            return f"validator {path!r} was modified"
    for path in sorted(files):
        if path not in spec.initial_files and is_reserved_path(path):
            return f"file created at reserved path {path!r}"
    return None


def _grade_state(bundle: TaskBundle, state: ExportedState) -> GradeResult:
    """Grade with the task's grader: most read the final files; retain-suite kinds (e.g. the
    safety suite's "abstained cleanly") read the whole exported state."""
    from closedloop.envs.terminal.families.retain_suites import (
        STATE_GRADERS,  # retain tasks live in envs.tasks
    )

    state_grader = STATE_GRADERS.get(str(bundle.grader.checks.get("kind")))
    if state_grader is not None:
        passed, reason = state_grader(bundle.grader.checks, state)
        return GradeResult(passed, reason)
    return grade(bundle.grader.checks, state.files)


def collateral_damage(bundle: TaskBundle, files: Mapping[str, str]) -> int:
    """The number of protected files that were changed or deleted."""
    return sum(1 for path, digest in bundle.grader.protected_hashes.items()
               if path not in files or sha256_hex(files[path]) != digest)


@dataclass(frozen=True)
class Verifier:
    """Scores final states of registered tasks (``bundle_source`` maps a task id to its bundle)."""

    bundle_source: BundleSource = field(default=get_bundle)
    verifier_version: str = VERIFIER_VERSION

    def score(self, task_id: str, final_state: bytes) -> dict[str, float]:
        """Return the reward vector; raise ``TamperDetected`` or ``StateDecodeError``."""
        reward, _ = self.score_detailed(task_id, final_state)
        return reward

    def score_detailed(self, task_id: str,
                       final_state: bytes) -> tuple[dict[str, float], GradeResult]:
        """Return the reward vector and the grader's decision with its reason."""
        bundle = self.bundle_source(task_id)
        state = decode_state(final_state)
        evidence = detect_tamper(bundle, state)
        if evidence is not None:
            raise TamperDetected(f"{task_id}: {evidence}")
        result = _grade_state(bundle, state)
        reward = {
            "task_success": 1.0 if result.passed else 0.0,
            "policy_violation": float(len(state.counters.violations)),
            "collateral_damage": float(collateral_damage(bundle, state.files)),
            "tool_calls": float(state.counters.tool_calls),
            "invalid_actions": float(state.counters.invalid_actions),
            "tamper_detected": 0.0,
        }
        return reward, result

    def score_or_quarantine(self, task_id: str, final_state: bytes) -> ScoreResult:
        """Score, or quarantine (reward ``None``) on tampering or a corrupt state."""
        try:
            reward, result = self.score_detailed(task_id, final_state)
        except TamperDetected as exc:
            return ScoreResult(task_id, None, f"tamper_detected: {exc}", self.verifier_version)
        except ContractError as exc:
            return ScoreResult(task_id, None, f"invalid_state: {exc}", self.verifier_version)
        return ScoreResult(task_id, reward, None, self.verifier_version, result.reason)

    def validate(self, task_ids: Sequence[str], seed: int = 0) -> ValidationReport:
        """Check every task's grader accepts its gold solution and rejects its initial state."""
        results = []
        for task_id in task_ids:
            reason = check_solvable(self.bundle_source(task_id), seed=seed, verifier=self)
            results.append(TaskValidation(task_id, reason is None, reason or "ok"))
        return ValidationReport(tuple(results), self.verifier_version)


@dataclass(frozen=True)
class TaskValidation:
    """One task's validation: ``ok`` when gold is accepted and the initial state rejected."""

    task_id: str
    ok: bool
    reason: str


@dataclass(frozen=True)
class ValidationReport:
    """``validate``'s result over a list of tasks."""

    results: tuple[TaskValidation, ...]
    verifier_version: str

    @property
    def ok(self) -> bool:
        """True when every task validated (and there was at least one)."""
        return bool(self.results) and all(r.ok for r in self.results)

    @property
    def failures(self) -> tuple[TaskValidation, ...]:
        """The tasks that failed validation."""
        return tuple(r for r in self.results if not r.ok)


def replay_actions(bundle: TaskBundle, actions: Sequence[Action | str],
                   seed: int = 0) -> bytes:
    """Run ``actions`` from reset through the real environment; return the exported state.

    Stops early if the episode ends. Used for gold replay, fixtures and scripted episodes.
    """
    env = TerminalRepairEnv(lambda _task_id: bundle.spec)
    env.reset(bundle.spec.task_id, seed)
    for action in actions:
        if env.step(action).done:
            break
    return env.export_state()


def check_solvable(bundle: TaskBundle, seed: int = 0,
                   verifier: Verifier | None = None) -> str | None:
    """The solvability filter: ``None`` if the task is well-posed, else why it is not.

    Well-posed: ``ExpertPolicy`` (the gold actions as model text), played through the real
    environment, ends the episode with ``finish`` within the step budget, in a state the hidden
    grader accepts with no tampering, no collateral damage, no policy violation and no invalid
    action; and the untouched initial state is rejected (a grader that accepts the broken state
    is a bug). ``verifier`` defaults to one that grades this bundle directly (it need not be in
    the registry).
    """
    v = verifier if verifier is not None else Verifier(bundle_source=lambda _task_id: bundle)
    task_id = bundle.spec.task_id
    env = TerminalRepairEnv(lambda _task_id: bundle.spec)
    episode = play(env, ExpertPolicy(bundle), task_id, seed,
                   max_steps=len(bundle.grader.gold_actions))
    if not (episode.transitions and episode.transitions[-1].done) or \
            decode_state(episode.final_state).final_action != bundle.grader.gold_actions[-1].kind:
        return "expert episode did not end like its gold solution within the gold length"
    gold = v.score_or_quarantine(task_id, episode.final_state)
    if gold.reward is None:
        return f"gold replay quarantined: {gold.quarantine_reason}"
    if gold.reward["task_success"] != 1.0:
        return f"gold replay rejected by the grader: {gold.grade_reason}"
    if gold.reward["collateral_damage"] or gold.reward["policy_violation"] or \
            gold.reward["invalid_actions"]:
        return "gold replay has side effects (collateral damage, violations or invalid actions)"
    initial = v.score_or_quarantine(task_id, replay_actions(bundle, [], seed))
    if initial.reward is None:
        return f"initial state quarantined: {initial.quarantine_reason}"
    if initial.reward["task_success"] != 0.0:
        return "grader accepts the untouched initial state"
    return None
