"""Independent replicates of one experiment (``closedloop experiment CONFIG --seeds N``).

Replicate ``i`` is the whole four-arm experiment (``closedloop.experiments.controls``) with
``training.seed = base + i``: its own SFT warm start (LoRA init, demonstration noise and order),
its own RL sampling, task draws and evaluation sampling, on the *same* task sets
(``environment.task_seed`` is not varied), so replicates differ only in the seeds of learning.

For each suite and each arm, the effect is the paired difference from that replicate's frozen
arm, per replicate (its own 95% bootstrap interval over tasks) and pooled. Replicates share the
tasks, so tasks are the resampling unit of the pooled interval too (a task's difficulty is shared
by its replicates; resampling (replicate, task) pairs as if independent would be too narrow):

    Δ_pooled = mean_t [ mean_r success_arm(r, t) − mean_r success_frozen(r, t) ],

over the tasks scored in both arms of every replicate, with a 95% paired percentile-bootstrap
interval over tasks. A replicate without a gain is
reported as it is; the pooled interval does not hide it (``replicates_with_gain`` counts them).

Replicates are independent, so they may run on different machines: ``only`` runs a subset of the
indices; the others are pooled when their ``experiment.json`` is already under the root (copied
from where they ran) and their frozen arm recorded the replicate's own config, and are listed as
``missing`` when absent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from closedloop.config import RunConfig
from closedloop.errors import ConfigDriftError
from closedloop.evaluate.stats import paired_bootstrap_ci, uniform_outcome
from closedloop.experiments.controls import ARMS, paired_diff, run_experiment
from closedloop.policy.registry import atomic_write_bytes
from closedloop.progress import log
from closedloop.training.integrity import recorded_config_differences


def replicate_config(cfg: RunConfig, index: int) -> RunConfig:
    """The config of replicate ``index``: every learning seed offset by ``index``."""
    return replace(cfg, training=replace(cfg.training, seed=cfg.training.seed + index))


def run_replicates(cfg: RunConfig, root: str | Path, n: int,
                   config_override: str | None = None,
                   only: list[int] | None = None,
                   claim_of: Callable[[Path], dict[str, Any] | None] | None = None
                   ) -> dict[str, Any]:
    """Run (or resume) ``n`` replicates under ``root/replicate-<i>`` (``only``: just these
    indices, pooling the others found finished on disk); write replicates.json once, atomically
    (``config_override``: the declared reason for a config that differs from the recorded one).

    ``claim_of(replicate_dir)`` (the CLI passes one that writes the replicate's report) returns
    that replicate's claim, or None; with it the claims and ``pool_measured`` are in the file.
    """
    if n < 1:
        raise ValueError(f"--seeds must be >= 1, got {n}")
    bad = sorted(i for i in (only or []) if not 0 <= i < n)
    if bad:
        raise ValueError(f"--only: replicate indices must be in 0..{n - 1}, got {bad}")
    out_dir = Path(root)
    results: list[dict[str, Any]] = []
    missing: list[int] = []
    for i in range(n):
        rep_dir = out_dir / f"replicate-{i}"
        t0 = time.perf_counter()
        if only is not None and i not in only:
            done = rep_dir / "experiment.json"
            if not done.is_file():
                missing.append(i)
                continue
            _check_recorded_config(rep_dir, replicate_config(cfg, i), config_override)
            result = json.loads(done.read_text(encoding="utf-8"))
            result["wall_s_this_launch"] = None  # ran elsewhere; its own logs hold the time
        else:
            log(f"replicates: {i + 1}/{n} (training.seed {cfg.training.seed + i})")
            result = run_experiment(replicate_config(cfg, i), rep_dir, config_override)
            result["wall_s_this_launch"] = time.perf_counter() - t0  # a resume: this launch
        result["replicate"], result["training_seed"] = i, cfg.training.seed + i
        results.append(result)
    pooled = pool_replicates(results, seed=cfg.training.seed)
    data = {"replicates": results, "pooled": pooled, "n": n, "missing": missing}
    if claim_of is not None:
        claims = {r["replicate"]: claim_of(out_dir / f"replicate-{r['replicate']}")
                  for r in results}
        pool_measured(data, {i: c for i, c in claims.items() if c is not None},
                      seed=cfg.training.seed)
    atomic_write_bytes(out_dir / "replicates.json",
                       (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())
    return data


def pool_measured(data: dict[str, Any], claims: dict[int, dict[str, Any]],
                  seed: int = 0) -> dict[str, Any]:
    """Add each replicate's claim (its report's) to ``data`` and the effect pooled over the
    replicates whose gates all passed (``pooled_measured``): a replicate with a failed or
    unmeasured gate has no measured comparison, so it does not enter that pool; ``pooled``
    keeps every replicate."""
    measured = [r for r in data["replicates"]
                if (claims.get(r["replicate"]) or {}).get("all_gates_passed")]
    data["claims"] = {str(i): c for i, c in sorted(claims.items())}
    data["measured_replicates"] = [r["replicate"] for r in measured]
    data["pooled_measured"] = pool_replicates(measured, seed=seed) if measured else {}
    return data


def _check_recorded_config(rep_dir: Path, cfg: RunConfig, override: str | None) -> None:
    """A replicate run elsewhere is pooled only if it ran this replicate's config."""
    frozen = rep_dir / "arms" / "frozen"
    differences = recorded_config_differences(
        frozen, cfg.to_dict(), "copy the whole replicate directory, or run it here")
    if differences and not override:
        raise ConfigDriftError(frozen / "config.json",
                               f"replicate {rep_dir.name} ran another config "
                               f"({'; '.join(differences[:6])})",
                               "pool only replicates of this config, or declare the change "
                               "with --override-config REASON")


