"""``check_env``: the environment contract checker, for any ``AgentEnv``; ``check_package``.

For every task and seed ``check_env`` runs the checks of ``closedloop.envs.check_properties``
(reset and step determinism, snapshot -> restore -> replay, unparsable text, fork isolation),
with actions of the environment's own (its package's action sampler) mixed with garbage text,
malformed calls and ``finish`` (``closedloop.envs.check_actions``). Fork isolation needs a
state-changing probe action of the env's own: the package's ``fork_probe``, else (also for a
task the declared probe has no action for) a sampler action found to change the state more than
an unparsable text does.

Every failure raises a subclass of ``EnvCheckError`` whose message names the task, the seed and
the step; an exception of the env's own type becomes ``EnvRaisedError`` naming it. What the env
does not offer (no sampler, no state-changing action, no ``fork``) is listed by name in
``EnvCheckReport.missing`` with the checks that could not run; the report counts every check
and every action source. ``check_package`` runs ``check_env`` from an ``EnvPackage`` and adds
the package checks (env version, expert accepted and initial state rejected by the verifier).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from closedloop.contracts import Action
from closedloop.envs.check_actions import (
    DEFAULT_WEIGHTS,
    ActionLike,
    ActionMix,
    Sampler,
    garbage_text,
    random_actions,
)
from closedloop.envs.check_properties import (
    EnvFactory,
    check_fork_isolation,
    check_invalid_actions,
    check_reset,
    check_steps,
    find_probe,
    fork_supported,
    location,
    replay_property,
    short,
)
from closedloop.envs.task_records import TaskSpec
from closedloop.errors import (
    CheckOptionError,
    EnvCheckError,
    EnvRaisedError,
    EnvVersionMismatchError,
    VerifierCheckError,
)

if TYPE_CHECKING:
    from closedloop.contracts.package import EnvPackage

__all__ = ["DEFAULT_WEIGHTS", "CheckOptionError", "EnvCheckReport", "check_env",
           "check_fork_isolation", "check_invalid_actions", "check_package", "check_reset",
           "check_steps", "find_probe", "random_actions", "replay_property"]

Probe = Callable[[str], ActionLike | None]

PROBE_TRIES = 64
"""Sampler draws tried for a state-changing probe action of a task before the fork isolation
check is reported as not offered (``fork_probe`` in ``EnvCheckReport.missing``)."""


@contextmanager
def _reported(task_id: str, seed: int, check: str) -> Iterator[None]:
    """Let check failures through; turn any other exception into ``EnvRaisedError``."""
    try:
        yield
    except (EnvCheckError, CheckOptionError):
        raise
    except Exception as exc:
        raise EnvRaisedError(f"task {task_id!r} seed {seed} step ?: {check}: the env raised "
                             f"{type(exc).__name__}: {short(str(exc))}") from exc


@dataclass(frozen=True)
class EnvCheckReport:
    """What ``check_env`` exercised, check by check and action source by source.

    missing: what the env does not offer (``action_sampler``, ``fork``, ``fork_probe``), with
    ``notes`` saying which checks did not run because of it.
    """

    resets: int
    sequences: int
    replays: int
    fork_checks: int
    steps: int
    invalid_checks: int = 0
    package_checks: int = 0
    sampler_actions: int = 0
    garbage_actions: int = 0
    malformed_calls: int = 0
    finish_actions: int = 0
    missing: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return asdict(self)

    def summary(self) -> str:
        """One line: counts, and what was not offered."""
        text = (f"{self.resets} resets, {self.sequences} sequences ({self.steps} steps: "
                f"{self.sampler_actions} sampler, {self.garbage_actions} garbage, "
                f"{self.malformed_calls} malformed, {self.finish_actions} finish), "
                f"{self.replays} replays, {self.invalid_checks} invalid-text checks, "
                f"{self.fork_checks} fork checks, {self.package_checks} package checks")
        return text + (f"; not offered: {', '.join(self.missing)}" if self.missing else "")


def _legacy_parts(env_factory: EnvFactory, task_ids: Sequence[str], seeds: Sequence[int],
                  spec_of: Callable[[str], TaskSpec] | None,
                  weights: Mapping[str, float] | None) -> tuple[Sampler, Probe, list[str]] | None:
    """The terminal env's sampler and probe, when its task specs are reachable."""
    specs: dict[str, TaskSpec] = {}

    def spec(task_id: str) -> TaskSpec:
        if task_id not in specs:
            if spec_of is not None:
                specs[task_id] = spec_of(task_id)
            else:
                env = env_factory()
                env.reset(task_id, seeds[0])
                specs[task_id] = getattr(env, "task_spec")  # noqa: B009
        return specs[task_id]

    if spec_of is None:
        env = env_factory()
        env.reset(task_ids[0], seeds[0])
        if not isinstance(getattr(env, "task_spec", None), TaskSpec):
            return None

    def probe(task_id: str) -> ActionLike | None:
        if "write_file" not in spec(task_id).allowed_tools:
            return None
        return Action.tool("write_file", path="fork_probe.txt", content="written in a fork\n")

    tools = sorted({t for task in task_ids for t in spec(task).allowed_tools})
    return (lambda rng, task_id: random_actions(rng, spec(task_id), 1, weights)[0]), probe, tools


