"""``train``, ``experiment``, ``smoke`` and ``reevaluate``: the commands that run (or resume)
training, the controlled experiments and their later evaluations, then write the report."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from closedloop.cli.run_dir_commands import verified
from closedloop.cli.text import (
    arm_lines,
    emit,
    reevaluate_lines,
    replicate_lines,
    report_lines,
    suite_lines,
)
from closedloop.progress import phase_lines, phase_times, reset_phases


def cmd_train(args: argparse.Namespace) -> int:
    """Run (or resume) a training run from a config file."""
    from closedloop.config import load_config, parse_config
    from closedloop.errors import ConfigError

    cfg = load_config(args.config)
    if cfg.credit.experiment_arm != "none":
        raise ConfigError("credit.experiment_arm", "an extra arm of `closedloop experiment`: a "
                          "single run does not train it")
    if getattr(args, "workers", None):  # where the RL steps' episodes run (docs/scale-out.md)
        data = cfg.to_dict()
        cfg = parse_config({**data, "rollout": {**data["rollout"], "workers": args.workers}})
    return _run_training(cfg, args)


def cmd_smoke(args: argparse.Namespace) -> int:
    """The smoke experiment on the embedded model: the four controls, then the report."""
    from closedloop.config import smoke_config

    return _run_experiment(smoke_config(), args)


def cmd_experiment(args: argparse.Namespace) -> int:
    """Run (or resume) the four controls of a config from one cold start."""
    from closedloop.config import load_config

    return _run_experiment(load_config(args.config), args)


def cmd_reevaluate(args: argparse.Namespace) -> int:
    """More attempts per task for finished policies, paired and pooled with their own
    evaluations (``closedloop.experiments.reevaluate``)."""
    from closedloop.experiments.reevaluate import reevaluate, reevaluate_experiment

    runs = [Path(p) for p in args.runs]
    verified(*runs, *([args.baseline] if args.baseline else []))
    if args.baseline:
        result = reevaluate(Path(args.baseline), runs, args.attempts, args.suite, args.step)
    elif len(runs) == 1:
        result = reevaluate_experiment(runs[0], args.attempts, args.suite, args.step)
    else:
        raise SystemExit("several runs need --baseline (a frozen arm at v0000)")
    emit(result, args.json, "\n".join(reevaluate_lines(result, args.attempts, args.step)))
    return 0


def _run_experiment(cfg: Any, args: argparse.Namespace) -> int:
    from closedloop.experiments.controls import run_experiment

    if getattr(args, "model", None):
        cfg = cfg.with_overrides(model=args.model)
    exp_dir = Path(args.run_dir or Path(cfg.run_dir) / time.strftime("smoke-%Y%m%d-%H%M%S"))
    if getattr(args, "seeds", None) is not None:
        return _run_replicates(cfg, exp_dir, args)
    if getattr(args, "only", None) is not None:
        raise SystemExit("--only selects replicates: it needs --seeds N")
    t0 = time.perf_counter()
    result = run_experiment(cfg, exp_dir, getattr(args, "override_config", None))
    lines = arm_lines(result) + suite_lines(result)
    report = write_run_report(exp_dir)
    if report:
        lines += report_lines(report.with_suffix(".json"))
        lines.append(f"report: {report}")
    lines.append(f"wall time: {(time.perf_counter() - t0) / 60:.1f} min")
    lines += ["== where the time went (this launch) ==",
              *phase_lines(result.get("phases_this_launch") or [])]
    emit({**result, "report": str(report) if report else None}, args.json, "\n".join(lines))
    return 0


def _run_replicates(cfg: Any, exp_dir: Path, args: argparse.Namespace) -> int:
    from closedloop.experiments.replicates import run_replicates

    t0 = time.perf_counter()
    data = run_replicates(cfg, exp_dir, args.seeds, getattr(args, "override_config", None),
                          only=getattr(args, "only", None), claim_of=_report_claim)
    lines = replicate_lines(data, exp_dir)
    lines.append(f"wall time: {(time.perf_counter() - t0) / 60:.1f} min")
    emit(data, args.json, "\n".join(lines))
    return 0


def _report_claim(rep_dir: Path) -> dict[str, Any] | None:
    """Write a replicate's report; return its claim (None where reports cannot be built)."""
    report = write_run_report(rep_dir)
    if report is None:
        return None
    claim: dict[str, Any] = json.loads(report.with_suffix(".json").read_text("utf-8"))["claim"]
    return claim


def write_run_report(exp_dir: Path) -> Path | None:
    """Write report.html and report.json of a run or experiment directory; the HTML path
    (None where the report's dependencies cannot be imported)."""
    try:
        from closedloop.evaluate.report import write_report
    except ImportError:
        return None
    html, _ = write_report(exp_dir)
    return Path(html)


def _run_training(cfg: Any, args: argparse.Namespace) -> int:
    from closedloop.training.loop import train

    if getattr(args, "model", None):
        cfg = cfg.with_overrides(model=args.model)
    run_dir = Path(args.run_dir or Path(cfg.run_dir) / time.strftime("run-%Y%m%d-%H%M%S"))
    reset_phases()
    summary = train(cfg, run_dir, args.override_config)
    report = write_run_report(run_dir)
    summary["report"] = str(report) if report else None
    text = "\n".join(f"{k}: {v}" for k, v in summary.items() if k != "seconds_by_step")
    text += "\n== where the time went (this launch) ==\n" + "\n".join(phase_lines(phase_times()))
    emit(summary, args.json, "\n== summary ==\n" + text)
    return 0
