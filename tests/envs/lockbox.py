"""A combination lock, written the way a user outside closedloop would write an environment.

Three dials (0-9) must be set to a hidden three-digit code and the episode ended with
``finish``. Tools: ``inspect(i)`` tells dial i's digit (with a random rattle drawn from the
env's own RNG, which is part of the state), ``set(i, v)`` turns dial i to v. Ten steps per
episode. The environment raises its own error type (``LockboxError``) for what a caller does
wrong, never for what a model writes.

``lockbox_package()`` is its ``EnvPackage``: task sets of two versioned families (content-hashed
ids), a verifier that reads only the exported state, tool schemas, an action sampler, a fork
probe, scripted expert / noisy / random policies and adjudicated fixtures. Tests register it by
its dotted path ``tests.envs.lockbox:lockbox_package``; nothing in ``closedloop`` knows it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from closedloop.contracts import (
    Action,
    ActionParseError,
    ScoreResult,
    SnapshotRef,
    Termination,
    Transition,
    canonical_json,
    content_hash,
    parse_action,
)
from closedloop.contracts.package import EnvPackage, EnvTaskSets, TaskInfo, TaskSetRequest
from closedloop.envs.discovery import EnvPackageError
from closedloop.envs.terminal.fixtures import AdjudicatedFixture
from closedloop.errors import EpisodeDoneError, EpisodeNotDoneError, SealedSnapshotError

ENV_ID = "lockbox-v1"
ENV_VERSION = "lockbox-env-v1"
VERIFIER_VERSION = "lockbox-verifier-v1"
BUDGET = 10
FAMILIES = {"lockbox-dials-v1": "train", "lockbox-mirror-v1": "heldout"}
_ID_RE = re.compile(r"^(?P<family>lockbox-[a-z]+-v1)/(?P<index>\d{3})-(?P<digest>[0-9a-f]{8})$")
SYSTEM_PROMPT = ("You open combination locks with tools. Set each dial to the code, then "
                 "finish.")
TOOLS: tuple[dict[str, Any], ...] = (
    {"name": "inspect", "description": "Tell the digit of dial i.",
     "parameters": {"i": "integer"}},
    {"name": "set", "description": "Turn dial i to digit v.",
     "parameters": {"i": "integer", "v": "integer"}},
    {"name": "finish", "description": "Declare the lock open."},
)


class LockboxError(Exception):
    """The lockbox's own error: unknown task, unknown snapshot, call before reset."""


# --------------------------------------------------------------------------- tasks
def code_of(family: str, index: int) -> tuple[int, int, int]:
    """The hidden code: digits 1-9 (the mirror family's are a palindrome)."""
    raw = hashlib.sha256(f"{family}/{index}".encode()).digest()
    a, b, c = (1 + raw[i] % 9 for i in range(3))
    return (a, b, a) if family == "lockbox-mirror-v1" else (a, b, c)


def task_id_of(family: str, index: int) -> str:
    """``family/NNN-hash8``, the hash over the family, index and code."""
    digest = content_hash([family, index, list(code_of(family, index))]).split(":", 1)[1][:8]
    return f"{family}/{index:03d}-{digest}"


def parse_task(task_id: str) -> tuple[str, int]:
    """(family, index) of a task id; ``LockboxError`` if it is not one of ours."""
    m = _ID_RE.match(task_id) if isinstance(task_id, str) else None
    if m is None or m["family"] not in FAMILIES or task_id_of(m["family"], int(m["index"])) \
            != task_id:
        raise LockboxError(f"not a lockbox task: {task_id!r}")
    return m["family"], int(m["index"])


def task_code(task_id: str) -> tuple[int, int, int]:
    """The code of a task (verifier and scripted expert only)."""
    return code_of(*parse_task(task_id))


# --------------------------------------------------------------------------- environment
def _rng_next(state: int) -> int:
    return (1103515245 * state + 12345) % 2**31


@dataclass
class _Store:
    entries: dict[str, tuple[SnapshotRef, dict[str, Any] | None, bytes | None]]


