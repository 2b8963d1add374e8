"""The report's self-contained HTML page: ``render_html(report)`` renders the dict that
``closedloop.evaluate.report.build_report`` returns, with its PNG plots embedded as ``data:`` URIs
(one file, no network). Missing numbers read "not measured", never 0.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping
from typing import Any

from closedloop.evaluate.plots import (
    plot_grad_mass,
    plot_learning_curves,
    plot_success,
    plot_termination,
    plot_training,
)
from closedloop.evaluate.report_async import asynchrony_html
from closedloop.evaluate.stats import wilson_interval

__all__ = ["render_html"]

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
             if s["ci_lo"] is not None else None, s["n_paired"],
             s["significant_regression"] if s.get("measured", True)
             else f"not measured: every attempt {s['no_signal']} at both points"
             if s.get("no_signal") else "not measured: no task scored at both points"]
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


def _span(c: Mapping[str, Any] | None) -> Any:
    """``+0.125 [+0.000, +0.292] (16 tasks)``, or why it is not measured."""
    if not c or not c.get("measured"):
        return f"not measured ({(c or {}).get('detail', 'no evaluation')})"
    lo, hi = c["ci"]
    return f"{c['estimate']:+.3f} [{lo:+.3f}, {hi:+.3f}] ({c['tasks']} tasks)"


def _claim_by_suite_html(claims: Mapping[str, Any]) -> str:
    if not claims:
        return "<p>No suite evaluated.</p>"
    rows = [[c["title"], _span(c["rl_minus_null"]), _span(c["rl_minus_frozen"]),
             _span(c["null_minus_frozen"])] for c in claims.values()]
    return ("<p>The reward's share is the RL arm against the shuffled-reward null (a gain the "
            "null also makes is not the reward's; docs/null-control.md); the null gate fails "
            "when the null's lower bound is above 0 on the held-out, family-disjoint or a "
            "retain suite.</p>"
            + _table(["suite", "RL - shuffled (the reward's share)", "RL - frozen",
                      "shuffled - frozen (the null)"], rows, "claim-by-suite-table"))


def _diagnostics_html(diag: Mapping[str, Any]) -> str:
    rows = [[suite, role, d["episodes"], d["turns_per_episode"], d["truncated_rate"],
             d["agent_finish_rate"], d["action_tokens_per_turn"], d["parse_failures_per_turn"]]
            for suite, arms in diag.get("arms", {}).items() for role, d in arms.items()
            if d is not None]
    updates = diag.get("updates") or []
    urows = [[u["step"], u["adv_len_corr"], u["grad_mass_total"], u["clipped_mass_pos"],
              u["clipped_mass_neg"], u["clip_frac_token"], u["abs_log_ratio_max"]]
             for u in updates]
    prows = [[u["step"], k, p.get("abs_log_ratio_p99"), p.get("abs_log_ratio_max"),
              p.get("clip_frac_token"), p.get("clip_frac_turn"), p.get("clip_frac_episode"),
              p.get("grad_mass_clipped_pos"), p.get("grad_mass_clipped_neg")]
             for u in updates for k, p in enumerate(u["passes"])]
    out = (_table(["suite", "arm", "episodes", "turns per episode", "truncated",
                   "ended by finish", "action tokens per turn", "parse failures per turn"],
                  rows, "arm-diagnostics-table") if rows else "<p>No evaluation traces.</p>")
    out += ("<p>Per update: the correlation of advantage with episode length, and the "
            "gradient mass a clip removed by advantage sign.</p>"
            + _table(["step", "corr(A, length)", "gradient mass", "clipped mass A>0",
                      "clipped mass A<0", "clip fraction (tokens)", "max |log r|"], urows,
                     "update-diagnostics-table")) if urows else ""
    if prows:
        out += ("<p>Every optimizer pass over a reused batch (from the second pass on the "
                "ratios are no longer 1):</p>"
                + _table(["step", "pass", "|log r| p99", "|log r| max", "clip tokens",
                          "clip turns", "clip episodes", "clipped mass A>0",
                          "clipped mass A<0"], prows, "passes-table"))
    return out


def _overlap_html(overlap: Mapping[str, Any]) -> str:
    audit, gate = overlap.get("audit"), overlap.get("gate") or {}
    if not isinstance(audit, Mapping):
        return f"<p>Held-out overlap audit: not recorded ({_fmt(gate.get('detail'))}).</p>"
    pairs = [f"{p.get('heldout_id')} ~ {p.get('train_id')} ({p.get('similarity')})"
             for key in ("exact_pairs", "near_pairs") for p in audit.get(key) or []
             if isinstance(p, Mapping)]
    rows: list[list[Any]] = [["rule version", audit.get("dedup_rule_version")],
            ["train tasks", audit.get("n_train")], ["held-out tasks", audit.get("n_heldout")],
            ["exact duplicate pairs", len(audit.get("exact_pairs") or [])],
            ["near-duplicate pairs", len(audit.get("near_pairs") or [])],
            ["max similarity (threshold)",
             f"{_fmt(audit.get('max_similarity'))} ({_fmt(audit.get('threshold'))})"],
            ["shared templates", audit.get("shared_templates") or "none"],
            ["shared families (reported, not a leak)", audit.get("shared_families") or "none"],
            ["flagged pairs", "; ".join(pairs[:10]) or "none"],
            ["gate heldout_overlap", f"{gate.get('status')}: {gate.get('detail')}"]]
    return _table(["", "value"], rows, "overlap-table")


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
        "<h2>What the reward caused, suite by suite</h2>",
        _claim_by_suite_html(report.get("claim_by_suite") or {}),
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
        "<h2>Held-out overlap audit</h2>", _overlap_html(report.get("overlap") or {}),
        "<h2>Termination distribution</h2>",
        _table(["phase", "counts"], [[p, d] for p, d in term.items()]),
        _img(plot_termination(term), "termination distribution"),
        "<h2>What each arm changed beside success</h2>",
        _diagnostics_html(report.get("diagnostics") or {}),
        "<h2>Training</h2>", rejection, _training_html(report),
        asynchrony_html(report.get("asynchrony")),
        "</body></html>"]
    return "\n".join(parts)
