"""Benchmark (not a test): bounded asynchrony (lag 1, generator thread) against the synchronous run.

Two runs of the same workload (tasks, seeds, model, warm start, budgets, objective) differ in
placement and freshness only (bounded asynchrony, docs/concepts.md):

- ``sync``: ``rollout.mode: synchronous``, ``rollout.max_version_lag: 0`` (the roles take
  turns: round r is sampled by v_r, then step r trains on it);
- ``async``: ``rollout.mode: async``, ``rollout.max_version_lag: --lag`` (1): the generator
  thread of ``closedloop.training.pipeline`` samples round r by v_max(0, r - 1) while the
  trainer updates.

Both use ``update.objective: ppo_clip`` with ``update.proximal_policy: trainer_at_step_start``
(the decoupled correction a lag >= 1 needs), as tests/test_async_run.py configures it. Each run
goes through the library's set-up path (``closedloop.training.loop.opened_run``: package check,
warm start, roles), publishes v0000, evaluates the start policy on the held-out suite, then the
RL phase (``closedloop.training.pipeline.run_rl``, timed here: its wall time), then the final
policy on the held-out suite. Per side it prints:

- wall time of the RL phase and per trained group (groups the admission queue handed to the
  trainer) and per collected group;
- the run's own asynchrony figures (``closedloop.evaluate.report_async.asynchrony_section``):
  Δ_version histogram of admitted groups, stale and dropped samples, D_sample, queue age,
  generator and trainer utilization (the ``pipeline`` record under async, the step timings when
  synchronous);
- the same utilizations over the RL wall time measured here, with the trainer's wait for the
  queue taken out (the step records' ``timing.trainer_wait_s``; the ``pipeline`` record's
  ``trainer_busy_s`` is already net of it);
- what overlap buys (a lower bound on the seconds both roles were busy at once: generator busy
  + trainer busy - RL wall) and what it costs (each role's busy time per round/step against the
  synchronous run's: on a host with fewer cores than the two roles' threads, each runs slower
  while the other computes; async's generator also loads and proves each version, which the
  synchronous run counts in the trainer's publish);
- the held-out result: the final policy's success (pass@1 with its bootstrap interval; pooled
  successes/attempts with the Wilson interval, ``closedloop.intervals``) and the paired
  difference async - sync over the same held-out tasks and seeds
  (``closedloop.evaluate.heldout.paired_difference``: paired bootstrap over tasks).

The ratio async / sync (wall per trained group, RL wall) is measured side by side in one
process (``--repeats`` alternates the order; medians); absolute seconds are labelled with the
machine. On 2 cores the two roles share the cores: the overlap can hide at most the shorter
role per step, and both slow down while they overlap; the benchmark says so in its output.

Default workload: the embedded SmolLM2 (the smoke's configuration scaled down: 8 train / 8
held-out terminal tasks, G=4, 2 groups per step, 4 RL steps, 6 turns, 96 action tokens, a
16-demonstration warm start, one held-out attempt per task): not run here (estimated at tens
of minutes on 2 cores: two warm starts, four evaluations, eight RL steps); its
figures are meant for an idle machine. ``--quick``: the tests' tiny agent
(tests/tiny_agent.py, the short run of tests/conftest.py: 2 train / 2 held-out tasks, 2 groups
x G=4, no warm start) with 2 RL steps, under a minute on 1 thread (27 s on the shared 2-core
host): a size check, not a measurement, and its held-out figures are 0 on both sides by
construction (the tiny agent is taught to give up on the held-out tasks).

    .venv/bin/python benchmarks/bench_async.py [--steps 4] [--lag 1] [--repeats 1]
        [--threads 1] [--quick] [--summary PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_label, median, rotate, set_threads
from _quick import build_quick_model, quick_config

from closedloop.config import parse_config, smoke_config
from closedloop.evaluate.heldout import EvalSummary, paired_difference
from closedloop.evaluate.report_async import asynchrony_section
from closedloop.evaluate.rundir import load_run
from closedloop.intervals import wilson_interval
from closedloop.policy.registry import version_name
from closedloop.training.loop import evaluate_start, opened_run
from closedloop.training.pipeline import run_rl
from closedloop.training.publisher import publication_latency
from closedloop.training.run import publish
from closedloop.training.run_evaluation import evaluate


@dataclass
class Side:
    """One run's figures (module doc)."""

    name: str
    rl_wall_s: float
    steps: int
    collected: int
    trained: int
    gen_busy_s: float
    trainer_busy_s: float
    trainer_wait_s: float
    seed: int
    section: dict[str, Any]
    start: EvalSummary
    final: EvalSummary

    def per_trained(self) -> float | None:
        """RL wall seconds per trained group (None when no group was trained)."""
        return self.rl_wall_s / self.trained if self.trained else None


