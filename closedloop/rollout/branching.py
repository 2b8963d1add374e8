"""Branch collection: K continuations forked from one recorded decision state (branching
credit, docs/credit.md).

Given an agent prefix B_t (``closedloop.rollout.prefix.AgentPrefix``: the snapshot S_t, the
exact context ids, memory ref, behaviour version and sampler), :meth:`BranchCollector.collect`
forks K environments from S_t (``env.fork(S_t, branch_id=str(k))``: the branch id isolates
writes, never the environment's randomness, which the snapshot carries) and runs K continuations
to termination under the parent's own behaviour manifest, each from the same context ids:

- the same remaining step budget (a branch carries its parent's t turns, so the collector's
  turn limit leaves it the parent's remaining turns) and the same token budgets (the manifest's
  action budget and the model's context window), and the environment's own budget in S_t;
- exploration differs only by policy sampling: branch k samples from its own stream, the
  content hash of (salt, parent episode, t, k);
- each branch is an ordinary episode record whose turns before t are the parent's, copied with
  ``action_mask`` 0 (this branch did not sample them) and ``continuation_parent`` set, and whose
  trajectory records ``parent_run_id``, ``parent_episode_id``, ``branch_point_turn`` and the
  branch point's manifest (S_t's reference among it); the K branches of one prefix form one
  group, whose lease names the parent's base snapshot (each branch's record starts there, through
  the copied prefix).

:func:`branch_points` picks branch points by a declared rule:

- ``after_tool_observation``: the first turn t >= 1 whose previous action was a tool call the
  environment answered without an error (the decision right after a tool observation);
- ``max_surprisal``: the turn t >= 1 whose action had the highest mean surprisal
  -mean log π_beh(a_t) under the recorded behaviour log-probs (a recorded proxy for a
  high-entropy turn: the full distribution is not recorded).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Literal

from closedloop.contracts import (
    AgentEnv,
    Episode,
    GroupLease,
    Termination,
    TurnRecord,
    content_hash,
)
from closedloop.errors import BranchError, SnapshotMismatchError
from closedloop.rollout.collector import INFRA_FAILURES, Collector
from closedloop.rollout.collector import _Live as Live
from closedloop.rollout.collector import _now as now
from closedloop.rollout.prefix import AgentPrefix, executed_turns
from closedloop.rollout.verifier_step import (
    BranchOrigin,
    CollectedGroup,
    RolloutGroup,
    VerifierStep,
)

__all__ = ["BRANCH_RULES", "BranchCollector", "BranchRule", "branch_points", "branch_stream"]

BranchRule = Literal["after_tool_observation", "max_surprisal"]
BRANCH_RULES: tuple[str, ...] = ("after_tool_observation", "max_surprisal")


def branch_points(episode: Episode, rule: BranchRule) -> list[int]:
    """The branch points of ``episode`` under ``rule`` (at most one; empty when none
    qualifies). Only turns t >= 1 that the parent reached with a recorded prompt and whose
    prefix was executed qualify."""
    last = min(executed_turns(episode), len(episode.turns) - 1)
    candidates = range(1, last + 1)
    if rule == "after_tool_observation":
        for t in candidates:
            prev = episode.turns[t - 1]
            if prev.action_kind == "tool" and prev.observation_error is None:
                return [t]
        return []
    if rule == "max_surprisal":
        scored = [(-sum(episode.turns[t].behavior_logprobs)
                   / max(len(episode.turns[t].behavior_logprobs), 1), t) for t in candidates]
        return [max(scored)[1]] if scored else []
    raise BranchError(f"unknown branch rule {rule!r}; known: {', '.join(BRANCH_RULES)}")


def branch_stream(salt: int, parent_episode_id: str, turn: int, k: int) -> int:
    """Branch k's sampling stream: 63 bits of the content hash of (salt, parent, turn, k)."""
    digest = content_hash(["branch", salt, parent_episode_id, turn, k]).split(":", 1)[1]
    return int(digest[:16], 16) % 2**63


