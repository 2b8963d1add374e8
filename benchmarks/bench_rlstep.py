"""Benchmark (not a test): one RL step's wall time split into collect / verify / update / publish.

Runs a training run (``closedloop.training.run.open_run`` and its roles) on the smoke
configuration scaled down (embedded model, temperature 0.7, ``drop_censored``, ``--groups``
groups of G=``--group`` per step, ``--max-turns`` turns, ``--action`` max action tokens, a
``--sft-demos`` x 2 epochs warm start so that episodes end and get verified) in a temporary run
directory: attach the roles, publish v0000, then ``rl_step`` until ``--steps`` steps have made
an update (at most ``--max-tries`` steps: a step whose groups are all censored or zero-variance
has nothing to update, and is reported as such). Each step's ``seconds`` (collect_s, admit_s,
update_s, publish_s) come from the step report (the metrics.jsonl ``rl_step`` line); the
verifier step runs within collect_s (after the rollout), so ``verify_s`` (and
decode/env/bookkeeping) are summed from the step's trace timings.

    .venv/bin/python benchmarks/bench_rlstep.py [--steps 1] [--max-tries 3] [--group 8]
        [--groups 2] [--sft-demos 16] [--max-turns 8] [--action 96] [--threads 1] [--quick]

``--quick``: a check that the step runs, in seconds: the tests' tiny agent on the tests' short
run (``_quick``: 2 groups of G=4, up to 6 turns), one step with an update; its figures mean
nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_label, set_threads
from _quick import build_quick_model, quick_config

from closedloop.config import RunConfig, parse_config, smoke_config
from closedloop.contracts import load_episodes
from closedloop.policy.registry import version_name
from closedloop.training.rl_step import rl_step
from closedloop.training.run import attach_roles, open_run, publish
from closedloop.training.warm_start import warm_start

PARTS = ("collect_s", "admit_s", "update_s", "publish_s")
TRACE_KEYS = ("decode_s", "env_s", "render_s", "bookkeeping_s", "reset_s", "verify_s")


def tiny_config(args: argparse.Namespace) -> RunConfig:
    base = smoke_config()
    r = dataclasses.replace
    return base.with_overrides(
        environment=r(base.environment, train_tasks=8, heldout_tasks=4,
                      max_turns=args.max_turns),
        rollout=r(base.rollout, group_size=args.group, max_action_tokens=args.action),
        training=r(base.training, rl_steps=args.max_tries, groups_per_step=args.groups),
        sft=r(base.sft, enabled=args.sft_demos > 0, demonstrations=max(1, args.sft_demos)))


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1, help="steps with an update to report")
    ap.add_argument("--max-tries", type=int, default=3, help="steps to run at most")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--action", type=int, default=96)
    ap.add_argument("--sft-demos", type=int, default=16,
                    help="warm-start demonstrations (0: no SFT; the raw model then rarely ends "
                    "an episode, every group is censored and the update is empty)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--summary")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.max_tries = 1, 3
    set_threads(args.threads)
    print(f"[rlstep] machine: {machine_label()}")
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        if args.quick:
            cfg = parse_config(quick_config(build_quick_model(Path(tmp)), args.max_tries))
            args.group, args.groups = cfg.rollout.group_size, cfg.training.groups_per_step
            args.max_turns, args.action = cfg.environment.max_turns, cfg.rollout.max_action_tokens
        else:
            cfg = tiny_config(args)
        run = open_run(cfg, Path(tmp) / "bench-run")
        try:
            if cfg.sft.enabled:
                warm_start(run)
            attach_roles(run)
            publish(run, version_name(0))
            taught = ("the tests' tiny agent taught" if args.quick else
                      f"{args.sft_demos} SFT demos x {cfg.sft.epochs} epochs")
            print(f"[rlstep] set-up (tasks, model, {taught}, adapter, publish v0000) "
                  f"{time.perf_counter() - t0:.1f}s; {args.groups} group(s) x G={args.group}, "
                  f"max {args.max_turns} turns, {args.action} max action tokens")
            updated = 0
            for step in range(args.max_tries):
                if updated >= args.steps:
                    break
                t1 = time.perf_counter()
                report = rl_step(run, step)
                wall = time.perf_counter() - t1
                _, eps = load_episodes(run.dir / "traces" / f"step-{step:04d}.jsonl")
                tr = {k: sum(e.trajectory.timings.get(k, 0.0) for e in eps) for k in TRACE_KEYS}
                turns = sum(len(e.turns) for e in eps)
                secs = report.seconds
                split = ", ".join(f"{k} {secs.get(k, 0.0):.2f}s "
                                  f"({100 * secs.get(k, 0.0) / wall:.0f}%)" for k in PARTS)
                print(f"[rlstep] step {step}: wall {wall:.2f}s = {split}; {len(eps)} episodes, "
                      f"{turns} turns, {report.admitted}/{report.groups} groups admitted"
                      + ("" if report.metrics else " (no trainable episodes: the update is "
                         "empty)"))
                print("[rlstep]   inside collect (trace timings): " + ", ".join(
                    f"{k} {v:.2f}s" for k, v in tr.items()))
                if report.metrics or not out:
                    out = {**{k: secs.get(k, 0.0) for k in PARTS}, "verify_s": tr["verify_s"],
                           "wall": wall}
                updated += bool(report.metrics)
            if not updated:
                print(f"[rlstep] no step of {args.max_tries} made an update (every group "
                      "censored or zero-variance): the figures are of an empty step")
        finally:
            run.close()
    for k, v in out.items():
        emit(args.summary, "rlstep", f"step with an update: {k}", round(v, 2), "s")
    return out


if __name__ == "__main__":
    main()
