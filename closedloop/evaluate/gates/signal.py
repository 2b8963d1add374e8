"""Gates on whether the RL arm's update was valid and informative, read from the run's metrics.

``ratio_on_policy``: a ratio-free objective (``reinforce_with_kl``) is the policy gradient only
when the batch was sampled by the policy being trained, i.e. πθ/π_beh = 1 on every action token
of a fresh synchronous batch. Each RL step logs ``ratio/abs_log_ratio_max`` = max |log πθ − log
π_beh| over the batch's action tokens (``closedloop.learn.objectives``); the gate fails when any
step exceeds ``consistency.max_abs_log_ratio`` (for a bfloat16 run audited against the bf16
same-engine baseline, the audit's bound when larger: bf16 rounding on both sides moves log-probs
by that much), or when the trainer scored at another temperature
than the sampler drew at (design.md §7, failure 22). Objectives with ratios (``ppo_clip``)
correct for the mismatch, so the gate does not apply to them.

``cold_start_band``: the experiment is informative only if the cold start can both succeed and
fail on what RL trains on. Its success on the train tasks (``eval-start-train``: one attempt
per task) must lie in the preregistered ``evaluation.cold_start_band`` [lo, hi], and its held-out
success (``eval-start``) must be above 0 and below ``hi``: a start at 0 leaves nothing to
sharpen, a start near 1 nothing to gain. Outside either, the gate fails (the design was not met).

``learning_signal``: a group-relative estimator gives no gradient for a zero-variance group
(every sibling scored alike), so an RL arm whose groups were all unanimous trained nothing and
its held-out comparison measures nothing. Over the RL steps::

    informative fraction  f = Σ (scored groups − zero-variance groups) / Σ scored groups
    signal steps          s = #steps with grad norm > 0 and gradient mass > 0

The gate passes when ``f >= evaluation.min_informative_group_fraction`` and
``s / steps >= evaluation.min_signal_step_fraction`` (both preregistered in the config). Short of
either it is NOT MEASURED — "the arm received no (or too little) learning signal" — never a
pass and never "no gain". It is never a failure either: too little signal is not a broken run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from closedloop.evaluate.gates.base import Gate, GateOptions
from closedloop.evaluate.rundir import RunDir, eval_summary

RATIO_FREE_OBJECTIVES = ("reinforce_with_kl",)
DEFAULT_MAX_ABS_LOG_RATIO = 1e-3
DEFAULT_MIN_INFORMATIVE = 0.25
DEFAULT_MIN_SIGNAL_STEPS = 0.5
DEFAULT_BAND = (0.15, 0.6)


@dataclass(frozen=True)
class LearningSignal:
    """What the RL steps of a run received (see the module doc)."""

    steps: int
    scored_groups: int
    informative_groups: int
    signal_steps: int
    grad_mass: float
    min_informative: float
    min_signal_steps: float

    @property
    def informative_fraction(self) -> float | None:
        """Informative groups / scored groups (None without a scored group)."""
        return self.informative_groups / self.scored_groups if self.scored_groups else None

    @property
    def sufficient(self) -> bool:
        """Both preregistered minimums met."""
        frac = self.informative_fraction
        return (frac is not None and frac >= self.min_informative and self.steps > 0
                and self.signal_steps / self.steps >= self.min_signal_steps)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the gate's evidence)."""
        return {"steps": self.steps, "scored_groups": self.scored_groups,
                "informative_groups": self.informative_groups,
                "informative_fraction": self.informative_fraction,
                "signal_steps": self.signal_steps, "grad_mass": self.grad_mass,
                "min_informative_group_fraction": self.min_informative,
                "min_signal_step_fraction": self.min_signal_steps}


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def learning_signal(run: RunDir) -> LearningSignal:
    """Count the RL steps' scored and informative groups and the steps that moved θ."""
    ev = run.section("evaluation")
    steps = run.metrics_of("rl_step")
    scored = informative = signal = 0
    mass = 0.0
    for rec in steps:
        credit = rec.get("credit") or {}
        n_scored = int(credit.get("n_scored_groups") or 0)
        scored += n_scored
        informative += max(0, n_scored - int(rec.get("zero_variance") or 0))
        m = rec.get("metrics") or {}
        grad = _float(m.get("optim/grad_norm")) or 0.0
        step_mass = _float(m.get("grad_mass/grad_mass_total")) or 0.0
        mass += step_mass
        if grad > 0 and step_mass > 0:
            signal += 1
    return LearningSignal(
        steps=len(steps), scored_groups=scored, informative_groups=informative,
        signal_steps=signal, grad_mass=mass,
        min_informative=float(ev.get("min_informative_group_fraction", DEFAULT_MIN_INFORMATIVE)),
        min_signal_steps=float(ev.get("min_signal_step_fraction", DEFAULT_MIN_SIGNAL_STEPS)))


