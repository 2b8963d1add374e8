"""Both arms of the recurrent actor–critic (sparse and shaped), their report and plot.

``run_both(cfg, out_dir)`` trains ``out_dir/sparse`` and ``out_dir/shaped`` (in two processes
when ``parallel``: one CPU thread each) and writes ``out_dir/report.json`` and
``out_dir/keydoor_ac.png``:

- per arm: greedy success on the train and held-out tasks per exit colour at the end, the first
  evaluated iteration where both colours of the train tasks reached ``solved_at`` (default 0.95),
  the wall time, and the curve of training success (the verifier's, sparse);
- the boundary check of the shaped arm: for every training episode, shaped discounted return −
  sparse discounted return − (−Φ(s_0) + γ^K Φ'(s_K)), its largest absolute value over the run
  (what "the shaped return differs from the sparse return only by the boundary term" means
  here); the two arms themselves are compared on the verifier's success, the same return for
  both;
- the plot: training success per iteration of both arms, and greedy success per colour.

Command: ``python -m closedloop.experiments.recurrent_ac_report --run-dir DIR`` (``--quick``:
a few hundred episodes, for a smoke check).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from closedloop.experiments.recurrent_ac import ACRunConfig, train_arm

__all__ = ["QUICK", "main", "plot_arms", "run_both"]

QUICK = ACRunConfig(train_tasks=8, heldout_tasks=4, iterations=6, group_size=4, eval_every=3,
                    trace_every=3)
"""A few hundred episodes: the pipeline end to end, not a learning claim."""
ARMS = ("sparse", "shaped")


def _train(args: tuple[ACRunConfig, str, bool]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    cfg, run_dir, shaping = args
    return train_arm(cfg, run_dir, shaping)


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _solved_at(evals: list[dict[str, Any]], level: float) -> int | None:
    for e in evals:
        train = e["train"]
        colours = [v for k, v in train.items() if k not in ("all", "n")]
        if colours and all(v is not None and v >= level for v in colours):
            return int(e["iteration"])
    return None


def arm_report(run_dir: Path, summary: dict[str, Any], level: float) -> dict[str, Any]:
    """One arm's entry of the report (module docstring)."""
    records = _read(run_dir / "metrics.jsonl")
    iters = [r for r in records if r["kind"] == "iteration"]
    devs = [r["boundary_max_dev"] for r in iters if r.get("boundary_max_dev") is not None]
    return {"run_dir": str(run_dir), "final_greedy": {s: summary["final"][s]
                                                      for s in ("train", "heldout")},
            "solved_at_iteration": _solved_at(summary["evaluations"], level),
            "episodes": sum(r["episodes"] for r in iters), "wall_s": summary["wall_s"],
            "train_success": [r["train_success"] for r in iters],
            "boundary_max_dev": max(devs) if devs else None}


def plot_arms(report: dict[str, Any], evals: dict[str, list[dict[str, Any]]]) -> bytes:
    """The PNG: training success per iteration, and greedy success per colour."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, style in zip(ARMS, ("-", "--"), strict=True):
        left.plot(report["arms"][name]["train_success"], style, label=name)
        for colour, c in (("red", "tab:red"), ("blue", "tab:blue")):
            pts = [(e["iteration"], e["train"].get(colour)) for e in evals[name]]
            right.plot([p[0] for p in pts], [p[1] for p in pts], style, color=c,
                       label=f"{name}, {colour} exit")
    left.set(title="training success (verifier, sampled)", xlabel="iteration",
             ylabel="success", ylim=(-0.05, 1.05))
    right.set(title="greedy success on the train tasks", xlabel="iteration", ylim=(-0.05, 1.05))
    left.legend()
    right.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def run_both(cfg: ACRunConfig, out_dir: str | Path, parallel: bool = True,
             solved_level: float = 0.95) -> dict[str, Any]:
    """Train both arms, write report.json and keydoor_ac.png; return the report."""
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    jobs = [(cfg, str(root / name), name == "shaped") for name in ARMS]
    t0 = time.perf_counter()
    if parallel:
        with multiprocessing.get_context("spawn").Pool(2) as pool:
            summaries = pool.map(_train, jobs)
    else:
        summaries = [train_arm(*job) for job in jobs]
    report: dict[str, Any] = {
        "config": {k: v for k, v in cfg.__dict__.items()}, "parallel": parallel,
        "wall_s": time.perf_counter() - t0,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                 "processor": platform.processor()},
        "arms": {name: arm_report(root / name, s, solved_level)
                 for name, s in zip(ARMS, summaries, strict=True)},
        "solved_level": solved_level,
        "compared": ("the arms on the verifier's success (the sparse return, the same for both);"
                     " within the shaped arm, per training episode: shaped discounted return - "
                     "sparse discounted return - (-Phi(s_0) + gamma^K Phi'(s_K)), Phi'(terminal)"
                     " = 0; boundary_max_dev is its largest absolute value")}
    evals = {name: s["evaluations"] for name, s in zip(ARMS, summaries, strict=True)}
    (root / "keydoor_ac.png").write_bytes(plot_arms(report, evals))
    (root / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    return report


def main(argv: list[str] | None = None) -> int:
    """The command of the module docstring."""
    p = argparse.ArgumentParser(prog="python -m closedloop.experiments.recurrent_ac_report",
                                description="recurrent actor-critic on key-and-door, sparse "
                                            "and shaped, with the report and plot")
    p.add_argument("--run-dir", default="runs/keydoor-ac")
    p.add_argument("--quick", action="store_true", help="a few hundred episodes (smoke)")
    p.add_argument("--iterations", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serial", action="store_true", help="one process, both arms in turn")
    args = p.parse_args(argv)
    cfg = replace(QUICK if args.quick else ACRunConfig(), seed=args.seed)
    if args.iterations:
        cfg = replace(cfg, iterations=args.iterations)
    report = run_both(cfg, args.run_dir, parallel=not args.serial)
    for name, arm in report["arms"].items():
        final = arm["final_greedy"]
        print(f"{name}: greedy success train {final['train']} held-out {final['heldout']}; "
              f"solved at iteration {arm['solved_at_iteration']}; {arm['episodes']} episodes, "
              f"{arm['wall_s']:.0f} s; boundary max |dev| {arm['boundary_max_dev']}")
    print(f"wall {report['wall_s']:.0f} s; report {Path(args.run_dir) / 'report.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
