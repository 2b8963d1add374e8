"""Text of the ``closedloop`` commands' results for the terminal (``--json`` prints the data
itself): the experiment's arms and suites, the report's summary, replicates and
reevaluations. Every number without a denominator prints as ``-``, never 0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(data: Any, as_json: bool, text: str) -> None:
    """Print ``data`` as sorted JSON with ``--json``, else ``text``."""
    print(json.dumps(data, indent=2, sort_keys=True, default=str) if as_json else text)


def fmt(x: float | None) -> str:
    """A rate with three decimals; ``-`` for not measured."""
    return "-" if x is None else f"{x:.3f}"


def arm_lines(result: dict[str, Any]) -> list[str]:
    """Each arm's held-out success with its interval and paired difference from frozen."""
    lines = ["", "== held-out success by arm (paired difference from frozen, 95% CI) =="]
    for name, arm in result["arms"].items():
        diff = arm.get("diff_vs_frozen")
        ci = arm.get("success_ci")
        lines.append(f"{name:9} success {fmt(arm['success'])} "
                     f"[{fmt(ci[0]) if ci else '-'}, {fmt(ci[1]) if ci else '-'}]"
                     + (f"  diff {fmt(diff['estimate'])} [{fmt(diff['lo'])}, "
                        f"{fmt(diff['hi'])}]{' (CI excludes 0)' if diff['excludes_zero'] else ''}"
                        if diff else ""))
        lines += _compute_lines(arm)
    return lines


def _compute_lines(arm: dict[str, Any]) -> list[str]:
    """An RL arm's compute (and a credit arm's difference from rloo), when recorded."""
    c = arm.get("compute")
    if not c:
        return []
    b = c["branches"]
    out = [f"{'':9} compute: {c['collected_episodes']} episodes collected"
           + (f" + {b['continuations']} branch continuations ({b['turns']} turns)"
              if b["continuations"] else "")
           + f", {c['trained_action_tokens']} action tokens trained, "
           f"{fmt(c['seconds_total'])} s; credit {', '.join(c['estimators'])}"]
    vs = arm.get("diff_vs_rloo")
    if vs:
        out.append(f"{'':9} vs rloo: {fmt(vs['estimate'])} [{fmt(vs['lo'])}, {fmt(vs['hi'])}]")
    return out


def report_lines(report_json: Path) -> list[str]:
    """The claim, the cold start by hint level, the learning curve and the zero-variance rate
    observed against its prediction, from report.json."""
    rep = json.loads(report_json.read_text(encoding="utf-8"))
    lines = ["== cold start by hint level (successes/attempts, Wilson 95% CI) =="]
    for r in rep["cold_start"]["by_level"]:
        ci = r["ci"] or [None, None]
        lines.append(f"{r['suite']:8} {r['level']:8} {r['successes']}/{r['scored']} = "
                     f"{fmt(r['rate'])} [{fmt(ci[0])}, {fmt(ci[1])}] over {r['tasks']} tasks")
    lines.append("== held-out learning curve of the RL arm ==")
    for p in rep["heldout_curve"]:
        lines.append(f"{p['label']:10} after {p['step']} steps, {p['interactions']} interactions"
                     f", {p['rl_wall_s']:.0f} s of RL: success {fmt(p['success'])} "
                     f"({p['successes']}/{p['scored']})")
    zv = rep["zero_variance"]["overall"]
    lines.append(f"zero-variance groups: observed {fmt(zv['observed_rate'])} "
                 f"({zv['zero_variance']}/{zv['scored_groups']}), predicted "
                 f"{fmt(zv['predicted_rate'])} (p^G + (1-p)^G)")
    null: dict[str, Any] = next((a["rl_minus_null"] for a in (rep.get("arms") or {}).values()
                                 if "rl_minus_null" in a), {})
    if null.get("measured"):
        lines.append(paired_line("held-out, RL against its null", null))
    for section, title in (("family_disjoint", "family-disjoint"),
                           ("in_distribution", "in distribution")):
        suite = rep.get(section) or {}
        for key in ("comparison", "control", "rl_minus_null"):
            c = suite.get(key) or {}
            if c.get("measured"):
                lines.append(paired_line(title, c))
            elif key == "control" and suite.get("comparison", {}).get("measured"):
                lines.append(f"{title} control: not measured ({c.get('detail')})")
    lines += claim_suite_lines(rep.get("claim_by_suite") or {})
    lines.append(f"claim: {rep['claim']['statement']}")
    return lines


