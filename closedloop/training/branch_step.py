"""Branching credit in an RL step (``credit.estimator: branching``; branching credit,
docs/credit.md): which siblings are branched, their agent prefixes restored, K continuations
each collected by the generator worker under the round's behaviour manifest and scored by the
verifier step, kept in ``traces/step-NNNN-branches.jsonl`` (reused as is when a resumed step
finds it), and their advantages added to the siblings' RLOO batch.

Targets: in each admitted group, in sample order, the first ``credit.branch_episodes_per_group``
scored siblings that have a branch point under ``credit.branch_rule``. Each target's prefix is
restored by verified replay (``closedloop.rollout.prefix.restore_prefix``); a segment store that
kept every turn's snapshot at collection time would replace that replay, nothing else.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from closedloop.contracts import Episode, PolicyManifest, TraceWriter, load_episodes
from closedloop.learn.branching import branch_compute, branch_credit
from closedloop.progress import Progress, log
from closedloop.rollout.branching import BranchCollector, BranchRule, branch_points
from closedloop.rollout.collector import CollectorConfig
from closedloop.rollout.prefix import restore_prefix
from closedloop.rollout.verifier_step import CollectedGroup

if TYPE_CHECKING:
    from closedloop.training.rl_step import CreditBatch
    from closedloop.training.run import Run

__all__ = ["branch_targets", "branching_batch", "step_branches"]


def _scored(episode: Episode) -> bool:
    t = episode.trajectory
    return t.termination.is_terminal and t.quarantine_reason is None and t.task_success is not None


def branch_targets(groups: Sequence[CollectedGroup], rule: BranchRule, per_group: int
                   ) -> list[tuple[Episode, int]]:
    """(episode, branch point) pairs of the module docstring, in group and sample order."""
    out: list[tuple[Episode, int]] = []
    for g in groups:
        taken = 0
        for ep in g.episodes:
            if taken == per_group:
                break
            points = branch_points(ep, rule) if _scored(ep) else []
            if points:
                out.append((ep, points[0]))
                taken += 1
    return out


def _reload(path: Path) -> list[CollectedGroup]:
    leases, episodes = load_episodes(path)
    by_group: dict[str, list[Episode]] = {}
    for ep in episodes:
        by_group.setdefault(ep.trajectory.group_id, []).append(ep)
    return [CollectedGroup(lease, tuple(sorted(by_group.get(lease.group_id, []),
                                               key=lambda e: e.trajectory.sample_index)))
            for lease in leases]


def step_branches(run: Run, step: int, manifest: PolicyManifest,
                  groups: Sequence[CollectedGroup]) -> tuple[list[CollectedGroup], float]:
    """The branch groups of step ``step`` (collected now by the worker holding ``manifest``'s
    version, or reloaded from their trace) and the seconds spent restoring prefixes."""
    c, ctx = run.cfg.credit, run.ctx
    path = ctx.directory.trace(f"step-{step:04d}-branches")
    if path.is_file():
        log(f"step {step}: reusing the branches in {path.name}")
        return _reload(path), 0.0
    t0 = time.perf_counter()
    prefixes = []
    for episode, turn in branch_targets(groups, c.branch_rule, c.branch_episodes_per_group):
        env = ctx.package.make_env()
        prefixes.append((restore_prefix(episode, turn, env), env))
    replay_s = time.perf_counter() - t0
    worker = run.roles()[1]
    worker.load(manifest.policy_version)
    partial = path.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    with TraceWriter(partial) as writer:
        collector = BranchCollector(
            worker.source(manifest), run.policy.renderer, ctx.package.make_env, ctx.verifier,
            ctx.package.family_split, manifest, ctx.directory.run_id, writer,
            CollectorConfig(max_turns=run.cfg.environment.max_turns,
                            sampling_salt=run.cfg.training.seed))
        with Progress(len(prefixes) * c.branch_k, f"step {step} branches") as bar:
            branches = collector.collect_branches(prefixes, c.branch_k, progress=bar.update)
    os.replace(partial, path)
    return branches, replay_s


def branching_batch(run: Run, step: int, groups: Sequence[CollectedGroup],
                    siblings: CreditBatch) -> CreditBatch:
    """``siblings`` (RLOO over each admitted group) plus every scored branch set's
    A_{t,k} = G_{t,k} - mean of the others, on the branches' own tokens (the copied prefix has
    action mask 0); records the branches' compute (sets, continuations, own turns and action
    tokens, replay and collection seconds)."""
    c = run.cfg.credit
    manifest = run.registry.manifest(run.state.orders[step].behavior_version)
    t0 = time.perf_counter()
    branches, replay_s = step_branches(run, step, manifest, groups)
    seconds = time.perf_counter() - t0
    episodes, adv, success = (list(siblings.episodes), list(siblings.advantages),
                              list(siblings.success))
    scored = zero = 0
    for bg in branches:
        credit = branch_credit(bg.episodes)
        if credit.advantages is None:
            continue
        scored += 1
        zero += credit.zero_variance
        for pos, i in enumerate(credit.member_indices):
            ep = bg.episodes[i]
            episodes.append(ep)
            adv.append(float(credit.advantages[pos]))
            success.append(bool((ep.trajectory.task_success or 0) >= 1.0))
    record: dict[str, Any] = {"parent_estimator": "rloo", "branch": {
        **branch_compute([bg.episodes for bg in branches]).to_dict(), "k": c.branch_k,
        "rule": c.branch_rule, "scored_sets": scored, "zero_variance_sets": zero,
        "discarded_sets": len(branches) - scored, "replay_s": replay_s, "seconds": seconds}}
    return dataclasses.replace(siblings, estimator="branching", episodes=tuple(episodes),
                               advantages=tuple(adv), success=tuple(success), record=record,
                               seconds={"branch_s": seconds})
