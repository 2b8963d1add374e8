"""One training run: set-up, warm start, synchronous RL steps with resume, evaluation.

``TrainingRun`` owns the run directory and every part a step touches; ``closedloop.loop`` reads
like seed 000's minimum training loop and calls its methods. A run directory holds::

    config.json        the resolved config (and its hash), environment and package versions
    launches.jsonl     one line per launch (git revision, versions, a declared config override)
    run.lock           held by the one launch using the directory
    template.json      the chat template's append-only check
    tasks.json         the train/held-out ids, solvability discards and the overlap audit
    traces/            JSONL traces: sft-demos, step-NNNN (one per RL step), eval-<label>
    ledger.sqlite      every group exactly once: collected, admitted, consumed, quarantined
    registry/          staged immutable policy versions, ACTIVE pointer, publish log
    checkpoints/       atomic trainer checkpoints (adapter, optimizer, step, consumed groups,
                       every RNG state, a digest of the ledger rows), step 0 included
    sft/               the warm-start adapter (merged into the base the RL adapter sits on)
    metrics.jsonl      one record per (kind, step, label), each written exactly once
    summary.json       the final summary (written only once every RL step is committed)

Every launch first proves the directory (``closedloop.run_integrity``): the config is the
recorded one unless an override is declared, the ledger passes its integrity checks and the
newest checkpoint's digest, and checkpoints, ledger, registry, metrics and traces agree; what
cannot be reconciled stops the run with an error naming the file. Resume: the latest
checkpoint is the source of truth. The ledger is reconciled with it; a step whose trace file
is complete is not collected again (its buffered groups are reused, never dropped or applied
twice); a partial trace (``.partial``) is discarded and the step collected again with the same
seeds and weights; a checkpoint whose step record never reached ``metrics.jsonl`` (a kill
right after its commit) is set aside and its step run again; so a resumed run ends with the
weights and the metrics of an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import platform
import random
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from closedloop.config import RunConfig
from closedloop.contracts import (
    ClosedloopError,
    Episode,
    PolicyManifest,
    TraceWriter,
    canonical_json,
    content_hash,
    load_episodes,
    sha256_hex,
)
from closedloop.contracts.metrics_log import MetricsLog
from closedloop.engine import HFGenerator, precision_label
from closedloop.envs.plugin import EnvPackageError, ScriptedPolicyLike
from closedloop.evaluate.heldout import EvalSummary, summarize_eval
from closedloop.evaluate.retain import summarize_suites
from closedloop.learn.audit import AuditResult, audit_logprobs, audit_tolerances
from closedloop.learn.checkpoint import (
    capture_rng_states,
    restore_rng_states,
    save_checkpoint,
)
from closedloop.learn.credit import group_advantages, summarize_credit
from closedloop.learn.sft import supervised_warm_start
from closedloop.learn.trainer import Trainer, TrainerConfig
from closedloop.policy import attach_lora, check_append_only, load_model
from closedloop.policy.lora import policy_weight_checksum, split_state_dict
from closedloop.policy.registry import PolicyRegistry, RegistryError, version_index, version_name
from closedloop.progress import Progress, log
from closedloop.rollout.admission import AdmissionController, apply_decision
from closedloop.rollout.collector import CollectedGroup
from closedloop.rollout.ledger import GroupSummary, Ledger, LedgerInconsistencyError
from closedloop.rollout.source import ActionSource, GeneratorSource, ScriptedSource
from closedloop.rollout.task_sampler import DifficultyBandSampler
from closedloop.rollout.tensors import build_training_batch
from closedloop.run_integrity import (
    RunLock,
    RunStateError,
    check_config,
    check_tasks,
    prove_state,
    require_complete,
)
from closedloop.runtime import (
    CollectorParts,
    build_manifest,
    make_collector,
    make_renderer,
    run_package,
    task_set_request,
)

GENERATOR_WORKER = "generator-0"


class ConsistencyGateError(ClosedloopError):
    """Generator and trainer disagree on log-probs at one version beyond the tolerance."""


@dataclass(frozen=True)
class StepReport:
    """What one RL step did (also one line of metrics.jsonl)."""

    step: int
    behavior_version: str
    output_version: str | None
    groups: int
    admitted: int
    zero_variance: int
    discarded: int
    mean_success: float | None
    metrics: dict[str, Any]
    seconds: dict[str, float]


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """A detached copy of the LoRA tensors: exactly those ``adapter_checksum`` covers."""
    return {k: v.detach().clone() for k, v in split_state_dict(model)[1].items()}


def _seed_all(seed: int) -> None:
    """Seed the process-wide RNGs (Python, NumPy, torch); checkpoints capture all three."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _git_revision() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=5, check=False)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _versions() -> dict[str, str]:
    import peft
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__, "python": platform.python_version(),
            "machine": f"{platform.machine()} {os.cpu_count()} cpus"}


