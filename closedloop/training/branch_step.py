"""Branches of an RL step (branching credit, docs/credit.md): which siblings are branched, their
agent prefixes restored, K continuations each collected under the step's behaviour manifest and
kept in ``traces/step-NNNN-branches.jsonl`` (reused as is when a resumed step finds it).

Targets: in each admitted group, in sample order, the first ``credit.branch_episodes_per_group``
scored siblings that have a branch point under ``credit.branch_rule``. Each target's prefix is
restored by verified replay (``closedloop.rollout.prefix.restore_prefix``); a segment store that
kept every turn's snapshot at collection time would replace that replay, nothing else.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from closedloop.contracts import Episode, PolicyManifest, TraceWriter, load_episodes
from closedloop.progress import Progress, log
from closedloop.rollout.branching import BranchCollector, BranchRule, branch_points
from closedloop.rollout.collector import CollectedGroup, CollectorConfig
from closedloop.rollout.prefix import restore_prefix
from closedloop.training.run_policy import RunPolicy

__all__ = ["branch_targets", "step_branches"]


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


def step_branches(run: RunPolicy, step: int, manifest: PolicyManifest,
                  groups: Sequence[CollectedGroup]) -> tuple[list[CollectedGroup], float]:
    """The branch groups of step ``step`` (collected now, or reloaded from their trace) and
    the seconds spent restoring prefixes by replay (0 when reloaded)."""
    c = run.cfg.credit
    path = run.dir / "traces" / f"step-{step:04d}-branches.jsonl"
    if path.is_file():
        log(f"step {step}: reusing the branches in {path.name}")
        return _reload(path), 0.0
    t0 = time.perf_counter()
    prefixes = []
    for episode, turn in branch_targets(groups, c.branch_rule, c.branch_episodes_per_group):
        env = run.package.make_env()
        prefixes.append((restore_prefix(episode, turn, env), env))
    replay_s = time.perf_counter() - t0
    partial = path.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    with TraceWriter(partial) as writer:
        collector = BranchCollector(
            run.model_source(manifest), run.renderer, run.package.make_env, run.verifier,
            run.package.family_split, manifest, run.run_id, writer,
            CollectorConfig(max_turns=run.cfg.environment.max_turns,
                            sampling_salt=run.cfg.training.seed))
        with Progress(len(prefixes) * c.branch_k, f"step {step} branches") as bar:
            branches = collector.collect_branches(prefixes, c.branch_k, progress=bar.update)
    os.replace(partial, path)
    return branches, replay_s