class LockboxEnv:
    """The lock (an ``AgentEnv`` and a ``SealingEnv``)."""

    env_version = ENV_VERSION

    def __init__(self, _store: _Store | None = None) -> None:
        self.state: dict[str, Any] | None = None
        self.store = _store or _Store({})
        self.head: str | None = None
        self.sealed: SnapshotRef | None = None

    # -- helpers -------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        if self.state is None:
            raise LockboxError("reset first")
        return self.state

    def rng_value(self, state: dict[str, Any]) -> int:
        """Draw from the state's RNG (advancing it)."""
        state["rng"] = _rng_next(state["rng"])
        return int(state["rng"] % 100)

    def _ref(self, state: dict[str, Any], label: str) -> SnapshotRef:
        digest = content_hash([self.head, self.state_hash(), label]).split(":", 1)[1]
        return SnapshotRef("lock-" + digest[:24], self.head, ENV_VERSION, self.state_hash(),
                           content_hash(state["rng"]), label)

    # -- AgentEnv ------------------------------------------------------------------------
    def reset(self, task_id: str, seed: int) -> str:
        """Dials at 0 0 0; the RNG seeded from (task, seed)."""
        family, _ = parse_task(task_id)
        rng0 = int(hashlib.sha256(f"{task_id}/{seed}".encode()).hexdigest()[:8], 16)
        self.state = {"task_id": task_id, "seed": seed, "dials": [0, 0, 0], "steps": 0,
                      "invalid": 0, "tool_errors": 0, "done": False, "termination": None,
                      "final_action": None, "rng": rng0}
        self.store, self.head, self.sealed = _Store({}), None, None
        return (f"Task: open the lock ({family}). Three dials, 0-9, now 0 0 0. Tools: "
                f"inspect(i), set(i, v), finish. Budget: {BUDGET} steps.")

    def step(self, action: Action | str) -> Transition:
        """One action; model text that does not parse is an error observation."""
        state = self._state()
        if state["done"]:
            raise EpisodeDoneError("the lock episode is over")
        state["steps"] += 1
        observation, error = self.apply(state, action)
        if not state["done"] and state["steps"] >= BUDGET:
            state["done"] = True
            state["termination"] = Termination.TASK_BUDGET_EXHAUSTED_TERMINAL.value
        if state["done"]:
            self._seal()
        term = Termination(state["termination"]) if state["termination"] else None
        return Transition(observation, state["done"], self.state_hash(), state["steps"], term,
                          error)

    def apply(self, state: dict[str, Any], action: Action | str) -> tuple[str, str | None]:
        """Apply one action to ``state``; return (observation, error code)."""
        if isinstance(action, str):
            try:
                action = parse_action(action)
            except ActionParseError as exc:
                state["invalid"] += 1
                return json.dumps({"error": "invalid_action", "reason": exc.reason}), \
                    "invalid_action"
        if action.kind != "tool":
            state.update(done=True, termination=Termination.AGENT_FINISH.value,
                         final_action=action.kind)
            return f"episode ended by {action.kind}", None
        return self.tool(state, action)

    def tool(self, state: dict[str, Any], action: Action) -> tuple[str, str | None]:
        """``inspect`` and ``set``."""
        args = action.args
        ok_i = isinstance(args.get("i"), int) and not isinstance(args.get("i"), bool) \
            and 0 <= args["i"] <= 2
        if action.name == "inspect" and ok_i and set(args) == {"i"}:
            digit = task_code(state["task_id"])[args["i"]]
            return f"dial {args['i']} clicks at {digit} (rattle {self.rng_value(state)})", None
        v = args.get("v")
        if action.name == "set" and ok_i and set(args) == {"i", "v"} and isinstance(v, int) \
                and not isinstance(v, bool) and 0 <= v <= 9:
            state["dials"][args["i"]] = v
            return f"dial {args['i']} set to {v}; dials {state['dials']}", None
        state["tool_errors"] += 1
        code = "bad_arguments" if action.name in ("inspect", "set") else "unknown_tool"
        return json.dumps({"error": code, "tool": action.name}), code

    def export_state(self) -> bytes:
        """Canonical JSON of the state."""
        return canonical_json(self._state()).encode()

    def state_hash(self) -> str:
        """Content hash of the state (dials, counters and RNG)."""
        return content_hash(self._state())

    def snapshot(self, label: str) -> SnapshotRef:
        """Store a deep copy of the state."""
        state = self._state()
        if state["done"]:
            raise EpisodeDoneError("the terminal state is sealed")
        ref = self._ref(state, label)
        self.store.entries.setdefault(ref.snapshot_id, (ref, copy.deepcopy(state), None))
        self.head = ref.snapshot_id
        return ref

    def stored(self, ref: SnapshotRef) -> dict[str, Any]:
        """The stored state of ``ref`` (not a copy)."""
        entry = self.store.entries.get(ref.snapshot_id)
        if entry is None or entry[0] != ref:
            raise LockboxError(f"unknown snapshot {ref.snapshot_id!r}")
        if entry[1] is None:
            raise SealedSnapshotError(f"{ref.snapshot_id} is a sealed terminal state")
        return entry[1]

    def restore(self, snapshot: SnapshotRef) -> None:
        """Back to a stored state (a copy of it)."""
        self.state = copy.deepcopy(self.stored(snapshot))
        self.head, self.sealed = snapshot.snapshot_id, None

    def fork(self, snapshot: SnapshotRef, branch_id: str) -> LockboxEnv:
        """An independent env at ``snapshot`` sharing the snapshot store."""
        child = type(self)(_store=self.store)
        child.restore(snapshot)
        return child

    # -- SealingEnv ----------------------------------------------------------------------
    def _seal(self) -> None:
        state = self._state()
        ref = self._ref(state, "terminal")
        self.store.entries.setdefault(ref.snapshot_id, (ref, None, self.export_state()))
        self.sealed = ref

    def sealed_terminal(self) -> SnapshotRef:
        """The sealed terminal snapshot."""
        if self.sealed is None:
            raise EpisodeNotDoneError("not ended")
        return self.sealed

    def export_sealed(self, ref: SnapshotRef) -> bytes:
        """The sealed bytes of ``ref``."""
        entry = self.store.entries.get(ref.snapshot_id)
        if entry is None or entry[2] is None or entry[0] != ref:
            raise LockboxError(f"{ref.snapshot_id} is not sealed here")
        return entry[2]