def branch_group_id(prefix: AgentPrefix) -> str:
    """The group id of the K branches of one prefix."""
    return f"{prefix.parent_episode_id}@t{prefix.turn}"


class BranchCollector(Collector):
    """A collector that also runs continuations from agent prefixes (module docstring)."""

    def collect_branches(self, prefixes: Sequence[tuple[AgentPrefix, AgentEnv]], k: int,
                         progress: Callable[[int], None] | None = None
                         ) -> list[CollectedGroup]:
        """K continuations of each (prefix, env left at S_t); one group per prefix, in order."""
        if k < 2:
            raise BranchError(f"branching credit compares continuations: K must be >= 2, got {k}")
        if self.scorer is None:
            raise BranchError("branch collection scores its continuations: the collector "
                              "needs a scorer")
        leases: list[GroupLease] = []
        live: list[Live] = []
        for prefix, env in prefixes:
            leases.append(self._lease(prefix, k))
            live += self._open_branches(prefix, leases[-1], env)
        finished = {ep.key: self._finish(ep) for ep in live if ep.termination is not None}
        self._drive([e for e in live if e.termination is None], finished, progress, None, None)
        rollouts = [RolloutGroup(lease, tuple(finished[f"{lease.group_id}/{i}"]
                                              for i in range(k))) for lease in leases]
        return VerifierStep(self.scorer, self.writer).score(rollouts)

    def _lease(self, prefix: AgentPrefix, k: int) -> GroupLease:
        m = self.manifest
        if prefix.policy_manifest_hash != m.manifest_hash():
            raise BranchError(f"{prefix.parent_episode_id}: the parent was sampled under manifest"
                              f" {prefix.policy_manifest_hash}; branches must use the same one")
        return GroupLease(group_id=branch_group_id(prefix), run_id=self.run_id,
                          task_id=prefix.task_id, seed=prefix.seed,
                          base_snapshot_id=prefix.base_snapshot_id,
                          behavior_manifest_hash=m.manifest_hash(),
                          behavior_policy_version=m.policy_version,
                          sampler_config_hash=m.sampler.config_hash(), group_size=k)

    def _open_branches(self, prefix: AgentPrefix, lease: GroupLease, env: AgentEnv
                       ) -> list[Live]:
        if self.writer is not None:
            self.writer.write(lease)
        family, split = self.task_info(prefix.task_id)
        origin = BranchOrigin(prefix.parent_run_id, prefix.parent_episode_id, prefix.turn,
                              prefix.manifest())
        last_obs = prefix.prefix_turns[-1].observation if prefix.prefix_turns else ""
        salt = self.config.sampling_salt
        out = []
        for i in range(lease.group_size):
            key = f"{lease.group_id}/{i}"
            ep = Live(key, lease, i, env, family, split, now(), list(prefix.next_prompt_ids),
                      branch=origin)
            ep.context_len = len(prefix.context_ids) - len(prefix.next_prompt_ids)
            ep.turns = [self._copied(t, key, lease, prefix.parent_episode_id)
                        for t in prefix.prefix_turns]
            try:
                ep.env = env.fork(prefix.snapshot, branch_id=str(i))
                if ep.env.state_hash() != prefix.snapshot.state_hash:
                    raise SnapshotMismatchError(f"branch {key}: the fork is not at S_t")
                stream = None if salt is None else branch_stream(
                    salt, prefix.parent_episode_id, prefix.turn, i)
                self.source.open(key, prefix.task_id, list(prefix.context_ids), last_obs,
                                 stream)
            except INFRA_FAILURES:
                ep.termination = Termination.INFRA_ABORT
            out.append(ep)
        return out

    def _copied(self, turn: TurnRecord, key: str, lease: GroupLease, parent: str) -> TurnRecord:
        """The parent's turn as a branch's: its ids, ``action_mask`` 0, the parent named."""
        copy = dataclasses.replace(turn, episode_id=key, group_id=lease.group_id,
                                   action_mask=[0] * len(turn.action_token_ids),
                                   continuation_parent=parent)
        if self.writer is not None:
            self.writer.write(copy)
        return copy
