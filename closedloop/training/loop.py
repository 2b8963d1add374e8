"""The reference training loop: the minimal training loop (docs/concepts.md) as the run's roles
taking turns.

    for step in range(rl_steps):
        order    = sampler draws the round's groups          (rl_step.draw_order)
        groups   = worker.rollout(order) under v_step        (generator, RolloutWorker)
        scored   = verifier_step.score(groups)               (clean-room verifier step)
        admitted = admission(scored, u=step)                 (complete, fresh, one version)
        batch    = credit(admitted)                          (rl_step.assign_credit)
        trainer.update(batch); trainer.checkpoint(step + 1)  (TrainerRole)
        publisher.stage(v_step+1); worker acks what it holds; ACTIVE = v_step+1

Each line is one library call; ``closedloop.training.rl_step.rl_step`` holds the per-step
sequence. ``opened_run`` is the one set-up path of every entry point (train, each
experiment arm, reevaluate).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from closedloop.config import RunConfig
from closedloop.engine import PrecisionChoice
from closedloop.evaluate.heldout import EvalSummary
from closedloop.evaluate.package_check import check_before_training, record_check
from closedloop.evaluate.retain import retain_delta
from closedloop.policy.registry import version_name
from closedloop.progress import log
from closedloop.training.frozen_objects import frozen_objects
from closedloop.training.pipeline import run_rl
from closedloop.training.publisher import publication_latency
from closedloop.training.resume import resume
from closedloop.training.rl_step import StepReport
from closedloop.training.run import Run, attach_roles, open_run, publish, write_summary
from closedloop.training.run_evaluation import (
    audit_frozen,
    evaluate,
    evaluate_retain,
    seed_sampler,
)
from closedloop.training.warm_start import warm_start
from closedloop.training.wiring import run_package


def curve_steps(rl_steps: int, points: int) -> tuple[int, ...]:
    """The policy versions (step counts) evaluated on the held-out suite during RL: ``points``
    evenly spaced counts from 0 (the start) to ``rl_steps`` (the final), distinct.

    ``curve_steps(8, 3) == (0, 4, 8)``; ``curve_steps(2, 5) == (0, 1, 2)``.
    """
    if rl_steps <= 0 or points <= 1:
        return (0, rl_steps) if rl_steps > 0 else (0,)
    return tuple(sorted({round(i * rl_steps / (points - 1)) for i in range(points)}))


def evaluate_start(run: Run) -> EvalSummary:
    """The start policy (v0000) on every suite the config asks for; seeds the task sampler
    with the cold start's train outcomes (before the first RL step only)."""
    cfg = run.cfg
    manifest = run.registry.manifest(version_name(0))
    start = evaluate(run, "start", manifest)
    if cfg.evaluation.environment_family_disjoint:
        evaluate(run, "start", manifest, suite="family")
    if cfg.evaluation.cold_start_train_eval:
        train_start = evaluate(run, "start", manifest, suite="train")
        if run.state.step == 0:
            seed_sampler(run, train_start)
    return start


def final_suites(cfg: RunConfig) -> tuple[str, ...]:
    """The suites besides the held-out one that the final policy is evaluated on, each against
    its start evaluation: ``family`` (families absent from training) when
    ``environment_family_disjoint``, and ``train`` (the tasks RL draws from: what the gradient
    moved in distribution, not a capability claim) when ``cold_start_train_eval``."""
    ev = cfg.evaluation
    return (("family",) if ev.environment_family_disjoint else ()) + (
        ("train",) if ev.cold_start_train_eval else ())


def after_step(run: Run, report: StepReport) -> None:
    """Log a finished step; in synchronous mode evaluate its curve point at once (under async
    the worker is collecting: ``train`` evaluates the curve points after the last step)."""
    log(f"step {report.step}: success {report.mean_success}, admitted {report.admitted}/"
        f"{report.groups} groups, zero-variance {report.zero_variance}, "
        f"kl {report.metrics.get('losses/kl')}")
    if run.cfg.rollout.mode == "synchronous":
        evaluate_curve_point(run, report.step + 1)


def evaluate_curve_point(run: Run, step: int) -> None:
    """Held-out evaluation of v_step, when ``step`` is an intermediate curve point."""
    cfg = run.cfg
    if 0 < step < cfg.training.rl_steps and step in curve_steps(cfg.training.rl_steps,
                                                                 cfg.evaluation.curve_points):
        evaluate(run, f"step-{step:04d}", run.registry.manifest(version_name(step)))


@contextmanager
def opened_run(cfg: RunConfig, run_dir: str | Path, config_override: str | None = None,
               precision: PrecisionChoice | None = None) -> Iterator[Run]:
    """The one set-up path: the run directory's environment package checked on its first
    launch, before anything is written (``closedloop.evaluate.package_check``), the run
    directory opened (locked, checked; ``precision``: a resolution to adopt on its first
    launch), its warm start done or reloaded (π_ref = the warm-started policy, "initial_sft")
    and the roles attached (trainer with the RL adapter, generator worker, publisher); closed
    on exit."""
    checked = check_before_training(run_package(cfg.environment), cfg.training.package_check,
                                    Path(run_dir))
    run = open_run(cfg, run_dir, config_override, precision)
    if checked is not None:
        record_check(checked, run.dir)
    try:
        if cfg.sft.enabled:
            warm_start(run)
        attach_roles(run)
        with frozen_objects():  # the set-up's objects out of the collector's walks
            yield run
    finally:
        run.close()


