"""``check_env``: the environment contract checker (seeded reset determinism, step determinism,
snapshot -> restore -> replay equality, fork isolation), and its reusable pieces.

Every failure raises a subclass of ``EnvCheckError`` whose message names the task, the seed and
the step. ``replay_property`` is the single-sequence property the test suite runs over many
random action sequences; ``random_actions`` generates those sequences from a public task spec.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from closedloop.contracts import Action, SnapshotRef, Transition
from closedloop.envs.errors import (
    EnvCheckError,
    ForkIsolationError,
    ReplayMismatchError,
    ResetNondeterminismError,
    StepNondeterminismError,
)
from closedloop.envs.task import TaskSpec

ActionLike = Action | str


class CheckableEnv(Protocol):
    """What ``check_env`` needs: an ``AgentEnv`` whose ``fork`` returns the same kind."""

    def reset(self, task_id: str, seed: int) -> str: ...  # noqa: D102
    def step(self, action: Action | str) -> Transition: ...  # noqa: D102
    def export_state(self) -> bytes: ...  # noqa: D102
    def state_hash(self) -> str: ...  # noqa: D102
    def snapshot(self, label: str) -> SnapshotRef: ...  # noqa: D102
    def restore(self, snapshot: SnapshotRef) -> None: ...  # noqa: D102
    def fork(self, snapshot: SnapshotRef, branch_id: str) -> Any: ...  # noqa: D102


EnvFactory = Callable[[], CheckableEnv]

DEFAULT_WEIGHTS: Mapping[str, float] = {
    "read_file": 2.0, "list_dir": 1.0, "write_file": 2.0, "replace": 2.0, "run": 1.0,
    "invalid": 2.0, "unknown_tool": 0.5, "finish": 0.3,
}
_GARBAGE = ("", "hello", "<tool_call>", "<tool_call>{</tool_call>", "<tool_call>[]</tool_call>",
            '<tool_call>{"name": 5}</tool_call>', '<tool_call>{"name": "read_file", '
            '"arguments": []}</tool_call>', "<tool_call>{}</tool_call><tool_call>{}</tool_call>",
            '<tool_call>{"name": "finish"}</tool_call> trailing', "</tool_call>",
            '<tool_call>{"name": "Read-File"}</tool_call>', "{\"name\": \"finish\"}")
_BAD_PATHS = ("../escape.txt", "/etc/passwd", ".grader/answer.json", ".closedloop/x", "a//b",
              "", "dir/../../x", "no_such_file.txt")


def random_actions(rng: random.Random, spec: TaskSpec, n: int,
                   weights: Mapping[str, float] | None = None) -> list[ActionLike]:
    """Return ``n`` random actions for ``spec``: valid tool calls, bad calls, garbage text, finish.

    Tool calls come as ``Action`` or as their canonical text (so parsing is exercised). ``run``
    is drawn only if the task allows it and has commands; ``weights`` overrides the mix (keys of
    ``DEFAULT_WEIGHTS``; weight 0 removes a kind).
    """
    mix = dict(DEFAULT_WEIGHTS, **(weights or {}))
    if "run" not in spec.allowed_tools or not spec.commands:
        mix["run"] = 0.0
    kinds = [k for k, w in mix.items() if w > 0]
    probs = [mix[k] for k in kinds]
    out: list[ActionLike] = []
    for i in range(n):
        action = _one_action(rng, spec, rng.choices(kinds, probs)[0], i)
        out.append(action.canonical_text() if isinstance(action, Action) and
                   rng.random() < 0.3 else action)
    return out


def _pick_path(rng: random.Random, spec: TaskSpec) -> str:
    files = sorted(spec.initial_files)
    if files and rng.random() < 0.7:
        return rng.choice(files)
    return rng.choice(_BAD_PATHS)


def _one_action(rng: random.Random, spec: TaskSpec, kind: str, i: int) -> ActionLike:
    if kind == "invalid":
        text = rng.choice(_GARBAGE)
        return text + "".join(rng.choice("<>{}\":x ") for _ in range(rng.randrange(4)))
    if kind == "finish":
        return Action.finish() if rng.random() < 0.8 else Action.abstain()
    if kind == "unknown_tool":
        return Action.tool("delete_everything", path=_pick_path(rng, spec))
    if kind == "list_dir":
        return Action.tool("list_dir", path=rng.choice([".", "sub", "..", ".grader", "."]))
    if kind == "read_file":
        return Action.tool("read_file", path=_pick_path(rng, spec))
    if kind == "write_file":
        path = _pick_path(rng, spec) if rng.random() < 0.6 else f"notes/n{rng.randrange(5)}.txt"
        return Action.tool("write_file", path=path, content=f"v{i}-{rng.randrange(1000)}\n")
    if kind == "replace":
        return _random_replace(rng, spec)
    names = sorted(spec.commands)
    command = rng.choice(names) if rng.random() < 0.9 else "not_a_command"
    args = [] if rng.random() < 0.7 else [rng.choice(["x", "--verbose", "../up", "a=b"])]
    return Action.tool("run", command=command, args=args)


def _random_replace(rng: random.Random, spec: TaskSpec) -> ActionLike:
    files = sorted(p for p, t in spec.initial_files.items() if t)
    if not files:
        return Action.tool("replace", path="missing.txt", old="a", new="b")
    path = rng.choice(files)
    text = spec.initial_files[path]
    start = rng.randrange(len(text))
    old = text[start:start + rng.randint(1, 8)]
    return Action.tool("replace", path=path, old=old, new=f"<{rng.randrange(100)}>",
                       count=rng.choice([1, 1, 1, 2]))


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
                    actions: Sequence[ActionLike], snapshot_at: int | None = None) -> int:
    """Check restore(S_k) + replay(a_k..) reproduces the episode; return the steps played.

    Plays ``actions`` from ``reset(task_id, seed)`` (stopping at ``done``) with a snapshot before
    every step, then for k = ``snapshot_at`` (clamped; default: the middle) restores S_k in the
    same env and in a fork and replays the suffix: observations, state hashes, errors,
    terminations and the exported final state must be identical. Raises
    ``ReplayMismatchError`` (``ForkIsolationError`` if the fork does not start at S_k).
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
    for how in ("restore", "fork"):
        if how == "restore":
            env.restore(ref)
            target: CheckableEnv = env
        else:
            target = env.fork(ref, f"replay-{k}")
        if target.state_hash() != ref.state_hash:
            error = ReplayMismatchError if how == "restore" else ForkIsolationError
            raise error(f"{_where(task_id, seed, k)}: {how} gave state hash "
                        f"{target.state_hash()} != snapshot {ref.state_hash}")
        again = _play(target, suffix, snapshot_every=False)
        _compare(first.transitions[k:], again.transitions, k, task_id, seed,
                 ReplayMismatchError, f"replay after {how}")
        if again.final_export != first.final_export or again.final_hash != first.final_hash:
            raise ReplayMismatchError(f"{_where(task_id, seed, played)}: replay after {how}: "
                                      "exported final state differs")
    return played