# --------------------------------------------------------------------------- verifier
@dataclass(frozen=True)
class LockboxVerifier:
    """Success when the exported dials equal the task's code and the episode ended by finish."""

    verifier_version: str = VERIFIER_VERSION

    def score_or_quarantine(self, task_id: str, final_state: bytes) -> ScoreResult:
        """Score exported bytes; a state of another task is tampering (unscored)."""
        try:
            state = json.loads(final_state)
            dials, steps = list(state["dials"]), float(state["steps"])
        except (ValueError, KeyError, TypeError) as exc:
            return ScoreResult.unscored(task_id, f"invalid_state: {exc}", self.verifier_version)
        if state.get("task_id") != task_id:
            return ScoreResult.unscored(task_id, f"tamper_detected: state of "
                                        f"{state.get('task_id')!r}", self.verifier_version)
        opened = tuple(dials) == task_code(task_id) and state.get("final_action") == "finish"
        return ScoreResult.of(task_id, 1.0 if opened else 0.0, self.verifier_version,
                              {"steps": steps, "invalid_actions": float(state["invalid"])},
                              "ok" if opened else "the lock stays shut")


# --------------------------------------------------------------------------- package
def task_sets(request: TaskSetRequest) -> EnvTaskSets:
    """Train from the dials family, held out from the mirror family (family ids versioned)."""
    if request.options:
        raise EnvPackageError(f"lockbox takes no options, got {sorted(request.options)}")
    if request.family_tasks:
        raise EnvPackageError("lockbox has no family-disjoint suite")
    rng = random.Random(f"lockbox/{request.seed}")
    train = tuple(task_id_of("lockbox-dials-v1", i)
                  for i in rng.sample(range(1000), request.train_tasks))
    heldout = tuple(task_id_of("lockbox-mirror-v1", i)
                    for i in rng.sample(range(1000), request.heldout_tasks))
    return EnvTaskSets(train, heldout)


def task_info(task_id: str) -> TaskInfo:
    """Family and split of a task (the code is never shown)."""
    family, index = parse_task(task_id)
    return TaskInfo(task_id, family, FAMILIES[family], "Open the combination lock.",
                    {"index": index, "dials": 3, "budget": BUDGET})


def gold(task_id: str) -> list[Action]:
    """Set the three dials to the code, then finish."""
    return [*(Action.tool("set", i=i, v=d) for i, d in enumerate(task_code(task_id))),
            Action.finish()]


class Planned:
    """Plays a plan of actions (then finish), one per ``act``."""

    def __init__(self, plan: Sequence[Action | str]) -> None:
        self.plan = list(plan)

    def act(self, observation: str) -> Action | str:
        """The next planned action."""
        return self.plan.pop(0) if self.plan else Action.finish()


def noisy(task_id: str, seed: int, rate: float) -> Planned:
    """The expert with a malformed call before a set, at ``rate``."""
    rng = random.Random(f"noisy/{task_id}/{seed}")
    plan: list[Action | str] = []
    for action in gold(task_id):
        if action.kind == "tool" and rng.random() < rate:
            plan.append(action.canonical_text()[:-3])
        plan.append(action)
    return Planned(plan)


