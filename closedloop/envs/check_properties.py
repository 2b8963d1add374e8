"""The environment checks ``check_env`` runs, one property each, for any ``AgentEnv``.

Each takes an env factory, a task id, a seed and the actions to play (``closedloop.envs.
check_actions``), and raises a subclass of ``EnvCheckError`` whose message names the task, the
seed and the step:

- reset determinism (``check_reset``): two fresh envs and a reset after a step agree on the
  observation, state hash and exported state;
- step determinism (``check_steps``): one action sequence in two fresh envs gives identical
  transitions and exported states;
- snapshot -> restore -> replay (``replay_property``): restoring S_k in place and in a fork and
  replaying the suffix reproduces the episode (this is what catches an RNG left out of the
  snapshot and a restore that does not roll the state back);
- unparsable text (``check_invalid_actions``): it is reported as an error, and two different
  unparsable texts from one state lead to one state (its effect does not depend on the text);
- fork isolation (``check_fork_isolation``) with a state-changing probe action: forks start at
  the snapshot, and a step in one fork reaches neither a sibling, the parent, nor the stored
  snapshot. ``find_probe`` looks for such an action among the sampler's, and
  ``fork_supported`` says whether the env forks at all.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from closedloop.contracts import Action, SnapshotRef, Transition
from closedloop.envs.check_actions import ActionLike, Sampler
from closedloop.errors import (
    EnvCheckError,
    ForkIsolationError,
    InvalidActionEffectError,
    ProbeNoEffectError,
    ReplayMismatchError,
    ResetNondeterminismError,
    RestoreMismatchError,
    StepNondeterminismError,
)

__all__ = ["EnvFactory", "check_fork_isolation", "check_invalid_actions", "check_reset",
           "check_steps", "find_probe", "fork_supported", "location", "replay_property", "short"]


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


def location(task_id: str, seed: int, step: int) -> str:
    """The place a check failed, as its message names it: ``task 'x' seed 0 step 3``."""
    return f"task {task_id!r} seed {seed} step {step}"


def _compare(a: Sequence[Transition], b: Sequence[Transition], offset: int, task_id: str,
             seed: int, error: type[EnvCheckError], what: str) -> None:
    if len(a) != len(b):
        raise error(f"{location(task_id, seed, offset + min(len(a), len(b)))}: {what}: "
                    f"{len(a)} vs {len(b)} transitions")
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if _key(x) != _key(y):
            field = next(n for n, u, v in zip(("observation", "done", "state_version",
                                               "step_index", "termination", "error"),
                                              _key(x), _key(y), strict=True) if u != v)
            raise error(f"{location(task_id, seed, offset + i)}: {what}: {field} differs "
                        f"({short(getattr(x, field))} vs {short(getattr(y, field))})")


def short(value: object) -> str:
    """``repr(value)``, cut to 120 characters (then ``...``), for a check's message."""
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
            raise error(f"{location(task_id, seed, k)}: {how} gave state hash "
                        f"{target.state_hash()} != snapshot {ref.state_hash}")
        try:
            again = _play(target, suffix, snapshot_every=False)
        except Exception as exc:  # the recorded suffix ran before: raising now is a mismatch
            raise ReplayMismatchError(f"{location(task_id, seed, k)}: replay after {how}: the env "
                                      f"raised {type(exc).__name__}: {short(str(exc))}"
                                      ) from exc
        _compare(first.transitions[k:], again.transitions, k, task_id, seed,
                 ReplayMismatchError, f"replay after {how}")
        if again.final_export != first.final_export or again.final_hash != first.final_hash:
            raise ReplayMismatchError(f"{location(task_id, seed, played)}: replay after {how}: "
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
            raise ResetNondeterminismError(f"{location(task_id, seed, 0)}: reset gave different "
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
        raise StepNondeterminismError(f"{location(task_id, seed, len(runs[0].transitions))}: "
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
            raise InvalidActionEffectError(f"{location(task_id, seed, at)}: the unparsable text "
                                           f"{short(text)} was not reported as an error")
        seen.append((text, (env.state_hash(), env.export_state(), t.done, t.termination)))
    for text, outcome in seen[1:]:
        if outcome != seen[0][1]:
            raise InvalidActionEffectError(
                f"{location(task_id, seed, at)}: the unparsable texts {short(seen[0][0])} and "
                f"{short(text)} led to different states (an invalid action had an effect "
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
    where = location(task_id, seed, at)
    if not fa.state_hash() == fb.state_hash() == ref.state_hash:
        raise ForkIsolationError(f"{where}: forks do not start at the snapshot's state "
                                 "(branch_id altered the state or RNG)")
    fa.step(probe)
    if fa.state_hash() == ref.state_hash:
        raise ProbeNoEffectError(f"{where}: the probe {short(probe)} did not change fork A's "
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


def fork_supported(env_factory: EnvFactory, task_id: str, seed: int) -> bool:
    """Whether ``fork`` of a snapshot after ``reset(task_id, seed)`` works (it does not raise
    ``NotImplementedError`` or ``AttributeError``)."""
    env = env_factory()
    env.reset(task_id, seed)
    ref = env.snapshot("fork-support")
    try:
        env.fork(ref, "support")
    except (NotImplementedError, AttributeError):
        return False
    return True