def claim_suite_lines(claims: dict[str, Any]) -> list[str]:
    """Per suite: RL − shuffled (the reward's share), RL − frozen, shuffled − frozen."""
    if not claims:
        return []
    lines = ["== what the reward caused, by suite: RL - shuffled (the reward's share) | "
             "RL - frozen | shuffled - frozen (the null) =="]
    for c in claims.values():
        cells = []
        for key in ("rl_minus_null", "rl_minus_frozen", "null_minus_frozen"):
            d = c.get(key) or {}
            cells.append(f"{d['estimate']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]"
                         if d.get("measured") else f"not measured (all {d['no_signal']})"
                         if d.get("no_signal") else "-")
        lines.append(f"{c['title']:32} " + " | ".join(cells))
    return lines


def paired_line(title: str, c: dict[str, Any]) -> str:
    """One measured paired comparison of report.json, printed."""
    lo, hi = c["ci"]
    return (f"{title}: {c['what']} = {c['estimate']:+.3f} [{lo:+.3f}, {hi:+.3f}] over "
            f"{c['tasks']} tasks")


SUITE_HEADINGS = {"family": "families never trained on",
                   "train": "the train tasks RL drew from, in distribution"}


def suite_lines(result: dict[str, Any]) -> list[str]:
    """The family-disjoint and train suites' arms, where they were evaluated."""
    lines = []
    for suite, heading in SUITE_HEADINGS.items():
        data = result.get("suites", {}).get(suite)
        if not data:
            continue
        lines.append(f"== {suite} suite ({data['tasks']} tasks, {heading}) ==")
        for name, arm in data["arms"].items():
            diff = arm.get("diff_vs_frozen")
            lines.append(f"{name:9} success {fmt(arm['success'])}"
                         + (f"  diff {fmt(diff['estimate'])} [{fmt(diff['lo'])}, "
                            f"{fmt(diff['hi'])}]" if diff else ""))
    return lines


def pooled_lines(pooled: dict[str, Any], per_replicate: bool) -> list[str]:
    """One line per suite and pooled entry of replicates.json: its effect per replicate (if
    asked) and pooled, with the interval."""
    lines = []
    for suite, arms in pooled.items():
        for arm, entry in arms.items():
            key = f"diff_vs_{entry['baseline']}"
            per = ", ".join(f"r{p['replicate']} {fmt((p[key] or {}).get('estimate'))}"
                            for p in entry["per_replicate"]) + "; " if per_replicate else ""
            pool = entry.get("pooled") or {}
            lines.append(f"{suite:8} {arm:9} {per}pooled {fmt(pool.get('estimate'))} "
                         f"[{fmt(pool.get('lo'))}, {fmt(pool.get('hi'))}]")
    return lines


def replicate_lines(data: dict[str, Any], exp_dir: Path) -> list[str]:
    """Replicates: each arm's effect per replicate and pooled, the replicates not found, each
    replicate's claim and the pool of the replicates whose gates all passed."""
    lines = ["", f"== {data['n']} replicates: each arm minus frozen, and rloo minus its shuffled "
                 "null, per replicate and pooled =="]
    lines += pooled_lines(data["pooled"], per_replicate=True)
    if data["missing"]:
        lines.append(f"not pooled (not run here, not found under {exp_dir}): replicates "
                     + ", ".join(map(str, data["missing"])))
    claims = data.get("claims", {})
    for i in sorted(claims, key=int):
        lines.append(f"replicate {i}: {claims[i]['statement']} "
                     f"({exp_dir / f'replicate-{i}' / 'report.html'})")
    if claims:
        measured = data["measured_replicates"]
        lines.append(f"== pooled over the replicates whose gates all passed: "
                     f"{', '.join(map(str, measured)) or 'none'} ==")
        lines += pooled_lines(data["pooled_measured"], per_replicate=False)
    return lines


def reevaluate_lines(result: dict[str, Any], attempts: int, step: int | None) -> list[str]:
    """More attempts per task: each policy's pooled success and each paired difference."""
    at = "" if step is None else f", treated runs at v{step:04d}"
    lines = ["", f"== {result['suite']} suite: {attempts} more attempts per task{at}, "
                 "pooled with each policy's own evaluation (paired by each episode's stream) =="]
    for name, run in result["runs"].items():
        lo, hi = run["attempts_per_task"]
        lines.append(f"{name:12} {run['version']} success {fmt(run['success'])} over "
                     f"{run['episodes']} episodes ({lo}-{hi} scored attempts per task)")
    for d in result["diffs"]:
        if d["estimate"] is None:
            lines.append(f"{d['treated']} - {d['baseline']}: fewer than 2 common tasks")
            continue
        lines.append(f"{d['treated']} - {d['baseline']}: {d['estimate']:+.3f} "
                     f"[{d['lo']:+.3f}, {d['hi']:+.3f}] over {d['n_tasks']} tasks"
                     + (" (CI excludes 0)" if d["excludes_zero"] else ""))
    if "written_to" in result:
        lines.append(f"written to {result['written_to']}")
    return lines