def gate_learning_signal(run: RunDir, opts: GateOptions) -> Gate:
    """The RL arm's informative-group fraction and signal steps meet their minimums."""
    sig = learning_signal(run)
    evidence = sig.to_dict()
    if sig.steps == 0:
        return Gate("learning_signal", None, evidence, "no RL step: no learning signal")
    frac = sig.informative_fraction
    if sig.sufficient:
        return Gate("learning_signal", True, evidence,
                    f"{sig.informative_groups}/{sig.scored_groups} informative groups "
                    f"({frac:.2f} >= {sig.min_informative}); {sig.signal_steps}/{sig.steps} "
                    "steps moved θ")
    if not sig.informative_groups:
        why = (f"the RL arm received no learning signal: all {sig.scored_groups} scored groups "
               "were zero-variance, so no gradient; the capability comparison is not measured")
    else:
        why = (f"too little learning signal: {sig.informative_groups}/{sig.scored_groups} "
               f"informative groups (minimum {sig.min_informative}), {sig.signal_steps}/"
               f"{sig.steps} steps moved θ (minimum {sig.min_signal_steps}); the capability "
               "comparison is not measured")
    return Gate("learning_signal", None, evidence, why)


def gate_ratio_on_policy(run: RunDir, opts: GateOptions) -> Gate:
    """Every RL step of a ratio-free objective had max |log πθ/π_beh| within tolerance."""
    trainer = run.trainer or {}
    objective = str(trainer.get("objective") or run.section("update").get("objective"))
    tol = float(run.section("consistency").get("max_abs_log_ratio", DEFAULT_MAX_ABS_LOG_RATIO))
    tol_source = "consistency.max_abs_log_ratio"
    audit = run.audit or {}
    if (run.section("training").get("precision") == "bfloat16"
            and audit.get("tolerance_source") == "bf16_same_engine_baseline"
            and isinstance(audit.get("tolerance_max"), int | float)
            and float(audit["tolerance_max"]) > tol):
        # bf16 matmuls on both sides: the declared bound is the audit's measured bf16 baseline
        tol, tol_source = float(audit["tolerance_max"]), "audit.json bf16 same-engine baseline"
    sampled_t = _float(run.section("rollout").get("temperature"))
    scored_t = _float(trainer.get("temperature", 1.0))
    evidence: dict[str, Any] = {"objective": objective, "tolerance": tol,
                                "tolerance_source": tol_source,
                                "sampler_temperature": sampled_t,
                                "trainer_temperature": scored_t}
    if objective not in RATIO_FREE_OBJECTIVES:
        return Gate("ratio_on_policy", True, evidence,
                    f"{objective} carries its own ratio: not a ratio-free objective",
                    applicable=False)
    updates = [r for r in run.metrics_of("rl_step") if r.get("metrics")]
    worst = [(r.get("step"), _float((r.get("metrics") or {}).get("ratio/abs_log_ratio_max")))
             for r in updates]
    missing = [s for s, v in worst if v is None]
    bad = [(s, v) for s, v in worst if v is not None and v > tol]
    evidence.update({"steps": len(updates), "max_abs_log_ratio": max(
        (v for _, v in worst if v is not None), default=None), "steps_over": len(bad)})
    problems = []
    if sampled_t is not None and scored_t is not None and not math.isclose(
            sampled_t, scored_t, rel_tol=1e-9):
        problems.append(f"the trainer scored πθ at temperature {scored_t} but the sampler drew "
                        f"at {sampled_t}: π_beh is not πθ")
    problems += [f"step {s}: max |log r| = {v:.3g} > {tol:.3g}" for s, v in bad[:3]]
    problems += [f"step {s} logged no ratio/abs_log_ratio_max" for s in missing[:3]]
    if problems:
        return Gate("ratio_on_policy", False, evidence, "; ".join(problems))
    if not updates:
        return Gate("ratio_on_policy", None, evidence, "no RL step updated θ: ratios not seen")
    return Gate("ratio_on_policy", True, evidence,
                f"{len(updates)} steps: max |log πθ/π_beh| {evidence['max_abs_log_ratio']:.2g} "
                f"<= {tol:.2g} at temperature {scored_t}")


def gate_cold_start_band(run: RunDir, opts: GateOptions) -> Gate:
    """The cold start's train success lies in the preregistered band; held-out in (0, hi)."""
    band = run.section("evaluation").get("cold_start_band") or list(DEFAULT_BAND)
    lo, hi = float(band[0]), float(band[1])
    train, held = eval_summary(run, "start-train"), eval_summary(run, "start")
    evidence: dict[str, Any] = {
        "band": [lo, hi], "train_success": None if train is None else train.pass_at_1,
        "train_ci": None if train is None else train.pass_at_1_ci,
        "heldout_success": None if held is None else held.pass_at_1,
        "heldout_ci": None if held is None else held.pass_at_1_ci}
    if train is None or train.pass_at_1 is None or held is None or held.pass_at_1 is None:
        return Gate("cold_start_band", None, evidence,
                    "no scored cold-start evaluation on the train and held-out tasks")
    problems = []
    if not lo <= train.pass_at_1 <= hi:
        problems.append(f"cold start's train success {train.pass_at_1:.3f} is outside the "
                        f"preregistered band [{lo}, {hi}]")
    if not 0 < held.pass_at_1 < hi:
        problems.append(f"cold start's held-out success {held.pass_at_1:.3f} is not in (0, {hi})")
    if problems:
        return Gate("cold_start_band", False, evidence, "; ".join(problems))
    return Gate("cold_start_band", True, evidence,
                f"train {train.pass_at_1:.3f} in [{lo}, {hi}], held-out {held.pass_at_1:.3f}")
