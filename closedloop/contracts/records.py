"""Turn, trajectory and group records: the trace schema (docs/concepts.md, trace
record).

A trace is sufficient to rebuild the gradient: exact token ids, the behaviour log-probs of the
distribution that sampled them, the raw-model log-probs beside them, the action mask, versions,
rewards and the termination code. Token ids are threaded::

    context(t) = context(t-1) + action_token_ids(t-1) + prompt_token_ids(t)

where ``prompt_token_ids`` is the full rendered prompt at turn 0 and the rendered observation
delta at later turns (``prompt_is_delta``). ``context_len_before`` is the length of context(t) and
is checked on read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from closedloop.contracts.manifest import SamplerConfig
from closedloop.contracts.termination import Termination
from closedloop.errors import FieldError

ActionKindOrInvalid = Literal["tool", "finish", "abstain", "invalid"]
GenerationFinish = Literal["stop", "eos", "length", "scripted"]


@dataclass(frozen=True)
class TurnRecord:
    """One agent action and the environment's answer to it."""

    run_id: str
    episode_id: str
    group_id: str
    task_id: str
    seed: int
    env_version: str
    base_snapshot_id: str
    behavior_policy_version: str
    policy_manifest_hash: str
    behavior_weight_checksum: str
    generator_build: str
    turn: int
    snapshot_before: str | None
    state_before: str
    context_segment_id: int
    memory_state_ref: str | None
    compactor_version: str | None
    prompt_token_ids: list[int]
    prompt_is_delta: bool
    context_len_before: int
    action_token_ids: list[int]
    sampler_config: SamplerConfig
    behavior_logprobs: list[float]
    raw_model_logprobs: list[float] | None
    action_mask: list[int]
    action_text: str
    action_kind: ActionKindOrInvalid
    parse_error: str | None
    generation_finish: GenerationFinish
    tool_name: str | None
    tool_args: dict[str, Any] | None
    observation: str
    observation_error: str | None
    state_after: str
    reward_components: dict[str, float] | None
    termination_reason: Termination | None
    continuation_parent: str | None
    timings: dict[str, float] = field(default_factory=dict)
    record: Literal["turn"] = "turn"

    def __post_init__(self) -> None:
        n = len(self.action_token_ids)
        if len(self.behavior_logprobs) != n:
            raise FieldError("behavior_logprobs", f"has {len(self.behavior_logprobs)} entries for "
                             f"{n} action tokens: not length-aligned")
        if self.raw_model_logprobs is not None and len(self.raw_model_logprobs) != n:
            raise FieldError("raw_model_logprobs", "not length-aligned with action tokens")
        if len(self.action_mask) != n:
            raise FieldError("action_mask", "not length-aligned with action tokens")
        if any(m not in (0, 1) for m in self.action_mask):
            raise FieldError("action_mask", "entries must be 0 or 1")
        if any(not math.isfinite(x) or x > 1e-6 for x in self.behavior_logprobs):
            raise FieldError("behavior_logprobs", "must be finite log-probabilities (<= 0)")
        if self.turn < 0 or self.context_len_before < 0:
            raise FieldError("turn", "turn and context_len_before must be >= 0")
        if (self.turn == 0) == self.prompt_is_delta:
            raise FieldError("prompt_is_delta", "must be false exactly at turn 0")


@dataclass(frozen=True)
class TrajectoryRecord:
    """One finished episode: its identity, its verified reward vector and its termination.

    ``reward`` is the verifier's named reward vector, or ``None`` when the episode is censored
    (truncation, timeout, infra abort, cancellation) or quarantined: unscored is never 0.
    """

    run_id: str
    episode_id: str
    group_id: str
    sample_index: int
    task_id: str
    task_family: str
    split: str
    seed: int
    env_version: str
    base_snapshot_id: str
    behavior_policy_version: str
    policy_manifest_hash: str
    behavior_weight_checksum: str
    sampler_config: SamplerConfig
    num_turns: int
    num_action_tokens: int
    termination: Termination
    reward: dict[str, float] | None
    verifier_version: str | None
    final_state_hash: str
    quarantine_reason: str | None
    mixed_policy: bool
    rollout_started_at: str
    rollout_finished_at: str
    parent_run_id: str | None = None
    branch_point_turn: int | None = None
    timings: dict[str, float] = field(default_factory=dict)
    record: Literal["trajectory"] = "trajectory"

    def __post_init__(self) -> None:
        if self.termination.is_censored and self.reward is not None:
            raise FieldError("reward", f"a censored episode ({self.termination.value}) must "
                             "have reward null, never a score")
        if self.quarantine_reason is not None and self.reward is not None:
            raise FieldError("reward", "a quarantined episode must have reward null")

    @property
    def task_success(self) -> float | None:
        """The verifier's task_success, or None when unscored."""
        return None if self.reward is None else self.reward.get("task_success")


@dataclass(frozen=True)
class GroupLease:
    """Binds G sibling episodes of one task (docs/concepts.md, group-relative credit).

    Every sibling shares the task, seed, base snapshot, behaviour manifest and sampler until the
    whole group is verified.
    """

    group_id: str
    run_id: str
    task_id: str
    seed: int
    base_snapshot_id: str
    behavior_manifest_hash: str
    behavior_policy_version: str
    sampler_config_hash: str
    group_size: int
    record: Literal["group"] = "group"

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise FieldError("group_size", "must be >= 1")


TraceRecord = TurnRecord | TrajectoryRecord | GroupLease
RECORD_TYPES: dict[str, type] = {"turn": TurnRecord, "trajectory": TrajectoryRecord,
                                 "group": GroupLease}
