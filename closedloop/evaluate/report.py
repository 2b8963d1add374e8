"""The core report (docs/gates.md): ``report.json`` and a self-contained ``report.html``.

``build_report(run_dir)`` recomputes everything from the run directory (traces first, then the
ledger, metrics and the gates); ``write_report`` writes the JSON and an HTML page whose PNG plots
are embedded as ``data:`` URIs, so the page is one file (``closedloop.evaluate.report_html``).

The capability claim (``report["claim"]``) follows one rule: a gain is stated only when every
gate passed *and* the paired bootstrap interval of per-task held-out success (the RL arm's
final evaluation minus the frozen arm's in an experiment, else the run's final minus its start)
lies above 0. Otherwise the report names the failed and unmeasured gates, or says that the
interval includes 0, and states that no gain is claimed. Numbers without a denominator are
``None`` (not measured), never 0.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from closedloop.envs.discovery import resolve_section
from closedloop.errors import EnvPackageError, RetainSuiteMismatchError, StatsInputError
from closedloop.evaluate.gates import GateOptions, GateReport, evaluate_gates, main_run_of
from closedloop.evaluate.heldout import EvalSummary, paired_difference
from closedloop.evaluate.learning import cold_start_table, heldout_curve, zero_variance_table
from closedloop.evaluate.more_attempts import reevaluations
from closedloop.evaluate.report_html import render_html
from closedloop.evaluate.retain import retain_delta, retain_suite_tasks, summarize_suites
from closedloop.evaluate.rundir import (
    RunDir,
    arm_evaluation,
    eval_summary,
    experiment_of,
    find_arms,
    load_run,
)

__all__ = ["REPORT_SCHEMA", "build_report", "capability_claim", "render_html", "write_report"]

REPORT_SCHEMA = "closedloop-report-v1"
_HELDOUT_KEYS = ("policy_version", "manifest_hash", "k", "pass_at_1", "pass_at_1_ci",
                 "pass_at_k", "pass_hat_k", "invalid_action_rate", "mean_tool_calls",
                 "mean_action_tokens", "mean_latency_s", "side_effect_rate", "termination",
                 "episodes")


def _heldout(summary: EvalSummary | None) -> dict[str, Any] | None:
    if summary is None:
        return None
    out = {k: getattr(summary, k) for k in _HELDOUT_KEYS}
    out["tasks"] = len(summary.tasks)
    out["tasks_scored"] = sum(1 for t in summary.tasks if t.n > 0)
    out["per_task_success"] = summary.per_task_success()
    return out


def _arms(run: RunDir, seed: int, final: EvalSummary | None) -> dict[str, Any]:
    """Each arm's held-out result (final, or start for the never-updated frozen arm) and its
    paired difference from the frozen arm."""
    exp = experiment_of(run.path)
    if exp is None:
        return {}
    results = {name: arm_evaluation(load_run(path)) for name, path in find_arms(exp).items()}
    frozen = next((n for n in sorted(results) if "frozen" in n.lower()), None)
    out: dict[str, Any] = {}
    for name, (label, summary) in sorted(results.items()):
        row: dict[str, Any] = {"path": str(find_arms(exp)[name]), "evaluation": label,
                               "result": _heldout(summary)}
        if frozen is not None and name != frozen:
            f_label, f_summary = results[frozen]
            row["vs_frozen"] = paired_difference(summary, f_summary, seed,
                                       f"{name} {label} - {frozen} {f_label}")
        if "shuffl" in name.lower():
            row["rl_minus_null"] = paired_difference(final, summary, seed,
                                                     f"RL final - {name} {label}")
        out[name] = row
    return out


def _retain(run: RunDir, seed: int) -> dict[str, Any]:
    """Per-suite retain delta (final - start) from the ``eval-retain-*`` traces."""
    traces = [run.eval_trace(f"retain-{label}") for label in ("start", "final")]
    if any(t is None or not t.episodes for t in traces):
        return {"measured": False, "detail": "no retain-suite evaluation at start and final"}
    try:
        suites = retain_suite_tasks(resolve_section(run.section("environment")),
                                    run.section("evaluation").get("retain_suites") or [])
        start, final = (summarize_suites(list(t.episodes), suites, k=1, seed=seed)
                        for t in traces if t is not None)
    except (EnvPackageError, RetainSuiteMismatchError) as exc:
        return {"measured": False, "detail": str(exc)}
    try:
        delta = retain_delta(start, final, seed=seed)
    except StatsInputError as exc:
        return {"measured": False, "detail": str(exc)}
    return {"measured": True, **delta.to_dict()}


def capability_claim(gates: GateReport, comparison: Mapping[str, Any]) -> dict[str, Any]:
    """State a gain only if all gates passed and the paired CI lies above 0 (see module doc)."""
    base = {"comparison": comparison.get("what"), "all_gates_passed": gates.all_passed,
            "failed_gates": gates.failed, "not_measured_gates": gates.not_measured}
    if "learning_signal" in gates.not_measured:
        detail = gates.gate("learning_signal").detail
        return {**base, "gain": None, "statement": f"Capability gain not measured: {detail}. "
                "No gain is claimed, and none is ruled out."}
    if not gates.all_passed:
        parts = []
        if gates.failed:
            parts.append(f"gates failed: {', '.join(gates.failed)}")
        if gates.not_measured:
            parts.append(f"gates not measured: {', '.join(gates.not_measured)}")
        if gates.not_evaluated:
            parts.append(f"gates not evaluated: {', '.join(gates.not_evaluated)}")
        return {**base, "gain": None, "statement": "Capability gain not measured: "
                + "; ".join(parts) + ". No gain is claimed."}
    if not comparison.get("measured"):
        return {**base, "gain": None, "statement": "Capability gain not measured: "
                f"{comparison.get('detail')}. No gain is claimed."}
    est, (lo, hi) = comparison["estimate"], comparison["ci"]
    span = f"{est:+.3f} [95% CI {lo:+.3f}, {hi:+.3f}] over {comparison['tasks']} tasks"
    if lo > 0:
        return {**base, "gain": True, "statement": f"Capability gain: held-out success "
                f"{comparison['what']} = {span}; every gate passed."}
    if hi < 0:
        return {**base, "gain": False, "statement": "Held-out success decreased: "
                f"{comparison['what']} = {span}. No gain is claimed."}
    half = (hi - lo) / 2
    return {**base, "gain": False, "resolution": half, "statement": "Held-out success shows "
            f"no gain (the interval includes 0): {comparison['what']} = {span}. No gain is "
            f"claimed, and none is ruled out: an effect smaller than about {half:.2f} (half "
            "the interval's width) is not resolved by this evaluation; more attempts per task "
            "narrow it, at best as 1/sqrt(attempts) (closedloop reevaluate)."}


SUITE_TITLES = {"family": "family-disjoint", "train": "train tasks, in distribution"}
"""The suites compared besides the held-out one, by their trace suffix."""


def suite_comparison(run: RunDir, seed: int, suite: str) -> dict[str, Any]:
    """One more suite's comparison, its own and never pooled with the template-disjoint one:
    the RL arm's final minus the frozen arm's start (in an experiment), else the run's final
    minus its start. In an experiment whose shuffled-reward arm was evaluated on the suite
    too, ``control`` is that arm's final minus the frozen start: a gain the null shares is not
    the reward's. ``family``: families absent from training; ``train``: the tasks RL drew its
    groups from (what the gradient moved in distribution; not a capability claim)."""
    title = SUITE_TITLES[suite]
    final = eval_summary(run, f"final-{suite}")
    base = eval_summary(run, f"start-{suite}")
    exp = experiment_of(run.path)
    arms = find_arms(exp) if exp is not None else {}
    frozen = next((p for n, p in sorted(arms.items()) if "frozen" in n.lower()), None)
    shuffled = next((p for n, p in sorted(arms.items()) if "shuffl" in n.lower()), None)
    what = f"final - start ({title})"
    if frozen is not None:
        base = eval_summary(load_run(frozen), f"start-{suite}") or base
        what = f"RL final - frozen start ({title})"
    if final is None and base is None:
        return {"measured": False, "what": what, "detail": f"no {title} evaluation"}
    out = {"start": _heldout(base), "final": _heldout(final),
           "comparison": paired_difference(final, base, seed, what)}
    null = None if shuffled is None else eval_summary(load_run(shuffled), f"final-{suite}")
    out["control"] = (paired_difference(null, base, seed,
                                        f"shuffled final - frozen start ({title})")
                      if null is not None
                      else {"measured": False, "what": "shuffled-reward control",
                            "detail": "the shuffled arm was not evaluated on this suite"})
    if null is not None:
        out["rl_minus_null"] = paired_difference(final, null, seed,
                                                 f"RL final - shuffled final ({title})")
    return out


def _steps(run: RunDir) -> list[dict[str, Any]]:
    """Per RL step: outcomes from the step trace, optimizer metrics from metrics.jsonl."""
    logged = {int(m.get("step", -1)): m for m in run.metrics_of("rl_step")}
    rows = []
    for trace in run.traces_of("step"):
        m = logged.get(trace.step if trace.step is not None else -1, {})
        met = m.get("metrics") or {}
        scores = [ep.trajectory.task_success for ep in trace.episodes
                  if ep.trajectory.task_success is not None]
        rows.append({
            "step": trace.step, "groups": m.get("groups"), "admitted": m.get("admitted"),
            "zero_variance": m.get("zero_variance"),
            "train_success": sum(scores) / len(scores) if scores else None,
            "scored_episodes": len(scores), "episodes": len(trace.episodes),
            "interactions": sum(len(ep.turns) for ep in trace.episodes),
            "action_tokens": sum(ep.trajectory.num_action_tokens for ep in trace.episodes),
            "wall_s": sum(float(v) for v in (m.get("seconds") or {}).values()) or None,
            **{k: met.get(k) for k in _STEP_METRICS}})
    return rows


_STEP_METRICS = ("losses/kl", "losses/kl_token_mean", "losses/entropy", "losses/pg_loss",
                 "optim/grad_norm", "ratio/ratio_p50", "ratio/ratio_p95", "ratio/ratio_p99",
                 "ratio/ratio_max", "clip/clip_frac_token", "grad_mass/grad_mass_total",
                 "grad_mass/grad_mass_short", "grad_mass/grad_mass_medium",
                 "grad_mass/grad_mass_long", "grad_mass/grad_mass_success",
                 "grad_mass/grad_mass_failure")


def _cumulative(values: list[Any]) -> list[float | None]:
    total = 0.0
    out: list[float | None] = []
    for v in values:
        if v is None:
            out.append(None)
            continue
        total += float(v)
        out.append(total)
    return out


def _training(run: RunDir) -> dict[str, Any]:
    steps = _steps(run)
    zero = sum(s["zero_variance"] or 0 for s in steps)
    admitted = sum(s["admitted"] or 0 for s in steps)
    mass: dict[str, float | None] = {}
    for band in ("short", "medium", "long", "success", "failure"):
        pairs = [(s["grad_mass/grad_mass_total"], s[f"grad_mass/grad_mass_{band}"])
                 for s in steps if s[f"grad_mass/grad_mass_{band}"] is not None
                 and s["grad_mass/grad_mass_total"]]
        weight = sum(t for t, _ in pairs)
        mass[band] = sum(t * v for t, v in pairs) / weight if weight else None
    return {
        "steps": steps,
        "zero_advantage_groups": {"zero_variance": zero, "admitted_groups": admitted,
                                  "rate": zero / admitted if admitted else None},
        "gradient_mass_share": mass,
        "learning_curves": {
            "train_success": [s["train_success"] for s in steps],
            "interactions": _cumulative([s["interactions"] for s in steps]),
            "action_tokens": _cumulative([s["action_tokens"] for s in steps]),
            "wall_s": _cumulative([s["wall_s"] for s in steps])}}


def _termination(run: RunDir) -> dict[str, dict[str, int]]:
    phases = {"train": run.traces_of("step"), "demonstrations": run.traces_of("demo")}
    phases.update({f"eval {t.label}": [t] for t in run.traces_of("eval")})
    return {phase: dict(sorted(Counter(str(r.get("termination")) for t in files
                                       for r in t.raw("trajectory")).items()))
            for phase, files in phases.items() if files}


def _ledger(run: RunDir) -> dict[str, Any] | None:
    if not run.has_ledger:
        return None
    with run.ledger() as ledger:
        c = ledger.counts()
    data = {k: v for k, v in c.__dict__.items() if k != "reasons"}
    data["reasons"] = dict(c.reasons)
    dropped = c.discarded + c.quarantined
    data["rejection_fraction"] = dropped / c.total if dropped and c.total else None
    return data


def _verifier(gates: GateReport) -> dict[str, Any] | None:
    try:
        gate = gates.gate("verifier_fp_fn")
    except KeyError:
        return None
    keys = ("fp", "n_negative", "fp_rate", "fp_ci", "fn", "n_positive", "fn_rate", "fn_ci",
            "n_tamper", "tamper_missed", "false_quarantine", "verifier_version",
            "fp_upper_bound", "fn_upper_bound", "run_verifier_versions", "by_family")
    return {**{k: gate.evidence.get(k) for k in keys}, "status": gate.status}


def build_report(run_dir: str | Path, gates: GateReport | None = None,
                 options: GateOptions | None = None) -> dict[str, Any]:
    """The report's data (JSON values only); ``gates`` are evaluated unless given."""
    run = load_run(main_run_of(run_dir))
    gates = gates if gates is not None else evaluate_gates(run_dir, options)
    seed = int(run.section("training").get("seed", 0))
    start, final = eval_summary(run, "start"), eval_summary(run, "final")
    arms = _arms(run, seed, final)
    frozen = next((a for n, a in sorted(arms.items()) if "frozen" in n.lower()), None)
    comparison = paired_difference(final, start, seed, "final - start")
    if frozen is not None and frozen["result"] is not None:
        label, frozen_summary = arm_evaluation(load_run(frozen["path"]))
        comparison = paired_difference(final, frozen_summary, seed, f"RL final - frozen {label}")
    report = {
        "schema": REPORT_SCHEMA,
        "run": {"path": str(run.path), "model": run.config.get("model"), **run.config_meta},
        "claim": capability_claim(gates, comparison),
        "gates": gates.to_dict(),
        "heldout": {"start": _heldout(start), "final": _heldout(final),
                    "final_minus_start": paired_difference(final, start, seed, "final - start")},
        "arms": arms,
        "retain_suites": _retain(run, seed),
        "verifier": _verifier(gates),
        "termination": _termination(run),
        "training": _training(run),
        "ledger": _ledger(run),
        "cold_start": cold_start_table(run),
        "heldout_curve": heldout_curve(run),
        "zero_variance": zero_variance_table(run),
        "family_disjoint": suite_comparison(run, seed, "family"),
        "in_distribution": suite_comparison(run, seed, "train"),
        "more_attempts": reevaluations(experiment_of(run.path), seed),
    }
    return _finite(report)


def _finite(obj: Any) -> Any:
    """Replace non-finite floats by None and tuples by lists (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def write_report(run_dir: str | Path, gates: GateReport | None = None,
                 options: GateOptions | None = None,
                 out_dir: str | Path | None = None) -> tuple[Path, Path]:
    """Write ``report.json`` and ``report.html`` (into ``out_dir``, default the run or
    experiment directory) and return their paths (html, json)."""
    report = build_report(run_dir, gates, options)
    out = Path(out_dir) if out_dir is not None else Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, html_path = out / "report.json", out / "report.html"
    json_path.write_text(json.dumps(report, indent=2, sort_keys=True, allow_nan=False) + "\n",
                         encoding="utf-8")
    html_path.write_text(render_html(report), encoding="utf-8")
    return html_path, json_path
