"""One synchronous RL step of a training run: draw the step's groups, collect (or reload)
them, admit them through the ledger, compute group-relative credit (with the shuffled-reward
null control), apply one update, checkpoint, mark the groups consumed and publish."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from closedloop.contracts import Episode, PolicyManifest, content_hash, load_episodes
from closedloop.errors import RunNotReadyError
from closedloop.learn.credit import group_advantages, summarize_credit
from closedloop.policy.registry import version_index, version_name
from closedloop.progress import log
from closedloop.rollout.admission import apply_decision
from closedloop.rollout.collector import CollectedGroup
from closedloop.rollout.ledger import GroupSummary
from closedloop.rollout.tensors import build_training_batch
from closedloop.training.resume import RunCheckpoints
from closedloop.training.wiring import CollectorParts, make_collector


@dataclass(frozen=True)
class StepReport:
    """What one RL step did (also one line of metrics.jsonl)."""

    step: int
    behavior_version: str
    output_version: str | None
    groups: int
    admitted: int
    zero_variance: int
    discarded: int
    mean_success: float | None
    metrics: dict[str, Any]
    seconds: dict[str, float]


class RunRLStep(RunCheckpoints):
    """The RL step (a ``TrainingRun`` part)."""

    def step_groups(self, step: int) -> list[tuple[str, str, int, int]]:
        """The groups of RL step ``step``: tasks from the difficulty-band sampler (each draw's
        stream and propensity are logged), deterministic seeds and group ids."""
        t = self.cfg.training
        rng = random.Random(f"{t.seed}/step/{step}")
        draws = self.sampler.sample(t.groups_per_step, step)
        self.log_metrics("task_draws", {"step": step, "draws": [d.to_dict() for d in draws]})
        return [(f"s{step:04d}-g{j}", d.task_id, rng.randrange(1, 10**6),
                 self.cfg.rollout.group_size) for j, d in enumerate(draws)]

    def collect_step(self, step: int, manifest: PolicyManifest) -> list[CollectedGroup]:
        """Collect (or, after a crash, reload) the complete groups of step ``step``."""
        path = self.dir / "traces" / f"step-{step:04d}.jsonl"
        if path.is_file():
            leases, episodes = load_episodes(path)
            by_group: dict[str, list[Episode]] = {}
            for ep in episodes:
                by_group.setdefault(ep.trajectory.group_id, []).append(ep)
            log(f"step {step}: reusing {len(leases)} buffered groups from {path.name}")
            return [CollectedGroup(lease, tuple(sorted(by_group[lease.group_id],
                                                       key=lambda e: e.trajectory.sample_index)))
                    for lease in leases]
        scale = self.scale_out()
        if scale is not None:  # Ray workers or a vLLM engine (closedloop.training.scale_out)
            from closedloop.training.scale_out import collect_traced

            scale.hold(manifest)
            lease = make_collector(self.model_source(manifest), manifest, CollectorParts(
                self.renderer, self.verifier, self.run_id, None, self.cfg.environment.max_turns,
                self.package)).make_lease
            return collect_traced(scale, lease, manifest, path, self.step_groups(step))
        self.generator.rng.manual_seed(int(content_hash(["step", step])[7:15], 16))
        return self._collect(self.model_source(manifest), manifest, path,
                             self.step_groups(step), f"step {step} collect")

    def rl_step(self, step: int) -> StepReport:
        """collect → verify → admit → credit → loss → one optimizer step → publish."""
        if self.trainer is None:
            raise RunNotReadyError("attach_rl_adapter() first")
        times: dict[str, float] = {}
        t0 = time.perf_counter()
        behavior = version_name(step)
        manifest = self.registry.manifest(behavior)
        groups = self.collect_step(step, manifest)
        times["collect_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        admitted = self._admit(groups, train_version_index=version_index(behavior))
        times["admit_s"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        credits, batch_eps, adv, success = self._credit(admitted)
        summary = summarize_credit(credits)
        metrics: dict[str, Any] = {}
        output: str | None = None
        if batch_eps:
            self.ledger.require_admitted([g.lease.group_id for g in admitted])
            batch = build_training_batch(batch_eps, pad_id=self.pad_id)
            result = self.trainer.step(batch, torch.tensor(adv), torch.tensor(success))
            metrics = dict(result.metrics)
        times["update_s"] = time.perf_counter() - t2
        t3 = time.perf_counter()
        self._update_sampler(groups)
        output = version_name(step + 1)
        self.consumed.update(g.lease.group_id for g in admitted)
        self._checkpoint(step + 1, output)
        if admitted:
            self.ledger.mark_consumed([g.lease.group_id for g in admitted], step + 1, output)
        self.publish(output)
        times["publish_s"] = time.perf_counter() - t3
        scores = [ep.trajectory.task_success for g in groups for ep in g.episodes
                  if ep.trajectory.task_success is not None]
        report = StepReport(
            step=step, behavior_version=behavior, output_version=output, groups=len(groups),
            admitted=len(admitted), zero_variance=summary.n_zero_variance,
            discarded=summary.n_discarded,
            mean_success=sum(scores) / len(scores) if scores else None,
            metrics=metrics, seconds=times)
        self.log_metrics("rl_step", {**report.__dict__, "credit": {
            "n_groups": summary.n_groups, "n_scored_groups": summary.n_scored_groups,
            "zero_variance_rate": summary.zero_variance_rate,
            "discard_reasons": dict(summary.discard_reasons)}})
        self.step = step + 1
        return report

    def _update_sampler(self, groups: Sequence[CollectedGroup]) -> None:
        """Per-task success counts for the difficulty bands; infra failures count apart."""
        for g in groups:
            trajs = [ep.trajectory for ep in g.episodes]
            scored = [t.task_success for t in trajs if t.task_success is not None]
            if scored:
                self.sampler.update(g.lease.task_id, sum(1 for s in scored if s >= 1.0),
                                    len(scored))
            for t in trajs:
                if t.quarantine_reason is not None or t.termination.value == "infra_abort":
                    self.sampler.record_failure(g.lease.task_id,
                                                t.quarantine_reason or "infra_abort")
        self.log_metrics("task_sampler", self.sampler.to_dict(
            group_size=self.cfg.rollout.group_size))

    def _admit(self, groups: Sequence[CollectedGroup], train_version_index: int
               ) -> list[CollectedGroup]:
        admitted = []
        for g in groups:
            gid = g.lease.group_id
            trajs = [ep.trajectory for ep in g.episodes]
            known = gid in self.ledger.group_ids()
            if not known:
                self.ledger.record_collected(g.lease, GroupSummary.from_trajectories(trajs))
            state = self.ledger.get(gid).state
            if state == "collected":
                decision = self.admission.admit(trajs, g.lease, train_version_index)
                apply_decision(self.ledger, decision)
                state = self.ledger.get(gid).state
            if state == "admitted":
                admitted.append(g)
        return admitted

    def _credit(self, groups: Sequence[CollectedGroup]) -> tuple[list[Any], list[Episode],
                                                                   list[float], list[bool]]:
        credits, episodes, adv, success = [], [], [], []
        for g in groups:
            trajs = [ep.trajectory for ep in g.episodes]
            rewards = self._control_rewards(g.lease.group_id, [t.task_success for t in trajs])
            censored = [t.termination.is_censored or t.quarantine_reason is not None
                        or t.task_success is None for t in trajs]
            credit = group_advantages(rewards, self.cfg.credit.estimator, censored,
                                      self.cfg.credit.censor_rule)
            credits.append(credit)
            if credit.advantages is None:
                continue
            a = credit.advantages
            if self.cfg.credit.group_reward_scale == "std":
                from closedloop.learn.reducers import apply_group_reward_scale

                scored = torch.tensor([rewards[i] for i in credit.member_indices])
                a = apply_group_reward_scale(a, scored, "std")
            for pos, i in enumerate(credit.member_indices):
                episodes.append(g.episodes[i])
                adv.append(float(a[pos]))
                success.append(bool((rewards[i] or 0) >= 1.0))
        return credits, episodes, adv, success

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
