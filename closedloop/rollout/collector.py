"""Version-pinned, group-batched multi-turn collection: the generator's side of a rollout
(trace record and token-id threading, docs/concepts.md).

A ``GroupLease`` binds G sibling episodes of one task, seed, base snapshot, behaviour manifest
and sampler. Each sibling gets its own environment instance (never one shared env: siblings
never see each other's writes). All live episodes of all groups step together: one batched
``act`` per turn, then one environment step each; finished episodes drop out. Every turn is
written as a ``TurnRecord`` as it happens; every episode ends as an unscored
``closedloop.rollout.verifier_step.Rollout`` holding the environment's exported final state.

``Collector.rollout`` stops there: scoring is the verifier step's own stage
(``closedloop.rollout.verifier_step``), which sees only the exported state. ``Collector.collect``
is both stages in a row (rollout, then the verifier step with the collector's ``scorer``) for
callers that want scored groups at once:

- terminal episodes (finish, environment terminal, task budget) are scored by the verifier from
  the exported state, outside the agent's reach;
- censored ones (``max_token_truncation``, ``max_step_truncation``, ``tool_timeout``,
  ``infra_abort``, ``scheduler_cancel``) get reward ``None``, never 0.

Only declared infrastructure failures (``INFRA_FAILURES``: ``InfrastructureError``, e.g. the
sandbox's ``SandboxInfraError``, and ``TimeoutError``) raised by a reset, the action source or
a step become ``infra_abort``. Anything else (a ``TypeError`` in the generator or the
environment) is a programming error: it propagates and stops the run, and since the trace is
written to a ``.partial`` file and the ledger is not touched during collection, the run
directory stays consistent for a resume once the bug is fixed. Malformed model text is not an
exception at all: the environment answers it with a structured error observation.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from closedloop.contracts import (
    AgentEnv,
    GroupLease,
    PolicyManifest,
    TaskVerifier,
    Termination,
    TraceWriter,
    TurnRecord,
    content_hash,
    parse_action,
)
from closedloop.contracts.records import ActionKindOrInvalid
from closedloop.errors import (
    ActionParseError,
    ContextBudgetExceeded,
    ContractError,
    InfrastructureError,
    SnapshotMismatchError,
)
from closedloop.rollout.source import ActionSample, ActionSource
from closedloop.rollout.verifier_step import CollectedGroup, Rollout, RolloutGroup, VerifierStep

INFRA_FAILURES: tuple[type[Exception], ...] = (InfrastructureError, TimeoutError)
"""The exceptions the collector records as ``infra_abort``; every other one propagates."""


class Renderer(Protocol):
    """Renders the prompt once and each observation delta once (see closedloop.policy.chat)."""

    def render_prompt(self, task_text: str) -> list[int]:
        """Token ids of system prompt + task + assistant header."""
        ...

    def render_observation(self, observation_text: str, *, turn_closed: bool = False
                           ) -> list[int]:
        """Token ids appended after an action: end of turn, observation, assistant header."""
        ...

    def turn_closed(self, action_ids: Sequence[int]) -> bool:
        """Whether the action's own ids already closed the assistant turn."""
        ...


@dataclass(frozen=True)
class CollectorConfig:
    """Episode limits imposed by the collector (not by the task contract).

    max_turns: a turn limit; reaching it before the task's own step budget ends the episode
    with ``max_step_truncation`` (censored). deadline_s: wall-clock budget for one call;
    episodes still live then end with ``scheduler_cancel``. sampling_salt: when set, every
    episode samples from its own random stream, ``episode_stream(salt, task, seed, index)``:
    two policies collecting the same (task, seed, sibling) draw the same uniforms, so where
    they agree they sample the same tokens (common random numbers: paired evaluations of two
    checkpoints differ where the policies differ, not where the dice did).
    """

    max_turns: int = 8
    deadline_s: float | None = None
    sampling_salt: int | None = None


def episode_stream(salt: int, task_id: str, seed: int, sample_index: int) -> int:
    """The seed of one episode's sampling stream: 63 bits of the content hash of
    ``[salt, task_id, seed, sample_index]`` (independent of the policy, the group id and the
    batch the episode is collected in)."""
    return int(content_hash([salt, task_id, seed, sample_index]).split(":", 1)[1][:16], 16) \
        % 2**63


@dataclass
class _Live:
    key: str
    lease: GroupLease
    sample_index: int
    env: AgentEnv
    family: str
    split: str
    started_at: str
    prompt_ids: list[int]
    context_len: int = 0
    turns: list[TurnRecord] = field(default_factory=list)
    termination: Termination | None = None
    timings: dict[str, float] = field(default_factory=dict)


def _safe_hash(env: AgentEnv) -> str:
    try:
        return env.state_hash()
    except INFRA_FAILURES:
        return "unavailable"


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _add(timings: dict[str, float], key: str, seconds: float) -> None:
    timings[key] = timings.get(key, 0.0) + seconds