# ------------------------------------------------------------------------------- workloads
def default_config(args: argparse.Namespace) -> dict[str, Any]:
    """The smoke's configuration (embedded SmolLM2) scaled down (module doc)."""
    data = smoke_config().to_dict()
    data["environment"].update(train_tasks=args.train_tasks, heldout_tasks=args.heldout_tasks,
                               max_turns=args.max_turns)
    data["rollout"].update(group_size=args.group, max_action_tokens=args.action)
    data["evaluation"].update(attempts_per_task=1, retain_suites=[], curve_points=2,
                              environment_family_disjoint=False, cold_start_train_eval=False)
    data["training"].update(rl_steps=args.steps, groups_per_step=args.groups,
                            package_check="quick")
    data["sft"].update(enabled=args.sft_demos > 0, demonstrations=max(1, args.sft_demos))
    data["update"].update(objective="ppo_clip", proximal_policy="trainer_at_step_start",
                          reference_policy="initial_sft" if args.sft_demos > 0 else "initial")
    return data


def side_config(base: dict[str, Any], side: str, lag: int) -> dict[str, Any]:
    """``base`` with the side's placement and freshness."""
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    data["rollout"].update(mode="async" if side == "async" else "synchronous",
                           max_version_lag=lag if side == "async" else 0)
    return data


# ------------------------------------------------------------------------------- one run
def run_side(name: str, data: dict[str, Any], run_dir: Path) -> Side:
    """Set up, evaluate the start, time the RL phase, evaluate the final policy; read the
    run's own records back."""
    cfg = parse_config(data)
    with opened_run(cfg, run_dir) as run:
        publish(run, version_name(0))
        start = evaluate_start(run)
        t0 = time.perf_counter()
        reports = run_rl(run)
        rl_wall = time.perf_counter() - t0
        final = evaluate(run, "final", run.registry.manifest(
            version_name(cfg.training.rl_steps)))
        run.log_metrics("weight_sync", {"label": "publication", "workers": list(
            run.roles()[2].worker_ids), "timing": publication_latency(run.registry)})
    rundir = load_run(run_dir)
    section = asynchrony_section(rundir) or {}
    steps = [m for m in rundir.metrics_of("rl_step")]
    wait = sum(float((m.get("timing") or {}).get("trainer_wait_s") or 0.0) for m in steps)
    pipeline = next(iter(rundir.metrics_of("pipeline")), None)
    if pipeline is not None:
        timing = pipeline["timing"]
        # trainer_busy_s is net of the queue wait; the figures below take the wait out again
        gen = float(timing["generator_busy_s"])
        trainer = float(timing["trainer_busy_s"]) + wait
    else:
        secs = [r.seconds for r in reports]
        gen = sum(s.get("collect_s", 0.0) for s in secs)
        trainer = sum(v for s in secs for k, v in s.items() if k not in ("collect_s", "wait_s"))
    return Side(name, rl_wall, len(reports), sum(r.groups for r in reports),
                sum(r.admitted for r in reports), gen, trainer, wait, cfg.training.seed, section,
                start, final)


# ------------------------------------------------------------------------------- printing
def _f(v: float | None, unit: str = "", digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}{unit}"


def heldout_line(s: Side) -> str:
    """Final held-out success: pass@1 (bootstrap CI over tasks) and pooled successes over
    scored attempts (Wilson 95%)."""
    hits, n = sum(t.successes for t in s.final.tasks), sum(t.n for t in s.final.tasks)
    wilson = "no scored attempt" if n == 0 else "Wilson 95% [{:.2f}, {:.2f}]".format(
        *wilson_interval(hits, n))
    ci = s.final.pass_at_1_ci
    return (f"final held-out pass@1 {_f(s.final.pass_at_1)}"
            + (f" (bootstrap [{ci[0]:.2f}, {ci[1]:.2f}])" if ci else "")
            + f"; {hits}/{n} scored attempts succeeded ({wilson}); start pass@1 "
            f"{_f(s.start.pass_at_1)}")


