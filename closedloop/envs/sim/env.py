"""``SimEnv``: an ``AgentEnv`` over pure rules and an immutable ``SimState``.

The rules (a ``Rules``) own the world: ``opening(task_id, seed)`` builds the world at reset and
the first observation; ``apply(world, action)`` returns an ``Outcome`` (observation, error code,
the new world or ``None`` when nothing changed, the action's duration in clock units, and an
optional end of episode). ``SimEnv`` does everything else, the same way for every rule set:

- model text is parsed here (``closedloop.contracts.parse_action``); unparsable text is the
  error observation ``invalid_action`` and changes nothing but the step, clock and counters;
- ``finish`` and ``abstain`` end the episode with ``agent_finish``; rules may end it too (a
  purchase, an answer); ``clock >= budget`` ends it with ``task_budget_exhausted_terminal``;
- snapshots are immutable states in a store shared by an env and its forks (reset starts a new
  store; ``closedloop.envs.snapshots.SnapshotBook``); restore re-derives the state hash from the
  state's bytes and refuses a mismatch; a fork is a new env over the same store, so nothing it
  does reaches its parent or siblings;
- the terminal state is sealed when the episode ends (``sealed_terminal``/``export_sealed``),
  and a sealed state is never restored or forked into an agent-facing env;
- rules whose world cannot hold their whole state say so with a ``snapshot_refusal`` attribute
  (a reason string; absent or ``None``: snapshots work): ``snapshot``, ``restore`` and ``fork``
  then raise ``SnapshotUnsupportedError`` (a ``NotImplementedError``) with that reason.
"""

from __future__ import annotations

import dataclasses

from closedloop.contracts import (
    Action,
    SnapshotRef,
    Termination,
    Transition,
    canonical_json,
    parse_action,
)
from closedloop.contracts.package import Outcome, Rules
from closedloop.envs.sim.state import MAX_LOG, SimCounters, SimState, decode_sim_state
from closedloop.envs.snapshots import BookedEnv, SnapshotBook
from closedloop.errors import (
    ActionParseError,
    ContractError,
    EnvNotResetError,
    EpisodeDoneError,
    SnapshotMismatchError,
    SnapshotUnsupportedError,
    TaskError,
)


def error_outcome(code: str, message: str, cost: int = 1) -> Outcome:
    """A failed action: the canonical structured error observation, world unchanged."""
    return Outcome(error_observation(code, message), error=code, cost=cost)


def error_observation(code: str, message: str) -> str:
    """The canonical error observation ``{"error": {"code": ..., "message": ...}}``."""
    return canonical_json({"error": {"code": code, "message": message}})


def _rehash(state: SimState) -> tuple[str, str]:
    """(state hash, RNG hash) of the state its bytes decode to."""
    decoded = decode_sim_state(state.to_bytes())
    return decoded.state_hash, decoded.rng_hash


def _check_sealed(ref: SnapshotRef, data: bytes) -> None:
    state = decode_sim_state(data)
    if state.state_hash != ref.state_hash or state.rng_hash != ref.rng_state_hash:
        raise SnapshotMismatchError(f"sealed snapshot {ref.snapshot_id!r} bytes changed")


