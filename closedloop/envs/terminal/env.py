"""``TerminalRepairEnv``: the terminal/file-repair environment (an ``AgentEnv``).

An episode: ``reset(task_id, seed)`` loads the task's public files; each ``step`` executes one
action (raw model text is parsed here) and consumes one step and one clock tick; ``finish`` or
``abstain`` ends it with ``agent_finish``; using up ``step_budget`` ends it with
``task_budget_exhausted_terminal``. An unparsable or failing action returns a structured error
observation and changes nothing but the step counter, clock and counters. A command that runs
past its limit returns the error code ``tool_timeout`` (the collector decides whether to censor);
a sandbox infrastructure failure raises ``SandboxInfraError`` and consumes nothing.

Snapshots are immutable states in a content-addressed store shared by an env and its forks
(``closedloop.envs.snapshots.SnapshotBook``); ``reset`` starts a new store, so snapshots belong
to one episode and its forks. When an episode ends, its terminal state is sealed: stored as bytes
with their hash, exported for the verifier by ``export_sealed`` (checked by ``decode_sealed``),
and never restorable or forkable into an agent-facing env.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from closedloop.contracts import Action, SnapshotRef, Termination, Transition, parse_action
from closedloop.envs.snapshots import BookedEnv, SnapshotBook
from closedloop.envs.task_records import TaskSpec
from closedloop.envs.terminal.sandbox import SandboxConfig, check_argv
from closedloop.envs.terminal.tools import (
    TOOLS,
    ToolContext,
    ToolOutcome,
    call_tool,
    error_observation,
    tool_schemas,
)
from closedloop.envs.terminal.workspace import (
    Counters,
    ExportedState,
    FileTree,
    LogEntry,
    Violation,
    WorkspaceLimits,
    WorkspaceState,
    decode_state,
    draw_seed,
    new_state,
)
from closedloop.errors import (
    ActionParseError,
    ContractError,
    EnvNotResetError,
    EpisodeDoneError,
    SnapshotMismatchError,
    TaskError,
    WorkspaceLimitError,
    WorkspacePathError,
)

ENV_VERSION = "terminal-repair-v1"
TaskSource = Callable[[str], TaskSpec]


@dataclass(frozen=True)
class EnvConfig:
    """Workspace caps, sandbox limits, and the byte cap of ``read_file`` observations."""

    limits: WorkspaceLimits = field(default_factory=WorkspaceLimits)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    read_cap_bytes: int = 8192


def decode_sealed(ref: SnapshotRef, data: bytes) -> ExportedState:
    """Decode sealed bytes and check them against ``ref`` (``SnapshotMismatchError`` if not).

    For the verifier: it proves the bytes are the terminal state the reference names.
    """
    state = decode_state(data)
    if (state.state_hash, state.rng_hash, state.env_version) != \
            (ref.state_hash, ref.rng_state_hash, ref.env_version):
        raise SnapshotMismatchError(f"sealed bytes do not match snapshot {ref.snapshot_id!r}")
    return state


class TerminalRepairEnv(BookedEnv[WorkspaceState]):
    """The terminal-repair environment. See the module docstring for the contract."""

    env_version: str = ENV_VERSION

    def __init__(self, task_source: TaskSource | None = None, config: EnvConfig | None = None,
                 *, _store: SnapshotBook[WorkspaceState] | None = None) -> None:
        self._task_source = task_source
        self.config = config or EnvConfig()
        self._store = _store or SnapshotBook(self.env_version, WorkspaceState.recompute_hashes,
                                             decode_sealed)
        self._ctx: dict[str, ToolContext] = {}
        self._state: WorkspaceState | None = None
        self.branch_id: str | None = None

    # -- task loading -------------------------------------------------------------------

    def _context(self, task_id: str) -> ToolContext:
        ctx = self._ctx.get(task_id)
        if ctx is None:
            ctx = ToolContext(self._load_spec(task_id), self.config.limits,
                              self.config.sandbox, self.config.read_cap_bytes)
            self._ctx[task_id] = ctx
        return ctx

    def _load_spec(self, task_id: str) -> TaskSpec:
        if self._task_source is None:
            raise TaskError("no task_source configured for TerminalRepairEnv")
        try:
            spec = self._task_source(task_id)
        except LookupError as exc:
            raise TaskError(f"unknown task {task_id!r}: {exc}") from None
        validate_spec(spec, self.config.limits, self.env_version)
        if spec.task_id != task_id:
            raise TaskError(f"task_source returned task {spec.task_id!r} for {task_id!r}")
        return spec

    @property
    def task_spec(self) -> TaskSpec:
        """The public spec of the current task."""
        return self._context(self._require_state().task_id).spec

    def tool_schemas(self) -> list[dict[str, object]]:
        """JSON schemas of the current task's tools."""
        return tool_schemas(self.task_spec)

    # -- AgentEnv -----------------------------------------------------------------------

    def reset(self, task_id: str, seed: int) -> str:
        """Load ``task_id`` with ``seed`` (a new snapshot store); return the first observation."""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TaskError(f"seed must be an int, got {seed!r}")
        spec = self._context(task_id).spec
        files = FileTree(spec.initial_files, self.config.limits)
        self._state = new_state(self.env_version, task_id, seed, spec.step_budget, files)
        self._store.reset()
        return first_observation(spec, files)

    def step(self, action: Action | str) -> Transition:
        """Execute one action or raw model text; every call consumes one step."""
        state = self._require_state()
        if state.done:
            raise EpisodeDoneError("the episode is over; reset, or restore a snapshot")
        parsed: Action | None
        if isinstance(action, str):
            try:
                parsed = parse_action(action)
            except ActionParseError as exc:
                parsed = None
                outcome = ToolOutcome(error_observation("invalid_action", exc.reason),
                                      error="invalid_action")
        elif isinstance(action, Action):
            parsed = action
        else:
            raise ContractError(f"step() takes an Action or model text, got {type(action)}")
        rng_after = state
        if parsed is not None:
            outcome, rng_after = self._execute(parsed, state)
        new = _advance(state, parsed, outcome, rng_after)
        self._state = new
        if new.done:
            self._store.seal(new)
        return Transition(outcome.observation, new.done, new.state_hash, new.steps,
                          new.termination, outcome.error)

    def _execute(self, action: Action, state: WorkspaceState) -> tuple[ToolOutcome,
                                                                         WorkspaceState]:
        if action.kind != "tool":
            return ToolOutcome(f"episode ended by {action.kind}"), state
        seed, drawn = draw_seed(state) if action.name == "run" else (0, state)
        outcome = call_tool(action, state, self._context(state.task_id), seed)
        return outcome, drawn if outcome.command_ran else state

    def export_state(self) -> bytes:
        """Canonical bytes of the current state (decode with ``decode_state``)."""
        return self._require_state().to_bytes()

    def state_hash(self) -> str:
        """Content hash of the current state."""
        return self._require_state().state_hash

    def snapshot(self, label: str) -> SnapshotRef:
        """Capture the current state (not allowed once the episode is over)."""
        return self._store.snapshot(self._require_state(), label)

    def restore(self, snapshot: SnapshotRef) -> None:
        """Return to a stored snapshot after re-checking its hashes; sealed ones raise."""
        state = self._store.restore(snapshot)
        self._context(state.task_id)
        self._state = state

    def fork(self, snapshot: SnapshotRef, branch_id: str) -> TerminalRepairEnv:
        """Return an independent env at ``snapshot``; ``branch_id`` never touches the RNG."""
        def child(book: SnapshotBook[WorkspaceState]) -> TerminalRepairEnv:
            env = TerminalRepairEnv(self._task_source, self.config, _store=book)
            env._ctx = self._ctx
            return env

        return self.fork_from(child, snapshot, branch_id)

    def _require_state(self) -> WorkspaceState:
        if self._state is None:
            raise EnvNotResetError("call reset(task_id, seed) first")
        return self._state


