"""The core report (docs/gates.md): ``report.json`` and a self-contained ``report.html``.

``build_report(run_dir)`` recomputes everything from the run directory (traces first, then the
ledger, metrics and the gates); ``write_report`` writes the JSON and an HTML page whose PNG plots
are embedded as ``data:`` URIs, so the page is one file.

The capability claim (``report["claim"]``) follows one rule: a gain is stated only when every
gate passed *and* the paired bootstrap interval of per-task held-out success (the RL arm's
final evaluation minus the frozen arm's in an experiment, else the run's final minus its start)
lies above 0. Otherwise the report names the failed and unmeasured gates, or says that the
interval includes 0, and states that no gain is claimed. Numbers without a denominator are
``None`` (not measured), never 0.
"""

from __future__ import annotations

import base64
import html
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
from closedloop.evaluate.plots import (
    plot_grad_mass,
    plot_learning_curves,
    plot_success,
    plot_termination,
    plot_training,
)
from closedloop.evaluate.retain import retain_delta, retain_suite_tasks, summarize_suites
from closedloop.evaluate.rundir import (
    RunDir,
    arm_evaluation,
    eval_summary,
    experiment_of,
    find_arms,
    load_run,
)
from closedloop.evaluate.stats import wilson_interval

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
            "step": trace.step, "estimator": (m.get("credit") or {}).get("estimator"),
            "groups": m.get("groups"), "admitted": m.get("admitted"),
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


# --------------------------------------------------------------------------- HTML
_CSS = """body{font-family:sans-serif;margin:24px;max-width:1150px;color:#222}
table{border-collapse:collapse;margin:8px 0 16px}td,th{border:1px solid #ccc;padding:3px 7px;
font-size:13px;text-align:left;vertical-align:top}th{background:#f3f3f3}.PASS{color:#1a7f37}
.FAIL{color:#c62828;font-weight:bold}.NOT{color:#a66b00}.NA{color:#777}
.claim{padding:10px 14px;border-left:6px solid #888;background:#f7f7f7;font-size:15px}
.gain{border-color:#1a7f37}img{max-width:100%;border:1px solid #eee}"""


def _fmt(v: Any) -> str:
    if v is None:
        return "not measured"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list | tuple) and len(v) == 2 and all(isinstance(x, float) for x in v):
        return f"[{v[0]:.3f}, {v[1]:.3f}]"
    return html.escape(str(v))


def _table(headers: list[str], rows: list[list[Any]], table_id: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c if isinstance(c, _Raw) else _fmt(c)}</td>"
                                    for c in row) + "</tr>" for row in rows)
    ident = f' id="{table_id}"' if table_id else ""
    return f"<table{ident}><tr>{head}</tr>{body}</table>"


class _Raw(str):
    """Already-escaped HTML for a table cell."""


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,' \
           f'{base64.b64encode(png).decode()}">'


def _gates_html(gates: Mapping[str, Any]) -> str:
    rows = [[g["name"], _Raw(f'<span class="{g["status"].split()[0].replace("/", "")}">'
                             f'{html.escape(g["status"])}</span>'), g["detail"]]
            for g in gates["gates"]]
    return _table(["gate", "status", "detail"], rows, "gates-table")


def _heldout_html(report: Mapping[str, Any]) -> str:
    cols = [("start", report["heldout"]["start"]), ("final", report["heldout"]["final"])]
    cols += [(f"{n} {a['evaluation']}", a["result"]) for n, a in report["arms"].items()]
    keys = ("pass_at_1", "pass_at_1_ci", "pass_hat_k", "pass_at_k", "k", "invalid_action_rate",
            "mean_tool_calls", "mean_action_tokens", "mean_latency_s", "side_effect_rate",
            "tasks_scored", "episodes", "policy_version")
    rows = [[k, *[(c or {}).get(k) for _, c in cols]] for k in keys]
    paired = [report["heldout"]["final_minus_start"]]
    paired += [a[key] for a in report["arms"].values()
               for key in ("vs_frozen", "rl_minus_null") if key in a]
    prow = [[p["what"], p.get("estimate"), p.get("ci"), p.get("tasks"),
             p.get("detail", "")] for p in paired]
    bars = [(name, (c or {}).get("pass_at_1"), *((c or {}).get("pass_at_1_ci")
                                                   or [None, None])) for name, c in cols]
    return (_table(["metric", *[n for n, _ in cols]], rows, "heldout-table")
            + _table(["paired difference (by task)", "estimate", "95% CI", "tasks", "note"],
                     prow) + _img(plot_success(bars), "held-out success"))


