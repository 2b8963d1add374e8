"""The ``closedloop`` command. Every subcommand takes ``--json`` for machine-readable output."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeAlias

from closedloop.engine import tune_allocator
from closedloop.errors import ClosedloopError, EnvPackageError
from closedloop.progress import phase_lines, phase_times, reset_phases

OVERRIDE_HELP = ("resume a run directory with a config that differs from the one it "
                 "recorded; REASON and the differing keys are kept in launches.jsonl")


def _print(data: Any, as_json: bool, text: str) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str) if as_json else text)


def _package(args: argparse.Namespace) -> Any:
    """The environment package of a command: ``--config``'s, else ``--env``/``--env-factory``,
    else the built-in terminal tasks."""
    from closedloop.envs.discovery import resolve_package
    from closedloop.training.wiring import run_package

    if getattr(args, "config", None):
        from closedloop.config import load_config

        return run_package(load_config(args.config).environment)
    return resolve_package(args.env, args.env_factory)


def _task_sets(package: Any, split: str | None) -> list[str]:
    """The ids of the package's default task sets (48 train / 16 held-out, seed 0)."""
    from closedloop.contracts.package import TaskSetRequest

    sets = package.task_sets(TaskSetRequest(48, 16, 0))
    if split is None:
        return [*sets.train, *sets.heldout]
    return list(sets.train if split == "train" else sets.heldout)


def cmd_tasks(args: argparse.Namespace) -> int:
    """List tasks or show one (the hidden grader is never shown)."""
    package = _package(args)
    if args.action == "list":
        rows = [{"id": info.task_id, "family": info.family, "split": info.split}
                for info in map(package.task_info, _task_sets(package, args.split))]
        text = "\n".join(f"{r['split']:8} {r['family']:18} {r['id']}" for r in rows)
        _print(rows, args.json, text + f"\n{len(rows)} tasks of {package.env_id}")
        return 0
    if not args.task_id:
        raise SystemExit("tasks show needs a TASK_ID")
    info = package.task_info(args.task_id)
    data = {"id": info.task_id, "env_id": package.env_id, "family": info.family,
            "split": info.split, "objective": info.objective, **dict(info.details)}
    text = "\n".join([f"{info.task_id}  ({info.family}, {info.split}, {package.env_id})",
                      info.objective,
                      *(f"{k}: {json.dumps(v, sort_keys=True, default=str)}"
                        for k, v in sorted(info.details.items()))])
    _print(data, args.json, text)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """The package check (``closedloop.evaluate.package_check``): the environment contract
    checker and the verifier FP/FN audit; exit 0 when it passes, 1 when it fails."""
    from closedloop.envs.discovery import resolve_package
    from closedloop.evaluate.package_check import check_environment_package

    target = args.package
    package = _package(args) if target is None else resolve_package(
        None if ":" in target else target, target if ":" in target else None)
    result = check_environment_package(package, "quick" if args.quick else "full")
    _print(result.to_dict(), args.json, "\n".join(result.lines()))
    return 0 if result.passed else 1