def print_side(s: Side) -> None:
    """The side's figures (module doc)."""
    sec = s.section
    overall = (sec.get("rates") or {}).get("overall", {}).get("all", {})
    util = sec.get("utilization") or {}
    trainer_net = s.trainer_busy_s - s.trainer_wait_s
    print(f"[async] {s.name}: RL wall {s.rl_wall_s:.2f}s over {s.steps} steps; "
          f"{s.trained}/{s.collected} groups trained; per trained group "
          f"{_f(s.per_trained(), 's')}, per collected group "
          f"{_f(s.rl_wall_s / s.collected if s.collected else None, 's')}")
    print(f"[async]   Δ_version of admitted groups {sec.get('delta_version_histogram')}; "
          f"samples {int(overall.get('samples', 0))}, stale {int(overall.get('stale', 0))}, "
          f"dropped {int(overall.get('dropped', 0))}; D_sample {sec.get('d_sample')}; "
          f"queue age {sec.get('queue_age_s')}; high-water {sec.get('high_water_groups')}")
    print(f"[async]   utilization, the run's own ({util.get('placement')}, of "
          f"{_f(util.get('wall_s'), 's')}): generator {_f(util.get('generator'))}, trainer "
          f"{_f(util.get('trainer'))}")
    print(f"[async]   utilization over the RL wall measured here: generator "
          f"{s.gen_busy_s:.2f}s ({s.gen_busy_s / s.rl_wall_s:.2f}), trainer {trainer_net:.2f}s "
          f"({trainer_net / s.rl_wall_s:.2f}) net of {s.trainer_wait_s:.2f}s waiting for the "
          f"queue; both busy at once at least "
          f"{max(0.0, s.gen_busy_s + trainer_net - s.rl_wall_s):.2f}s")
    print(f"[async]   {heldout_line(s)}")


def print_cost(sync: Side, asy: Side) -> None:
    """What overlap costs: each role's busy time per round/step, async against sync."""
    def per(v: float, n: int) -> float:
        return v / max(1, n)

    g0, g1 = per(sync.gen_busy_s, sync.steps), per(asy.gen_busy_s, asy.steps)
    t0 = per(sync.trainer_busy_s - sync.trainer_wait_s, sync.steps)
    t1 = per(asy.trainer_busy_s - asy.trainer_wait_s, asy.steps)
    print(f"[async] cost of overlap: generator busy per round sync {g0:.2f}s, async {g1:.2f}s "
          f"(x{_f(g1 / g0 if g0 else None)}); trainer busy per step (net of waiting) sync "
          f"{t0:.2f}s, async {t1:.2f}s (x{_f(t1 / t0 if t0 else None)}); async's generator "
          "also loads and proves each version, which the synchronous trainer's publish does")


def cores_note(threads: int) -> None:
    """The honest caveat about the host's cores."""
    import os

    import torch

    cpus = os.cpu_count() or 1
    t = threads or torch.get_num_threads()
    print(f"[async] {cpus} cpus; torch uses {t} intra-op thread(s) per role: the synchronous "
          f"run computes on {t}, the async run's two roles want {2 * t} at once")
    if cpus < 2 * t or cpus <= 2:
        print("[async] on this host the generator and the trainer share the cores: the "
              "overlap can hide at most the shorter role per step, and each role runs slower "
              "while the other computes (the 'cost of overlap' line); what overlap buys here "
              "is small, on a host with a core (or a device) per role it is larger")


