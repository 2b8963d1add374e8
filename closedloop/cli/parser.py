"""The argument parser of every ``closedloop`` subcommand (each bound to its function by
``set_defaults(fn=...)``)."""

from __future__ import annotations

import argparse
from typing import TypeAlias

from closedloop.cli.env_commands import (
    cmd_check,
    cmd_collect,
    cmd_play,
    cmd_replay,
    cmd_tasks,
)
from closedloop.cli.run_commands import cmd_experiment, cmd_reevaluate, cmd_smoke, cmd_train
from closedloop.cli.run_dir_commands import cmd_export, cmd_gates, cmd_report

DESCRIPTION = ("The ``closedloop`` command. Every subcommand takes ``--json`` for "
               "machine-readable output.")
OVERRIDE_HELP = ("resume a run directory with a config that differs from the one it "
                 "recorded; REASON and the differing keys are kept in launches.jsonl")

_Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(prog="closedloop", description=DESCRIPTION)
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
    tr.add_argument("--workers", choices=["in_process", "ray"],
                    help="where the RL steps' episodes run (overrides rollout.workers; ray: "
                         "environment and generator workers as Ray actors, section ray)")
    tr.set_defaults(fn=cmd_train)
    ex = sub.add_parser("experiment", help="the four controls of a config, then the report")
    ex.add_argument("config")
    ex.add_argument("--run-dir")
    ex.add_argument("--override-config", metavar="REASON", help=OVERRIDE_HELP)
    _add_replicate_args(ex)
    ex.set_defaults(fn=cmd_experiment)
    sm = sub.add_parser("smoke", help="the smoke experiment on the embedded model")
    sm.add_argument("--run-dir")
    sm.add_argument("--model", help="a local Hugging Face model folder instead")
    _add_replicate_args(sm)
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


def _add_replicate_args(parser: argparse.ArgumentParser) -> None:
    """``--seeds N`` and ``--only I...``: an experiment's independent replicates."""
    parser.add_argument("--seeds", type=int, metavar="N",
                        help="run N independent replicates (training.seed + 0..N-1), pooled")
    parser.add_argument("--only", type=int, nargs="+", metavar="I",
                        help="with --seeds: run only these replicate indices; pool the others "
                             "found finished under the run dir")


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