def cmd_play(args: argparse.Namespace) -> int:
    """Play one episode with a scripted policy, print it turn by turn, write its trace."""
    from closedloop.contracts import SamplerConfig, TraceWriter, sha256_hex
    from closedloop.policy import load_tokenizer
    from closedloop.rollout.source import ScriptedSource
    from closedloop.training.wiring import (
        CollectorParts,
        build_manifest,
        make_collector,
        make_renderer,
    )

    package = _package(args)
    renderer = make_renderer(load_tokenizer(), package)
    manifest = build_manifest(policy_version=f"scripted-{args.policy}",
                              weight_checksum=sha256_hex(f"scripted-{args.policy}"),
                              tokenizer_revision=sha256_hex("embedded-tokenizer"),
                              renderer=renderer, sampler=SamplerConfig(), step_budget=8,
                              max_action_tokens=0, model_id=f"scripted-{args.policy}")
    source = ScriptedSource(lambda task, key: package.scripted_policy(
        args.policy, task, args.seed, 0.3), renderer.encode, build=f"scripted-{args.policy}")
    trace = Path(args.trace or f"runs/play/{int(time.time())}-{args.policy}.jsonl")
    with TraceWriter(trace) as writer:
        collector = make_collector(source, manifest, CollectorParts(
            renderer, package.verifier(), "play", writer, args.max_turns, package))
        lease = collector.make_lease("play", args.task_id, args.seed, 1)
        (group,) = collector.collect([lease])
    (ep,) = group.episodes
    traj = ep.trajectory
    data = {"task_id": traj.task_id, "env_id": package.env_id, "policy": args.policy,
            "seed": traj.seed, "termination": traj.termination.value, "reward": traj.reward,
            "quarantine_reason": traj.quarantine_reason, "trace": str(trace),
            "turns": [{"turn": t.turn, "action": t.action_text, "kind": t.action_kind,
                       "error": t.observation_error, "observation": t.observation}
                      for t in ep.turns]}
    lines = [f"task {traj.task_id} ({args.policy}, seed {traj.seed})"]
    for t in ep.turns:
        lines += [f"[{t.turn}] > {t.action_text}",
                  *("    " + line for line in t.observation.splitlines()[:12])]
    lines += [f"termination: {traj.termination.value}", f"reward: {traj.reward}",
              f"trace: {trace}"]
    _print(data, args.json, "\n".join(lines))
    return 0


def _replay_package(args: argparse.Namespace) -> Any:
    """``--env``/``--env-factory``/``--config``; else the config of the run the trace is in;
    else the registered package of the trace's env version (``EnvPackageError`` if none)."""
    from closedloop.contracts import read_trace
    from closedloop.envs.discovery import package_for_version, resolve_section

    if args.env or args.env_factory or args.config:
        return _package(args)
    config = Path(args.trace).resolve().parent.parent / "config.json"
    if config.is_file():
        section = json.loads(config.read_text("utf-8")).get("config", {}).get("environment")
        return resolve_section(section)
    version = next((getattr(r, "env_version", None) for r in read_trace(args.trace)
                    if getattr(r, "env_version", None)), None)
    if version is None:
        return _package(args)
    found = package_for_version(version)
    if found is None:
        raise EnvPackageError(f"{args.trace}: env version {version!r} is not that of a "
                              "registered environment package; pass --env or --env-factory")
    return found


def _verified(*paths: str | Path) -> None:
    """The read-only integrity proof of every run directory a command reads (the one ``train``
    runs before its first step); stops with the named error naming the file."""
    from closedloop.evaluate.rundir import verify_reading

    verify_reading(*paths)


def cmd_replay(args: argparse.Namespace) -> int:
    """Re-execute a trace's recorded actions; exit 1 unless everything reproduces."""
    from closedloop.rollout.replay import replay_trace

    trace = Path(args.trace)
    if trace.parent.name == "traces" and (trace.parent.parent / "config.json").is_file():
        _verified(trace.parent.parent)  # a trace of a run directory: prove the run first
    package = _replay_package(args)
    report = replay_trace(args.trace, package.make_env, package.verifier())
    data = {"trace": report.path, "env_id": package.env_id, "ok": report.ok, **report.counts(),
            "episodes": [e.__dict__ for e in report.episodes]}
    lines = [f"{e.episode_id}: {'ok' if e.ok else 'MISMATCH'} "
             f"(observations {e.observations_match}, states {e.state_hashes_match}, "
             f"reward {e.reward_match}) {'; '.join(e.mismatches)}" for e in report.episodes]
    c = report.counts()
    lines.append(f"{c['reproduced']}/{c['episodes']} episodes reproduced "
                 f"({c['turns']} turns): observations, state hashes and rewards "
                 f"({package.env_id})")
    _print(data, args.json, "\n".join(lines))
    return 0 if report.ok else 1