def train(cfg: RunConfig, run_dir: str | Path, config_override: str | None = None,
          final_other_suites: bool = True, final_retain: bool = True,
          precision: PrecisionChoice | None = None) -> dict[str, Any]:
    """Run (or resume) a whole experiment and return its summary (``config_override``: the
    declared reason for a config that differs from the run directory's). ``final_other_suites``
    / ``final_retain`` False skip the final policy's evaluations on ``final_suites`` / the
    retain suites (an experiment's control arm: those claims are the RL arm's); the summary's
    ``retain_delta`` is then None. ``precision``: see ``opened_run``."""
    with opened_run(cfg, run_dir, config_override, precision) as run:
        if not resume(run):
            publish(run, version_name(0))
        start = evaluate_start(run)
        retain_start = evaluate_retain(run, "start", run.registry.manifest(version_name(0)))
        if run.state.step == 0 and not (run.dir / "audit.json").is_file():
            audit_frozen(run, "start", run.registry.manifest(version_name(0)))
        else:
            log("the start policy's evaluation was reused from its trace")
        evaluate_curve_point(run, run.state.step)  # a crash between a step and its curve point
        steps = run_rl(run, on_step=lambda report: after_step(run, report))
        for step in curve_steps(cfg.training.rl_steps, cfg.evaluation.curve_points):
            evaluate_curve_point(run, step)  # under async, the worker was busy until now
        final_version = version_name(cfg.training.rl_steps)
        final = evaluate(run, "final", run.registry.manifest(final_version))
        for suite in final_suites(cfg) if final_other_suites else ():
            evaluate(run, "final", run.registry.manifest(final_version), suite=suite)
        retain = None
        if final_retain:
            retain_final = evaluate_retain(run, "final", run.registry.manifest(final_version))
            retain = retain_delta(retain_start, retain_final, seed=cfg.training.seed).to_dict()
            run.log_metrics("retain", retain)
        run.log_metrics("weight_sync", {"label": "publication", "workers": list(
            run.roles()[2].worker_ids), "timing": publication_latency(run.registry)})
        summary = summarize_run(run, start, final, steps)
        summary["retain_delta"] = retain
        path = write_summary(run, summary)
        log(f"summary written to {path}")
        return summary


def _ci(summary: EvalSummary) -> list[float] | None:
    return list(summary.pass_at_1_ci) if summary.pass_at_1_ci else None


def logged_steps(run: Run) -> list[dict[str, Any]]:
    """Every RL step's record in the run's metrics log, in step order: all launches of a
    resumed run, not only this one."""
    return sorted((m for m in run.ctx.directory.metrics if m.get("kind") == "rl_step"),
                  key=lambda m: int(m["step"]))


def summarize_run(run: Run, start: EvalSummary, final: EvalSummary,
                  steps: list[StepReport]) -> dict[str, Any]:
    """The short summary printed at the end of a run (and kept as summary.json).

    The per-step figures cover every step of the run (from its metrics log, so a resumed run
    reports all of them); ``rl_steps_this_session`` counts the steps this launch trained.
    """
    counts = run.ctx.ledger.counts()
    logged = logged_steps(run)
    scored_groups = sum(int(m["groups"]) - int(m["discarded"]) for m in logged)
    return {
        "run_dir": str(run.dir),
        "model": run.policy.loaded.model_id,
        "heldout_tasks": len(run.ctx.tasks.heldout),
        "heldout_success_start": start.pass_at_1, "heldout_success_start_ci": _ci(start),
        "heldout_success_final": final.pass_at_1, "heldout_success_final_ci": _ci(final),
        "pass_hat_k_start": start.pass_hat_k, "pass_hat_k_final": final.pass_hat_k,
        "invalid_action_rate_start": start.invalid_action_rate,
        "invalid_action_rate_final": final.invalid_action_rate,
        "rl_steps_this_session": len(steps),
        "train_success_by_step": [m.get("mean_success") for m in logged],
        "kl_by_step": [(m.get("metrics") or {}).get("losses/kl") for m in logged],
        "zero_variance_groups": sum(int(m["zero_variance"]) for m in logged),
        "groups_collected": sum(int(m["groups"]) for m in logged),
        "zero_variance_rate": (sum(int(m["zero_variance"]) for m in logged)
                               / max(1, scored_groups)),
        "ledger": {k: v for k, v in counts.__dict__.items()} if hasattr(counts, "__dict__")
        else str(counts),
        "sft_action_tokens": run.state.sft_tokens,
        "seconds_by_step": [m.get("seconds") for m in logged],
    }
