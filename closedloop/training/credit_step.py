"""The credit step of a training run: the estimator the config names, dispatched by name
(docs/credit.md), and what it records.

- ``rloo``, ``grpo``, ``dr_grpo``: one advantage per admitted episode from its group's rewards
  (the shuffled-reward null permutes them first), under the declared censoring rule;
- ``branching``: RLOO over each group's siblings, plus the advantages of the continuations
  forked at the siblings' branch points (:mod:`closedloop.training.branch_step`);
- ``gae``: turn-level GAE with a critic over the policy's hidden states, each turn's advantage
  on its own action tokens (:mod:`closedloop.training.gae_step`).

Every RL step's metrics record says which estimator produced its update (``credit.estimator``),
and, for branching, what the branches cost (``credit.branch``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from closedloop.contracts import Episode, PolicyManifest
from closedloop.contracts.batch import TrainingBatch
from closedloop.learn.branching import branch_compute, branch_credit
from closedloop.learn.credit import ESTIMATORS, GroupCredit, group_advantages
from closedloop.learn.critic import TurnCritic
from closedloop.learn.reducers import apply_group_reward_scale
from closedloop.learn.turn_credit import broadcast_turn_values
from closedloop.rollout.collector import CollectedGroup
from closedloop.training.branch_step import step_branches
from closedloop.training.gae_step import credited, load_critic, new_critic, save_critic, turn_gae
from closedloop.training.resume import RunCheckpoints


@dataclass
class StepCredit:
    """The credit of one RL step: the episodes of its batch with their advantages and success
    labels (in batch order), the groups' credit (zero-variance and discard counts), and the
    record the step's metrics keep under ``credit`` (``estimator`` and the estimator's own)."""

    estimator: str
    credits: list[GroupCredit] = field(default_factory=list)
    episodes: list[Episode] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    success: list[bool] = field(default_factory=list)
    record: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    turn_advantages: list[list[float]] | None = None

    def add(self, episode: Episode, advantage: float, reward: float | None) -> None:
        """Append one episode of the batch."""
        self.episodes.append(episode)
        self.advantages.append(advantage)
        self.success.append(bool((reward or 0) >= 1.0))

    def token_advantages(self, batch: TrainingBatch) -> torch.Tensor | None:
        """Per-token advantages of ``batch`` (built from ``episodes``): each turn's advantage
        on its own action tokens, or ``None`` when the estimator gives one per episode."""
        if self.turn_advantages is None:
            return None
        width = max(len(a) for a in self.turn_advantages)
        table = torch.tensor([a + [0.0] * (width - len(a)) for a in self.turn_advantages])
        return broadcast_turn_values(table, batch.turn_ids_B_T, batch.action_mask_B_T)


class RunCredit(RunCheckpoints):
    """The run's credit estimators (a ``TrainingRun`` part)."""

    def step_credit(self, step: int, manifest: PolicyManifest,
                    groups: Sequence[CollectedGroup]) -> StepCredit:
        """The credit of step ``step`` over its admitted ``groups`` (module docstring)."""
        name = self.cfg.credit.estimator
        if name in ESTIMATORS:
            out = StepCredit(name)
            self.group_credit(groups, name, out)
            return out
        if name == "branching":
            return self.branching_credit(step, manifest, groups)
        if name == "gae":
            return self.gae_credit(groups)
        raise NotImplementedError(f"credit.estimator {name!r} is refused at config load")

    def gae_credit(self, groups: Sequence[CollectedGroup]) -> StepCredit:
        """Turn-level GAE with the critic over the policy's hidden states
        (``closedloop.training.gae_step``); the groups' RLOO credit is computed for the
        zero-variance counts only. The episode advantage reported is its turns' mean."""
        out = StepCredit("gae")
        out.credits = self._summary_credit(groups)
        t0 = time.perf_counter()
        episodes = [ep for g in groups for ep in g.episodes if credited(ep)]
        if episodes:
            critic, optimizer = self.turn_critic()
            advantages, out.record = turn_gae(self, critic, optimizer, episodes)
            out.turn_advantages = advantages
            for ep, adv in zip(episodes, advantages, strict=True):
                out.add(ep, sum(adv) / len(adv), ep.trajectory.task_success)
        out.seconds["critic_s"] = time.perf_counter() - t0
        return out

    def _summary_credit(self, groups: Sequence[CollectedGroup]) -> list[GroupCredit]:
        summary = StepCredit("rloo")
        self.group_credit(groups, "rloo", summary)
        return summary.credits

    def turn_critic(self) -> tuple[TurnCritic, torch.optim.Optimizer]:
        """The run's critic and its optimizer (created at first use)."""
        if getattr(self, "_critic", None) is None:
            self._critic = new_critic(self.model, self.cfg.training.seed + 7,
                                      self.cfg.credit.critic_learning_rate)
        return self._critic

    def save_credit_state(self, step: int) -> None:
        """The critic beside checkpoint ``step`` (gae only)."""
        if self.cfg.credit.estimator == "gae":
            save_critic(self.dir, step, *self.turn_critic())

    def load_credit_state(self, step: int) -> None:
        """The critic of checkpoint ``step`` (gae only)."""
        if self.cfg.credit.estimator == "gae":
            load_critic(self.dir, step, *self.turn_critic())

    def branching_credit(self, step: int, manifest: PolicyManifest,
                         groups: Sequence[CollectedGroup]) -> StepCredit:
        """RLOO over each group's siblings, plus each branch set's A_{t,k} = G_{t,k} - mean of
        the others on the branches' own tokens (the copied prefix has action mask 0). Records
        the branches' compute (sets, continuations, own turns and action tokens, seconds)."""
        out = StepCredit("branching")
        self.group_credit(groups, "rloo", out)
        t0 = time.perf_counter()
        branches, replay_s = step_branches(self, step, manifest, groups)
        out.seconds["branch_s"] = time.perf_counter() - t0
        scored = zero = 0
        for bg in branches:
            credit = branch_credit(bg.episodes)
            if credit.advantages is None:
                continue
            scored += 1
            zero += credit.zero_variance
            for pos, i in enumerate(credit.member_indices):
                ep = bg.episodes[i]
                out.add(ep, float(credit.advantages[pos]), ep.trajectory.task_success)
        cost = branch_compute([bg.episodes for bg in branches])
        out.record = {"parent_estimator": "rloo", "branch": {
            **cost.to_dict(), "k": self.cfg.credit.branch_k, "rule": self.cfg.credit.branch_rule,
            "scored_sets": scored, "zero_variance_sets": zero,
            "discarded_sets": len(branches) - scored, "replay_s": replay_s,
            "seconds": out.seconds["branch_s"]}}
        return out

    def group_credit(self, groups: Sequence[CollectedGroup], estimator: str,
                     out: StepCredit) -> None:
        """Trajectory-level advantages of every group's members into ``out``."""
        for g in groups:
            trajs = [ep.trajectory for ep in g.episodes]
            rewards = self._control_rewards(g.lease.group_id, [t.task_success for t in trajs])
            censored = [t.termination.is_censored or t.quarantine_reason is not None
                        or t.task_success is None for t in trajs]
            credit = group_advantages(rewards, estimator, censored,
                                      self.cfg.credit.censor_rule)
            out.credits.append(credit)
            if credit.advantages is None:
                continue
            a = credit.advantages
            if self.cfg.credit.group_reward_scale == "std":
                scored = torch.tensor([rewards[i] for i in credit.member_indices])
                a = apply_group_reward_scale(a, scored, "std")
            for pos, i in enumerate(credit.member_indices):
                out.add(g.episodes[i], float(a[pos]), rewards[i])

    def _control_rewards(self, group_id: str, rewards: list[float | None]) -> list[float | None]:
        """The shuffled-reward null control: permute scored rewards within the group.

        The permutation is seeded by the group id, so a resumed run permutes identically. With
        ``reward_control: none`` the rewards are returned unchanged.
        """
        if self.cfg.credit.reward_control == "none":
            return rewards
        scored = [i for i, r in enumerate(rewards) if r is not None]
        values = [rewards[i] for i in scored]
        random.Random(f"shuffle/{group_id}").shuffle(values)
        out = list(rewards)
        for i, v in zip(scored, values, strict=True):
            out[i] = v
        return out