def _advance(state: WorkspaceState, action: Action | None, outcome: ToolOutcome,
             rng_from: WorkspaceState) -> WorkspaceState:
    """Return the state after one step: counters, clock, files, RNG and end of episode."""
    step = state.steps + 1
    c = state.counters
    is_tool = action is not None and action.kind == "tool"
    name = "<invalid>" if action is None else action.name
    counters = Counters(
        tool_calls=c.tool_calls + is_tool,
        invalid_actions=c.invalid_actions + (action is None),
        tool_errors=c.tool_errors + (is_tool and outcome.error is not None),
        commands_run=c.commands_run + outcome.command_ran,
        timeouts=c.timeouts + outcome.timed_out,
        violations=c.violations + tuple(Violation(step, code, detail)
                                        for code, detail in outcome.violations),
        log=(*c.log, LogEntry(step, name, outcome.error)),
    )
    new = dataclasses.replace(
        state, files=outcome.files if outcome.files is not None else state.files,
        clock=state.clock + 1, rng_state=rng_from.rng_state, rng_hash=rng_from.rng_hash,
        steps=step, counters=counters)
    if action is not None and action.kind in ("finish", "abstain"):
        return dataclasses.replace(new, done=True, termination=Termination.AGENT_FINISH,
                                   final_action=action.kind)
    if step >= state.step_budget:
        return dataclasses.replace(new, done=True,
                                   termination=Termination.TASK_BUDGET_EXHAUSTED_TERMINAL)
    return new