def check_env(env_factory: EnvFactory, task_ids: Sequence[str], seeds: Sequence[int],
              n_random_sequences: int = 4, *, sequence_length: int = 10, rng_seed: int = 0,
              sampler: Sampler | None = None, probe: Probe | None = None,
              tool_names: Sequence[str] = (), mix: Mapping[str, float] | None = None,
              spec_of: Callable[[str], TaskSpec] | None = None,
              weights: Mapping[str, float] | None = None) -> EnvCheckReport:
    """Run every check over ``task_ids`` x ``seeds``; raise the first ``EnvCheckError``.

    sampler: ``(rng, task_id) -> action`` of the env's own; probe: ``task_id -> state-changing
    action or None``; tool_names: the env's tools (for malformed calls); mix: source weights
    (``check_actions.DEFAULT_MIX`` keys). Without a sampler, an env exposing a terminal
    ``task_spec`` (or given ``spec_of``) gets the terminal random actions (``weights`` are
    theirs) and the ``write_file`` probe. Sequences come from ``random.Random(rng_seed)``, so a
    failure reproduces.
    """
    if not task_ids or not seeds:
        raise CheckOptionError("check_env needs at least one task id and one seed")
    if sampler is None:
        legacy = _legacy_parts(env_factory, task_ids, seeds, spec_of, weights)
        if legacy is not None:
            sampler, legacy_probe, legacy_tools = legacy
            probe, tool_names = probe or legacy_probe, tool_names or legacy_tools
    elif weights is not None:
        raise CheckOptionError("weights apply to the terminal actions; with a sampler, "
                               "weigh the sources with mix=")
    actions = ActionMix(sampler, tool_names, mix)
    rng = random.Random(rng_seed)
    counts = dict.fromkeys(("resets", "sequences", "replays", "forks", "steps", "invalid"), 0)
    missing = list(actions.missing)
    notes = ["no action sampler: sequences hold only garbage, malformed calls and finish"
             ] if sampler is None else []
    with _reported(task_ids[0], seeds[0], "fork"):
        forks_ok = fork_supported(env_factory, task_ids[0], seeds[0])
    if not forks_ok:
        missing.append("fork")
        notes.append("fork raised NotImplementedError: no fork isolation checks, replays "
                     "restore in place only")
    for task_id in task_ids:
        task_probe = _task_probe(env_factory, task_id, seeds[0], sampler, probe, rng) \
            if forks_ok else None
        if forks_ok and task_probe is None:
            missing.append("fork_probe")
            notes.append(f"task {task_id!r}: no state-changing action (no fork_probe, none "
                         "found by the sampler): no fork isolation check")
        for seed in seeds:
            _check_one(env_factory, task_id, seed, actions, rng, counts, n_random_sequences,
                       sequence_length, forks_ok, task_probe)
    c = actions.counts
    return EnvCheckReport(counts["resets"], counts["sequences"], counts["replays"],
                          counts["forks"], counts["steps"], counts["invalid"], 0,
                          c["sampler"], c["garbage"], c["malformed"], c["finish"],
                          tuple(dict.fromkeys(missing)), tuple(notes))


def _task_probe(env_factory: EnvFactory, task_id: str, seed: int, sampler: Sampler | None,
                probe: Probe | None, rng: random.Random) -> ActionLike | None:
    """The declared probe of ``task_id``; when there is none (no ``probe``, or it answers
    ``None`` for this task, e.g. the ``write_file`` probe on a task without that tool), a
    state-changing action of the env's own sampler (``find_probe``), so a state-changing action
    is found whenever the sampler draws one."""
    with _reported(task_id, seed, "fork probe"):
        declared = probe(task_id) if probe is not None else None
        if declared is not None:
            return declared
        if sampler is not None:
            return find_probe(env_factory, task_id, seed, sampler, rng, tries=PROBE_TRIES)
    return None


