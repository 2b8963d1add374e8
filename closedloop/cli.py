"""The ``closedloop`` command. Every subcommand takes ``--json`` for machine-readable output."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from closedloop.allocator import tune_allocator
from closedloop.contracts import ClosedloopError


def _print(data: Any, as_json: bool, text: str) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str) if as_json else text)


def cmd_tasks(args: argparse.Namespace) -> int:
    """List tasks or show one (the hidden grader is never shown)."""
    from closedloop.envs.tasks.registry import get_spec, list_tasks

    if args.action == "list":
        ids = list_tasks(split=args.split) if args.split else list_tasks()
        rows = [{"id": t, "family": get_spec(t).family, "split": get_spec(t).split} for t in ids]
        text = "\n".join(f"{r['split']:8} {r['family']:18} {r['id']}" for r in rows)
        _print(rows, args.json, text + f"\n{len(rows)} tasks")
        return 0
    if not args.task_id:
        raise SystemExit("tasks show needs a TASK_ID")
    spec = get_spec(args.task_id)
    data = {"id": spec.task_id, "family": spec.family, "template": spec.template,
            "split": spec.split, "objective": spec.objective,
            "allowed_tools": list(spec.allowed_tools), "commands": dict(spec.commands),
            "protected_paths": list(spec.protected_paths), "step_budget": spec.step_budget,
            "files": dict(spec.initial_files)}
    text = "\n".join([f"{spec.task_id}  ({spec.family}, {spec.split})", spec.objective,
                      f"tools: {', '.join(spec.allowed_tools)}; commands: "
                      f"{', '.join(spec.commands)}; budget {spec.step_budget} steps",
                      *(f"--- {p}\n{c}" for p, c in spec.initial_files.items())])
    _print(data, args.json, text)
    return 0


def _scripted_policy(kind: str, task_id: str, seed: int) -> Any:
    from closedloop.envs.scripted import ExpertPolicy, NoisyExpertPolicy, RandomPolicy
    from closedloop.envs.tasks.registry import get_bundle

    if kind == "expert":
        return ExpertPolicy(get_bundle(task_id))
    if kind == "noisy":
        return NoisyExpertPolicy(get_bundle(task_id), error_rate=0.3, seed=seed)
    return RandomPolicy(seed=seed)


def cmd_play(args: argparse.Namespace) -> int:
    """Play one episode with a scripted policy, print it turn by turn, write its trace."""
    from closedloop.contracts import SamplerConfig, TraceWriter, sha256_hex
    from closedloop.policy import ChatRenderer, load_tokenizer
    from closedloop.rollout.source import ScriptedSource
    from closedloop.runtime import (
        AGENT_TOOLS,
        SYSTEM_PROMPT,
        CollectorParts,
        build_manifest,
        make_collector,
    )
    from closedloop.verify.verifier import Verifier

    tokenizer = load_tokenizer()
    renderer = ChatRenderer(tokenizer, SYSTEM_PROMPT, list(AGENT_TOOLS))
    manifest = build_manifest(policy_version=f"scripted-{args.policy}",
                              weight_checksum=sha256_hex(f"scripted-{args.policy}"),
                              tokenizer_revision=sha256_hex("embedded-tokenizer"),
                              renderer=renderer, sampler=SamplerConfig(), step_budget=8,
                              max_action_tokens=0, model_id=f"scripted-{args.policy}")
    source = ScriptedSource(lambda task, key: _scripted_policy(args.policy, task, args.seed),
                            renderer.encode, build=f"scripted-{args.policy}")
    trace = Path(args.trace or f"runs/play/{int(time.time())}-{args.policy}.jsonl")
    with TraceWriter(trace) as writer:
        collector = make_collector(source, manifest, CollectorParts(
            renderer, Verifier(), "play", writer, max_turns=args.max_turns))
        lease = collector.make_lease("play", args.task_id, args.seed, 1)
        (group,) = collector.collect([lease])
    (ep,) = group.episodes
    traj = ep.trajectory
    data = {"task_id": traj.task_id, "policy": args.policy, "seed": traj.seed,
            "termination": traj.termination.value, "reward": traj.reward,
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


def cmd_replay(args: argparse.Namespace) -> int:
    """Re-execute a trace's recorded actions; exit 1 unless everything reproduces."""
    from closedloop.rollout.replay import replay_trace
    from closedloop.runtime import make_env
    from closedloop.verify.verifier import Verifier

    report = replay_trace(args.trace, make_env, Verifier())
    data = {"trace": report.path, "ok": report.ok, **report.counts(),
            "episodes": [e.__dict__ for e in report.episodes]}
    lines = [f"{e.episode_id}: {'ok' if e.ok else 'MISMATCH'} "
             f"(observations {e.observations_match}, states {e.state_hashes_match}, "
             f"reward {e.reward_match}) {'; '.join(e.mismatches)}" for e in report.episodes]
    c = report.counts()
    lines.append(f"{c['reproduced']}/{c['episodes']} episodes reproduced "
                 f"({c['turns']} turns): observations, state hashes and rewards")
    _print(data, args.json, "\n".join(lines))
    return 0 if report.ok else 1


