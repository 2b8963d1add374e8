"""The evaluation side of a training run: the evaluation suites (held-out, family-disjoint,
train), the retain suites, seeding the task sampler from the cold start, and the
generator/trainer log-prob audit at the frozen checkpoint. Evaluations sample with the
generator worker, which loads the evaluated version from the registry."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from closedloop.contracts import Episode, PolicyManifest, content_hash, load_episodes
from closedloop.errors import ConsistencyGateError, UnknownNameError
from closedloop.evaluate.heldout import EvalSummary, summarize_eval
from closedloop.evaluate.retain import retain_suite_tasks, summarize_suites
from closedloop.learn.logprob_audit import AuditResult, audit_logprobs, audit_tolerances
from closedloop.progress import log, phase
from closedloop.rollout.work_orders import GroupSpec
from closedloop.training.collection import collect_with_worker
from closedloop.training.run import Run

EVAL_SUITES = ("heldout", "family", "train")
"""``heldout``: template-disjoint; ``family``: families absent from training; ``train``: the
tasks RL draws its groups from (in distribution, never a capability claim)."""


def eval_name(label: str, suite: str = "heldout") -> str:
    """The name of an evaluation: ``<label>`` on ``heldout``, ``<label>-<suite>`` otherwise;
    its trace is ``traces/eval-<name>.jsonl``."""
    return label if suite == "heldout" else f"{label}-{suite}"


EVAL_CHUNK_EPISODES = 48
"""An evaluation collects at most this many episodes at once. Its episodes decode in lockstep,
each holding its KV cache (~40 MB for a SmolLM2 episode of 900 ids, fp32), so a 16-task ×
24-attempt evaluation (384 episodes) runs as eight collections; each is kept on disk as it
ends, and a resumed run collects only the chunks it lacks. Every episode samples from its own
random stream, so chunking changes no episode's uniforms (in bf16 a smaller batch's logits can
differ in their last bits, as any change of batch composition does)."""


def suite_tasks(run: Run, suite: str) -> list[str]:
    """The task ids of an evaluation suite: ``heldout`` (template-disjoint), ``family``
    (families absent from training) or ``train`` (the cold start's training distribution)."""
    tasks = run.ctx.tasks
    by_suite = {"heldout": tasks.heldout, "train": tasks.train, "family": tasks.family}
    if suite not in by_suite:
        raise UnknownNameError("evaluation suite", suite, by_suite)
    return list(by_suite[suite])


def evaluate(run: Run, label: str, manifest: PolicyManifest, suite: str = "heldout",
             seeds: Sequence[int] | None = None) -> EvalSummary:
    """Evaluate ``manifest`` (the generator worker loads its version) on a suite
    (``suite_tasks``): on ``heldout`` and ``family``, ``attempts_per_task`` attempts per task
    over the seeds; on ``train``, one attempt per task with the first seed; with ``seeds``
    given, one attempt per task and seed (more evaluation of a finished policy,
    ``closedloop.experiments.reevaluate``). The trace is ``eval-<label>`` for ``heldout`` and
    ``eval-<label>-<suite>`` otherwise; an existing trace is reused (resume)."""
    ev = run.cfg.evaluation
    if seeds is not None:
        seeds, attempts = list(seeds), len(seeds)
    else:
        attempts = 1 if suite == "train" else ev.attempts_per_task
        seeds = list(ev.seeds)[:attempts]
    name = eval_name(label, suite)
    run.roles()[1].rng.manual_seed(int(content_hash(["eval", name])[7:15], 16))
    specs = [GroupSpec(f"eval-{name}-{i:03d}-s{seed}", task, seed, 1)
             for i, task in enumerate(suite_tasks(run, suite)) for seed in seeds]
    path = run.ctx.directory.trace(f"eval-{name}")
    if path.is_file():
        episodes = load_episodes(path)[1]
    else:
        with phase(f"eval {name}"):
            episodes = _collect_in_chunks(run, manifest, path, specs, f"eval {name}")
    summary = summarize_eval(episodes, k=attempts, seed=run.cfg.training.seed)
    run.log_metrics("eval", {"label": name, "suite": suite, **summary.to_dict()})
    return summary


def _collect_in_chunks(run: Run, manifest: PolicyManifest, path: Path,
                       specs: Sequence[GroupSpec], desc: str) -> list[Episode]:
    """Collect evaluation groups (one episode each) into the trace ``path``, at most
    ``EVAL_CHUNK_EPISODES`` at a time. Above that, chunk k is first written to
    ``traces/.chunks/<path stem>/k.jsonl`` (reused on resume), then the chunks are joined
    into ``path`` in order (atomically) and removed."""
    if len(specs) <= EVAL_CHUNK_EPISODES:
        collected = collect_with_worker(run, manifest, path, specs, desc)
        return [ep for g in collected for ep in g.episodes]
    chunk_dir = path.parent / ".chunks" / path.stem
    starts = range(0, len(specs), EVAL_CHUNK_EPISODES)
    parts = []
    for k, start in enumerate(starts):
        part = chunk_dir / f"{k:03d}.jsonl"
        if not part.is_file():
            chunk_dir.mkdir(parents=True, exist_ok=True)
            collect_with_worker(run, manifest, part, specs[start:start + EVAL_CHUNK_EPISODES],
                                f"{desc} ({k + 1}/{len(starts)})")
        parts.append(part)
    joined = path.with_suffix(".partial")
    with open(joined, "wb") as out:
        for part in parts:
            out.write(part.read_bytes())
        out.flush()
        os.fsync(out.fileno())
    os.replace(joined, path)
    shutil.rmtree(chunk_dir)
    return list(load_episodes(path)[1])


def seed_sampler(run: Run, summary: EvalSummary) -> None:
    """Give the difficulty-band sampler the cold start's per-task outcomes on the train
    tasks, so its learnable stream is known before the first RL draw."""
    sampler = run.state.sampler
    for t in summary.tasks:
        if t.n > 0 and t.task_id in run.ctx.tasks.train:
            sampler.record_prior(t.task_id, t.successes, t.n)
    run.log_metrics("task_sampler", {"seeded_from": "eval-start-train",
                                     **sampler.to_dict(group_size=run.cfg.rollout.group_size)})


def evaluate_retain(run: Run, label: str, manifest: PolicyManifest) -> dict[str, EvalSummary]:
    """The retain suites (tool use, instruction following, safety), one attempt per task
    with the first evaluation seed; summaries per suite."""
    ev = run.cfg.evaluation
    path = run.ctx.directory.trace(f"eval-retain-{label}")
    suite_ids = (retain_suite_tasks(run.ctx.package, ev.retain_suites)
                 if ev.retain_suites else {})
    if path.is_file():
        episodes = load_episodes(path)[1]
    else:
        tasks = tuple(t for ids in suite_ids.values() for t in ids)
        seed = ev.seeds[0]
        run.roles()[1].rng.manual_seed(int(content_hash(["retain", label])[7:15], 16))
        specs = [GroupSpec(f"retain-{label}-{i:03d}", t, seed, 1) for i, t in enumerate(tasks)]
        with phase(f"eval retain-{label}"):
            collected = collect_with_worker(run, manifest, path, specs, f"retain {label}")
        episodes = [ep for g in collected for ep in g.episodes]
    suites = summarize_suites(episodes, suite_ids, k=1, seed=run.cfg.training.seed)
    run.log_metrics("retain_eval", {"label": label, **{
        name: summary.to_dict() for name, summary in suites.items()}})
    return suites


def audit_frozen(run: Run, label: str, manifest: PolicyManifest) -> AuditResult:
    """Generator vs trainer log-probs at the frozen checkpoint that sampled eval ``label``
    (its first ``consistency.audit_episodes`` episodes), the trainer's π_train holding that
    checkpoint.

    Raises ``ConsistencyGateError`` when the declared tolerance is exceeded: the strict
    synchronous objective is only valid when the two paths agree.
    """
    with phase("audit"):
        return _audit(run, label, manifest)


def _audit(run: Run, label: str, manifest: PolicyManifest) -> AuditResult:
    _, episodes = load_episodes(run.ctx.directory.trace(f"eval-{label}"))
    c = run.cfg.consistency
    model, pad_id = run.roles()[0].model, run.policy.pad_id
    precision = run.ctx.precision.precision
    episodes = episodes[:c.audit_episodes]
    bounds = audit_tolerances(c.tolerance_source, c.max_abs_tolerance, model, episodes,
                              pad_id=pad_id, sampler=manifest.sampler, precision=precision)
    tol = bounds.tolerance_max
    result = audit_logprobs(model, episodes, manifest.weight_checksum,
                            tolerance_max=tol, tolerance_p95=bounds.tolerance_p95,
                            pad_id=pad_id, precision=precision, sampler=manifest.sampler)
    run.ctx.directory.write_json("audit.json", {"label": label,
                                                "version": manifest.policy_version,
                                                **result.to_dict(), **bounds.to_dict()})
    run.log_metrics("audit", result.to_dict())
    log(f"log-prob audit at {manifest.policy_version}: max |Δ| {result.abs_max:.2e}, p95 "
        f"{result.abs_p95:.2e}, p99 {result.abs_p99:.2e}, k3 {result.k3:.2e} over "
        f"{result.n_tokens} tokens -> {'pass' if result.passed else 'FAIL'}")
    if not result.passed:
        raise ConsistencyGateError(f"generator/trainer mismatch {result.abs_max:.3e} "
                                   f"exceeds the tolerance {tol:.1e}")
    return result
