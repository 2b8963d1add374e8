"""``check_env``: the environment contract checker, for any ``AgentEnv``, and its pieces.

For every task and seed it runs, with actions of the environment's own (its package's action
sampler) mixed with garbage text, malformed calls and ``finish``
(``closedloop.envs.check_actions``):

- reset determinism (``check_reset``): two fresh envs and a reset after a step agree on the
  observation, state hash and exported state;
- step determinism (``check_steps``): one action sequence in two fresh envs gives identical
  transitions and exported states;
- snapshot -> restore -> replay (``replay_property``): restoring S_k in place and in a fork and
  replaying the suffix reproduces the episode (this is what catches an RNG left out of the
  snapshot and a restore that does not roll the state back);
- unparsable text (``check_invalid_actions``): it is reported as an error, and two different
  unparsable texts from one state lead to one state (its effect does not depend on the text);
- fork isolation (``check_fork_isolation``) with a state-changing probe action of the env's own:
  the package's ``fork_probe``, else a sampler action found to change the state more than an
  unparsable text does; forks start at the snapshot, and a step in one fork reaches neither a
  sibling, the parent, nor the stored snapshot.

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
from typing import TYPE_CHECKING, Any, Protocol

from closedloop.contracts import Action, SnapshotRef, Transition
from closedloop.envs.check_actions import (
    DEFAULT_WEIGHTS,
    ActionLike,
    ActionMix,
    Sampler,
    garbage_text,
    random_actions,
)
from closedloop.envs.task import TaskSpec
from closedloop.errors import (
    CheckOptionError,
    EnvCheckError,
    EnvRaisedError,
    EnvVersionMismatchError,
    ForkIsolationError,
    InvalidActionEffectError,
    ProbeNoEffectError,
    ReplayMismatchError,
    ResetNondeterminismError,
    RestoreMismatchError,
    StepNondeterminismError,
    VerifierCheckError,
)

if TYPE_CHECKING:
    from closedloop.envs.plugin import EnvPackage

__all__ = ["DEFAULT_WEIGHTS", "CheckOptionError", "EnvCheckReport", "check_env",
           "check_fork_isolation", "check_invalid_actions", "check_package", "check_reset",
           "check_steps", "find_probe", "random_actions", "replay_property"]

Probe = Callable[[str], ActionLike | None]


class CheckableEnv(Protocol):
    """What ``check_env`` needs: an ``AgentEnv`` whose ``fork`` returns the same kind."""

    env_version: str

    def reset(self, task_id: str, seed: int) -> str: ...
    def step(self, action: Action | str) -> Transition: ...
    def export_state(self) -> bytes: ...
    def state_hash(self) -> str: ...
    def snapshot(self, label: str) -> SnapshotRef: ...
    def restore(self, snapshot: SnapshotRef) -> None: ...
    def fork(self, snapshot: SnapshotRef, branch_id: str) -> Any: ...


EnvFactory = Callable[[], CheckableEnv]


def _key(t: Transition) -> tuple[Any, ...]:
    return (t.observation, t.done, t.state_version, t.step_index, t.termination, t.error)


@dataclass(frozen=True)
class _Run:
    transitions: tuple[Transition, ...]
    snapshots: tuple[SnapshotRef, ...]
    final_export: bytes
    final_hash: str


def _play(env: CheckableEnv, actions: Sequence[ActionLike], snapshot_every: bool) -> _Run:
    transitions: list[Transition] = []
    refs: list[SnapshotRef] = []
    for i, action in enumerate(actions):
        if snapshot_every:
            refs.append(env.snapshot(f"t{i}"))
        transitions.append(env.step(action))
        if transitions[-1].done:
            break
    return _Run(tuple(transitions), tuple(refs), env.export_state(), env.state_hash())


def _where(task_id: str, seed: int, step: int) -> str:
    return f"task {task_id!r} seed {seed} step {step}"


def _compare(a: Sequence[Transition], b: Sequence[Transition], offset: int, task_id: str,
             seed: int, error: type[EnvCheckError], what: str) -> None:
    if len(a) != len(b):
        raise error(f"{_where(task_id, seed, offset + min(len(a), len(b)))}: {what}: "
                    f"{len(a)} vs {len(b)} transitions")
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if _key(x) != _key(y):
            field = next(n for n, u, v in zip(("observation", "done", "state_version",
                                               "step_index", "termination", "error"),
                                              _key(x), _key(y), strict=True) if u != v)
            raise error(f"{_where(task_id, seed, offset + i)}: {what}: {field} differs "
                        f"({_short(getattr(x, field))} vs {_short(getattr(y, field))})")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:120] + "..."


def replay_property(env_factory: EnvFactory, task_id: str, seed: int,
                    actions: Sequence[ActionLike], snapshot_at: int | None = None, *,
                    fork: bool = True) -> int:
    """Check restore(S_k) + replay(a_k..) reproduces the episode; return the steps played.

    Plays ``actions`` from ``reset(task_id, seed)`` (stopping at ``done``) with a snapshot before
    every step, then for k = ``snapshot_at`` (clamped; default: the middle) restores S_k in the
    same env and (``fork=True``) in a fork and replays the suffix: observations, state hashes,
    errors, terminations and the exported final state must be identical. Raises
    ``RestoreMismatchError`` when the restored hash is not the snapshot's, ``ForkIsolationError``
    when the fork's is not, ``ReplayMismatchError`` when the replay differs or raises.
    """
    env = env_factory()
    env.reset(task_id, seed)
    first = _play(env, actions, snapshot_every=True)
    played = len(first.transitions)
    if played == 0:
        return 0
    k = played // 2 if snapshot_at is None else max(0, min(snapshot_at, played - 1))
    ref = first.snapshots[k]
    suffix = actions[k:played]
    for how in ("restore", "fork") if fork else ("restore",):
        if how == "restore":
            env.restore(ref)
            target: CheckableEnv = env
        else:
            target = env.fork(ref, f"replay-{k}")
        if target.state_hash() != ref.state_hash:
            error = RestoreMismatchError if how == "restore" else ForkIsolationError
            raise error(f"{_where(task_id, seed, k)}: {how} gave state hash "
                        f"{target.state_hash()} != snapshot {ref.state_hash}")
        try:
            again = _play(target, suffix, snapshot_every=False)
        except Exception as exc:  # the recorded suffix ran before: raising now is a mismatch
            raise ReplayMismatchError(f"{_where(task_id, seed, k)}: replay after {how}: the env "
                                      f"raised {type(exc).__name__}: {_short(str(exc))}"
                                      ) from exc
        _compare(first.transitions[k:], again.transitions, k, task_id, seed,
                 ReplayMismatchError, f"replay after {how}")
        if again.final_export != first.final_export or again.final_hash != first.final_hash:
            raise ReplayMismatchError(f"{_where(task_id, seed, played)}: replay after {how}: "
                                      "exported final state differs")
    return played


def check_reset(env_factory: EnvFactory, task_id: str, seed: int,
                step_action: ActionLike = "") -> None:
    """Two fresh envs and a second reset (after ``step_action``, by default an unparsable
    text) give the same observation, hash and exported state."""
    a, b = env_factory(), env_factory()
    results = [(a.reset(task_id, seed), a.state_hash(), a.export_state()),
               (b.reset(task_id, seed), b.state_hash(), b.export_state())]
    a.step(step_action)
    results.append((a.reset(task_id, seed), a.state_hash(), a.export_state()))
    for i, what in enumerate(("observation", "state hash", "exported state")):
        if len({r[i] for r in results}) != 1:
            raise ResetNondeterminismError(f"{_where(task_id, seed, 0)}: reset gave different "
                                           f"{what}s")


def check_steps(env_factory: EnvFactory, task_id: str, seed: int,
                actions: Sequence[ActionLike]) -> None:
    """The same actions from the same reset in two fresh envs give identical transitions."""
    runs = []
    for _ in range(2):
        env = env_factory()
        env.reset(task_id, seed)
        runs.append(_play(env, actions, snapshot_every=False))
    _compare(runs[0].transitions, runs[1].transitions, 0, task_id, seed,
             StepNondeterminismError, "two fresh envs")
    if runs[0].final_export != runs[1].final_export:
        raise StepNondeterminismError(f"{_where(task_id, seed, len(runs[0].transitions))}: "
                                      "exported final states differ")


def _at_prefix(env_factory: EnvFactory, task_id: str, seed: int,
               prefix: Sequence[ActionLike]) -> tuple[CheckableEnv, int]:
    """A fresh env after ``prefix`` (reset again if the prefix ended the episode); the step."""
    env = env_factory()
    env.reset(task_id, seed)
    played = _play(env, prefix, snapshot_every=False)
    if played.transitions and played.transitions[-1].done:
        env.reset(task_id, seed)
        return env, 0
    return env, len(played.transitions)


def check_invalid_actions(env_factory: EnvFactory, task_id: str, seed: int,
                          prefix: Sequence[ActionLike], texts: Sequence[str]) -> None:
    """From the state after ``prefix``, each unparsable text in ``texts`` must return an error
    and lead to the same state, done flag and termination (``InvalidActionEffectError``)."""
    env, at = _at_prefix(env_factory, task_id, seed, prefix)
    ref = env.snapshot("invalid-check")
    seen: list[tuple[str, tuple[Any, ...]]] = []
    for text in texts:
        env.restore(ref)
        t = env.step(text)
        if t.error is None:
            raise InvalidActionEffectError(f"{_where(task_id, seed, at)}: the unparsable text "
                                           f"{_short(text)} was not reported as an error")
        seen.append((text, (env.state_hash(), env.export_state(), t.done, t.termination)))
    for text, outcome in seen[1:]:
        if outcome != seen[0][1]:
            raise InvalidActionEffectError(
                f"{_where(task_id, seed, at)}: the unparsable texts {_short(seen[0][0])} and "
                f"{_short(text)} led to different states (an invalid action had an effect "
                "that depends on its text)")


def check_fork_isolation(env_factory: EnvFactory, task_id: str, seed: int,
                         prefix: Sequence[ActionLike], probe: ActionLike) -> None:
    """Forks of one snapshot start equal (branch_id leaves the RNG alone) and stay isolated.

    ``probe`` is a state-changing action run in fork A only (``ProbeNoEffectError`` if it
    changes nothing); fork B, the parent and a fresh fork of the snapshot must keep their
    state hash and exported bytes, and the probe in B and in the fresh fork must agree.
    """
    env, at = _at_prefix(env_factory, task_id, seed, prefix)
    ref = env.snapshot("fork-check")
    parent_bytes = env.export_state()
    fa, fb = env.fork(ref, "a"), env.fork(ref, "b")
    where = _where(task_id, seed, at)
    if not fa.state_hash() == fb.state_hash() == ref.state_hash:
        raise ForkIsolationError(f"{where}: forks do not start at the snapshot's state "
                                 "(branch_id altered the state or RNG)")
    fa.step(probe)
    if fa.state_hash() == ref.state_hash:
        raise ProbeNoEffectError(f"{where}: the probe {_short(probe)} did not change fork A's "
                                 "state")
    for name, other in (("fork B", fb), ("the parent", env)):
        if other.state_hash() != ref.state_hash or other.export_state() != parent_bytes:
            raise ForkIsolationError(f"{where}: a step in fork A reached {name}")
    fresh = env.fork(ref, "c")
    if fresh.state_hash() != ref.state_hash or fresh.export_state() != parent_bytes:
        raise ForkIsolationError(f"{where}: a step in fork A changed the stored snapshot")
    tb = fb.step(probe)
    tc = fresh.step(probe)
    if _key(tb) != _key(tc):
        raise ForkIsolationError(f"{where}: the same action in two forks diverged")


def find_probe(env_factory: EnvFactory, task_id: str, seed: int, sampler: Sampler,
               rng: random.Random, tries: int = 24) -> ActionLike | None:
    """A sampler action that, from the reset state, changes the state more than an unparsable
    text does (so it is a real state change, not a step counter); ``None`` if none is found."""
    env = env_factory()
    env.reset(task_id, seed)
    ref = env.snapshot("probe-search")
    env.step("")
    counters_only = env.export_state()
    for _ in range(tries):
        action = sampler(rng, task_id)
        env.restore(ref)
        t = env.step(action)
        if not t.done and env.export_state() != counters_only and \
                env.state_hash() != ref.state_hash:
            return action
    return None


def _fork_supported(env_factory: EnvFactory, task_id: str, seed: int) -> bool:
    env = env_factory()
    env.reset(task_id, seed)
    ref = env.snapshot("fork-support")
    try:
        env.fork(ref, "support")
    except (NotImplementedError, AttributeError):
        return False
    return True


@contextmanager
def _reported(task_id: str, seed: int, check: str) -> Iterator[None]:
    """Let check failures through; turn any other exception into ``EnvRaisedError``."""
    try:
        yield
    except (EnvCheckError, CheckOptionError):
        raise
    except Exception as exc:
        raise EnvRaisedError(f"task {task_id!r} seed {seed} step ?: {check}: the env raised "
                             f"{type(exc).__name__}: {_short(str(exc))}") from exc


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
        forks_ok = _fork_supported(env_factory, task_ids[0], seeds[0])
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
    with _reported(task_id, seed, "fork probe"):
        if probe is not None:
            return probe(task_id)
        if sampler is not None:
            return find_probe(env_factory, task_id, seed, sampler, rng)
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
    from closedloop.envs.plugin import TaskSetRequest

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
        raise VerifierCheckError(f"{_where(task_id, seed, 0)}: the verifier accepts the "
                                 "untouched reset state")
    observation = env.reset(task_id, seed)
    policy = package.scripted_policy("expert", task_id, seed)
    for step in range(max_steps):  # noqa: B007 - ``step`` names the step in the message
        t = env.step(policy.act(observation))
        observation = t.observation
        if t.done:
            break
    else:
        raise VerifierCheckError(f"{_where(task_id, seed, max_steps)}: the scripted expert "
                                 f"did not end the episode in {max_steps} steps")
    final = verifier.score_or_quarantine(task_id, env.export_state())
    if final.success != 1.0:
        raise VerifierCheckError(f"{_where(task_id, seed, step + 1)}: the verifier scored the "
                                 f"expert's final state {final.success} "
                                 f"({final.quarantine_reason or final.grade_reason})")