def _training_html(report: Mapping[str, Any]) -> str:
    tr = report["training"]
    steps = tr["steps"]
    z = tr["zero_advantage_groups"]
    series = {k: [s[k] for s in steps] for k in ("losses/kl", "optim/grad_norm",
                                                 "losses/entropy", "ratio/ratio_p95",
                                                 "ratio/ratio_max", "train_success")}
    rows = [[s["step"], s["estimator"], s["groups"], s["admitted"], s["zero_variance"],
             s["train_success"], s["losses/kl"], s["optim/grad_norm"], s["losses/entropy"],
             s["ratio/ratio_p50"], s["ratio/ratio_p99"], s["ratio/ratio_max"]] for s in steps]
    return (f"<p>Zero-advantage groups: {z['zero_variance']} of {z['admitted_groups']} "
            f"admitted groups (rate {_fmt(z['rate'])}). Each update's credit estimator is its "
            "step's <code>credit.estimator</code> record.</p>"
            + _table(["step", "credit", "groups", "admitted", "zero-var", "train success", "KL",
                      "grad norm", "entropy", "ratio p50", "ratio p99", "ratio max"], rows,
                     "steps")
            + _img(plot_training([s["step"] for s in steps], series), "training diagnostics")
            + "<h3>Gradient mass</h3>"
            + _img(plot_grad_mass(tr["gradient_mass_share"]), "gradient mass")
            + "<h3>Learning curves</h3>"
            + _img(plot_learning_curves(tr["learning_curves"]), "learning curves"))


def _suite_html(suite: Mapping[str, Any], table_id: str) -> str:
    if suite.get("measured") is False:
        return f"<p>{_fmt(suite.get('detail'))}.</p>"
    c = suite["comparison"]
    rows = [[c["what"], (suite["start"] or {}).get("pass_at_1"),
             (suite["final"] or {}).get("pass_at_1"), c.get("estimate"), c.get("ci"),
             c.get("tasks"), c.get("detail", "")]]
    for key in ("control", "rl_minus_null"):
        k = suite.get(key) or {}
        if k:
            rows.append([k.get("what"), (suite["start"] or {}).get("pass_at_1"), None,
                         k.get("estimate"), k.get("ci"), k.get("tasks"), k.get("detail", "")])
    return _table(["comparison", "start", "final", "estimate", "95% CI", "tasks", "note"],
                  rows, table_id)


def _curve_html(curve: list[Mapping[str, Any]]) -> str:
    rows = [[p["label"], p["step"], p["success"], p["ci"], p["scored"], p["interactions"],
             p["rl_wall_s"]] for p in curve]
    return _table(["evaluation", "RL steps", "held-out success", "Wilson 95% CI", "attempts",
                   "environment interactions", "RL wall s"], rows, "curve-table")


def _cold_start_html(cold: Mapping[str, Any]) -> str:
    if not cold.get("measured"):
        return "<p>Cold-start table: not measured (no start evaluation).</p>"
    level_rows = [[r["suite"], r["level"], r["tasks"], r["successes"], r["scored"], r["rate"],
                   r["ci"]] for r in cold["by_level"]]
    rows = [[r["suite"], r["family"], r["template"], r["level"], r["tasks"], r["successes"],
             r["scored"], r["rate"], r["ci"]] for r in cold["rows"]]
    return (_table(["suite", "level", "tasks", "successes", "attempts", "rate",
                    "Wilson 95% CI"], level_rows, "level-table")
            + _table(["suite", "family", "template", "level", "tasks", "successes", "attempts",
                      "rate", "Wilson 95% CI"], rows, "cold-start-table"))


def _zero_variance_html(zv: Mapping[str, Any]) -> str:
    o = zv["overall"]
    rows = [[r["step"], r["scored_groups"], r["zero_variance"], r["observed_rate"],
             r["predicted_rate"]] for r in zv["steps"]]
    return (f"<p>Overall: {o['zero_variance']} of {o['scored_groups']} scored groups "
            f"zero-variance (observed {_fmt(o['observed_rate'])}, Wilson 95% CI "
            f"{_fmt(o['observed_ci'])}); predicted {_fmt(o['predicted_rate'])} "
            "(p^G + (1-p)^G under the sampler's estimates before each draw).</p>"
            + _table(["step", "scored groups", "zero-variance", "observed rate",
                      "predicted rate"], rows, "zero-variance-table"))


def _verifier_html(v: Mapping[str, Any] | None) -> str:
    if v is None:
        return "<p>Verifier audit: not measured.</p>"
    rows = [["false positives", v["fp"], v["n_negative"], v["fp_rate"], v["fp_ci"],
             v["fp_upper_bound"]],
            ["false negatives", v["fn"], v["n_positive"], v["fn_rate"], v["fn_ci"],
             v["fn_upper_bound"]],
            ["tamper not quarantined", v["tamper_missed"], v["n_tamper"],
             v["tamper_missed"] / v["n_tamper"] if v["n_tamper"] else None,
             list(wilson_interval(v["tamper_missed"], v["n_tamper"])) if v["n_tamper"]
             else None, 0]]
    return _table(["error", "count", "denominator", "rate", "Wilson 95% CI",
                   "preregistered bound"], rows, "verifier-table") + \
        f"<p>{_fmt(v['verifier_version'])}; gate {_fmt(v['status'])}.</p>"


