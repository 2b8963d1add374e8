"""The four controls from one cold start (docs/concepts.md, four controls).

    frozen     the warm-started policy, no update (its held-out result is the start evaluation)
    rloo       the normal synchronous RL arm
    shuffled   the null: the same loop with rewards permuted within each group and, by a fair
               coin per group, reflected about the group mean (docs/null-control.md)
    sft_only   supervised steps on fresh demonstrations, trained action tokens matched to rloo

Every arm starts from the same warm start (its adapter is copied, not retrained) and is
evaluated on the same held-out tasks with the same seeds and the same scaffold. With
``credit.experiment_arm`` an optional fifth arm trains with that credit estimator
(``closedloop.experiments.credit_arm``); every trained RL arm's entry reports its compute.
Each arm's success is reported with its paired difference from ``frozen`` (bootstrap over
tasks). The
experiment directory holds ``experiment.json`` and one run directory per arm under ``arms/``.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from closedloop.config import RunConfig
from closedloop.contracts import load_episodes
from closedloop.engine import PrecisionChoice, release_free_memory
from closedloop.errors import RunStateError
from closedloop.evaluate.heldout import EvalSummary, summarize_eval
from closedloop.evaluate.stats import shared_task_comparison
from closedloop.experiments.credit_arm import OPTIONAL_ARMS, arm_compute, credit_arm_config
from closedloop.learn.null_control import RewardControl
from closedloop.policy.registry import atomic_write_bytes, version_name
from closedloop.progress import log, phase, phase_times, reset_phases
from closedloop.training.integrity import recorded_meta
from closedloop.training.loop import evaluate_start, final_suites, opened_run, train
from closedloop.training.resume import resume
from closedloop.training.run import publish
from closedloop.training.run_evaluation import audit_frozen, eval_name, evaluate, evaluate_retain
from closedloop.training.warm_start import sft_only

ARMS = ("frozen", "rloo", "shuffled", "sft_only")
NULL_CONTROL: RewardControl = "shuffle_flip_within_group"
"""The shuffled arm's reward null: the within-group shuffle with a sign flip, zero expected
update for every reducer and for update rules odd in the gradient (docs/null-control.md)."""
SHARED = ("sft/adapter.pt", "sft/result.json", "traces/sft-demos.jsonl",
          "traces/eval-start.jsonl", "traces/eval-start-family.jsonl",
          "traces/eval-start-train.jsonl", "traces/eval-retain-start.jsonl", "audit.json",
          "package_check.json")
SUITE_ARMS = ("frozen", "rloo", "shuffled")
"""The arms evaluated on the family-disjoint and the train suites: each suite's comparison is RL
final − frozen start, beside the shuffled-reward null on the same suite (a gain the null shares
is not the reward's). The SFT-only control answers the template-disjoint claim and skips them;
the retain suites' final evaluation is the RL arm's alone."""


def _copy_cold_start(cold: Path, arm: Path) -> None:
    """Give an arm the cold start's warm-start adapter and start evaluation."""
    for rel in SHARED:
        src, dst = cold / rel, arm / rel
        if src.is_file() and not dst.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def _eval_of(run_dir: Path, label: str, cfg: RunConfig, suite: str = "heldout") -> EvalSummary:
    _, episodes = load_episodes(run_dir / "traces" / f"eval-{eval_name(label, suite)}.jsonl")
    return summarize_eval(episodes, k=cfg.evaluation.attempts_per_task, seed=cfg.training.seed)


def _suites(cfg: RunConfig) -> tuple[str, ...]:
    """``heldout`` (the template-disjoint suite, every arm), then ``family`` (families absent
    from training) and ``train`` (the tasks RL draws its groups from: what the gradient moved in
    distribution, not a capability claim) where the config evaluates them."""
    return ("heldout", *final_suites(cfg))


def _cold_start(cfg: RunConfig, frozen_dir: Path, config_override: str | None = None) -> None:
    """Warm start, publish v0000, evaluate it on every suite and audit it: the frozen arm."""
    with opened_run(cfg, frozen_dir, config_override) as run:
        if not resume(run):
            publish(run, version_name(0))
        manifest = run.registry.manifest(version_name(0))
        evaluate_start(run)
        evaluate_retain(run, "start", manifest)
        if not (frozen_dir / "audit.json").is_file():
            audit_frozen(run, "start", manifest)


def cold_start_precision(frozen_dir: Path) -> PrecisionChoice | None:
    """The precision the cold start resolved (its config.json): every arm of the experiment
    adopts it, so the arms compute alike even where a measured race decided."""
    recorded = recorded_meta(frozen_dir).get("precision")
    return None if recorded is None else PrecisionChoice.from_dict(recorded)


def _sft_only(cfg: RunConfig, arm_dir: Path, tokens: int,
              config_override: str | None = None,
              precision: PrecisionChoice | None = None) -> None:
    with opened_run(cfg, arm_dir, config_override, precision) as run:
        if not (arm_dir / "traces" / "eval-final.jsonl").is_file():
            publish(run, version_name(0))
            sft_only(run, tokens, "matched")
        final = run.registry.manifest(version_name(cfg.training.rl_steps))
        evaluate(run, "final", final)


def _final_suites(cfg: RunConfig, arm_dir: Path, config_override: str | None) -> None:
    """Evaluate a finished arm's final policy on each of ``final_suites`` and the retain suites
    it has not been evaluated on (an experiment directory written before that suite was
    evaluated)."""
    missing = [s for s in final_suites(cfg)
               if not (arm_dir / "traces" / f"eval-{eval_name('final', s)}.jsonl").is_file()]
    retain = bool(cfg.evaluation.retain_suites) and not (
        arm_dir / "traces" / "eval-retain-final.jsonl").is_file()
    if not missing and not retain:
        return
    log(f"experiment: arm {arm_dir.name}, final policy on the "
        f"{', '.join(missing + (['retain'] if retain else []))} suite(s)")
    with opened_run(cfg, arm_dir, config_override) as run:
        if not resume(run):
            raise RunStateError(arm_dir, "the arm's summary exists but no checkpoint resumes",
                                "delete the arm's directory to train it again")
        final = run.registry.manifest(version_name(cfg.training.rl_steps))
        for suite in missing:
            evaluate(run, "final", final, suite=suite)
        if retain:
            evaluate_retain(run, "final", final)


SFT_TOKEN_TOLERANCE = 0.25
"""The SFT-only arm's trained action tokens must lie within this relative tolerance of the RL
arm's (it stops at the first batch that reaches them, so it overshoots by at most one batch;
it falls short only when its demonstrations run out)."""


def token_match(rl_tokens: int, sft_tokens: int | None) -> dict[str, Any]:
    """The SFT-only arm's trained action tokens against the RL arm's: ``within`` when
    |sft − rl| <= ``SFT_TOKEN_TOLERANCE`` · rl (``None`` when the SFT-only arm logged none)."""
    within = None if sft_tokens is None else \
        abs(sft_tokens - rl_tokens) <= SFT_TOKEN_TOLERANCE * rl_tokens
    return {"rl": rl_tokens, "sft_only": sft_tokens, "tolerance": SFT_TOKEN_TOLERANCE,
            "within": within}


def _sft_only_tokens(run_dir: Path) -> int | None:
    """The action tokens the SFT-only arm trained on (its ``sft_only`` metrics record)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "sft_only":
            return int(rec.get("trained_action_tokens") or 0)
    return None


def _trained_tokens(run_dir: Path) -> int:
    """Action tokens the RL arm's optimizer steps trained on (from its metrics)."""
    total = 0
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "rl_step":
            total += int(rec.get("metrics", {}).get("batch/n_action_tokens") or 0)
    return total


@contextmanager
def _arm_phase(name: str) -> Iterator[None]:
    """Time an arm as a phase; once it has finished, return the heap it freed to the OS (the
    tuned allocator keeps it) before the next arm starts."""
    with phase(name):
        yield
    release_free_memory()


def run_experiment(cfg: RunConfig, exp_dir: str | Path,
                   config_override: str | None = None) -> dict[str, Any]:
    """Run (or resume) the four arms and write experiment.json; return its content.

    The shuffled arm runs the same loop and budgets as rloo; its held-out evaluations are the
    start (shared) and the final one (``curve_points: 2``): the learning curve is the RL arm's.
    """
    root = Path(exp_dir)
    arms = {name: root / "arms" / name for name in ARMS}
    t0 = time.perf_counter()
    reset_phases()
    log("experiment: cold start (warm start, start evaluation, audit) = the frozen arm")
    with _arm_phase("cold start (the frozen arm)"):
        _cold_start(cfg, arms["frozen"], config_override)
    precision = cold_start_precision(arms["frozen"])
    controls: tuple[tuple[str, RewardControl], ...] = (
        ("rloo", "none"), ("shuffled", NULL_CONTROL))
    for name, control in controls:
        arm_cfg = replace(cfg, credit=replace(cfg.credit, reward_control=control))
        if control != "none":
            arm_cfg = replace(arm_cfg, evaluation=replace(arm_cfg.evaluation, curve_points=2))
        if not (arms[name] / "summary.json").is_file():
            _copy_cold_start(arms["frozen"], arms[name])
            log(f"experiment: arm {name}")
            with _arm_phase(f"arm {name}"):
                train(arm_cfg, arms[name], config_override,
                      final_other_suites=name in SUITE_ARMS, final_retain=name in SUITE_ARMS,
                      precision=precision)
        elif name in SUITE_ARMS:
            _final_suites(arm_cfg, arms[name], config_override)
    if cfg.credit.experiment_arm != "none":  # the optional credit arm (credit_arm.py)
        name = cfg.credit.experiment_arm
        arms[name] = root / "arms" / name
        if not (arms[name] / "summary.json").is_file():
            _copy_cold_start(arms["frozen"], arms[name])
            log(f"experiment: arm {name} (credit.estimator {name})")
            with _arm_phase(f"arm {name}"):
                train(credit_arm_config(cfg), arms[name], config_override,
                      final_other_suites=False, final_retain=False, precision=precision)
    tokens = _trained_tokens(arms["rloo"])
    _copy_cold_start(arms["frozen"], arms["sft_only"])
    log(f"experiment: arm sft_only, matched to {tokens} RL action tokens")
    with phase("arm sft_only"):
        _sft_only(cfg, arms["sft_only"], tokens, config_override, precision)
    result = summarize_experiment(cfg, arms, tokens)
    result["wall_s_this_launch"] = time.perf_counter() - t0
    result["phases_this_launch"] = phase_times()
    result["precision"] = precision.to_dict() if precision is not None else None
    # replicates treat an existing experiment.json as a finished replicate: never half-written
    atomic_write_bytes(root / "experiment.json",
                       (json.dumps(result, indent=2, sort_keys=True) + "\n").encode())
    return result


def _arm_entry(summary: EvalSummary, base: dict[str, float] | None, cfg: RunConfig,
               path: Path) -> dict[str, Any]:
    """One arm's success on a suite; ``diff_vs_frozen`` against ``base`` (the frozen arm's
    per-task success) unless ``base`` is None (the frozen arm itself)."""
    per_task = summary.per_task_success()
    entry: dict[str, Any] = {"run_dir": str(path), "success": summary.pass_at_1,
                             "success_ci": summary.pass_at_1_ci,
                             "pass_hat_k": summary.pass_hat_k,
                             "invalid_action_rate": summary.invalid_action_rate,
                             "per_task": per_task}
    diff = None if base is None else paired_diff(per_task, base, cfg.training.seed)
    if diff is not None:
        entry["diff_vs_frozen"] = diff
    return entry


def _compute_and_credit_arm(cfg: RunConfig, arms: dict[str, Path],
                            entries: dict[str, dict[str, Any]]) -> None:
    """Each trained RL arm's compute (``credit_arm.arm_compute``); the optional credit arm's
    paired difference from the rloo arm (``diff_vs_rloo``), beside its difference from frozen."""
    for name in ("rloo", "shuffled", *OPTIONAL_ARMS):
        if name in entries:
            entries[name]["compute"] = arm_compute(arms[name], cfg.rollout.group_size)
    for name in OPTIONAL_ARMS:
        if name in entries:
            diff = paired_diff(entries[name]["per_task"], entries["rloo"]["per_task"],
                               cfg.training.seed)
            if diff is not None:
                entries[name]["diff_vs_rloo"] = diff


def paired_diff(treated: dict[str, float], base: dict[str, float],
                seed: int) -> dict[str, Any] | None:
    """Per-task ``treated − base`` over the tasks scored in both, with its paired bootstrap
    interval (``estimate``, ``lo``, ``hi``, ``n_tasks``, ``excludes_zero``); None below 2
    tasks, and None when every attempt of both failed or every one succeeded (no signal:
    ``closedloop.evaluate.stats.uniform_outcome``)."""
    ci = shared_task_comparison(treated, base, seed=seed).ci
    if ci is None:
        return None
    return {"estimate": ci.estimate, "lo": ci.lo, "hi": ci.hi, "n_tasks": ci.n,
            "excludes_zero": ci.lo > 0 or ci.hi < 0}


def summarize_experiment(cfg: RunConfig, arms: dict[str, Path], tokens: int) -> dict[str, Any]:
    """Each arm's success on each suite and its paired difference from frozen, with CIs.

    ``arms`` (the template-disjoint held-out suite) keeps its historical place; the
    family-disjoint and train suites, when evaluated, are under ``suites.family`` and
    ``suites.train`` with the same fields.
    """
    out: dict[str, Any] = {"matched_action_tokens": tokens, "seeds": list(cfg.evaluation.seeds),
                           "token_match": token_match(tokens, _sft_only_tokens(
                               arms["sft_only"])), "suites": {}}
    for suite in _suites(cfg):
        frozen = _eval_of(arms["frozen"], "start", cfg, suite)
        base = frozen.per_task_success()
        names = ARMS + tuple(a for a in OPTIONAL_ARMS if a in arms) if suite == "heldout" \
            else SUITE_ARMS
        entries = {name: _arm_entry(frozen if name == "frozen"
                                    else _eval_of(arms[name], "final", cfg, suite),
                                    None if name == "frozen" else base, cfg, arms[name])
                   for name in names}
        out["suites"][suite] = {"tasks": len(base), "arms": entries}
        if suite == "heldout":
            _compute_and_credit_arm(cfg, arms, entries)
    out["arms"] = out["suites"]["heldout"]["arms"]
    out["heldout_tasks"] = out["suites"]["heldout"]["tasks"]
    return out
