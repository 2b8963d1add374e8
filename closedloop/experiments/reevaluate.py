"""More evaluation of finished runs: the same policies, more attempts per task.

A paired interval from 16 held-out tasks × 3 attempts is about ±0.12 wide, so a smaller effect
is not resolved by a smoke's own evaluation. ``reevaluate`` gives policies already trained more
attempts, without training again: the baseline run's start policy (v0000: an experiment's
frozen cold start) and each treated run's final policy are evaluated on ``attempts`` more
attempts per task of a suite, with seeds ``EXTRA_SEED_BASE + j`` (j < attempts), and pooled
with each run's own evaluation of that policy:

    s_run(t) = successes / scored attempts of task t, over all its attempts
    Δ(a, b)  = mean_t [ s_a(t) − s_b(t) ]     over the tasks scored in both,

with a 95% paired percentile-bootstrap interval over tasks. The runs must share
``training.seed`` and the suite's tasks: every episode samples from its own stream keyed by
that seed, the task, the evaluation seed and the sibling, so the attempts are paired draw for
draw across runs. Each run keeps its new evaluation (``traces/eval-more<N>[-<suite>].jsonl``,
collected and resumed chunk by chunk); an experiment's claim and gates stay those of its
preregistered evaluation, and this one is reported beside it.

An SFT-only control (an experiment's ``sft_only`` arm: supervised steps matched to the RL arm's
trained action tokens, published as its final version, no RL checkpoint) is a treated run too:
its published final version is loaded and evaluated the same way.

``step``: the treated runs' policy after that many RL steps (v<step>) instead of the final one
— a learning curve whose points resolve what a 3-attempt curve point cannot. Its own
evaluation is the curve point ``eval-step-<step>`` where the run has one; where it has none,
the new evaluation also covers the preregistered evaluation's seeds, so every policy
compared is scored on the same seeds. Its trace is ``eval-more<N>-v<step>[-<suite>].jsonl``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from closedloop.config import RunConfig, parse_config
from closedloop.contracts import Episode, PolicyManifest, load_episodes
from closedloop.contracts.metrics_log import read_metrics
from closedloop.errors import ConfigDriftError, RunStateError
from closedloop.evaluate.heldout import summarize_eval
from closedloop.experiments.controls import paired_diff
from closedloop.policy.registry import atomic_write_bytes, version_name
from closedloop.progress import log
from closedloop.training import integrity as run_integrity
from closedloop.training.loop import opened_run
from closedloop.training.resume import resume
from closedloop.training.run import Run
from closedloop.training.run_evaluation import EVAL_SUITES, eval_name, evaluate

EXTRA_SEED_BASE = 1000


def extra_seeds(attempts: int) -> list[int]:
    """The evaluation seeds of ``attempts`` more attempts: ``EXTRA_SEED_BASE + j``."""
    if attempts < 1:
        raise ValueError(f"--attempts must be >= 1, got {attempts}")
    return [EXTRA_SEED_BASE + j for j in range(attempts)]


def recorded_config(run_dir: Path) -> RunConfig:
    """The config a run directory recorded (``config.json``), validated."""
    return parse_config(run_integrity.recorded_config(run_dir,
                                                      "reevaluate a complete run directory"))


def _trace_name(label: str, suite: str) -> str:
    return f"eval-{eval_name(label, suite)}.jsonl"


def evaluate_more(run_dir: Path, attempts: int, suite: str, baseline: bool,
                  step: int | None = None) -> dict[str, Any]:
    """Evaluate one run's policy on ``attempts`` more attempts per task of ``suite``; pool them
    with the run's own evaluation of that policy. ``baseline``: the start policy (the run must
    be at v0000, as an experiment's frozen arm is); else the final one, or with ``step`` the
    policy after that many steps (the run must be finished). Returns the run's pooled per-task
    success and what was pooled."""
    if suite not in EVAL_SUITES:
        raise ValueError(f"--suite must be one of {EVAL_SUITES}, got {suite!r}")
    cfg = recorded_config(run_dir)
    seeds = extra_seeds(attempts)
    clash = sorted(set(seeds) & set(cfg.evaluation.seeds))
    if clash:
        raise ConfigDriftError(run_dir / "config.json",
                               f"evaluation.seeds {clash} are also extra-attempt seeds",
                               f"evaluation seeds below {EXTRA_SEED_BASE} leave room for these")
    final = cfg.training.rl_steps
    version = 0 if baseline else final if step is None else step
    if not 0 < version <= final and not baseline:
        raise ValueError(f"--step must be in 1..{final} (the run's training.rl_steps), "
                         f"got {version}")
    sft_only = is_sft_only(run_dir)
    if sft_only and baseline:
        raise RunStateError(run_dir, "an SFT-only control is not a baseline (it has no RL "
                            "checkpoint at v0000 to resume)", "pass the frozen arm as --baseline")
    if sft_only and version != final:
        raise ValueError(f"{run_dir.name} is an SFT-only control: it has no policy after "
                         f"{version} RL steps, only its final one")
    label = f"more{attempts}" if version in (0, final) else f"more{attempts}-v{version:04d}"
    own = "start" if baseline else "final" if version == final else f"step-{version:04d}"
    own_trace = run_dir / "traces" / _trace_name(own, suite)
    if not own_trace.is_file():
        if version in (0, final):
            raise RunStateError(own_trace, f"the run has no {own} evaluation on the {suite} "
                                "suite", "finish the run (or its experiment) first")
        # no curve point at this step: score the preregistered evaluation's seeds too
        seeds = list(cfg.evaluation.seeds)[:cfg.evaluation.attempts_per_task] + seeds
    with opened_run(cfg, run_dir) as run:
        if sft_only:  # no RL checkpoint to resume: its published final version is the policy
            manifest = load_version(run, version_name(final))
        else:
            resume(run)
            expected = 0 if baseline else final
            if run.state.step != expected:
                what = "the baseline's start policy" if baseline else "the final policy"
                raise RunStateError(run_dir / "checkpoints", f"the run is at step "
                                    f"{run.state.step}; {what} is v{expected:04d}",
                                    "pass a frozen arm as the baseline and finished runs to "
                                    "compare" if baseline else "finish the run first")
            manifest = load_version(run, version_name(version))
        log(f"reevaluate: {run_dir} {manifest.policy_version}, {len(seeds)} more attempts "
            f"per {suite} task")
        evaluate(run, label, manifest, suite=suite, seeds=seeds)
    return _pooled(run_dir, cfg, manifest.policy_version, own_trace, label, suite)


def load_version(run: Run, version: str) -> PolicyManifest:
    """The generator worker holds a published ``version`` (loaded from the registry and hashed:
    ``RegistryError`` unless it holds exactly the manifest's weights); the trainer and its
    checkpoint are untouched."""
    return run.roles()[1].load(version)


def is_sft_only(run_dir: Path) -> bool:
    """Whether a run directory is an SFT-only control (its metrics log an ``sft_only`` record)."""
    path = run_dir / "metrics.jsonl"
    return path.is_file() and any(r.get("kind") == "sft_only" for r in read_metrics(path))


def _pooled(run_dir: Path, cfg: RunConfig, version: str, own_trace: Path, label: str,
            suite: str) -> dict[str, Any]:
    """A run's own evaluation of a policy pooled with its new one: per-task success."""
    pooled = [p for p in (own_trace, run_dir / "traces" / _trace_name(label, suite))
              if p.is_file()]
    episodes: list[Episode] = [ep for p in pooled for ep in load_episodes(p)[1]]
    summary = summarize_eval(episodes, k=1, seed=cfg.training.seed)
    scored = [t.n for t in summary.tasks]
    return {"run_dir": str(run_dir), "version": version,
            "training_seed": cfg.training.seed, "success": summary.pass_at_1,
            "episodes": len(episodes), "attempts_per_task": [min(scored), max(scored)],
            "traces": [p.name for p in pooled],
            "per_task": summary.per_task_success()}


def reevaluate(baseline: Path, treated: Sequence[Path], attempts: int,
               suite: str = "heldout", step: int | None = None) -> dict[str, Any]:
    """The baseline's start policy and each treated run's final policy (or v<step>), each with
    ``attempts`` more attempts (module doc); the paired difference of every treated run from
    the baseline, and of each earlier-listed treated run from each later one (an experiment:
    rloo − shuffled)."""
    names = [baseline.name, *(p.name for p in treated)]
    if len(set(names)) != len(names):
        raise ValueError(f"runs must have distinct directory names, got {names}")
    seeds = {p: recorded_config(p).training.seed for p in [baseline, *treated]}
    if len(set(seeds.values())) != 1:
        found = sorted(set(seeds.values()))
        raise ConfigDriftError(baseline / "config.json",
                               f"training.seed differs across the runs ({found})",
                               "compare runs of one replicate: their attempts are paired only "
                               "when every episode's stream is keyed by the same seed")
    runs = {baseline.name: evaluate_more(baseline, attempts, suite, baseline=True)}
    for path in treated:
        runs[path.name] = evaluate_more(path, attempts, suite, baseline=False, step=step)
    seed = next(iter(seeds.values()))
    order = [p.name for p in treated]
    pairs = [(a, baseline.name) for a in order] + [
        (a, b) for i, a in enumerate(order) for b in order[i + 1:]]
    diffs = []
    for a, b in pairs:
        diff = paired_diff(runs[a]["per_task"], runs[b]["per_task"], seed)
        diffs.append({"treated": a, "baseline": b, **(diff or {"estimate": None})})
    return {"suite": suite, "attempts_added": attempts, "step": step,
            "seeds": [EXTRA_SEED_BASE, EXTRA_SEED_BASE + attempts - 1],
            "baseline": baseline.name, "runs": runs, "diffs": diffs}


def reevaluate_experiment(exp_dir: Path, attempts: int, suite: str = "heldout",
                          step: int | None = None) -> dict[str, Any]:
    """``reevaluate`` an experiment directory's frozen arm (baseline) against its finished RL
    arm, shuffled-reward null and (without ``step``) SFT-only control; the result is also
    written to ``reevaluation-<suite>-more<attempts>[-v<step>].json`` there (atomically)."""
    arms = exp_dir / "arms"
    names = ("rloo", "shuffled") if step is not None else ("rloo", "shuffled", "sft_only")
    treated = [arms / name for name in names if (arms / name).is_dir()]
    if not (arms / "frozen").is_dir() or not treated:
        raise RunStateError(arms, "no frozen arm and RL arm to compare",
                            "pass an experiment directory (closedloop experiment/smoke)")
    result = reevaluate(arms / "frozen", treated, attempts, suite, step)
    tail = "" if step is None else f"-v{step:04d}"
    out = exp_dir / f"reevaluation-{suite}-more{attempts}{tail}.json"
    atomic_write_bytes(out, (json.dumps(result, indent=2, sort_keys=True) + "\n").encode())
    result["written_to"] = str(out)
    return result
