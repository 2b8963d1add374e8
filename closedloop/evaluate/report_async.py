"""The report's asynchrony section: what freshness and placement did to a run (bounded
asynchrony, docs/concepts.md), read from its metrics alone.

- Δ_version = u - v of every admitted group (a histogram) and D_sample (mean |log π_train^u -
  log π_beh^v| over the trained tokens, per step);
- Δ_time (trainer consume time - rollout finish time) and queue age (consume time - the
  round's queueing), p50/p95/max over groups, and the queue's high-water mark;
- stale and dropped sample rates, overall and stratified by task family, length band and
  reward band (the queue's own decision records, summed over steps);
- generator and trainer utilization: busy time over the RL phase's wall time (an async run's
  ``pipeline`` record; a synchronous run's step timings, where the two take turns);
- publication latency per worker (p50/p95 load and ACK seconds) and what each round's
  in-flight boundary did.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from closedloop.evaluate.rundir import RunDir

__all__ = ["asynchrony_html", "asynchrony_section"]

_DIMS = ("task_family", "length_band", "reward_band")


def _quantiles(values: Sequence[float]) -> dict[str, float] | None:
    vals = sorted(float(v) for v in values if isinstance(v, int | float))
    if not vals:
        return None

    def at(q: float) -> float:
        return vals[min(len(vals) - 1, max(0, int(-(-q * len(vals) // 1)) - 1))]

    return {"p50": at(0.5), "p95": at(0.95), "max": vals[-1]}


def _strata(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Samples, stale and dropped counts and rates per stratum value, summed over steps."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for dim in ("overall", *_DIMS):
        cells: dict[str, dict[str, float]] = {}
        for m in steps:
            for row in (m.get("admission") or {}).get("rates", {}).get(dim, []):
                key = "all" if dim == "overall" else str(row.get(dim))
                n = float(row.get("n_samples", 0))
                cell = cells.setdefault(key, {"samples": 0.0, "stale": 0.0, "dropped": 0.0})
                cell["samples"] += n
                cell["stale"] += n * float(row.get("stale_rate", 0.0))
                cell["dropped"] += n * float(row.get("drop_rate", 0.0))
        for cell in cells.values():
            n = cell["samples"]
            cell["stale_rate"] = cell["stale"] / n if n else 0.0
            cell["drop_rate"] = cell["dropped"] / n if n else 0.0
        out[dim] = cells
    return out


def _utilization(run: RunDir, steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    pipeline = next((m for m in run.metrics_of("pipeline")), None)
    if pipeline is not None:
        t = pipeline.get("timing") or {}
        wall = float(t.get("wall_s") or 0.0)
        return {"placement": "async", "wall_s": wall,
                "generator": t.get("generator_busy_s", 0.0) / wall if wall else None,
                "trainer": t.get("trainer_busy_s", 0.0) / wall if wall else None}
    secs = [m.get("seconds") or {} for m in steps]
    gen = sum(float(s.get("collect_s", 0.0)) for s in secs)
    train = sum(float(s.get(k, 0.0)) for s in secs for k in ("admit_s", "update_s",
                                                              "publish_s"))
    wall = gen + train
    return {"placement": "synchronous", "wall_s": wall,
            "generator": gen / wall if wall else None, "trainer": train / wall if wall else None}


def asynchrony_section(run: RunDir) -> dict[str, Any] | None:
    """The section's data (module doc); ``None`` for a run without admission records."""
    steps = sorted((m for m in run.metrics_of("rl_step") if m.get("admission")),
                   key=lambda m: int(m.get("step", 0)))
    if not steps:
        return None
    rollout = run.section("rollout")
    lags: dict[str, int] = {}
    ages: list[float] = []
    delays: list[float] = []
    high_water = 0
    rows = []
    for m in steps:
        adm, timing = m["admission"], m.get("timing") or {}
        for g in adm.get("groups", []):
            if g.get("disposition") == "admit" and g.get("delta_version") is not None:
                lags[str(g["delta_version"])] = lags.get(str(g["delta_version"]), 0) + 1
        ages += [a for a in timing.get("queue_age_s", []) if a is not None]
        delays += [d for d in timing.get("delta_time_s", []) if d is not None]
        high_water = max(high_water, int(timing.get("high_water_groups") or 0))
        rows.append({"step": m.get("step"), "behavior_version": adm.get("behavior_version"),
                     "train_version": adm.get("train_version"),
                     "max_delta_version": adm.get("max_delta_version"),
                     "d_sample": (m.get("policies") or {}).get("d_sample"),
                     "in_flight": adm.get("in_flight")})
    d_sample = [r["d_sample"] for r in rows if isinstance(r["d_sample"], int | float)]
    sync = next(iter(run.metrics_of("weight_sync")), None)
    return {"mode": rollout.get("mode", "synchronous"),
            "max_version_lag": rollout.get("max_version_lag", 0),
            "in_flight_policy": rollout.get("in_flight_policy", "finish_old"),
            "delta_version_histogram": dict(sorted(lags.items())),
            "d_sample": {"mean": sum(d_sample) / len(d_sample), "max": max(d_sample)}
            if d_sample else None,
            "delta_time_s": _quantiles(delays), "queue_age_s": _quantiles(ages),
            "high_water_groups": high_water, "rates": _strata(steps),
            "utilization": _utilization(run, steps),
            "publication_latency": (sync or {}).get("timing"), "steps": rows}


def _f(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else "—" if v is None else str(v)


def asynchrony_html(section: Mapping[str, Any] | None) -> str:
    """The section as HTML ('' without one)."""
    if not section:
        return ""
    util = section["utilization"]
    overall = section["rates"]["overall"].get("all", {})
    q = section["queue_age_s"] or {}
    dt = section["delta_time_s"] or {}
    lines = [
        "<h2>Asynchrony</h2>",
        f"<p>{section['mode']}, max_version_lag {section['max_version_lag']}, in-flight "
        f"{section['in_flight_policy']}. Δ_version of admitted groups: "
        f"{section['delta_version_histogram']}; D_sample {_f(section['d_sample'])}.</p>",
        f"<p>Δ_time p50 {_f(dt.get('p50'))} s, p95 {_f(dt.get('p95'))} s; queue age p50 "
        f"{_f(q.get('p50'))} s, p95 {_f(q.get('p95'))} s; high-water "
        f"{section['high_water_groups']} groups.</p>",
        f"<p>Stale rate {_f(overall.get('stale_rate'))}, drop rate "
        f"{_f(overall.get('drop_rate'))} over {_f(overall.get('samples'))} samples; "
        f"utilization ({util['placement']}): generator {_f(util['generator'])}, trainer "
        f"{_f(util['trainer'])} of {_f(util['wall_s'])} s.</p>",
    ]
    for dim in _DIMS:
        cells = section["rates"][dim]
        lines.append(f"<p>{dim}: " + "; ".join(
            f"{k} stale {_f(c['stale_rate'])} drop {_f(c['drop_rate'])} (n={int(c['samples'])})"
            for k, c in sorted(cells.items())) + "</p>")
    return "\n".join(lines)