def _retain_html(retain: Mapping[str, Any]) -> str:
    if not retain.get("measured"):
        return f"<p>Retain suites: {_fmt(retain.get('detail'))}.</p>"
    rows = [[name, s["before"], s["after"], s["delta"], [s["ci_lo"], s["ci_hi"]]
             if s["ci_lo"] is not None else None, s["n_paired"], s["significant_regression"]]
            for name, s in retain["suites"].items()]
    return _table(["suite", "start", "final", "delta", "95% CI", "tasks",
                   "significant regression"], rows, "retain-table")


def _more_attempts_html(found: list[Mapping[str, Any]]) -> str:
    if not found:
        return "<p>None (closedloop reevaluate adds attempts to an experiment's arms).</p>"
    rows = []
    for r in found:
        if not r["measured"]:
            rows.append([r["file"], None, None, f"not measured: {r['detail']}", None, None])
            continue
        for d in r["diffs"]:
            scored = ", ".join(f"{name} {lo}-{hi}" for name in (d["treated"], d["baseline"])
                               for lo, hi in [r["arms"][name]["attempts_per_task"] or ("?", "?")])
            rows.append([r["file"], r["suite"], d["what"], d.get("estimate"), d.get("ci"),
                         f"{d['tasks']} tasks; scored attempts per task: {scored}"])
    return ("<p>Recomputed from the traces each file names. Not the claim: these attempts "
            "were added after the preregistered evaluation was seen.</p>"
            + _table(["file", "suite", "comparison", "difference", "paired 95% CI", "scored"],
                     rows, "more-attempts-table"))


def _precision_html(precision: Any) -> str:
    """The run's resolved matmul precision and why (config.json's record)."""
    if not isinstance(precision, Mapping):
        return "<p id='precision'>Precision: not recorded (a run before the precision policy).</p>"
    return (f"<p id='precision'>Precision: {html.escape(str(precision.get('precision')))} "
            f"(asked for {html.escape(str(precision.get('requested')))}: "
            f"{html.escape(str(precision.get('reason')))})</p>")


def render_html(report: Mapping[str, Any]) -> str:
    """The self-contained HTML page of a report dict (plots embedded as data URIs)."""
    claim = report["claim"]
    term = report["termination"]
    ledger = report["ledger"] or {}
    rejection = (f"<p>Rejected groups: {ledger.get('discarded')} discarded, "
                 f"{ledger.get('quarantined')} quarantined of {ledger.get('total', '?')} "
                 f"(fraction {_fmt(ledger.get('rejection_fraction'))}); reasons "
                 f"{_fmt(ledger.get('reasons'))}.</p>") if ledger.get(
        "rejection_fraction") else ""
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>closedloop report"
        f"</title><style>{_CSS}</style></head><body><h1>closedloop report</h1>",
        f"<p>{_fmt(report['run'].get('path'))} — model {_fmt(report['run'].get('model'))}, "
        f"config {_fmt(report['run'].get('config_hash'))}, git "
        f"{_fmt(report['run'].get('git_revision'))}</p>",
        _precision_html(report["run"].get("precision")),
        f"<p class='claim{' gain' if claim['gain'] else ''}' id='claim'>"
        f"{html.escape(claim['statement'])}</p>",
        "<h2>Go/no-go gates</h2>", _gates_html(report["gates"]),
        "<h2>Held-out evaluation</h2>", _heldout_html(report),
        "<h2>Family-disjoint suite</h2>", _suite_html(report["family_disjoint"], "family-table"),
        "<h2>In distribution: the train tasks</h2>",
        "<p>The tasks RL drew its groups from, one attempt each: what the gradient moved, not "
        "a capability on unseen tasks.</p>", _suite_html(report["in_distribution"], "train-table"),
        "<h2>More attempts per task, added later</h2>",
        _more_attempts_html(report["more_attempts"]),
        "<h2>Held-out learning curve</h2>", _curve_html(report["heldout_curve"]),
        "<h2>Cold start by hint level</h2>", _cold_start_html(report["cold_start"]),
        "<h2>Zero-variance groups: observed vs predicted</h2>",
        _zero_variance_html(report["zero_variance"]),
        "<h2>Retain suites</h2>", _retain_html(report["retain_suites"]),
        "<h2>Verifier audit</h2>", _verifier_html(report["verifier"]),
        "<h2>Termination distribution</h2>",
        _table(["phase", "counts"], [[p, d] for p, d in term.items()]),
        _img(plot_termination(term), "termination distribution"),
        "<h2>Training</h2>", rejection, _training_html(report),
        "</body></html>"]
    return "\n".join(parts)
