"""Gates on whether the RL arm's update was valid and informative, read from the run's metrics.

``ratio_on_policy``: a ratio-free objective (``uses_ratio`` False: ``reinforce_with_kl``) is the
policy gradient only
when the batch was sampled by the policy being trained, i.e. πθ/π_beh = 1 on every action token
of a fresh synchronous batch. Each RL step logs, over the batch's action tokens,
``ratio/abs_log_ratio_max`` = max_t |log πθ(a_t) − log π_beh(a_t)| and
``ratio/abs_log_ratio_p99`` = the exact 0.99 quantile of the same values
(``closedloop.learn.objectives``). The gate fails when

- the trainer scored at another temperature than the sampler drew at (docs/concepts.md,
  tempered scoring);
- float32 (or any run not audited against the bf16 same-engine baseline): a step's max exceeds
  τ = ``consistency.max_abs_log_ratio``;
- bfloat16 run audited against the bf16 same-engine baseline: a step's p99 exceeds
  max(τ, ``audit.json`` ``tolerance_p99``), where ``tolerance_p99`` = max(τ_audit, 2·p99_t b_t)
  and b_t = |log π_bf16(a_t) − log π_fp32(a_t)| on the audited tokens
  (``closedloop.learn.logprob_audit.audit_tolerances``). bf16 rounding on both sides gives |log r| a
  rare-token tail whose maximum grows with the number of tokens it is taken over, so a step's
  max is not comparable with the audit's max over another number of tokens; a quantile is.
  The step max is reported in the evidence, not gated;
- a step logged no value of the statistic it is gated on.

Objectives with ratios (``ppo_clip``) correct for the mismatch, so the gate does not apply to them.

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

from closedloop.evaluate.gates.base import Gate, GateOptions, ratio_free
from closedloop.evaluate.rundir import RunDir, eval_summary

DEFAULT_MAX_ABS_LOG_RATIO = 1e-3
MAX_KEY = "ratio/abs_log_ratio_max"
P99_KEY = "ratio/abs_log_ratio_p99"
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


@dataclass(frozen=True)
class RatioBound:
    """The per-step statistic ``ratio_on_policy`` gates, its bound, and where the bound came
    from (see the module doc)."""

    key: str
    label: str
    tolerance: float
    source: str


def ratio_bound(run: RunDir) -> RatioBound:
    """p99 against the audit's bf16 bound for a bf16 run audited against the bf16 same-engine
    baseline; max against ``consistency.max_abs_log_ratio`` otherwise."""
    declared = float(run.section("consistency").get("max_abs_log_ratio",
                                                    DEFAULT_MAX_ABS_LOG_RATIO))
    audit = run.audit or {}
    if not (run.precision == "bfloat16"
            and audit.get("tolerance_source") == "bf16_same_engine_baseline"):
        return RatioBound(MAX_KEY, "max", declared, "consistency.max_abs_log_ratio")
    audited = _float(audit.get("tolerance_p99"))
    if audited is None:
        return RatioBound(P99_KEY, "p99", declared,
                          "consistency.max_abs_log_ratio: audit.json has no tolerance_p99")
    if audited <= declared:
        return RatioBound(P99_KEY, "p99", declared, "consistency.max_abs_log_ratio")
    return RatioBound(P99_KEY, "p99", audited, "audit.json tolerance_p99 (bf16 same-engine "
                                               "baseline)")


def _temperature_problem(sampled_t: float | None, scored_t: float | None) -> list[str]:
    if sampled_t is None or scored_t is None or math.isclose(sampled_t, scored_t, rel_tol=1e-9):
        return []
    return [f"the trainer scored πθ at temperature {scored_t} but the sampler drew at "
            f"{sampled_t}: π_beh is not πθ"]


def gate_ratio_on_policy(run: RunDir, opts: GateOptions) -> Gate:
    """Every RL step of a ratio-free objective had its |log πθ/π_beh| tail within the bound
    (max in float32, p99 in an audited bf16 run) at the sampler's temperature."""
    trainer = run.trainer or {}
    objective = str(trainer.get("objective") or run.section("update").get("objective"))
    bound = ratio_bound(run)
    sampled_t = _float(run.section("rollout").get("temperature"))
    scored_t = _float(trainer.get("temperature", 1.0))
    evidence: dict[str, Any] = {"objective": objective, "statistic": bound.key,
                                "tolerance": bound.tolerance, "tolerance_source": bound.source,
                                "sampler_temperature": sampled_t,
                                "trainer_temperature": scored_t}
    if not ratio_free(objective):
        return Gate("ratio_on_policy", True, evidence,
                    f"{objective} carries its own ratio: not a ratio-free objective",
                    applicable=False)
    updates = [r for r in run.metrics_of("rl_step") if r.get("metrics")]
    gated = [(r.get("step"), _float(r["metrics"].get(bound.key))) for r in updates]
    step_max = [v for r in updates if (v := _float(r["metrics"].get(MAX_KEY))) is not None]
    step_p99 = [v for r in updates if (v := _float(r["metrics"].get(P99_KEY))) is not None]
    bad = [(s, v) for s, v in gated if v is not None and v > bound.tolerance]
    evidence.update({"steps": len(updates), "max_abs_log_ratio": max(step_max, default=None),
                     "max_abs_log_ratio_p99": max(step_p99, default=None),
                     "steps_over": len(bad)})
    problems = _temperature_problem(sampled_t, scored_t)
    problems += [f"step {s}: {bound.label} |log r| = {v:.3g} > {bound.tolerance:.3g} "
                 f"({bound.source})" for s, v in bad[:3]]
    problems += [f"step {s} logged no {bound.key}" for s, v in gated if v is None][:3]
    if problems:
        return Gate("ratio_on_policy", False, evidence, "; ".join(problems))
    if not updates:
        return Gate("ratio_on_policy", None, evidence, "no RL step updated θ: ratios not seen")
    worst = max(v for _, v in gated if v is not None)
    ungated = "" if bound.key == MAX_KEY or not step_max else (
        f" (step max {max(step_max):.2g}, not gated in bf16)")
    return Gate("ratio_on_policy", True, evidence,
                f"{len(updates)} steps: {bound.label} |log πθ/π_beh| {worst:.2g} <= "
                f"{bound.tolerance:.2g}{ungated} at temperature {scored_t}")


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