def sample_action(rng: random.Random, task_id: str) -> Action | str:
    """Random inspect/set calls, in and out of range."""
    if rng.random() < 0.4:
        return Action.tool("inspect", i=rng.randrange(-1, 4))
    return Action.tool("set", i=rng.randrange(-1, 4), v=rng.randrange(-1, 11))


def fork_probe(task_id: str) -> Action:
    """Turning dial 0 changes the state (at least its step counter)."""
    return Action.tool("set", i=0, v=7)


def play(env: LockboxEnv, task_id: str, actions: Sequence[Action], seed: int = 0) -> bytes:
    """Reset, play ``actions`` (stopping at the end), return the exported state."""
    env.reset(task_id, seed)
    for action in actions:
        if env.step(action).done:
            break
    return env.export_state()


def _label(task_id: str, state_bytes: bytes) -> bool:
    """Independent label: the code recomputed from the hash, the dials read from the JSON."""
    state = json.loads(state_bytes)
    family, index = parse_task(task_id)
    raw = hashlib.sha256(f"{family}/{index}".encode()).digest()
    want = [1 + raw[0] % 9, 1 + raw[1] % 9, 1 + raw[2 if family == "lockbox-dials-v1" else 0]
            % 9]
    return bool(state["dials"] == want and state["final_action"] == "finish")


def fixtures(task_ids: tuple[str, ...] | None) -> list[AdjudicatedFixture]:
    """Per task: 2 positives, 4 negatives and 1 tamper fixture, each label checked by
    ``_label``; default tasks: 12 train and 12 held-out."""
    if task_ids is None:
        sets = task_sets(TaskSetRequest(12, 12, 0))
        task_ids = (*sets.train, *sets.heldout)
    out = []
    for task_id in task_ids:
        c, g = task_code(task_id), gold(task_id)
        variants: list[tuple[str, list[Action], bool]] = [
            ("gold", g, True),
            ("detour", [Action.tool("set", i=0, v=(c[0] % 9) + 1), *g], True),
            ("untouched", [Action.finish()], False),
            ("off_by_one", [*g[:2], Action.tool("set", i=2, v=c[2] % 9 + 1), Action.finish()],
             False),
            ("partial", [*g[:2], Action.finish()], False),
            ("abstained", [*g[:3], Action.abstain()], False)]
        for kind, actions, label in variants:
            state = play(LockboxEnv(), task_id, actions)
            if _label(task_id, state) != label:
                raise LockboxError(f"{task_id}#{kind}: hand label {label} disagrees")
            out.append(AdjudicatedFixture(f"{task_id}#{kind}", task_id, parse_task(task_id)[0],
                                          kind, state, label, False, kind))
        other = task_ids[(task_ids.index(task_id) + 1) % len(task_ids)]
        if other != task_id:
            state = play(LockboxEnv(), other, gold(other))
            out.append(AdjudicatedFixture(f"{task_id}#tamper", task_id, parse_task(task_id)[0],
                                          "tamper", state, False, True, "another task's state"))
    return out


def make_package(env_cls: type[LockboxEnv] = LockboxEnv, **changes: Any) -> EnvPackage:
    """The lockbox package over ``env_cls`` (broken variants in the tests), with ``changes``."""
    fields: dict[str, Any] = dict(
        env_id=ENV_ID, env_version=ENV_VERSION, make_env=env_cls, task_sets=task_sets,
        task_info=task_info, make_verifier=LockboxVerifier, tool_schemas=TOOLS,
        system_prompt=SYSTEM_PROMPT, action_sampler=sample_action, fork_probe=fork_probe,
        scripted={"expert": lambda task_id, seed, rate: Planned(gold(task_id)),
                  "noisy": noisy,
                  "random": lambda task_id, seed, rate: _RandomPolicy(task_id, seed)},
        fixtures=fixtures, description="a three-dial combination lock (a test environment)")
    fields.update(changes)
    return EnvPackage(**fields)


class _RandomPolicy:
    def __init__(self, task_id: str, seed: int) -> None:
        self.task_id, self.rng = task_id, random.Random(f"random/{task_id}/{seed}")

    def act(self, observation: str) -> Action | str:
        return sample_action(self.rng, self.task_id)


def lockbox_package() -> EnvPackage:
    """The registered package (``environment.factory: tests.envs.lockbox:lockbox_package``)."""
    return make_package()
