"""``tasks``, ``play``, ``replay`` and ``collect``: the commands that take an environment
(``--env``, ``--env-factory`` or a run ``--config``; default the built-in terminal tasks)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from closedloop.cli.text import emit
from closedloop.errors import EnvPackageError


def command_package(args: argparse.Namespace) -> Any:
    """The environment package of a command: ``--config``'s, else ``--env``/``--env-factory``,
    else the built-in terminal tasks."""
    from closedloop.envs.discovery import resolve_package
    from closedloop.training.wiring import run_package

    if getattr(args, "config", None):
        from closedloop.config import load_config

        return run_package(load_config(args.config).environment)
    return resolve_package(args.env, args.env_factory)


def default_task_ids(package: Any, split: str | None) -> list[str]:
    """The ids of the package's default task sets (48 train / 16 held-out, seed 0)."""
    from closedloop.contracts.package import TaskSetRequest

    sets = package.task_sets(TaskSetRequest(48, 16, 0))
    if split is None:
        return [*sets.train, *sets.heldout]
    return list(sets.train if split == "train" else sets.heldout)


def cmd_tasks(args: argparse.Namespace) -> int:
    """List tasks or show one (the hidden grader is never shown)."""
    package = command_package(args)
    if args.action == "list":
        rows = [{"id": info.task_id, "family": info.family, "split": info.split}
                for info in map(package.task_info, default_task_ids(package, args.split))]
        text = "\n".join(f"{r['split']:8} {r['family']:18} {r['id']}" for r in rows)
        emit(rows, args.json, text + f"\n{len(rows)} tasks of {package.env_id}")
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
    emit(data, args.json, text)
    return 0


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

    package = command_package(args)
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
    emit(data, args.json, "\n".join(lines))
    return 0


def _replay_package(args: argparse.Namespace) -> Any:
    """``--env``/``--env-factory``/``--config``; else the config of the run the trace is in;
    else the registered package of the trace's env version (``EnvPackageError`` if none)."""
    from closedloop.contracts import read_trace
    from closedloop.envs.discovery import package_for_version, resolve_section

    if args.env or args.env_factory or args.config:
        return command_package(args)
    config = Path(args.trace).resolve().parent.parent / "config.json"
    if config.is_file():
        section = json.loads(config.read_text("utf-8")).get("config", {}).get("environment")
        return resolve_section(section)
    version = next((getattr(r, "env_version", None) for r in read_trace(args.trace)
                    if getattr(r, "env_version", None)), None)
    if version is None:
        return command_package(args)
    found = package_for_version(version)
    if found is None:
        raise EnvPackageError(f"{args.trace}: env version {version!r} is not that of a "
                              "registered environment package; pass --env or --env-factory")
    return found


def cmd_replay(args: argparse.Namespace) -> int:
    """Re-execute a trace's recorded actions; exit 1 unless everything reproduces."""
    from closedloop.rollout.replay import replay_trace

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
    emit(data, args.json, "\n".join(lines))
    return 0 if report.ok else 1


def cmd_collect(args: argparse.Namespace) -> int:
    """Collect groups of G sibling episodes per task with a model; write and summarize the trace."""
    from collections import Counter

    from closedloop.contracts import SamplerConfig, TraceWriter
    from closedloop.engine import HFGenerator, precision_label, resolve_precision, warn_if_emulated
    from closedloop.progress import Progress, log
    from closedloop.rollout.source import GeneratorSource
    from closedloop.rollout.verifier_step import VerifierStep
    from closedloop.training.run import load_policy
    from closedloop.training.wiring import CollectorParts, build_manifest, make_collector

    package = command_package(args)
    precision = resolve_precision(args.precision)
    log(f"precision: {precision.describe()}")
    warn_if_emulated(precision)
    policy = load_policy(args.model or "embedded", "float32", package)  # the runs' loading path
    loaded, renderer = policy.loaded, policy.renderer
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
    tasks = default_task_ids(package, None if args.tasks == "all" else args.tasks)[: args.limit]
    out = Path(args.out or f"runs/collect/{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    verifier = package.verifier()
    with TraceWriter(out) as writer:
        collector = make_collector(source, manifest, CollectorParts(
            renderer, verifier, f"collect-{out.stem}", writer, args.max_turns, package))
        leases = [collector.make_lease(f"g{i:03d}", t, args.seed, args.group_size)
                  for i, t in enumerate(tasks)]
        with Progress(len(leases) * args.group_size, "collect") as bar:
            rollouts = collector.rollout(leases, progress=bar.update)  # the generator
        groups = VerifierStep(verifier, writer).score(rollouts)  # the verifier step
    trajs = [ep.trajectory for g in groups for ep in g.episodes]
    scored = [t.task_success for t in trajs if t.task_success is not None]
    data = {"trace": str(out), "env_id": package.env_id, "groups": len(groups),
            "episodes": len(trajs), "scored": len(scored),
            "success_rate": sum(scored) / len(scored) if scored else None,
            "termination": dict(Counter(t.termination.value for t in trajs)),
            "action_tokens": sum(t.num_action_tokens for t in trajs),
            "generator": gen.stats.__dict__}
    emit(data, args.json, "\n".join(f"{k}: {v}" for k, v in data.items()))
    return 0