class SimEnv(BookedEnv[SimState]):
    """An ``AgentEnv`` over ``rules`` (see the module docstring for the contract)."""

    def __init__(self, rules: Rules, *, _store: SnapshotBook[SimState] | None = None) -> None:
        self.rules = rules
        self.env_version: str = rules.env_version
        self._store = _store or SnapshotBook(self.env_version, _rehash, _check_sealed,
                                             seal_in_id=True)
        self._state: SimState | None = None
        self.branch_id: str | None = None

    def reset(self, task_id: str, seed: int) -> str:
        """Load ``task_id`` at ``seed`` (a new snapshot store); return the first observation."""
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise TaskError(f"seed must be a non-negative int, got {seed!r}")
        if not isinstance(task_id, str):
            raise TaskError(f"task_id must be a string, got {task_id!r}")
        opening = self.rules.opening(task_id, seed)
        if opening.budget < 1:
            raise TaskError(f"task {task_id!r}: budget must be >= 1, got {opening.budget}")
        self._state = SimState.initial(self.env_version, task_id, seed, opening.budget,
                                       opening.world)
        self._store.reset()
        return opening.observation

    def step(self, action: Action | str) -> Transition:
        """Execute one action or raw model text; every call consumes one step."""
        state = self._require()
        if state.done:
            raise EpisodeDoneError("the episode is over; reset, or restore a snapshot")
        parsed: Action | None = None
        if isinstance(action, str):
            try:
                parsed = parse_action(action)
            except ActionParseError as exc:
                outcome = error_outcome("invalid_action", exc.reason)
        elif isinstance(action, Action):
            parsed = action
        else:
            raise ContractError(f"step() takes an Action or model text, got {type(action)}")
        if parsed is not None:
            outcome = self._execute(state, parsed)
        new = _advance(state, parsed, outcome)
        self._state = new
        if new.done:
            self._store.seal(new)
        return Transition(outcome.observation, new.done, new.state_hash, new.steps,
                          new.termination, outcome.error)

    def _execute(self, state: SimState, action: Action) -> Outcome:
        if action.kind != "tool":
            return Outcome(f"episode ended by {action.kind}", end=Termination.AGENT_FINISH,
                           final_action=action.kind)
        outcome = self.rules.apply(state.world(), action)
        if outcome.cost < 1:
            raise ContractError(f"rules of {self.env_version}: action cost must be >= 1")
        return outcome

    def export_state(self) -> bytes:
        """Canonical bytes of the current state (decode with ``decode_sim_state``)."""
        return self._require().to_bytes()

    def state_hash(self) -> str:
        """sha256 of the exported bytes."""
        return self._require().state_hash

    def snapshot(self, label: str) -> SnapshotRef:
        """Capture the current state (not once the episode is over: it is sealed)."""
        state = self._require()
        self._refuse("snapshot")
        return self._store.snapshot(state, label)

    def restore(self, snapshot: SnapshotRef) -> None:
        """Return to a stored snapshot after re-deriving its hashes; sealed ones raise."""
        self._refuse("restore")
        self._state = self._store.restore(snapshot)

    def fork(self, snapshot: SnapshotRef, branch_id: str) -> SimEnv:
        """An independent env at ``snapshot``; ``branch_id`` never changes the state."""
        self._refuse("fork")
        return self.fork_from(lambda book: SimEnv(self.rules, _store=book), snapshot, branch_id)

    def _refuse(self, what: str) -> None:
        reason = getattr(self.rules, "snapshot_refusal", None)
        if reason is not None:
            raise SnapshotUnsupportedError(f"{self.env_version}: cannot {what}: {reason}")

    def current_state(self) -> SimState:
        """The current state record (read-only; for adapters and tests)."""
        return self._require()

    def _require(self) -> SimState:
        if self._state is None:
            raise EnvNotResetError("call reset(task_id, seed) first")
        return self._state


def _advance(state: SimState, action: Action | None, outcome: Outcome) -> SimState:
    """The state after one step: world, clock, counters, log and end of episode."""
    step = state.steps + 1
    is_tool = action is not None and action.kind == "tool"
    c = state.counters
    counters = SimCounters(c.tool_calls + is_tool, c.invalid_actions + (action is None),
                           c.tool_errors + (is_tool and outcome.error is not None))
    name = "<invalid>" if action is None else action.name
    world_json = state.world_json if outcome.world is None else canonical_json(
        dict(outcome.world))
    new = dataclasses.replace(
        state, world_json=world_json, clock=state.clock + outcome.cost, steps=step,
        counters=counters, log=(*state.log, (step, name, outcome.error))[-MAX_LOG:])
    if outcome.end is not None:
        return dataclasses.replace(new, done=True, termination=outcome.end,
                                   final_action=outcome.final_action or name)
    if new.clock >= state.budget:
        return dataclasses.replace(new, done=True,
                                   termination=Termination.TASK_BUDGET_EXHAUSTED_TERMINAL)
    return new