class Collector:
    """Collects complete groups under one behaviour manifest."""

    def __init__(self, source: ActionSource, renderer: Renderer,
                 env_factory: Callable[[], AgentEnv], scorer: TaskVerifier | None,
                 task_info: Callable[[str], tuple[str, str]], manifest: PolicyManifest,
                 run_id: str, writer: TraceWriter | None = None,
                 config: CollectorConfig | None = None) -> None:
        self.source = source
        self.renderer = renderer
        self.env_factory = env_factory
        self.scorer = scorer
        self.task_info = task_info
        self.manifest = manifest
        self.run_id = run_id
        self.writer = writer
        self.config = config or CollectorConfig()

    def make_lease(self, group_id: str, task_id: str, seed: int, group_size: int) -> GroupLease:
        """Reset a probe environment to find the base snapshot, and bind the group to it."""
        env = self.env_factory()
        env.reset(task_id, seed)
        base = env.snapshot("base")
        return GroupLease(group_id=group_id, run_id=self.run_id, task_id=task_id, seed=seed,
                          base_snapshot_id=base.snapshot_id,
                          behavior_manifest_hash=self.manifest.manifest_hash(),
                          behavior_policy_version=self.manifest.policy_version,
                          sampler_config_hash=self.manifest.sampler.config_hash(),
                          group_size=group_size)

    def collect(self, leases: Sequence[GroupLease],
                progress: Callable[[int], None] | None = None) -> list[CollectedGroup]:
        """``rollout`` then the verifier step (the collector's ``scorer``, trajectory records
        to its writer): complete scored groups in lease order."""
        if self.scorer is None:
            raise ContractError("this collector has no scorer: use rollout() and a verifier "
                                "step")
        return VerifierStep(self.scorer, self.writer).score(self.rollout(leases, progress))

    def rollout(self, leases: Sequence[GroupLease],
                progress: Callable[[int], None] | None = None) -> list[RolloutGroup]:
        """Run every sibling of every lease to the end; return complete, unscored groups in
        lease order (the verifier step scores them)."""
        self._check_leases(leases)
        started = time.perf_counter()
        live: list[_Live] = []
        finished: dict[str, Rollout] = {}
        for lease in leases:
            if self.writer is not None:
                self.writer.write(lease)
            for i in range(lease.group_size):
                ep = self._start(lease, i)
                if ep.termination is None:
                    live.append(ep)
                else:
                    finished[ep.key] = self._finish(ep)
        while live:
            if self._past_deadline(started):
                for ep in live:
                    ep.termination = Termination.SCHEDULER_CANCEL
            else:
                self._step_all(live)
            still = []
            for ep in live:
                if ep.termination is None:
                    still.append(ep)
                else:
                    finished[ep.key] = self._finish(ep)
                    if progress is not None:
                        progress(1)
            live = still
        return [RolloutGroup(lease, tuple(finished[f"{lease.group_id}/{i}"]
                                          for i in range(lease.group_size)))
                for lease in leases]

    def _check_leases(self, leases: Sequence[GroupLease]) -> None:
        manifest_hash = self.manifest.manifest_hash()
        for lease in leases:
            if lease.behavior_manifest_hash != manifest_hash:
                raise SnapshotMismatchError(
                    f"group {lease.group_id} is leased to manifest {lease.behavior_manifest_hash}"
                    f", the collector samples with {manifest_hash}")

    def _past_deadline(self, started: float) -> bool:
        limit = self.config.deadline_s
        return limit is not None and time.perf_counter() - started > limit

    def _start(self, lease: GroupLease, index: int) -> _Live:
        t0 = time.perf_counter()
        family, split = self.task_info(lease.task_id)
        key = f"{lease.group_id}/{index}"
        env = self.env_factory()
        ep = _Live(key, lease, index, env, family, split, _now(), [])
        try:
            observation = env.reset(lease.task_id, lease.seed)
            base = env.snapshot("base")
            if base.snapshot_id != lease.base_snapshot_id:
                raise SnapshotMismatchError(
                    f"sibling {key} reset to {base.snapshot_id}, lease says "
                    f"{lease.base_snapshot_id}")
            ep.prompt_ids = self.renderer.render_prompt(observation)
            salt = self.config.sampling_salt
            stream = None if salt is None else episode_stream(salt, lease.task_id, lease.seed,
                                                              index)
            self.source.open(key, lease.task_id, ep.prompt_ids, observation, stream)
        except INFRA_FAILURES:
            ep.timings["infra_error"] = 1.0
            ep.termination = Termination.INFRA_ABORT
            traceback.print_exc()
        _add(ep.timings, "reset_s", time.perf_counter() - t0)
        return ep

    def _step_all(self, live: list[_Live]) -> None:
        t0 = time.perf_counter()
        try:
            samples = self.source.act([ep.key for ep in live])
        except ContextBudgetExceeded as exc:
            for ep in live:
                if ep.key in exc.keys:
                    ep.termination = Termination.MAX_TOKEN_TRUNCATION
            rest = [ep for ep in live if ep.termination is None]
            if rest and len(rest) < len(live):
                self._step_all(rest)
            return
        except INFRA_FAILURES:
            traceback.print_exc()
            for ep in live:
                ep.termination = Termination.INFRA_ABORT
            return
        decode_share = (time.perf_counter() - t0) / len(live)
        for ep, sample in zip(live, samples, strict=True):
            self._apply(ep, sample, decode_share)

    def _apply(self, ep: _Live, sample: ActionSample, decode_s: float) -> None:
        turn = len(ep.turns)
        prompt = ep.prompt_ids
        ep.context_len += len(prompt)
        state_before = _safe_hash(ep.env)
        kind, tool_name, tool_args, parse_error, action = _parse(sample.text)
        timings = {"decode_s": decode_s}
        error: str | None = None
        observation = ""
        termination: Termination | None = None
        t0 = time.perf_counter()
        if sample.finish == "length":
            termination, error = Termination.MAX_TOKEN_TRUNCATION, "max_token_truncation"
        else:
            try:
                tr = ep.env.step(action if action is not None else sample.text)
                observation, error = tr.observation, tr.error
                if tr.error == "tool_timeout":
                    termination = Termination.TOOL_TIMEOUT
                elif tr.done:
                    termination = tr.termination or Termination.ENV_TERMINAL_FAILURE
                elif turn + 1 >= self.config.max_turns:
                    termination = Termination.MAX_STEP_TRUNCATION
            except INFRA_FAILURES as exc:
                traceback.print_exc()
                termination, error = Termination.INFRA_ABORT, f"infra_abort: {exc!r}"[:500]
        timings["env_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        next_prompt: list[int] = []
        if termination is None:
            next_prompt = self.renderer.render_observation(
                observation, turn_closed=self.renderer.turn_closed(sample.token_ids))
            self.source.extend(ep.key, observation, next_prompt)
        timings["render_s"] = time.perf_counter() - t1
        record = self._turn_record(ep, turn, prompt, sample, kind, tool_name, tool_args,
                                   parse_error, observation, error, state_before, termination,
                                   timings)
        ep.turns.append(record)
        ep.context_len += len(sample.token_ids)
        ep.prompt_ids = next_prompt
        ep.termination = termination
        for k, v in timings.items():
            _add(ep.timings, k, v)

    def _turn_record(self, ep: _Live, turn: int, prompt: list[int], sample: ActionSample,
                     kind: ActionKindOrInvalid, tool_name: str | None,
                     tool_args: dict[str, Any] | None, parse_error: str | None,
                     observation: str, error: str | None, state_before: str,
                     termination: Termination | None, timings: dict[str, float]) -> TurnRecord:
        t0 = time.perf_counter()
        lease, m = ep.lease, self.manifest
        record = TurnRecord(
            run_id=self.run_id, episode_id=ep.key, group_id=lease.group_id,
            task_id=lease.task_id, seed=lease.seed, env_version=ep.env.env_version,
            base_snapshot_id=lease.base_snapshot_id,
            behavior_policy_version=m.policy_version, policy_manifest_hash=m.manifest_hash(),
            behavior_weight_checksum=m.weight_checksum, generator_build=self.source.build,
            turn=turn, snapshot_before=None, state_before=state_before, context_segment_id=0,
            memory_state_ref=None, compactor_version=m.compactor_version,
            prompt_token_ids=list(prompt), prompt_is_delta=turn > 0,
            context_len_before=ep.context_len, action_token_ids=list(sample.token_ids),
            sampler_config=m.sampler, behavior_logprobs=list(sample.behavior_logprobs),
            raw_model_logprobs=sample.raw_logprobs, action_mask=[1] * len(sample.token_ids),
            action_text=sample.text, action_kind=kind, parse_error=parse_error,
            generation_finish=sample.finish, tool_name=tool_name, tool_args=tool_args,
            observation=observation, observation_error=error,
            state_after=_safe_hash(ep.env), reward_components=None,
            termination_reason=termination, continuation_parent=None, timings=timings)
        if self.writer is not None:
            self.writer.write(record)
        timings["bookkeeping_s"] = time.perf_counter() - t0
        return record

    def _finish(self, ep: _Live) -> Rollout:
        """End an episode: close its source session, export the final state of a terminal
        one (for the verifier step), and freeze what was played."""
        self.source.close(ep.key)
        termination = ep.termination or Termination.INFRA_ABORT
        final_hash = _safe_hash(ep.env) if ep.turns or termination.is_terminal else ""
        final_state = ep.env.export_state() if termination.is_terminal else None
        return Rollout(
            run_id=self.run_id, episode_id=ep.key, lease=ep.lease, sample_index=ep.sample_index,
            task_family=ep.family, split=ep.split, env_version=ep.env.env_version,
            manifest=self.manifest, turns=tuple(ep.turns), termination=termination,
            final_state=final_state, final_state_hash=final_hash, started_at=ep.started_at,
            finished_at=_now(), timings=dict(ep.timings))


def _parse(text: str) -> tuple[ActionKindOrInvalid, str | None, dict[str, Any] | None,
                               str | None, Any]:
    try:
        action = parse_action(text)
    except ActionParseError as exc:
        return "invalid", None, None, exc.reason, None
    return action.kind, action.name, dict(action.args), None, action