def cmd_collect(args: argparse.Namespace) -> int:
    """Collect groups of G sibling episodes per task with a model; write and summarize the trace."""
    from collections import Counter

    from closedloop.contracts import SamplerConfig, TraceWriter
    from closedloop.envs.tasks.registry import list_tasks
    from closedloop.policy import ChatRenderer, HFGenerator, load_model
    from closedloop.progress import Progress, log
    from closedloop.rollout.source import GeneratorSource
    from closedloop.runtime import (
        AGENT_TOOLS,
        SYSTEM_PROMPT,
        CollectorParts,
        build_manifest,
        make_collector,
    )
    from closedloop.verify.verifier import Verifier

    loaded = load_model(None if args.model in (None, "embedded") else args.model)
    log(f"model {loaded.model_id} from {loaded.source} in {loaded.load_seconds:.1f}s")
    renderer = ChatRenderer(loaded.tokenizer, SYSTEM_PROMPT, list(AGENT_TOOLS))
    sampler = SamplerConfig(args.temperature, args.top_p, args.top_k)
    manifest = build_manifest(policy_version="v0000", weight_checksum=loaded.weight_checksum,
                              tokenizer_revision=loaded.tokenizer_revision, renderer=renderer,
                              sampler=sampler, step_budget=args.max_turns,
                              max_action_tokens=args.max_action_tokens,
                              model_id=loaded.model_id)
    gen = HFGenerator(loaded.model, loaded.tokenizer, weight_checksum=loaded.weight_checksum,
                      seed=args.seed)
    source = GeneratorSource(gen, renderer.action_text, sampler, args.max_action_tokens,
                             manifest.generator_build)
    tasks = list_tasks(split=None if args.tasks == "all" else args.tasks)[: args.limit]
    out = Path(args.out or f"runs/collect/{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    with TraceWriter(out) as writer:
        collector = make_collector(source, manifest, CollectorParts(
            renderer, Verifier(), f"collect-{out.stem}", writer, args.max_turns))
        leases = [collector.make_lease(f"g{i:03d}", t, args.seed, args.group_size)
                  for i, t in enumerate(tasks)]
        with Progress(len(leases) * args.group_size, "collect") as bar:
            groups = collector.collect(leases, progress=bar.update)
    trajs = [ep.trajectory for g in groups for ep in g.episodes]
    scored = [t.task_success for t in trajs if t.task_success is not None]
    data = {"trace": str(out), "groups": len(groups), "episodes": len(trajs),
            "scored": len(scored), "success_rate": sum(scored) / len(scored) if scored else None,
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


def _run_experiment(cfg: Any, args: argparse.Namespace) -> int:
    from closedloop.experiment import run_experiment

    if getattr(args, "model", None):
        cfg = cfg.with_overrides(model=args.model)
    exp_dir = Path(args.run_dir or Path(cfg.run_dir) / time.strftime("smoke-%Y%m%d-%H%M%S"))
    result = run_experiment(cfg, exp_dir)
    lines = ["", "== held-out success by arm (paired difference from frozen, 95% CI) =="]
    for name, arm in result["arms"].items():
        diff = arm.get("diff_vs_frozen")
        ci = arm.get("success_ci")
        lines.append(f"{name:9} success {_fmt(arm['success'])} "
                     f"[{_fmt(ci[0]) if ci else '-'}, {_fmt(ci[1]) if ci else '-'}]"
                     + (f"  diff {_fmt(diff['estimate'])} [{_fmt(diff['lo'])}, "
                        f"{_fmt(diff['hi'])}]{' (CI excludes 0)' if diff['excludes_zero'] else ''}"
                        if diff else ""))
    report = _write_report(exp_dir)
    if report:
        lines.append(f"report: {report}")
    _print({**result, "report": str(report) if report else None}, args.json, "\n".join(lines))
    return 0


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
    from closedloop.loop import train

    if getattr(args, "model", None):
        cfg = cfg.with_overrides(model=args.model)
    run_dir = Path(args.run_dir or Path(cfg.run_dir) / time.strftime("run-%Y%m%d-%H%M%S"))
    summary = train(cfg, run_dir)
    report = _write_report(run_dir)
    summary["report"] = str(report) if report else None
    text = "\n".join(f"{k}: {v}" for k, v in summary.items() if k != "seconds_by_step")
    _print(summary, args.json, "\n== summary ==\n" + text)
    return 0


def cmd_gates(args: argparse.Namespace) -> int:
    """Evaluate the go/no-go gates of a run; exit 0 all pass, 1 a gate failed, 3 only
    not-measured gates remain (2: not a run directory)."""
    from closedloop.evaluate.gates import evaluate_gates, format_table

    report = evaluate_gates(args.run_dir)
    _print(report.to_dict(), args.json, format_table(report))
    return report.exit_code


def cmd_report(args: argparse.Namespace) -> int:
    """Write report.html and report.json for a run (or experiment) directory."""
    from closedloop.evaluate.report import write_report

    html_path, json_path = write_report(args.run_dir)
    _print({"html": str(html_path), "json": str(json_path)}, args.json,
           f"report: {html_path}\ndata: {json_path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(prog="closedloop", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tasks", help="list or show tasks")
    t.add_argument("action", choices=["list", "show"])
    t.add_argument("task_id", nargs="?")
    t.add_argument("--split", choices=["train", "heldout"])
    t.set_defaults(fn=cmd_tasks)
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
    co.add_argument("--out", help="trace path (default runs/collect/<time>.jsonl)")
    co.set_defaults(fn=cmd_collect)
    tr = sub.add_parser("train", help="run or resume training from a YAML config")
    tr.add_argument("config")
    tr.add_argument("--run-dir")
    tr.set_defaults(fn=cmd_train)
    ex = sub.add_parser("experiment", help="the four controls of a config, then the report")
    ex.add_argument("config")
    ex.add_argument("--run-dir")
    ex.set_defaults(fn=cmd_experiment)
    sm = sub.add_parser("smoke", help="the smoke experiment on the embedded model")
    sm.add_argument("--run-dir")
    sm.add_argument("--model", help="a local Hugging Face model folder instead")
    sm.set_defaults(fn=cmd_smoke)
    ga = sub.add_parser("gates", help="evaluate the go/no-go gates of a run directory")
    ga.add_argument("run_dir")
    ga.set_defaults(fn=cmd_gates)
    rp = sub.add_parser("report", help="write report.html and report.json for a run")
    rp.add_argument("run_dir")
    rp.set_defaults(fn=cmd_report)
    for sp in (t, pl, r, co, tr, ex, sm, ga, rp):
        sp.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``closedloop`` console script."""
    args = build_parser().parse_args(argv)
    tune_allocator()
    try:
        return int(args.fn(args))
    except ClosedloopError as exc:
        print(f"closedloop: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