def cmd_collect(args: argparse.Namespace) -> int:
    """Collect groups of G sibling episodes per task with a model; write and summarize the trace."""
    from collections import Counter

    from closedloop.contracts import SamplerConfig, TraceWriter
    from closedloop.engine import HFGenerator, precision_label, resolve_precision, warn_if_emulated
    from closedloop.policy import load_model
    from closedloop.progress import Progress, log
    from closedloop.rollout.source import GeneratorSource
    from closedloop.training.wiring import (
        CollectorParts,
        build_manifest,
        make_collector,
        make_renderer,
    )

    package = _package(args)
    precision = resolve_precision(args.precision)
    log(f"precision: {precision.describe()}")
    warn_if_emulated(precision)
    loaded = load_model(None if args.model in (None, "embedded") else args.model)
    log(f"model {loaded.model_id} from {loaded.source} in {loaded.load_seconds:.1f}s")
    renderer = make_renderer(loaded.tokenizer, package)
    sampler = SamplerConfig(args.temperature, args.top_p, args.top_k)
    manifest = build_manifest(policy_version="v0000", weight_checksum=loaded.weight_checksum,
                              tokenizer_revision=loaded.tokenizer_revision, renderer=renderer,
                              sampler=sampler, step_budget=args.max_turns,
                              max_action_tokens=args.max_action_tokens,
                              model_id=loaded.model_id,
                              dtype=precision_label(precision.precision))
    gen = HFGenerator(loaded.model, loaded.tokenizer, weight_checksum=loaded.weight_checksum,
                      seed=args.seed, precision=precision.precision)
    source = GeneratorSource(gen, renderer.action_text, sampler, args.max_action_tokens,
                             manifest.generator_build)
    tasks = _task_sets(package, None if args.tasks == "all" else args.tasks)[: args.limit]
    out = Path(args.out or f"runs/collect/{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    with TraceWriter(out) as writer:
        collector = make_collector(source, manifest, CollectorParts(
            renderer, package.verifier(), f"collect-{out.stem}", writer, args.max_turns,
            package))
        leases = [collector.make_lease(f"g{i:03d}", t, args.seed, args.group_size)
                  for i, t in enumerate(tasks)]
        with Progress(len(leases) * args.group_size, "collect") as bar:
            groups = collector.collect(leases, progress=bar.update)
    trajs = [ep.trajectory for g in groups for ep in g.episodes]
    scored = [t.task_success for t in trajs if t.task_success is not None]
    data = {"trace": str(out), "env_id": package.env_id, "groups": len(groups),
            "episodes": len(trajs), "scored": len(scored),
            "success_rate": sum(scored) / len(scored) if scored else None,
            "termination": dict(Counter(t.termination.value for t in trajs)),
            "action_tokens": sum(t.num_action_tokens for t in trajs),
            "generator": gen.stats.__dict__}
    _print(data, args.json, "\n".join(f"{k}: {v}" for k, v in data.items()))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Run (or resume) a training run from a config file."""
    from closedloop.config import load_config

    return _run_training(load_config(args.config), args)


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
    _verified(*runs, *([args.baseline] if args.baseline else []))
    if args.baseline:
        result = reevaluate(Path(args.baseline), runs, args.attempts, args.suite, args.step)
    elif len(runs) == 1:
        result = reevaluate_experiment(runs[0], args.attempts, args.suite, args.step)
    else:
        raise SystemExit("several runs need --baseline (a frozen arm at v0000)")
    at = "" if args.step is None else f", treated runs at v{args.step:04d}"
    lines = ["", f"== {result['suite']} suite: {args.attempts} more attempts per task{at}, "
                 "pooled with each policy's own evaluation (paired by each episode's stream) =="]
    for name, run in result["runs"].items():
        lo, hi = run["attempts_per_task"]
        lines.append(f"{name:12} {run['version']} success {_fmt(run['success'])} over "
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
    _print(result, args.json, "\n".join(lines))
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
    lines = ["", "== held-out success by arm (paired difference from frozen, 95% CI) =="]
    for name, arm in result["arms"].items():
        diff = arm.get("diff_vs_frozen")
        ci = arm.get("success_ci")
        lines.append(f"{name:9} success {_fmt(arm['success'])} "
                     f"[{_fmt(ci[0]) if ci else '-'}, {_fmt(ci[1]) if ci else '-'}]"
                     + (f"  diff {_fmt(diff['estimate'])} [{_fmt(diff['lo'])}, "
                        f"{_fmt(diff['hi'])}]{' (CI excludes 0)' if diff['excludes_zero'] else ''}"
                        if diff else ""))
    lines += _suite_lines(result)
    report = _write_report(exp_dir)
    if report:
        lines += _report_lines(report.with_suffix(".json"))
        lines.append(f"report: {report}")
    lines.append(f"wall time: {(time.perf_counter() - t0) / 60:.1f} min")
    lines += ["== where the time went (this launch) ==",
              *phase_lines(result.get("phases_this_launch") or [])]
    _print({**result, "report": str(report) if report else None}, args.json, "\n".join(lines))
    return 0


def _report_lines(report_json: Path) -> list[str]:
    """The claim, the cold start by hint level, the learning curve and the zero-variance rate
    observed against its prediction, from report.json."""
    rep = json.loads(report_json.read_text(encoding="utf-8"))
    lines = ["== cold start by hint level (successes/attempts, Wilson 95% CI) =="]
    for r in rep["cold_start"]["by_level"]:
        ci = r["ci"] or [None, None]
        lines.append(f"{r['suite']:8} {r['level']:8} {r['successes']}/{r['scored']} = "
                     f"{_fmt(r['rate'])} [{_fmt(ci[0])}, {_fmt(ci[1])}] over {r['tasks']} tasks")
    lines.append("== held-out learning curve of the RL arm ==")
    for p in rep["heldout_curve"]:
        lines.append(f"{p['label']:10} after {p['step']} steps, {p['interactions']} interactions"
                     f", {p['rl_wall_s']:.0f} s of RL: success {_fmt(p['success'])} "
                     f"({p['successes']}/{p['scored']})")
    zv = rep["zero_variance"]["overall"]
    lines.append(f"zero-variance groups: observed {_fmt(zv['observed_rate'])} "
                 f"({zv['zero_variance']}/{zv['scored_groups']}), predicted "
                 f"{_fmt(zv['predicted_rate'])} (p^G + (1-p)^G)")
    null: dict[str, Any] = next((a["rl_minus_null"] for a in (rep.get("arms") or {}).values()
                                 if "rl_minus_null" in a), {})
    if null.get("measured"):
        lines.append(_paired_line("held-out, RL against its null", null))
    for section, title in (("family_disjoint", "family-disjoint"),
                           ("in_distribution", "in distribution")):
        suite = rep.get(section) or {}
        for key in ("comparison", "control", "rl_minus_null"):
            c = suite.get(key) or {}
            if c.get("measured"):
                lines.append(_paired_line(title, c))
            elif key == "control" and suite.get("comparison", {}).get("measured"):
                lines.append(f"{title} control: not measured ({c.get('detail')})")
    lines.append(f"claim: {rep['claim']['statement']}")
    return lines


def _paired_line(title: str, c: dict[str, Any]) -> str:
    """One measured paired comparison of report.json, printed."""
    lo, hi = c["ci"]
    return (f"{title}: {c['what']} = {c['estimate']:+.3f} [{lo:+.3f}, {hi:+.3f}] over "
            f"{c['tasks']} tasks")


_SUITE_HEADINGS = {"family": "families never trained on",
                   "train": "the train tasks RL drew from, in distribution"}


def _suite_lines(result: dict[str, Any]) -> list[str]:
    """The family-disjoint and train suites' arms, where they were evaluated."""
    lines = []
    for suite, heading in _SUITE_HEADINGS.items():
        data = result.get("suites", {}).get(suite)
        if not data:
            continue
        lines.append(f"== {suite} suite ({data['tasks']} tasks, {heading}) ==")
        for name, arm in data["arms"].items():
            diff = arm.get("diff_vs_frozen")
            lines.append(f"{name:9} success {_fmt(arm['success'])}"
                         + (f"  diff {_fmt(diff['estimate'])} [{_fmt(diff['lo'])}, "
                            f"{_fmt(diff['hi'])}]" if diff else ""))
    return lines


def _pooled_lines(pooled: dict[str, Any], per_replicate: bool) -> list[str]:
    """One line per suite and pooled entry of replicates.json: its effect per replicate (if
    asked) and pooled, with the interval."""
    lines = []
    for suite, arms in pooled.items():
        for arm, entry in arms.items():
            key = f"diff_vs_{entry['baseline']}"
            per = ", ".join(f"r{p['replicate']} {_fmt((p[key] or {}).get('estimate'))}"
                            for p in entry["per_replicate"]) + "; " if per_replicate else ""
            pool = entry.get("pooled") or {}
            lines.append(f"{suite:8} {arm:9} {per}pooled {_fmt(pool.get('estimate'))} "
                         f"[{_fmt(pool.get('lo'))}, {_fmt(pool.get('hi'))}]")
    return lines


def _run_replicates(cfg: Any, exp_dir: Path, args: argparse.Namespace) -> int:
    from closedloop.experiments.replicates import run_replicates

    t0 = time.perf_counter()
    data = run_replicates(cfg, exp_dir, args.seeds, getattr(args, "override_config", None),
                          only=getattr(args, "only", None), claim_of=_report_claim)
    lines = ["", f"== {data['n']} replicates: each arm minus frozen, and rloo minus its shuffled "
                 "null, per replicate and pooled =="]
    lines += _pooled_lines(data["pooled"], per_replicate=True)
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
        lines += _pooled_lines(data["pooled_measured"], per_replicate=False)
    lines.append(f"wall time: {(time.perf_counter() - t0) / 60:.1f} min")
    _print(data, args.json, "\n".join(lines))
    return 0


def _report_claim(rep_dir: Path) -> dict[str, Any] | None:
    """Write a replicate's report; return its claim (None where reports cannot be built)."""
    report = _write_report(rep_dir)
    if report is None:
        return None
    claim: dict[str, Any] = json.loads(report.with_suffix(".json").read_text("utf-8"))["claim"]
    return claim


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _write_report(exp_dir: Path) -> Path | None:
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
    report = _write_report(run_dir)
    summary["report"] = str(report) if report else None
    text = "\n".join(f"{k}: {v}" for k, v in summary.items() if k != "seconds_by_step")
    text += "\n== where the time went (this launch) ==\n" + "\n".join(phase_lines(phase_times()))
    _print(summary, args.json, "\n== summary ==\n" + text)
    return 0


def cmd_gates(args: argparse.Namespace) -> int:
    """Evaluate the go/no-go gates of a run; exit 0 all pass, 1 a gate failed, 3 only
    not-measured gates remain (2: not a run directory)."""
    from closedloop.evaluate.gates import evaluate_gates, format_table

    _verified(args.run_dir)
    report = evaluate_gates(args.run_dir)
    _print(report.to_dict(), args.json, format_table(report))
    return report.exit_code


def cmd_report(args: argparse.Namespace) -> int:
    """Write report.html and report.json for a run (or experiment) directory."""
    from closedloop.evaluate.report import write_report

    _verified(args.run_dir)
    html_path, json_path = write_report(args.run_dir)
    _print({"html": str(html_path), "json": str(json_path)}, args.json,
           f"report: {html_path}\ndata: {json_path}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write a run's trace records as Parquet tables or a Hugging Face dataset (checked by
    reading them back)."""
    from closedloop.export import export_run

    _verified(args.run_dir)
    result = export_run(args.run_dir, args.format, args.out, overwrite=args.overwrite)
    data = {"path": str(result.path), "format": result.format, "counts": dict(result.counts)}
    counts = ", ".join(f"{n} {k}" for k, n in result.counts.items())
    _print(data, args.json, f"exported {counts} to {result.path} ({result.format}; read back "
           "equal to the JSONL)")
    return 0


_Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(prog="closedloop", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    env_commands = _add_env_commands(sub)
    commands = [*env_commands, *_add_run_commands(sub), *_add_run_dir_commands(sub)]
    for sp in commands:
        sp.add_argument("--json", action="store_true", help="machine-readable output")
    for sp in env_commands:
        sp.add_argument("--env", help="registered environment id (default: the terminal tasks)")
        sp.add_argument("--env-factory", metavar="PKG.MODULE:ATTR",
                        help="load the environment package from a dotted path")
        sp.add_argument("--config", help="take the environment from a run config")
    return p


def _add_env_commands(sub: _Subcommands) -> list[argparse.ArgumentParser]:
    """``tasks``, ``check``, ``play``, ``replay`` and ``collect``: the commands that take an
    environment."""
    t = sub.add_parser("tasks", help="list or show tasks")
    t.add_argument("action", choices=["list", "show"])
    t.add_argument("task_id", nargs="?")
    t.add_argument("--split", choices=["train", "heldout"])
    t.set_defaults(fn=cmd_tasks)
    ck = sub.add_parser("check", help="check an environment package: the env contract checker "
                        "and the verifier FP/FN audit (what train runs before its first step)")
    ck.add_argument("package", nargs="?", metavar="PACKAGE",
                    help="a registered environment id or a dotted 'pkg.module:attr' factory "
                         "(default: --env/--env-factory/--config, else the terminal tasks)")
    ck.add_argument("--quick", action="store_true",
                    help="one task, one seed and its fixtures (no disagreement allowed)")
    ck.set_defaults(fn=cmd_check)
    pl = sub.add_parser("play", help="play one episode with a scripted policy")
    pl.add_argument("task_id")
    pl.add_argument("--policy", choices=["expert", "noisy", "random"], default="expert")
    pl.add_argument("--seed", type=int, default=11)
    pl.add_argument("--max-turns", type=int, default=8)
    pl.add_argument("--trace")
    pl.set_defaults(fn=cmd_play)
    r = sub.add_parser("replay", help="re-execute a trace and check it reproduces")
    r.add_argument("trace")
    r.set_defaults(fn=cmd_replay)
    co = sub.add_parser("collect", help="collect groups of episodes with a model")
    co.add_argument("--tasks", choices=["train", "heldout", "all"], default="heldout")
    co.add_argument("--group-size", type=int, default=8)
    co.add_argument("--model", help="'embedded' (default) or a local Hugging Face folder")
    co.add_argument("--temperature", type=float, default=1.0)
    co.add_argument("--top-p", type=float, default=1.0)
    co.add_argument("--top-k", type=int)
    co.add_argument("--max-turns", type=int, default=8)
    co.add_argument("--max-action-tokens", type=int, default=96)
    co.add_argument("--limit", type=int, help="only the first N tasks")
    co.add_argument("--seed", type=int, default=11)
    co.add_argument("--precision", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="matmul precision (auto: bfloat16 where the CPU multiplies it "
                    "natively, float32 elsewhere)")
    co.add_argument("--out", help="trace path (default runs/collect/<time>.jsonl)")
    co.set_defaults(fn=cmd_collect)
    return [t, ck, pl, r, co]


def _add_run_commands(sub: _Subcommands) -> list[argparse.ArgumentParser]:
    """``train``, ``experiment`` and ``smoke``: the commands that run (or resume) training."""
    tr = sub.add_parser("train", help="run or resume training from a YAML config")
    tr.add_argument("config")
    tr.add_argument("--run-dir")
    tr.add_argument("--override-config", metavar="REASON", help=OVERRIDE_HELP)
    tr.set_defaults(fn=cmd_train)
    ex = sub.add_parser("experiment", help="the four controls of a config, then the report")
    ex.add_argument("config")
    ex.add_argument("--run-dir")
    ex.add_argument("--override-config", metavar="REASON", help=OVERRIDE_HELP)
    ex.add_argument("--seeds", type=int, metavar="N",
                    help="run N independent replicates (training.seed + 0..N-1), pooled")
    ex.add_argument("--only", type=int, nargs="+", metavar="I",
                    help="with --seeds: run only these replicate indices; pool the others "
                         "found finished under the run dir")
    ex.set_defaults(fn=cmd_experiment)
    sm = sub.add_parser("smoke", help="the smoke experiment on the embedded model")
    sm.add_argument("--run-dir")
    sm.add_argument("--model", help="a local Hugging Face model folder instead")
    sm.add_argument("--seeds", type=int, metavar="N",
                    help="run N independent replicates (training.seed + 0..N-1), pooled")
    sm.add_argument("--only", type=int, nargs="+", metavar="I",
                    help="with --seeds: run only these replicate indices; pool the others "
                         "found finished under the run dir")
    sm.add_argument("--override-config", metavar="REASON", help=OVERRIDE_HELP)
    sm.set_defaults(fn=cmd_smoke)
    rv = sub.add_parser("reevaluate", help="more evaluation attempts for finished policies "
                        "(an experiment's frozen, rloo, shuffled and SFT-only arms), paired and "
                        "pooled")
    rv.add_argument("runs", nargs="+", metavar="DIR",
                    help="an experiment directory, or with --baseline the finished runs to "
                         "compare with it")
    rv.add_argument("--baseline", metavar="DIR",
                    help="a run at v0000 (a frozen arm): its start policy is the baseline")
    rv.add_argument("--attempts", type=int, required=True, metavar="N",
                    help="attempts per task to add (seeds 1000..1000+N-1)")
    rv.add_argument("--suite", choices=["heldout", "family", "train"], default="heldout")
    rv.add_argument("--step", type=int, metavar="K",
                    help="evaluate the treated runs' policy after K RL steps (v000K) instead "
                         "of their final one: a point of the learning curve")
    rv.set_defaults(fn=cmd_reevaluate)
    return [tr, ex, sm, rv]


def _add_run_dir_commands(sub: _Subcommands) -> list[argparse.ArgumentParser]:
    """``gates``, ``report`` and ``export``: the commands that read a finished run directory."""
    ga = sub.add_parser("gates", help="evaluate the go/no-go gates of a run directory")
    ga.add_argument("run_dir")
    ga.set_defaults(fn=cmd_gates)
    rp = sub.add_parser("report", help="write report.html and report.json for a run")
    rp.add_argument("run_dir")
    rp.set_defaults(fn=cmd_report)
    xp = sub.add_parser("export", help="write a run's traces as Parquet or a HF dataset")
    xp.add_argument("run_dir")
    xp.add_argument("--format", choices=["parquet", "hf"], default="parquet")
    xp.add_argument("--out", help="output folder (default RUN_DIR/export/<format>)")
    xp.add_argument("--overwrite", action="store_true", help="replace an existing export")
    xp.set_defaults(fn=cmd_export)
    return [ga, rp, xp]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``closedloop`` console script."""
    args = build_parser().parse_args(argv)
    tune_allocator()
    try:
        return int(args.fn(args))
    except ClosedloopError as exc:
        print(f"closedloop: {type(exc).__name__}: {exc}", file=sys.stderr)
        for note in getattr(exc, "__notes__", ()):
            print(f"closedloop: {note}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