def _check_one(env_factory: EnvFactory, task_id: str, seed: int, actions: ActionMix,
               rng: random.Random, counts: dict[str, int], n_sequences: int, length: int,
               forks_ok: bool, probe: ActionLike | None) -> None:
    with _reported(task_id, seed, "check_reset"):
        check_reset(env_factory, task_id, seed, actions.sequence(rng, task_id, 1)[0])
    counts["resets"] += 1
    for _ in range(n_sequences):
        sequence = actions.sequence(rng, task_id, length)
        with _reported(task_id, seed, "check_steps"):
            check_steps(env_factory, task_id, seed, sequence)
        with _reported(task_id, seed, "replay_property"):
            counts["steps"] += replay_property(env_factory, task_id, seed, sequence,
                                               rng.randrange(length), fork=forks_ok)
        counts["sequences"] += 1
        counts["replays"] += 1
    with _reported(task_id, seed, "check_invalid_actions"):
        check_invalid_actions(env_factory, task_id, seed, actions.sequence(rng, task_id, 2),
                              [garbage_text(rng), garbage_text(rng), ""])
    counts["invalid"] += 1
    if forks_ok and probe is not None:
        with _reported(task_id, seed, "check_fork_isolation"):
            check_fork_isolation(env_factory, task_id, seed, actions.sequence(rng, task_id, 3),
                                 probe)
        counts["forks"] += 1


# --------------------------------------------------------------------------- packages
def check_package(package: EnvPackage, task_ids: Sequence[str] | None = None,
                  seeds: Sequence[int] = (0, 1), n_random_sequences: int = 3, *,
                  sequence_length: int = 10, rng_seed: int = 0,
                  mix: Mapping[str, float] | None = None,
                  expert_max_steps: int = 64) -> EnvCheckReport:
    """``check_env`` with the package's env, sampler, probe and tools, plus package checks.

    task_ids default to the first two train and the first held-out task of a small request.
    Package checks per task: ``make_env().env_version`` is the package's
    (``EnvVersionMismatchError``); with a scripted ``expert``, the verifier scores the expert's
    final state 1.0 and the untouched reset state below 1.0 (``VerifierCheckError``).
    """
    from closedloop.contracts.package import TaskSetRequest

    if task_ids is None:
        sets = package.task_sets(TaskSetRequest(2, 1, 0))
        task_ids = [*sets.train[:2], *sets.heldout[:1]]
    env = package.make_env()
    if getattr(env, "env_version", None) != package.env_version:
        raise EnvVersionMismatchError(f"package {package.env_id!r}: make_env() has env_version "
                                      f"{getattr(env, 'env_version', None)!r}, the package says "
                                      f"{package.env_version!r}")
    report = check_env(package.make_env, task_ids, seeds, n_random_sequences,
                       sequence_length=sequence_length, rng_seed=rng_seed,
                       sampler=package.action_sampler, probe=package.fork_probe,
                       tool_names=package.tool_names, mix=mix)
    checks = 1
    if "expert" in package.scripted:
        for task_id in task_ids:
            with _reported(task_id, seeds[0], "verifier check"):
                _check_expert(package, task_id, seeds[0], expert_max_steps)
            checks += 1
    missing = report.missing + (() if "expert" in package.scripted else ("scripted.expert",))
    notes = report.notes + (() if "expert" in package.scripted else (
        "no scripted expert: the verifier's acceptance of a solution was not checked",))
    return EnvCheckReport(**{**report.to_dict(), "package_checks": checks,
                             "missing": missing, "notes": notes})


def _check_expert(package: EnvPackage, task_id: str, seed: int, max_steps: int) -> None:
    verifier = package.verifier()
    env = package.make_env()
    env.reset(task_id, seed)
    initial = verifier.score_or_quarantine(task_id, env.export_state())
    if initial.success is not None and initial.success >= 1.0:
        raise VerifierCheckError(f"{location(task_id, seed, 0)}: the verifier accepts the "
                                 "untouched reset state")
    observation = env.reset(task_id, seed)
    policy = package.scripted_policy("expert", task_id, seed)
    for step in range(max_steps):  # noqa: B007 - ``step`` names the step in the message
        t = env.step(policy.act(observation))
        observation = t.observation
        if t.done:
            break
    else:
        raise VerifierCheckError(f"{location(task_id, seed, max_steps)}: the scripted expert "
                                 f"did not end the episode in {max_steps} steps")
    final = verifier.score_or_quarantine(task_id, env.export_state())
    if final.success != 1.0:
        raise VerifierCheckError(f"{location(task_id, seed, step + 1)}: the verifier scored the "
                                 f"expert's final state {final.success} "
                                 f"({final.quarantine_reason or final.grade_reason})")