NULL_PAIR = ("rloo", "shuffled")
"""The RL arm against its shuffled-reward null: the reward's share of a change."""


def pool_replicates(results: list[dict[str, Any]], seed: int = 0) -> dict[str, Any]:
    """Per suite: each arm's effect against frozen, per replicate and pooled over (replicate,
    task) units; and, where both ran, ``rloo-vs-shuffled`` (the RL arm against its null) the
    same way. Each entry names its ``baseline``; its per-replicate rows carry
    ``diff_vs_<baseline>``."""
    pooled: dict[str, Any] = {}
    suites = sorted({s for r in results for s in r.get("suites", {})})
    for suite in suites:
        pooled[suite] = {}
        suite_arms = [r.get("suites", {}).get(suite, {}).get("arms", {}) for r in results]
        pairs = [(arm, "frozen") for arm in ARMS if arm != "frozen"] + [NULL_PAIR]
        for arm, baseline in pairs:
            if not any(arm in arms and baseline in arms for arms in suite_arms):
                continue  # an arm this suite does not evaluate
            name = arm if baseline == "frozen" else f"{arm}-vs-{baseline}"
            pooled[suite][name] = _pool_pair(results, suite_arms, arm, baseline, seed)
    return pooled


def _pool_pair(results: list[dict[str, Any]], suite_arms: list[dict[str, Any]], arm: str,
               baseline: str, seed: int) -> dict[str, Any]:
    key = f"diff_vs_{baseline}"
    treated: dict[str, list[float]] = {}
    base: dict[str, list[float]] = {}
    per_rep = []
    for r, arms in zip(results, suite_arms, strict=True):
        a, b = arms.get(arm, {}), arms.get(baseline, {})
        a_tasks, b_tasks = a.get("per_task") or {}, b.get("per_task") or {}
        common = sorted(set(a_tasks) & set(b_tasks))
        for task in common:
            treated.setdefault(task, []).append(float(a_tasks[task]))
            base.setdefault(task, []).append(float(b_tasks[task]))
        diff = a.get(key) or paired_diff(a_tasks, b_tasks, seed)
        per_rep.append({"replicate": r["replicate"], "success": a.get("success"),
                        f"{baseline}_success": b.get("success"), key: diff})
    complete = [t for t, v in treated.items() if len(v) == len(results)]
    entry: dict[str, Any] = {"baseline": baseline, "per_replicate": per_rep,
                             "replicates_with_gain": sum(
                                 1 for p in per_rep if (p[key] or {}).get("lo", 0) > 0)}
    pooled_a = {t: sum(treated[t]) / len(treated[t]) for t in complete}
    pooled_b = {t: sum(base[t]) / len(base[t]) for t in complete}
    if len(complete) >= 2 and uniform_outcome(pooled_a, pooled_b) is None:  # else no signal
        ci = paired_bootstrap_ci(pooled_a, pooled_b, seed=seed)
        entry["pooled"] = {"estimate": ci.estimate, "lo": ci.lo, "hi": ci.hi, "tasks": ci.n,
                           "replicates": len(results), "excludes_zero": ci.lo > 0 or ci.hi < 0}
    return entry