# ------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (module doc)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--steps", type=int, default=4, help="RL steps per run")
    ap.add_argument("--lag", type=int, default=1, help="the async run's max_version_lag")
    ap.add_argument("--repeats", type=int, default=1,
                    help="pairs of runs (order alternated; medians)")
    ap.add_argument("--train-tasks", type=int, default=8)
    ap.add_argument("--heldout-tasks", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--action", type=int, default=96)
    ap.add_argument("--sft-demos", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true",
                    help="the tests' tiny agent, 2 RL steps (under a minute on 1 thread)")
    ap.add_argument("--summary")
    args = ap.parse_args(argv)
    if args.lag < 1:
        ap.error("--lag must be >= 1 (the synchronous side is lag 0)")
    if args.quick:
        args.steps = 2
    return args


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    set_threads(args.threads)
    print(f"[async] machine: {machine_label()}")
    cores_note(args.threads)
    sides: dict[str, list[Side]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        if args.quick:
            base = quick_config(build_quick_model(Path(tmp)), args.steps)
            print(f"[async] quick: the tests' tiny agent taught in "
                  f"{time.perf_counter() - t0:.1f}s; {args.steps} RL steps of 2 groups x G=4")
        else:
            base = default_config(args)
            print(f"[async] embedded model, {args.train_tasks}/{args.heldout_tasks} tasks, "
                  f"{args.steps} steps of {args.groups} groups x G={args.group}, "
                  f"{args.max_turns} turns, {args.action} action tokens, "
                  f"{args.sft_demos} SFT demos")
        for rep in range(args.repeats):
            for name in rotate(("sync", "async"), rep):
                t1 = time.perf_counter()
                side = run_side(name, side_config(base, name, args.lag),
                                Path(tmp) / f"{name}-{rep}")
                print(f"[async] repeat {rep}, {name}: whole run (set-up, evaluations, RL) "
                      f"{time.perf_counter() - t1:.1f}s")
                print_side(side)
                sides[name].append(side)
    return report(args, sides)


def report(args: argparse.Namespace, sides: dict[str, list[Side]]) -> dict[str, float]:
    """The side-by-side ratios, the held-out difference, the summary rows."""
    sync, asy = sides["sync"][-1], sides["async"][-1]
    print_cost(sync, asy)
    wall = {k: median([s.rl_wall_s for s in v]) for k, v in sides.items()}
    per = {k: [p for s in v if (p := s.per_trained()) is not None] for k, v in sides.items()}
    ratio_wall = wall["async"] / wall["sync"]
    ratio_group = (statistics.median(per["async"]) / statistics.median(per["sync"])
                   if per["async"] and per["sync"] else None)
    diff = paired_difference(asy.final, sync.final, seed=sync.seed,
                             what=f"final held-out success, async lag {args.lag} - sync")
    print(f"[async] side by side ({args.repeats} pair(s), medians): RL wall async/sync "
          f"{ratio_wall:.2f}; wall per trained group async/sync {_f(ratio_group)} "
          "(< 1: the overlap pays)")
    if diff["measured"]:
        print(f"[async] held-out, async - sync (paired over {diff['tasks']} tasks, same seeds): "
              f"{diff['estimate']:+.3f}, 95% paired bootstrap [{diff['ci'][0]:+.3f}, "
              f"{diff['ci'][1]:+.3f}]")
    else:
        print(f"[async] held-out, async - sync: not measured ({diff['detail']})")
    if args.quick:
        print("[async] quick: the tiny agent is taught to give up on the held-out tasks, so "
              "both sides score 0 there by construction; the held-out comparison means "
              "something only on the default workload")
    same_start = sync.start.per_task_success() == asy.start.per_task_success()
    print(f"[async] start policies evaluated alike (v0000, same seeds): {same_start}")
    print(f"[async] machine: {machine_label('at the end')}")
    out = {"rl_wall_async_over_sync": ratio_wall, "sync_rl_wall_s": wall["sync"],
           "async_rl_wall_s": wall["async"]}
    emit(args.summary, "async", f"RL wall, async lag {args.lag} / sync", round(ratio_wall, 3),
         "x")
    if ratio_group is not None:
        out["per_group_async_over_sync"] = ratio_group
        emit(args.summary, "async", "wall per trained group, async / sync",
             round(ratio_group, 3), "x", "< 1")
    for name, side in (("sync", sync), ("async", asy)):
        emit(args.summary, "async", f"{name} RL wall per trained group",
             _f(side.per_trained()), "s")
    if diff["measured"]:
        out["heldout_async_minus_sync"] = float(diff["estimate"])
        emit(args.summary, "async", "held-out final, async - sync",
             f"{diff['estimate']:+.3f} [{diff['ci'][0]:+.3f}, {diff['ci'][1]:+.3f}]")
    return out


if __name__ == "__main__":
    main()
