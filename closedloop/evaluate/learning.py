"""The report's evidence that learning was possible and happened, from a run directory.

- ``cold_start_table``: the start policy's success per suite, family, base template and hint
  level, with the number of tasks, scored attempts, successes and the Wilson 95% interval, plus
  one row per (suite, level). A template named ``<base>.<level>`` is posed at hint level
  ``level`` (the terminal tasks' ``exact`` > ``located`` > ``symptom``); any other template is
  ``unleveled``.
  Suites are the start evaluations a run keeps: ``train`` (``eval-start-train``: the cold start
  on the training distribution, one attempt per task), ``heldout`` (``eval-start``, template-
  disjoint) and ``family`` (``eval-start-family``, families never trained on).
- ``heldout_curve``: held-out success of each evaluated version during RL (``eval-start``,
  ``eval-step-NNNN``, ``eval-final``) against the environment interactions (agent actions) and
  the wall time the RL steps had taken by then.
- ``zero_variance_table``: per RL step, the observed zero-variance rate of its scored groups
  against the sampler's prediction made before the step's draws,
  P̂ = Σ_i π_i P̂_deg(i, G) with P_deg(p, G) = p^G + (1 − p)^G (closedloop.rollout.task_sampler).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from closedloop.evaluate.rundir import RunDir
from closedloop.evaluate.stats import wilson_interval

START_SUITES = (("train", "start-train"), ("heldout", "start"), ("family", "start-family"))


UNLEVELED = "unleveled"


def template_and_level(task_id: str) -> tuple[str, str]:
    """(base template, hint level) from a task id ``family/<base>.<level>/NNN-hash``; a
    template without a level suffix is ``UNLEVELED``."""
    parts = task_id.split("/")
    template = parts[1] if len(parts) >= 3 else "?"
    base, sep, level = template.rpartition(".")
    return (base, level) if sep and base and level else (template, UNLEVELED)


def _row(keys: dict[str, Any], tasks: set[str], scored: int, successes: int) -> dict[str, Any]:
    return {**keys, "tasks": len(tasks), "scored": scored, "successes": successes,
            "rate": successes / scored if scored else None,
            "ci": list(wilson_interval(successes, scored)) if scored else None}


def cold_start_table(run: RunDir) -> dict[str, Any]:
    """The start policy's success by suite/family/template/level and by suite/level."""
    cells: dict[tuple[str, str, str, str], list[Any]] = defaultdict(lambda: [set(), 0, 0])
    levels: dict[tuple[str, str], list[Any]] = defaultdict(lambda: [set(), 0, 0])
    for suite, label in START_SUITES:
        trace = run.eval_trace(label)
        if trace is None:
            continue
        for ep in trace.episodes:
            t = ep.trajectory
            base, level = template_and_level(t.task_id)
            for acc in (cells[(suite, t.task_family, base, level)], levels[(suite, level)]):
                acc[0].add(t.task_id)
                if t.task_success is not None:
                    acc[1] += 1
                    acc[2] += int(t.task_success >= 1.0)
    rows = [_row({"suite": s, "family": f, "template": b, "level": lv}, *v)
            for (s, f, b, lv), v in sorted(cells.items())]
    by_level = [_row({"suite": s, "level": lv}, *v) for (s, lv), v in sorted(levels.items())]
    return {"rows": rows, "by_level": by_level, "measured": bool(rows)}


def heldout_curve(run: RunDir) -> list[dict[str, Any]]:
    """Held-out success per evaluated version, with interactions and RL wall time by then."""
    steps = sorted(run.metrics_of("rl_step"), key=lambda m: int(m.get("step", -1)))
    interactions: dict[int, int] = {}
    for trace in run.traces_of("step"):
        if trace.step is not None:
            interactions[trace.step] = sum(len(ep.turns) for ep in trace.episodes)
    n_steps = int(run.section("training").get("rl_steps", len(steps)))
    points = [(0, "start")]
    for t in run.traces_of("eval"):
        label = t.label or ""
        if label.startswith("step-") and label[len("step-"):].isdigit():
            points.append((int(label[len("step-"):]), label))
    if run.eval_trace("final") is not None:
        points.append((n_steps, "final"))
    out = []
    for step, label in sorted(set(points)):
        found = run.eval_trace(label)
        if found is None:
            continue
        trace = found
        scored = [ep.trajectory.task_success for ep in trace.episodes
                  if ep.trajectory.task_success is not None]
        wins = sum(1 for s in scored if s >= 1.0)
        wall = sum(sum(float(v) for v in (m.get("seconds") or {}).values())
                   for m in steps if int(m.get("step", -1)) < step)
        out.append({"step": step, "label": label, "scored": len(scored), "successes": wins,
                    "success": wins / len(scored) if scored else None,
                    "ci": list(wilson_interval(wins, len(scored))) if scored else None,
                    "interactions": sum(v for s, v in interactions.items() if s < step),
                    "rl_wall_s": wall})
    return out


def zero_variance_table(run: RunDir) -> dict[str, Any]:
    """Observed vs predicted zero-variance rate per RL step and overall (module doc)."""
    predicted_before: dict[int, float] = {}
    last: float | None = None
    for rec in run.metrics:
        if rec.get("kind") == "task_sampler":
            info = rec.get("informative") or {}
            if isinstance(info.get("predicted_next_rate"), int | float):
                last = float(info["predicted_next_rate"])
        elif rec.get("kind") == "task_draws" and last is not None:
            predicted_before.setdefault(int(rec.get("step", -1)), last)
    rows, zero_total, scored_total, pred_total = [], 0, 0, 0.0
    for rec in sorted(run.metrics_of("rl_step"), key=lambda m: int(m.get("step", -1))):
        step = int(rec.get("step", -1))
        scored = int((rec.get("credit") or {}).get("n_scored_groups") or 0)
        zero = int(rec.get("zero_variance") or 0)
        pred = predicted_before.get(step)
        rows.append({"step": step, "scored_groups": scored, "zero_variance": zero,
                     "observed_rate": zero / scored if scored else None,
                     "predicted_rate": pred})
        if scored and pred is not None:
            zero_total, scored_total, pred_total = (zero_total + zero, scored_total + scored,
                                                    pred_total + pred * scored)
    overall = {"scored_groups": scored_total, "zero_variance": zero_total,
               "observed_rate": zero_total / scored_total if scored_total else None,
               "observed_ci": list(wilson_interval(zero_total, scored_total))
               if scored_total else None,
               "predicted_rate": pred_total / scored_total if scored_total else None}
    return {"steps": rows, "overall": overall}
