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

from closedloop.contracts import Episode, load_episodes
from closedloop.errors import EmptySampleError, MixedPolicyGroupError, TraceFormatError
from closedloop.evaluate.heldout import EvalSummary, paired_difference, summarize_eval

REEVALUATION_GLOB = "reevaluation-*.json"


def _not_measured(path: Path, detail: str) -> dict[str, Any]:
    return {"file": path.name, "measured": False, "detail": detail}


def _arm(exp_dir: Path, name: str, traces: Any, seed: int) -> EvalSummary | str:
    """One arm's pooled evaluation from the named traces, or why it is not measured."""
    if not isinstance(traces, list) or not traces or not all(
            isinstance(t, str) and t and "/" not in t and "\\" not in t and t not in (".", "..")
            for t in traces):
        return f"arm {name!r}: 'traces' must list trace file names"
    folder = exp_dir / "arms" / name / "traces"
    episodes: list[Episode] = []
    for trace in traces:
        if not (folder / trace).is_file():
            return f"arm {name!r}: {trace} is missing"
        try:
            episodes += load_episodes(folder / trace)[1]
        except TraceFormatError as exc:
            return f"arm {name!r}: {exc}"
    try:
        return summarize_eval(episodes, k=1, seed=seed)
    except MixedPolicyGroupError as exc:
        return f"arm {name!r}: its traces mix policy versions ({exc})"
    except EmptySampleError:
        return f"arm {name!r}: its traces hold no episodes"


def read_reevaluation(exp_dir: Path, path: Path, seed: int) -> dict[str, Any]:
    """One reevaluation file, its figures recomputed from its traces (module doc)."""
    try:
        data = json.loads(path.read_text())
        suite, runs, pairs = data["suite"], data["runs"], data["diffs"]
        named = {str(name): rec["traces"] for name, rec in runs.items()}
        pairs = [(d["treated"], d["baseline"]) for d in pairs]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return _not_measured(path, f"unreadable ({type(exc).__name__}: {exc})")
    summaries: dict[str, EvalSummary] = {}
    for name, traces in named.items():
        summary = _arm(exp_dir, name, traces, seed)
        if isinstance(summary, str):
            return _not_measured(path, summary)
        summaries[name] = summary
    diffs = []
    for treated, base in pairs:
        if treated not in summaries or base not in summaries:
            return _not_measured(path, f"pair {treated} - {base} names an arm it did not pool")
        a, b = summaries[treated], summaries[base]
        what = f"{treated} {a.policy_version} - {base} {b.policy_version}"
        diffs.append({"treated": treated, "baseline": base,
                      **paired_difference(a, b, seed, what)})
    arms = {}
    for name, s in summaries.items():
        scored = [t.n for t in s.tasks if t.n > 0]
        arms[name] = {"version": s.policy_version, "success": s.pass_at_1,
                      "episodes": s.episodes, "traces": list(named[name]),
                      "attempts_per_task": [min(scored), max(scored)] if scored else None,
                      "per_task": s.per_task_success()}
    return {"file": path.name, "measured": True, "suite": suite,
            "step": data.get("step"), "arms": arms, "diffs": diffs}


def reevaluations(exp_dir: Path | None, seed: int) -> list[dict[str, Any]]:
    """Every reevaluation file of an experiment directory, recomputed (none outside one)."""
    if exp_dir is None:
        return []
    return [read_reevaluation(exp_dir, p, seed) for p in sorted(exp_dir.glob(REEVALUATION_GLOB))]