def check_reset(env_factory: EnvFactory, task_id: str, seed: int) -> None:
    """Two fresh envs and a second reset give the same observation, hash and exported state."""
    a, b = env_factory(), env_factory()
    results = [(a.reset(task_id, seed), a.state_hash(), a.export_state()),
               (b.reset(task_id, seed), b.state_hash(), b.export_state())]
    a.step(Action.tool("list_dir"))
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


def check_fork_isolation(env_factory: EnvFactory, task_id: str, seed: int,
                         prefix: Sequence[ActionLike], probe: Action) -> None:
    """Forks of one snapshot start equal (branch_id leaves the RNG alone) and stay isolated.

    ``probe`` is a state-changing action (e.g. a ``write_file``) run in fork A only; fork B, the
    parent and a fresh restore of the snapshot must keep their state hash and exported bytes.
    """
    env = env_factory()
    env.reset(task_id, seed)
    played = _play(env, prefix, snapshot_every=False)
    if played.transitions and played.transitions[-1].done:
        env.reset(task_id, seed)
    at = 0 if played.transitions and played.transitions[-1].done else len(played.transitions)
    ref = env.snapshot("fork-check")
    parent_bytes = env.export_state()
    fa, fb = env.fork(ref, "a"), env.fork(ref, "b")
    where = _where(task_id, seed, at)
    if not fa.state_hash() == fb.state_hash() == ref.state_hash:
        raise ForkIsolationError(f"{where}: forks do not start at the snapshot's state "
                                 "(branch_id altered the state or RNG)")
    fa.step(probe)
    if fa.state_hash() == ref.state_hash:
        raise ForkIsolationError(f"{where}: the probe action did not change fork A's state")
    checks = [("fork B", fb), ("the parent", env)]
    for name, other in checks:
        if other.state_hash() != ref.state_hash or other.export_state() != parent_bytes:
            raise ForkIsolationError(f"{where}: a write in fork A reached {name}")
    fresh = env.fork(ref, "c")
    if fresh.state_hash() != ref.state_hash or fresh.export_state() != parent_bytes:
        raise ForkIsolationError(f"{where}: a write in fork A changed the snapshot")
    tb = fb.step(probe)
    tc = fresh.step(probe)
    if _key(tb) != _key(tc):
        raise ForkIsolationError(f"{where}: the same action in two forks diverged")


