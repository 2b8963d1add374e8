"""Later evaluations with more attempts per task (``closedloop reevaluate``), read back for the
report from the traces they name.

``reevaluate`` writes ``reevaluation-<suite>-more<N>[-v<step>].json`` into an experiment
directory; for every arm it names the traces it pooled (``arms/<arm>/traces/<name>``). The report
trusts none of that file's figures: it reloads those traces and recomputes

    s_arm(t) = successes / scored attempts of task t over every pooled attempt,
    Δ(a, b)  = mean_t [ s_a(t) − s_b(t) ]   over the tasks scored in both,

with the paired percentile-bootstrap interval over tasks, for the pairs the file lists. Each
arm's pooled episodes must come from one policy version. These comparisons are reported beside
the claim, never as it: their number of attempts was chosen after the preregistered evaluation
was seen, and adding attempts until an interval clears 0 would inflate false positives.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from closedloop.contracts import load_episodes
from closedloop.errors import TraceFormatError
from closedloop.evaluate.heldout import summarize_eval
from closedloop.evaluate.stats import paired_bootstrap_ci

REEVALUATION_GLOB = "reevaluation-*.json"


def _not_measured(path: Path, detail: str) -> dict[str, Any]:
    return {"file": path.name, "measured": False, "detail": detail}


def _arm(exp_dir: Path, name: str, traces: Any, seed: int) -> dict[str, Any] | str:
    """One arm's pooled per-task success from the named traces, or why it is not measured."""
    if not isinstance(traces, list) or not traces or not all(
            isinstance(t, str) and t and "/" not in t and "\\" not in t and t not in (".", "..")
            for t in traces):
        return f"arm {name!r}: 'traces' must list trace file names"
    folder = exp_dir / "arms" / name / "traces"
    episodes = []
    for trace in traces:
        if not (folder / trace).is_file():
            return f"arm {name!r}: {trace} is missing"
        try:
            episodes += load_episodes(folder / trace)[1]
        except TraceFormatError as exc:
            return f"arm {name!r}: {exc}"
    versions = sorted({ep.trajectory.behavior_policy_version for ep in episodes})
    if len(versions) != 1:
        return f"arm {name!r}: its traces hold {len(versions)} policy versions {versions}"
    summary = summarize_eval(episodes, k=1, seed=seed)
    scored = [t.n for t in summary.tasks if t.n > 0]
    return {"version": versions[0], "success": summary.pass_at_1, "episodes": len(episodes),
            "attempts_per_task": [min(scored), max(scored)] if scored else None,
            "traces": list(traces), "per_task": summary.per_task_success()}


def read_reevaluation(exp_dir: Path, path: Path, seed: int) -> dict[str, Any]:
    """One reevaluation file, its figures recomputed from its traces (module doc)."""
    try:
        data = json.loads(path.read_text())
        suite, runs, pairs = data["suite"], data["runs"], data["diffs"]
        named = {name: rec["traces"] for name, rec in runs.items()}
        pairs = [(d["treated"], d["baseline"]) for d in pairs]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return _not_measured(path, f"unreadable ({type(exc).__name__}: {exc})")
    arms: dict[str, dict[str, Any]] = {}
    for name, traces in named.items():
        arm = _arm(exp_dir, str(name), traces, seed)
        if isinstance(arm, str):
            return _not_measured(path, arm)
        arms[str(name)] = arm
    diffs = []
    for treated, base in pairs:
        if treated not in arms or base not in arms:
            return _not_measured(path, f"pair {treated} - {base} names an arm it did not pool")
        a, b = arms[treated]["per_task"], arms[base]["per_task"]
        common = sorted(set(a) & set(b))
        row: dict[str, Any] = {"treated": treated, "baseline": base,
                               "what": f"{treated} {arms[treated]['version']} - {base} "
                                       f"{arms[base]['version']}", "tasks": len(common)}
        if len(common) >= 2:
            ci = paired_bootstrap_ci({t: a[t] for t in common}, {t: b[t] for t in common},
                                     seed=seed)
            row.update(estimate=ci.estimate, ci=[ci.lo, ci.hi])
        diffs.append(row)
    return {"file": path.name, "measured": True, "suite": suite,
            "step": data.get("step"), "arms": arms, "diffs": diffs}


def reevaluations(exp_dir: Path | None, seed: int) -> list[dict[str, Any]]:
    """Every reevaluation file of an experiment directory, recomputed (none outside one)."""
    if exp_dir is None:
        return []
    return [read_reevaluation(exp_dir, p, seed) for p in sorted(exp_dir.glob(REEVALUATION_GLOB))]