def validate_spec(spec: TaskSpec, limits: WorkspaceLimits, env_version: str) -> None:
    """Raise ``TaskError`` unless the spec can run here (version, files, tools, commands)."""
    if not isinstance(spec, TaskSpec):
        raise TaskError(f"task_source must return a TaskSpec, got {type(spec).__name__}")
    if spec.env_version != env_version:
        raise TaskError(f"task {spec.task_id!r} targets {spec.env_version!r}, "
                        f"this env is {env_version!r}")
    try:
        FileTree(spec.initial_files, limits)
    except (WorkspacePathError, WorkspaceLimitError) as exc:
        raise TaskError(f"task {spec.task_id!r}: initial files: {exc}") from None
    unknown = sorted(set(spec.allowed_tools) - set(TOOLS))
    if unknown:
        raise TaskError(f"task {spec.task_id!r}: unknown tools {unknown}")
    for name, argv in spec.commands.items():
        check_argv(argv)
        if argv[1] != "-m" and argv[1] not in spec.initial_files:
            raise TaskError(f"task {spec.task_id!r}: command {name!r} runs {argv[1]!r}, "
                            "which is not an initial file")
    if isinstance(spec.step_budget, bool) or not isinstance(spec.step_budget, int) \
            or spec.step_budget < 1:
        raise TaskError(f"task {spec.task_id!r}: step_budget must be an int >= 1")


def first_observation(spec: TaskSpec, files: FileTree) -> str:
    """The reset observation: objective, files, tools, commands and the step budget."""
    lines = [f"Task: {spec.objective}", "", "Workspace files:"]
    lines += [f"  {p}  {files.size(p)} bytes" for p in sorted(files)] or ["  (none)"]
    tools = ", ".join(sorted(spec.allowed_tools))
    lines += ["", f"Tools: {tools}; finish and abstain end the episode."]
    if spec.commands and "run" in spec.allowed_tools:
        lines.append("Commands for run:")
        lines += [f"  {name}: {' '.join(argv)}" for name, argv in sorted(spec.commands.items())]
    lines += ["", f"Step budget: {spec.step_budget}"]
    return "\n".join(lines)