def load_warm_start(sft_dir: Path) -> tuple[dict[str, torch.Tensor], int]:
    """The run's SFT adapter (``adapter.pt``) and its trained action tokens (``result.json``);
    ``RunStateError`` naming the damaged file and how to recover otherwise."""
    adapter_file, result_file = sft_dir / "adapter.pt", sft_dir / "result.json"
    recovery = (f"delete {sft_dir} to train the warm start again (and checkpoints/ and "
                "registry/, which were trained from it)")
    try:
        meta = json.loads(result_file.read_text(encoding="utf-8"))
        tokens = int(meta["trained_action_tokens"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RunStateError(result_file, f"the warm start's record is unreadable "
                            f"({type(exc).__name__}: {exc})", recovery) from None
    try:
        state: dict[str, torch.Tensor] = torch.load(adapter_file, weights_only=True)
    except Exception as exc:  # torch raises several types for a damaged file
        raise RunStateError(adapter_file, f"the warm-start adapter does not load "
                            f"({type(exc).__name__}: {exc})", recovery) from None
    return state, tokens


class TrainingRun:
    """The state of one run (see the module docstring)."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path,
                 config_override: str | None = None) -> None:
        """Lock the run directory and check its config against the recorded one
        (``closedloop.run_integrity``; ``config_override`` is the declared reason for a change).
        """
        self.cfg = cfg
        self.dir = Path(run_dir)
        for sub in ("traces", "checkpoints", "sft"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self._lock = RunLock(self.dir)
        try:
            self._open(cfg, config_override)
        except BaseException:
            self._lock.release()
            raise

    def _open(self, cfg: RunConfig, config_override: str | None) -> None:
        check_config(self.dir, cfg.to_dict(), {"config_hash": cfg.config_hash(),
                                               "git_revision": _git_revision(),
                                               "versions": _versions()}, config_override)
        self.run_id = f"{self.dir.name}"
        self.metrics_path = self.dir / "metrics.jsonl"
        self.metrics = MetricsLog(self.metrics_path)
        if self.metrics.repaired_tail:
            log(f"{self.metrics_path}: cut off a last line a killed launch left unfinished")
        _seed_all(cfg.training.seed)
        self.package = run_package(cfg.environment)  # tasks, env, verifier, scaffold
        tasks_json = self.dir / "tasks.json"
        recorded_tasks = tasks_json.read_bytes() if tasks_json.is_file() else None
        self._build_tasks()
        check_tasks(tasks_json, recorded_tasks, {"train": self.train_tasks,
                                                 "heldout": self.heldout_tasks},
                    config_override)
        self._load_policy()
        self.verifier = self.package.verifier()
        self.ledger = Ledger(self.dir / "ledger.sqlite")
        self.registry = PolicyRegistry(self.dir / "registry")
        self.admission = AdmissionController(cfg.rollout.max_version_lag,
                                             censor_rule=cfg.credit.censor_rule)
        self.sampler = DifficultyBandSampler(
            self.train_tasks, [self.package.task_info(t).family for t in self.train_tasks],
            seed=cfg.training.seed)
        self.trainer: Trainer | None = None
        self.step = 0
        self.consumed: set[str] = set()
        self.sft_tokens = 0

    # ------------------------------------------------------------------ set-up
    def _write_json(self, name: str, data: Any) -> None:
        path = self.dir / name
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
        os.replace(tmp, path)

    def log_metrics(self, kind: str, data: dict[str, Any]) -> None:
        """Store one record in metrics.jsonl, exactly once per key (``(kind, step, label)``,
        ``closedloop.contracts.metrics_log``): a record without ``step`` or ``label`` is keyed
        by the run's current step (one that names its source, ``seeded_from``, by that)."""
        line = {"kind": kind, "time": time.time(), **data}
        if "label" not in line and "seeded_from" in line:
            line["label"] = str(line["seeded_from"])
        if "step" not in line and "label" not in line:
            line["step"] = self.step
        self.metrics.put(line)

    def _build_tasks(self) -> None:
        request = task_set_request(self.cfg, self.package)
        sets = self.package.task_sets(request)
        self.train_tasks, self.heldout_tasks = list(sets.train), list(sets.heldout)
        if request.family_tasks and "family" not in sets.suites:
            raise EnvPackageError(f"environment package {self.package.env_id!r} has no "
                                  "family-disjoint suite; set evaluation."
                                  "environment_family_disjoint: false")
        self.family_tasks = list(sets.suites.get("family", ()))
        self._write_json("tasks.json", {
            "env_id": self.package.env_id, "train": self.train_tasks,
            "heldout": self.heldout_tasks, "family": self.family_tasks,
            "discarded": list(sets.discarded), **sets.audit})
        log(f"tasks: {len(self.train_tasks)} train / {len(self.heldout_tasks)} held-out "
            f"(template-disjoint) / {len(self.family_tasks)} family-disjoint "
            f"of {self.package.env_id}, {len(sets.discarded)} discarded by the solvability "
            "filter")

    def _load_policy(self) -> None:
        cfg = self.cfg
        model_arg = None if cfg.model == "embedded" else cfg.model
        self.loaded = load_model(model_arg, dtype=cfg.training.dtype)
        log(f"model {self.loaded.model_id} loaded from {self.loaded.source} in "
            f"{self.loaded.load_seconds:.1f}s")
        self.tokenizer = self.loaded.tokenizer
        self.model: Any = self.loaded.model
        if getattr(self.model, "hf_quantizer", None) is not None:
            self.model.hf_quantizer.remove_quantization_config(self.model)
        self.renderer = make_renderer(self.tokenizer, self.package)
        report = check_append_only(self.renderer)
        self._write_json("template.json", report._asdict() if hasattr(report, "_asdict")
                         else report.__dict__)
        self.pad_id = int(self.tokenizer.pad_token_id or 0)

    # ------------------------------------------------------------------ warm start
    def warm_start(self) -> None:
        """SFT on noisy-expert demonstrations, merged into the base (π_ref = initial SFT)."""
        cfg = self.cfg.sft
        adapter_file = self.dir / "sft" / "adapter.pt"
        model = attach_lora(self.model, r=self.cfg.training.lora_rank,
                            alpha=self.cfg.training.lora_alpha, seed=self.cfg.training.seed,
                            target_modules=tuple(self.cfg.training.lora_targets))
        if adapter_file.is_file():
            state, self.sft_tokens = load_warm_start(adapter_file.parent)
            model.load_state_dict(state, strict=False)
            log("warm start: reusing the run's SFT adapter")
        else:
            demos = self.collect_demonstrations(cfg.demonstrations)
            with Progress(cfg.epochs * len(demos), "sft", "ep") as bar:
                result = supervised_warm_start(
                    model, demos, self.pad_id, epochs=cfg.epochs, batch_size=cfg.batch_size,
                    learning_rate=cfg.learning_rate, seed=self.cfg.training.seed,
                    bf16_autocast=cfg.bf16_autocast, progress=bar.update)
            self.sft_tokens = result.trained_action_tokens
            meta = {"optimizer_steps": result.optimizer_steps, "episodes": result.episodes,
                    "trained_action_tokens": result.trained_action_tokens,
                    "losses": list(result.losses)}
            # result.json first, the adapter last and atomically: an adapter never lacks its
            # record, so a resume either reuses both or trains again
            self._write_json("sft/result.json", meta)
            tmp = adapter_file.with_suffix(".pt.tmp")
            torch.save(adapter_state(model), tmp)
            os.replace(tmp, adapter_file)
            self.log_metrics("sft", meta)
            log(f"warm start: {result.optimizer_steps} steps on {result.episodes} "
                f"demonstrations, {result.trained_action_tokens} action tokens, loss "
                f"{result.losses[0]:.3f} -> {result.losses[-1]:.3f}")
        self.model = model.merge_and_unload()

    def collect_demonstrations(self, n: int, offset: int = 0,
                               name: str = "sft-demos") -> list[Episode]:
        """Noisy-expert episodes on train tasks, through the same collector and renderer."""
        rate, seed = self.cfg.sft.noise_rate, self.cfg.training.seed

        def make_policy(task_id: str, key: str) -> ScriptedPolicyLike:
            return self.package.scripted_policy(
                "noisy", task_id, int(content_hash([seed, offset, key])[7:15], 16), rate)

        source = ScriptedSource(make_policy, self.renderer.encode, build="scripted-noisy")
        manifest = self.manifest_for("scripted", demo=True)
        tasks = [self.train_tasks[i % len(self.train_tasks)] for i in range(n)]
        path = self.dir / "traces" / f"{name}.jsonl"
        path.unlink(missing_ok=True)
        groups = self._collect(source, manifest, path, [
            (f"{name}-{i:04d}", task, 1000 + offset + i, 1) for i, task in enumerate(tasks)],
            "demos")
        episodes = [ep for g in groups for ep in g.episodes]
        solved = sum(1 for ep in episodes if (ep.trajectory.task_success or 0) >= 1)
        log(f"demonstrations: {len(episodes)} episodes, {solved} solved")
        return episodes

    # ------------------------------------------------------------------ policy identity
    def attach_rl_adapter(self) -> None:
        """Wrap the (warm-started) base with a fresh LoRA adapter; build the trainer."""
        t = self.cfg.training
        self.model = attach_lora(self.model, r=t.lora_rank, alpha=t.lora_alpha,
                                 seed=t.seed + 1, target_modules=tuple(t.lora_targets))
        u = self.cfg.update
        trainer_cfg = TrainerConfig(objective=u.objective, reducer=self.cfg.credit.reduction,
                                    learning_rate=t.learning_rate, kl_beta=u.kl_beta,
                                    kl_estimator=u.kl_estimator, clip_eps=u.clip_eps,
                                    precision=t.precision,
                                    temperature=self.cfg.rollout.temperature,
                                    optimizer_steps_per_batch=u.optimizer_steps_per_fresh_batch)
        self.trainer = Trainer(self.model, trainer_cfg, reference=self.model.disable_adapter)
        self.generator = HFGenerator(self.model, self.tokenizer, seed=t.seed,
                                     precision=t.precision)
        self._write_json("trainer.json", trainer_cfg.__dict__)

    def manifest_for(self, version: str, demo: bool = False) -> PolicyManifest:
        """The manifest of ``version`` under the run's scaffold (weights as they are now).

        ``demo=True`` gives the scripted demonstrator's manifest: same scaffold, and a weight
        checksum that names the script, since no weights sampled those actions.
        """
        if demo:
            script = sha256_hex(f"scripted-noisy-expert/{self.cfg.sft.noise_rate}")
            base = adapter = None
            version, combined = "scripted-noisy-expert", script
        else:
            ident = policy_weight_checksum(self.model)
            base, adapter, combined = ident.base_checksum, ident.adapter_checksum, ident.combined
        return build_manifest(
            policy_version=version, weight_checksum=combined,
            tokenizer_revision=self.loaded.tokenizer_revision, renderer=self.renderer,
            sampler=self.cfg.rollout.sampler, step_budget=self.cfg.environment.max_turns,
            max_action_tokens=self.cfg.rollout.max_action_tokens,
            model_id=self.loaded.model_id,
            dtype=precision_label(self.cfg.training.precision, self.cfg.training.dtype),
            base_weight_checksum=base, adapter_checksum=adapter)

    def publish(self, version: str) -> PolicyManifest:
        """Stage the adapter as ``version``, have the generator ack its checksum, publish."""
        template = self.manifest_for(version)
        adapter = adapter_state(self.model)
        try:
            staged = self.registry.stage(adapter, template, kind="adapter", version=version)
            manifest = staged.manifest
        except RegistryError:
            manifest = self.registry.manifest(version)  # staged before a crash: must match
            if manifest.weight_checksum != template.weight_checksum:
                raise
        # template.weight_checksum is the combined base + adapter checksum of these very weights
        # (computed above by manifest_for): hashing the 135M base again would cost ~0.7 s.
        self.generator.refresh_weights(template.weight_checksum)
        self.registry.ack(GENERATOR_WORKER, version, self.generator.weight_checksum)
        self.registry.publish(version, require_acks_from=[GENERATOR_WORKER])
        return manifest

    # ------------------------------------------------------------------ collection
    def _collect(self, source: ActionSource, manifest: PolicyManifest, path: Path,
                 groups: Sequence[tuple[str, str, int, int]], desc: str
                 ) -> list[CollectedGroup]:
        partial = path.with_suffix(".partial")
        partial.unlink(missing_ok=True)
        with TraceWriter(partial) as writer:
            parts = CollectorParts(self.renderer, self.verifier, self.run_id, writer,
                                   self.cfg.environment.max_turns, self.package)
            collector = make_collector(source, manifest, parts)
            leases = [collector.make_lease(gid, task, seed, size)
                      for gid, task, seed, size in groups]
            with Progress(sum(g[3] for g in groups), desc) as bar:
                collected = collector.collect(leases, progress=bar.update)
        os.replace(partial, path)
        return collected

    def model_source(self, manifest: PolicyManifest) -> GeneratorSource:
        """Sample actions from the current weights (the behaviour policy of ``manifest``)."""
        if self.generator.weight_checksum != manifest.weight_checksum:
            raise RegistryError("the generator's weights are not the manifest's")
        return GeneratorSource(self.generator, self.renderer.action_text, manifest.sampler,
                               manifest.max_action_tokens, manifest.generator_build)

    # ------------------------------------------------------------------ evaluation
    def suite_tasks(self, suite: str) -> list[str]:
        """The task ids of an evaluation suite: ``heldout`` (template-disjoint), ``family``
        (families absent from training) or ``train`` (the cold start's training distribution)."""
        tasks = {"heldout": self.heldout_tasks, "train": self.train_tasks,
                 "family": self.family_tasks}
        if suite not in tasks:
            raise ValueError(f"unknown evaluation suite {suite!r}; known: {sorted(tasks)}")
        return list(tasks[suite])

    def evaluate(self, label: str, manifest: PolicyManifest,
                 suite: str = "heldout") -> EvalSummary:
        """Evaluate ``manifest`` on a suite (``suite_tasks``): on ``heldout`` and ``family``,
        ``attempts_per_task`` attempts per task over the seeds; on ``train``, one attempt per task
        with the first seed. The trace is ``eval-<label>`` for ``heldout`` and
        ``eval-<label>-<suite>`` otherwise; an existing trace is reused (resume)."""
        ev = self.cfg.evaluation
        attempts = 1 if suite == "train" else ev.attempts_per_task
        seeds = list(ev.seeds)[:attempts]
        name = label if suite == "heldout" else f"{label}-{suite}"
        self.generator.rng.manual_seed(int(content_hash(["eval", name])[7:15], 16))
        groups = [(f"eval-{name}-{i:03d}-s{seed}", task, seed, 1)
                  for i, task in enumerate(self.suite_tasks(suite)) for seed in seeds]
        path = self.dir / "traces" / f"eval-{name}.jsonl"
        if path.is_file():
            episodes = load_episodes(path)[1]
        else:
            collected = self._collect(self.model_source(manifest), manifest, path, groups,
                                      f"eval {name}")
            episodes = [ep for g in collected for ep in g.episodes]
        summary = summarize_eval(episodes, k=attempts, seed=self.cfg.training.seed)
        self.log_metrics("eval", {"label": name, "suite": suite, **summary.to_dict()})
        return summary

    def seed_sampler(self, summary: EvalSummary) -> None:
        """Give the difficulty-band sampler the cold start's per-task outcomes on the train
        tasks, so its learnable stream is known before the first RL draw."""
        for t in summary.tasks:
            if t.n > 0 and t.task_id in self.train_tasks:
                self.sampler.record_prior(t.task_id, t.successes, t.n)
        self.log_metrics("task_sampler", {"seeded_from": "eval-start-train",
                                          **self.sampler.to_dict(
                                              group_size=self.cfg.rollout.group_size)})

    def evaluate_retain(self, label: str, manifest: PolicyManifest) -> dict[str, EvalSummary]:
        """The retain suites (tool use, instruction following, safety), one attempt per task
        with the first evaluation seed; summaries per suite."""
        ev = self.cfg.evaluation
        path = self.dir / "traces" / f"eval-retain-{label}.jsonl"
        if path.is_file():
            episodes = load_episodes(path)[1]
        else:
            tasks = self._retain_tasks(tuple(ev.retain_suites))
            seed = ev.seeds[0]
            self.generator.rng.manual_seed(int(content_hash(["retain", label])[7:15], 16))
            groups = [(f"retain-{label}-{i:03d}", t, seed, 1) for i, t in enumerate(tasks)]
            collected = self._collect(self.model_source(manifest), manifest, path, groups,
                                      f"retain {label}")
            episodes = [ep for g in collected for ep in g.episodes]
        suites = summarize_suites(episodes, k=1, seed=self.cfg.training.seed)
        self.log_metrics("retain_eval", {"label": label, **{
            name: summary.to_dict() for name, summary in suites.items()}})
        return suites

    def _retain_tasks(self, suites: tuple[str, ...]) -> tuple[str, ...]:
        if not suites:
            return ()
        if self.package.retain_tasks is None:
            raise EnvPackageError(f"environment package {self.package.env_id!r} has no retain "
                                  f"suites (asked for {list(suites)}); set "
                                  "evaluation.retain_suites: []")
        return self.package.retain_tasks(suites)

    def audit_frozen(self, label: str, manifest: PolicyManifest) -> AuditResult:
        """Generator vs trainer log-probs at the frozen checkpoint that sampled eval ``label``.

        Raises ``ConsistencyGateError`` when the declared tolerance is exceeded: the strict
        synchronous objective is only valid when the two paths agree.
        """
        _, episodes = load_episodes(self.dir / "traces" / f"eval-{label}.jsonl")
        c = self.cfg.consistency
        bounds = audit_tolerances(c.tolerance_source, c.max_abs_tolerance, self.model, episodes,
                                  pad_id=self.pad_id, sampler=manifest.sampler,
                                  precision=self.cfg.training.precision)
        tol = bounds.tolerance_max
        result = audit_logprobs(self.model, episodes, manifest.weight_checksum,
                                tolerance_max=tol, tolerance_p95=bounds.tolerance_p95,
                                pad_id=self.pad_id, precision=self.cfg.training.precision,
                                sampler=manifest.sampler)
        self._write_json("audit.json", {"label": label, "version": manifest.policy_version,
                                        **result.to_dict(), **bounds.to_dict()})
        self.log_metrics("audit", result.to_dict())
        log(f"log-prob audit at {manifest.policy_version}: max |Δ| {result.abs_max:.2e}, p95 "
            f"{result.abs_p95:.2e}, k3 {result.k3:.2e} over {result.n_tokens} tokens -> "
            f"{'pass' if result.passed else 'FAIL'}")
        if not result.passed:
            raise ConsistencyGateError(f"generator/trainer mismatch {result.abs_max:.3e} "
                                       f"exceeds the tolerance {tol:.1e}")
        return result

    # ------------------------------------------------------------------ one RL step
    def step_groups(self, step: int) -> list[tuple[str, str, int, int]]:
        """The groups of RL step ``step``: tasks from the difficulty-band sampler (each draw's
        stream and propensity are logged), deterministic seeds and group ids."""
        t = self.cfg.training
        rng = random.Random(f"{t.seed}/step/{step}")
        draws = self.sampler.sample(t.groups_per_step, step)
        self.log_metrics("task_draws", {"step": step, "draws": [d.to_dict() for d in draws]})
        return [(f"s{step:04d}-g{j}", d.task_id, rng.randrange(1, 10**6),
                 self.cfg.rollout.group_size) for j, d in enumerate(draws)]

    def collect_step(self, step: int, manifest: PolicyManifest) -> list[CollectedGroup]:
        """Collect (or, after a crash, reload) the complete groups of step ``step``."""
        path = self.dir / "traces" / f"step-{step:04d}.jsonl"
        if path.is_file():
            leases, episodes = load_episodes(path)
            by_group: dict[str, list[Episode]] = {}
            for ep in episodes:
                by_group.setdefault(ep.trajectory.group_id, []).append(ep)
            log(f"step {step}: reusing {len(leases)} buffered groups from {path.name}")
            return [CollectedGroup(lease, tuple(sorted(by_group[lease.group_id],
                                                       key=lambda e: e.trajectory.sample_index)))
                    for lease in leases]
        self.generator.rng.manual_seed(int(content_hash(["step", step])[7:15], 16))
        return self._collect(self.model_source(manifest), manifest, path,
                             self.step_groups(step), f"step {step} collect")

    def rl_step(self, step: int) -> StepReport:
        """collect → verify → admit → credit → loss → one optimizer step → publish."""
        if self.trainer is None:
            raise RuntimeError("attach_rl_adapter() first")
        times: dict[str, float] = {}
        t0 = time.perf_counter()
        behavior = version_name(step)
        manifest = self.registry.manifest(behavior)
        groups = self.collect_step(step, manifest)
        times["collect_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        admitted = self._admit(groups, train_version_index=version_index(behavior))
        times["admit_s"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        credits, batch_eps, adv, success = self._credit(admitted)
        summary = summarize_credit(credits)
        metrics: dict[str, Any] = {}
        output: str | None = None
        if batch_eps:
            self.ledger.require_admitted([g.lease.group_id for g in admitted])
            batch = build_training_batch(batch_eps, pad_id=self.pad_id)
            result = self.trainer.step(batch, torch.tensor(adv), torch.tensor(success))
            metrics = dict(result.metrics)
        times["update_s"] = time.perf_counter() - t2
        t3 = time.perf_counter()
        self._update_sampler(groups)
        output = version_name(step + 1)
        self.consumed.update(g.lease.group_id for g in admitted)
        self._checkpoint(step + 1, output)
        if admitted:
            self.ledger.mark_consumed([g.lease.group_id for g in admitted], step + 1, output)
        self.publish(output)
        times["publish_s"] = time.perf_counter() - t3
        scores = [ep.trajectory.task_success for g in groups for ep in g.episodes
                  if ep.trajectory.task_success is not None]
        report = StepReport(
            step=step, behavior_version=behavior, output_version=output, groups=len(groups),
            admitted=len(admitted), zero_variance=summary.n_zero_variance,
            discarded=summary.n_discarded,
            mean_success=sum(scores) / len(scores) if scores else None,
            metrics=metrics, seconds=times)
        self.log_metrics("rl_step", {**report.__dict__, "credit": {
            "n_groups": summary.n_groups, "n_scored_groups": summary.n_scored_groups,
            "zero_variance_rate": summary.zero_variance_rate,
            "discard_reasons": dict(summary.discard_reasons)}})
        self.step = step + 1
        return report

    def _update_sampler(self, groups: Sequence[CollectedGroup]) -> None:
        """Per-task success counts for the difficulty bands; infra failures count apart."""
        for g in groups:
            trajs = [ep.trajectory for ep in g.episodes]
            scored = [t.task_success for t in trajs if t.task_success is not None]
            if scored:
                self.sampler.update(g.lease.task_id, sum(1 for s in scored if s >= 1.0),
                                    len(scored))
            for t in trajs:
                if t.quarantine_reason is not None or t.termination.value == "infra_abort":
                    self.sampler.record_failure(g.lease.task_id,
                                                t.quarantine_reason or "infra_abort")
        self.log_metrics("task_sampler", self.sampler.to_dict(
            group_size=self.cfg.rollout.group_size))

    def _admit(self, groups: Sequence[CollectedGroup], train_version_index: int
               ) -> list[CollectedGroup]:
        admitted = []
        for g in groups:
            gid = g.lease.group_id
            trajs = [ep.trajectory for ep in g.episodes]
            known = gid in self.ledger.group_ids()
            if not known:
                self.ledger.record_collected(g.lease, GroupSummary.from_trajectories(trajs))
            state = self.ledger.get(gid).state
            if state == "collected":
                decision = self.admission.admit(trajs, g.lease, train_version_index)
                apply_decision(self.ledger, decision)
                state = self.ledger.get(gid).state
            if state == "admitted":
                admitted.append(g)
        return admitted

    def _credit(self, groups: Sequence[CollectedGroup]) -> tuple[list[Any], list[Episode],
                                                                   list[float], list[bool]]:
        credits, episodes, adv, success = [], [], [], []
        for g in groups:
            trajs = [ep.trajectory for ep in g.episodes]
            rewards = self._control_rewards(g.lease.group_id, [t.task_success for t in trajs])
            censored = [t.termination.is_censored or t.quarantine_reason is not None
                        or t.task_success is None for t in trajs]
            credit = group_advantages(rewards, self.cfg.credit.estimator, censored,
                                      self.cfg.credit.censor_rule)
            credits.append(credit)
            if credit.advantages is None:
                continue
            a = credit.advantages
            if self.cfg.credit.group_reward_scale == "std":
                from closedloop.learn.reducers import apply_group_reward_scale

                scored = torch.tensor([rewards[i] for i in credit.member_indices])
                a = apply_group_reward_scale(a, scored, "std")
            for pos, i in enumerate(credit.member_indices):
                episodes.append(g.episodes[i])
                adv.append(float(a[pos]))
                success.append(bool((rewards[i] or 0) >= 1.0))
        return credits, episodes, adv, success

    def _control_rewards(self, group_id: str, rewards: list[float | None]) -> list[float | None]:
        """The shuffled-reward null control: permute scored rewards within the group.

        The permutation is seeded by the group id, so a resumed run permutes identically. With
        ``reward_control: none`` the rewards are returned unchanged.
        """
        if self.cfg.credit.reward_control == "none":
            return rewards
        scored = [i for i, r in enumerate(rewards) if r is not None]
        values = [rewards[i] for i in scored]
        random.Random(f"shuffle/{group_id}").shuffle(values)
        out = list(rewards)
        for i, v in zip(scored, values, strict=True):
            out[i] = v
        return out

    def sft_only(self, max_tokens: int, label: str) -> dict[str, Any]:
        """The SFT-only control: more supervised steps on fresh demonstrations, stopping at
        ``max_tokens`` trained action tokens (matched to an RL arm), then publish the result
        as the final version. ``max_tokens == 0`` (the RL arm trained on nothing) trains
        nothing.
        """
        cfg = self.cfg.sft
        trained, steps = 0, 0
        if max_tokens > 0:
            demos = self.collect_demonstrations(cfg.demonstrations, offset=10_000,
                                                name=f"sft-only-{label}")
            with Progress(max_tokens, "sft-only", "tok") as bar:
                result = supervised_warm_start(
                    self.model, demos, self.pad_id, epochs=max(1, cfg.epochs * 4),
                    batch_size=cfg.batch_size, learning_rate=self.cfg.training.learning_rate,
                    seed=self.cfg.training.seed + 7, max_tokens=max_tokens,
                    bf16_autocast=cfg.bf16_autocast)
                bar.update(min(max_tokens, result.trained_action_tokens))
            trained, steps = result.trained_action_tokens, result.optimizer_steps
        self.publish(version_name(self.cfg.training.rl_steps))
        meta = {"optimizer_steps": steps, "trained_action_tokens": trained,
                "target_tokens": max_tokens}
        self.log_metrics("sft_only", meta)
        return meta

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self, step: int, version: str) -> None:
        if self.trainer is None:
            raise RuntimeError("no trainer")
        adapter = adapter_state(self.model)
        save_checkpoint(self.dir / "checkpoints", step, adapter,
                        self.trainer.optimizer.state_dict(), version, sorted(self.consumed),
                        capture_rng_states({"generator": self.generator.rng}),
                        {"sft_tokens": self.sft_tokens, "task_sampler": self.sampler.to_dict(),
                         "ledger_digest": self.ledger.digest().to_dict()})

    def resume(self) -> bool:
        """Prove the run directory's state (``closedloop.run_integrity.prove_state``), restore
        the checkpoint it names and reconcile the ledger with it. Without a checkpoint (a new
        run) write the step-0 one (the fresh adapter, optimizer and RNG states) and return
        False."""
        if self.trainer is None:
            raise RuntimeError("attach_rl_adapter() first")
        ckpt, _ = prove_state(self.dir, self.ledger, self.registry.versions(), self.metrics)
        if ckpt is None:
            self._checkpoint(0, version_name(0))
            return False
        missing = self.model.load_state_dict(ckpt.model_state, strict=False)
        if missing.unexpected_keys:
            raise RuntimeError(f"checkpoint holds unknown tensors: {missing.unexpected_keys}")
        self.trainer.optimizer.load_state_dict(ckpt.optimizer_state)
        restore_rng_states(ckpt.rng_states, {"generator": self.generator.rng}
                           if "generator" in ckpt.rng_states.get("generators", {}) else None)
        if "task_sampler" in ckpt.extra:
            self.sampler = DifficultyBandSampler.from_dict(ckpt.extra["task_sampler"])
        self.step = ckpt.step
        self.trainer.step_count = ckpt.step
        self.consumed = set(ckpt.consumed_group_ids)
        try:
            report = self.ledger.reconcile_with_checkpoint(self.consumed, ckpt.step,
                                                           ckpt.output_policy_version)
        except LedgerInconsistencyError as exc:
            raise RunStateError(self.ledger.path, f"disagrees with {ckpt.path} ({exc})",
                                "restore ledger.sqlite and checkpoints/ from one backup, or "
                                "start a new run directory") from None
        log(f"resumed at step {ckpt.step} ({ckpt.output_policy_version}); ledger: "
            f"{len(report.marked_consumed)} marked consumed from the checkpoint, "
            f"{len(report.reverted_to_admitted)} reverted to admitted")
        self.generator.refresh_weights(policy_weight_checksum(self.model).combined)
        active = self.registry.active()
        if active is None or active.version != ckpt.output_policy_version:
            self.publish(ckpt.output_policy_version)
        return True

    def close(self) -> None:
        """Close the ledger and release the run directory."""
        try:
            self.ledger.close()
        finally:
            self._lock.release()


def write_summary(run: TrainingRun, data: dict[str, Any]) -> Path:
    """Write summary.json atomically and return its path, once every RL step of the config is
    committed and logged (``RunStateError`` otherwise)."""
    require_complete(run.dir, run.cfg.training.rl_steps, run.metrics)
    run._write_json("summary.json", data)
    return run.dir / "summary.json"


__all__ = ["StepReport", "TrainingRun", "canonical_json", "write_summary"]