@dataclass(frozen=True)
class EnvCheckReport:
    """What ``check_env`` exercised: resets, step sequences, replays, fork checks, steps."""

    resets: int
    sequences: int
    replays: int
    fork_checks: int
    steps: int


def check_env(env_factory: EnvFactory, task_ids: Sequence[str], seeds: Sequence[int],
              n_random_sequences: int = 4, *, sequence_length: int = 10, rng_seed: int = 0,
              spec_of: Callable[[str], TaskSpec] | None = None,
              weights: Mapping[str, float] | None = None) -> EnvCheckReport:
    """Run every check over ``task_ids`` x ``seeds``; raise the first ``EnvCheckError``.

    ``spec_of`` gives the public spec for random actions (default: the env's ``task_spec``
    after a reset). Sequences come from ``random.Random(rng_seed)``, so a failure reproduces.
    """
    rng = random.Random(rng_seed)
    resets = sequences = replays = forks = steps = 0
    for task_id in task_ids:
        spec = _spec(env_factory, task_id, seeds, spec_of)
        probe = _probe(spec)
        for seed in seeds:
            check_reset(env_factory, task_id, seed)
            resets += 1
            for _ in range(n_random_sequences):
                actions = random_actions(rng, spec, sequence_length, weights)
                check_steps(env_factory, task_id, seed, actions)
                steps += replay_property(env_factory, task_id, seed, actions,
                                         rng.randrange(sequence_length))
                sequences += 1
                replays += 1
            if probe is not None:
                check_fork_isolation(env_factory, task_id, seed,
                                     random_actions(rng, spec, 3, weights), probe)
                forks += 1
    return EnvCheckReport(resets, sequences, replays, forks, steps)


def _spec(env_factory: EnvFactory, task_id: str, seeds: Sequence[int],
          spec_of: Callable[[str], TaskSpec] | None) -> TaskSpec:
    if spec_of is not None:
        return spec_of(task_id)
    env = env_factory()
    env.reset(task_id, seeds[0] if seeds else 0)
    spec = getattr(env, "task_spec", None)
    if not isinstance(spec, TaskSpec):
        raise EnvCheckError(f"task {task_id!r}: pass spec_of; the env has no task_spec")
    return spec


def _probe(spec: TaskSpec) -> Action | None:
    if "write_file" in spec.allowed_tools:
        return Action.tool("write_file", path="fork_probe.txt", content="written in a fork\n")
    return None
