"""The exact agent prefix of a recorded episode, and the states at its turn boundaries.

A snapshot of the world is not a decision state: the agent's context is part of it. At turn t
of a recorded episode the agent prefix is

    B_t = (snapshot_ref S_t, context ids, memory ref, behaviour version, sampler)

(:class:`AgentPrefix`). S_t is obtained by *verified replay*: a fresh environment is reset to the
episode's task and seed, must reproduce the recorded base snapshot id, and the recorded action
texts are re-executed; before and after every action the environment's state hash must equal
the recorded ``state_before`` / ``state_after`` (:class:`PrefixRestoreError` otherwise). Only
then is the state snapshotted. The context ids are the trace's own (``Episode.context_token_ids``:
no re-rendering, no re-tokenization). When a segment store keeps each turn's snapshot at
collection time, it replaces the replay here; the prefix record and every check stay the same.

:func:`boundary_states` gives the exported state at each boundary h_0 … h_K of an episode by the
same verified replay (for shaping potentials and interventions).
"""

from __future__ import annotations

from dataclasses import dataclass

from closedloop.contracts import (
    AgentEnv,
    Episode,
    SamplerConfig,
    SnapshotRef,
    TurnRecord,
    content_hash,
)
from closedloop.errors import BranchError, PrefixRestoreError

__all__ = ["AgentPrefix", "boundary_states", "executed_turns", "restore_prefix", "restore_state",
           "was_executed"]


def was_executed(turn: TurnRecord) -> bool:
    """Whether the collector executed the turn's action (a cut-off action or an infrastructure
    failure never reached the environment)."""
    return turn.generation_finish != "length" and not (
        turn.observation_error or "").startswith("infra_abort")


def executed_turns(episode: Episode) -> int:
    """The number of leading turns whose actions the environment executed."""
    n = 0
    for turn in episode.turns:
        if not was_executed(turn):
            break
        n += 1
    return n


@dataclass(frozen=True)
class AgentPrefix:
    """B_t: what a continuation from turn ``turn`` of a recorded episode starts from.

    ``base_snapshot_id``: the parent's base (reset) snapshot, where a branch's record starts
    too (through the copied prefix); ``snapshot``: S_t (taken after verified replay);
    ``context_ids``: context(t), the exact ids
    the sampler saw before action t (turn t's prompt included); ``prefix_turns``: the parent's
    turn records 0..t-1; ``memory_state_ref``, ``behavior_policy_version``,
    ``policy_manifest_hash`` and ``sampler`` are the parent's at turn t.
    """

    parent_run_id: str
    parent_episode_id: str
    parent_group_id: str
    task_id: str
    seed: int
    base_snapshot_id: str
    turn: int
    snapshot: SnapshotRef
    context_ids: tuple[int, ...]
    memory_state_ref: str | None
    behavior_policy_version: str
    policy_manifest_hash: str
    sampler: SamplerConfig
    prefix_turns: tuple[TurnRecord, ...]
    next_prompt_ids: tuple[int, ...]

    @property
    def context_hash(self) -> str:
        """The content hash of the context ids (two prefixes agree iff their hashes do)."""
        return content_hash(list(self.context_ids))

    def manifest(self) -> dict[str, object]:
        """The branch point's manifest as recorded on every branch: parent run and episode,
        turn, snapshot, context hash and length, memory ref, behaviour version and sampler."""
        return {"parent_run_id": self.parent_run_id,
                "parent_episode_id": self.parent_episode_id, "branch_point_turn": self.turn,
                "snapshot": self.snapshot.to_dict(), "context_hash": self.context_hash,
                "context_len": len(self.context_ids), "memory_state_ref": self.memory_state_ref,
                "behavior_policy_version": self.behavior_policy_version,
                "policy_manifest_hash": self.policy_manifest_hash,
                "sampler_config_hash": self.sampler.config_hash()}


def _replay(episode: Episode, env: AgentEnv, upto: int) -> list[bytes]:
    """Reset and re-execute turns 0..upto-1 with every hash checked; the exported state at each
    boundary h_0 … h_upto."""
    traj = episode.trajectory
    where = f"episode {traj.episode_id}"
    env.reset(traj.task_id, traj.seed)
    base = env.snapshot("base")
    if base.snapshot_id != traj.base_snapshot_id:
        raise PrefixRestoreError(f"{where}: reset gives base snapshot {base.snapshot_id}, the "
                                 f"trace recorded {traj.base_snapshot_id}")
    states = [env.export_state()]
    for turn in episode.turns[:upto]:
        if env.state_hash() != turn.state_before:
            raise PrefixRestoreError(f"{where} turn {turn.turn}: replayed state before differs "
                                     "from the recorded one")
        env.step(turn.action_text)
        if env.state_hash() != turn.state_after:
            raise PrefixRestoreError(f"{where} turn {turn.turn}: replayed state after differs "
                                     "from the recorded one")
        states.append(env.export_state())
    return states


def boundary_states(episode: Episode, env: AgentEnv) -> list[bytes]:
    """The exported state at h_0 … h_K, K = :func:`executed_turns`, by verified replay in
    ``env`` (which is reset)."""
    return _replay(episode, env, executed_turns(episode))


def restore_state(episode: Episode, turn: int, env: AgentEnv) -> SnapshotRef:
    """S_t of ``episode`` for any 0 <= t <= its executed turns: verified replay of turns
    0..t-1 in ``env`` (reset first), then a snapshot there (``env`` is left at S_t)."""
    n = executed_turns(episode)
    if not 0 <= turn <= n:
        raise BranchError(f"episode {episode.trajectory.episode_id}: turn {turn} is not in "
                          f"0..{n}")
    _replay(episode, env, turn)
    return env.snapshot(f"state-{turn}")


def restore_prefix(episode: Episode, turn: int, env: AgentEnv) -> AgentPrefix:
    """B_t for ``turn`` of ``episode``: replay turns 0..t-1 in ``env`` (reset first, every hash
    checked), snapshot S_t there, and take the context ids from the trace.

    Needs 1 <= t < the number of executed turns whose next turn has a recorded prompt (the
    parent acted at t, so context(t) is in the trace); ``BranchError`` otherwise. ``env`` is
    left at S_t: fork the continuations from it.
    """
    n = executed_turns(episode)
    traj = episode.trajectory
    if not 1 <= turn < len(episode.turns) or turn > n:
        raise BranchError(f"episode {traj.episode_id}: branch point {turn} is not in 1.."
                          f"{min(n, len(episode.turns) - 1)}")
    _replay(episode, env, turn)
    snapshot = env.snapshot(f"branch-point-{turn}")
    at = episode.turns[turn]
    return AgentPrefix(
        parent_run_id=traj.run_id, parent_episode_id=traj.episode_id,
        parent_group_id=traj.group_id, task_id=traj.task_id, seed=traj.seed,
        base_snapshot_id=traj.base_snapshot_id, turn=turn,
        snapshot=snapshot, context_ids=tuple(episode.context_token_ids(turn)),
        memory_state_ref=at.memory_state_ref,
        behavior_policy_version=traj.behavior_policy_version,
        policy_manifest_hash=traj.policy_manifest_hash, sampler=traj.sampler_config,
        prefix_turns=tuple(episode.turns[:turn]),
        next_prompt_ids=tuple(at.prompt_token_ids))
