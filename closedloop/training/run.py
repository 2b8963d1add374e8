"""The one set-up path of every entry point (train, each experiment arm, reevaluate): a run
directory opened and proved, its tasks, its policy loaded, and the roles that act on it.

``open_run`` returns a :class:`Run`: a plain record of what the run shares
(:class:`RunContext`: config, directory, environment package, task sets, verifier, ledger,
registry), the policy as loaded (:class:`PolicyStack`), what the loop advances
(:class:`LoopState`), and, once ``attach_roles`` has run, the roles: the trainer
(``TrainerRole``), the generator worker (``RolloutWorker``) and the publisher. The functions of
``warm_start``, ``evaluation``, ``rl_step``, ``resume`` and ``loop`` take a ``Run``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from closedloop.config import RunConfig, task_set_request
from closedloop.contracts import GuardedVerifier, PolicyManifest, SamplerConfig, sha256_hex
from closedloop.contracts.package import EnvPackage, TaskSetRequest
from closedloop.engine import PrecisionChoice, device_label, precision_label
from closedloop.errors import EnvPackageError, RunNotReadyError
from closedloop.learn.logprob_audit import sample_drift
from closedloop.policy import LoadedModel, check_append_only, load_model
from closedloop.policy.lora import PolicyChecksum
from closedloop.policy.registry import PolicyRegistry, PreparedWeights
from closedloop.progress import log, phase
from closedloop.rollout.admission import AdmissionController
from closedloop.rollout.ledger import Ledger
from closedloop.rollout.queues import AdmissionQueue
from closedloop.rollout.task_sampler import DifficultyBandSampler
from closedloop.rollout.work_orders import WorkOrder
from closedloop.training.integrity import check_tasks, require_complete
from closedloop.training.publisher import ProbeReference, Publisher
from closedloop.training.replicas import PolicyRecipe, ReplicaPool
from closedloop.training.rollout_worker import RolloutWorker, WorkerParts
from closedloop.training.run_directory import RunDirectory
from closedloop.training.trainer_role import TrainerRole
from closedloop.training.weight_sync import Probe, probe_of
from closedloop.training.wiring import build_manifest, make_renderer, run_package

__all__ = ["LoopState", "PolicyStack", "Run", "RunContext", "TaskSets", "attach_roles",
           "load_policy", "manifest_for", "open_run", "write_summary"]

GENERATOR_WORKER = "generator-0"


def _seed_all(seed: int) -> None:
    """Seed the process-wide RNGs (Python, NumPy, torch); checkpoints capture all three."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass(frozen=True)
class TaskSets:
    """The run's task ids: train (RL draws groups from them), held-out (template-disjoint),
    family-disjoint, and the noisy expert's demonstration tasks (never a train or eval task)."""

    train: list[str]
    heldout: list[str]
    family: list[str]
    demo: list[str]


@dataclass
class PolicyStack:
    """The policy as loaded: ``model`` is the base, then base + SFT merged after the warm start
    (π_ref); the trainer role wraps it with the RL adapter."""

    loaded: LoadedModel
    tokenizer: Any
    renderer: Any
    pad_id: int
    model: Any


@dataclass(frozen=True)
class RunContext:
    """What every role of one run shares (read-only)."""

    cfg: RunConfig
    directory: RunDirectory
    package: EnvPackage
    tasks: TaskSets
    verifier: GuardedVerifier
    ledger: Ledger
    registry: PolicyRegistry

    @property
    def precision(self) -> PrecisionChoice:
        """The run's resolved precision (every matmul path uses ``.precision``)."""
        return self.directory.precision

    def log_metrics(self, kind: str, data: dict[str, Any], step: int) -> None:
        """``RunDirectory.log_metrics``."""
        self.directory.log_metrics(kind, data, step)


@dataclass
class LoopState:
    """What the loop advances: the step (= versions trained), the consumed group ids, the
    warm start's trained action tokens, the task sampler, and the work orders drawn for rounds
    not yet consumed."""

    sampler: DifficultyBandSampler
    step: int = 0
    consumed: set[str] = field(default_factory=set)
    sft_tokens: int = 0
    orders: dict[int, WorkOrder] = field(default_factory=dict)


@dataclass
class Run:
    """One open run (module doc). ``trainer``, ``worker`` and ``publisher`` are set by
    ``attach_roles`` (after the warm start); ``credit_state`` holds what a credit estimator
    keeps across steps (the GAE critic, ``closedloop.training.gae_step``)."""

    ctx: RunContext
    policy: PolicyStack
    state: LoopState
    queue: AdmissionQueue
    trainer: TrainerRole | None = None
    worker: RolloutWorker | None = None
    publisher: Publisher | None = None
    probe: Probe | None = None
    credit_state: dict[str, Any] = field(default_factory=dict)
    scale: Any = None  # Ray workers or a vLLM engine for the RL rounds (training.scale_out)

    @property
    def cfg(self) -> RunConfig:
        """The run's config."""
        return self.ctx.cfg

    @property
    def dir(self) -> Path:
        """The run directory."""
        return self.ctx.directory.path

    @property
    def registry(self) -> PolicyRegistry:
        """The policy registry."""
        return self.ctx.registry

    def log_metrics(self, kind: str, data: dict[str, Any]) -> None:
        """One metrics record keyed by the current step unless it names its own."""
        self.ctx.log_metrics(kind, data, self.state.step)

    def roles(self) -> tuple[TrainerRole, RolloutWorker, Publisher]:
        """The trainer, worker and publisher (``RunNotReadyError`` before ``attach_roles``)."""
        if self.trainer is None or self.worker is None or self.publisher is None:
            raise RunNotReadyError("attach_roles() first")
        return self.trainer, self.worker, self.publisher

    def close(self) -> None:
        """Stop the replicas and the scale-out workers, close the ledger and release the run
        directory."""
        try:
            if self.publisher is not None and self.publisher.replicas is not None:
                self.publisher.replicas.stop()
            if self.scale is not None:
                self.scale.close()
            self.ctx.ledger.close()
        finally:
            self.ctx.directory.close()


# ----------------------------------------------------------------------------- set-up
def load_policy(model: str, dtype: str, package: EnvPackage | None = None) -> PolicyStack:
    """The model (``embedded`` or a local folder), its tokenizer and the package's chat
    renderer: what every entry point samples with (``closedloop collect`` included)."""
    loaded = load_model(None if model == "embedded" else model, dtype=dtype)
    log(f"model {loaded.model_id} loaded from {loaded.source} in {loaded.load_seconds:.1f}s")
    if getattr(loaded.model, "hf_quantizer", None) is not None:
        loaded.model.hf_quantizer.remove_quantization_config(loaded.model)
    renderer = make_renderer(loaded.tokenizer, package)
    return PolicyStack(loaded, loaded.tokenizer, renderer,
                       int(loaded.tokenizer.pad_token_id or 0), loaded.model)


def open_run(cfg: RunConfig, run_dir: str | Path, config_override: str | None = None,
             precision: PrecisionChoice | None = None) -> Run:
    """Open, lock and prove ``run_dir`` for ``cfg`` (``closedloop.training.integrity``;
    ``config_override``: the declared reason for a changed config; ``precision``: a
    resolution to adopt on the first launch), build its tasks, load the policy."""
    directory = RunDirectory(run_dir, cfg, config_override, precision)
    try:
        _seed_all(cfg.training.seed)
        package = run_package(cfg.environment)  # tasks, env, verifier, scaffold
        tasks_json = directory.path / "tasks.json"
        recorded_tasks = tasks_json.read_bytes() if tasks_json.is_file() else None
        tasks = _build_tasks(cfg, package, directory)
        check_tasks(tasks_json, recorded_tasks, {"train": tasks.train,
                                                 "heldout": tasks.heldout}, config_override)
        with phase("model load"):
            policy = load_policy(cfg.model, cfg.training.dtype, package)
            if directory.device != "cpu":  # every role's copy follows (engine.device)
                policy.model.to(directory.device)
                log(f"device: {device_label(directory.device)}")
        report = check_append_only(policy.renderer)
        directory.write_json("template.json", report._asdict() if hasattr(report, "_asdict")
                             else report.__dict__)
        ctx = RunContext(cfg, directory, package, tasks, package.verifier(),
                         Ledger(directory.path / "ledger.sqlite"),
                         PolicyRegistry(directory.path / "registry"))
    except BaseException:
        directory.close()
        raise
    sampler = DifficultyBandSampler(tasks.train, [package.task_info(t).family
                                                  for t in tasks.train],
                                    seed=cfg.training.seed)
    controller = AdmissionController(
        cfg.rollout.max_version_lag, drift_tol=cfg.rollout.max_sample_drift,
        censor_rule=cfg.credit.censor_rule,
        allow_mixed_policy=cfg.rollout.in_flight_policy == "mixed_policy")
    queue = AdmissionQueue(controller, ctx.ledger, groups_per_round=cfg.training.groups_per_step,
                           max_version_lag=cfg.rollout.max_version_lag)
    return Run(ctx, policy, LoopState(sampler), queue)


def _build_tasks(cfg: RunConfig, package: EnvPackage, directory: RunDirectory) -> TaskSets:
    request = task_set_request(cfg, package)
    sets = package.task_sets(request)
    train, heldout = list(sets.train), list(sets.heldout)
    if request.family_tasks and "family" not in sets.suites:
        raise EnvPackageError(f"environment package {package.env_id!r} has no "
                              "family-disjoint suite; set evaluation."
                              "environment_family_disjoint: false")
    family = list(sets.suites.get("family", ()))
    demo = _demo_tasks(package, request, {*train, *heldout, *family}, train)
    directory.write_json("tasks.json", {
        "env_id": package.env_id, "train": train, "heldout": heldout, "family": family,
        "demo": demo, "discarded": list(sets.discarded), **sets.audit})
    log(f"tasks: {len(train)} train / {len(heldout)} held-out (template-disjoint) / "
        f"{len(family)} family-disjoint of {package.env_id}, {len(sets.discarded)} discarded "
        f"by the solvability filter; demonstrations on {len(demo)} other train-template tasks")
    return TaskSets(train, heldout, family, demo)


def _demo_tasks(package: EnvPackage, request: TaskSetRequest, taken: set[str],
                train: list[str]) -> list[str]:
    """The tasks the noisy expert demonstrates: other instances of the train templates (the
    package's train set at ``task_seed + 1``, less every train and evaluation task), so the
    warm start teaches the templates without memorizing the tasks RL then trains on and the
    cold start's train success measures the policy, not recall. A package that has no other
    instances leaves the train tasks themselves (logged)."""
    other = package.task_sets(replace(request, seed=request.seed + 1, family_tasks=0))
    demo = [t for t in other.train if t not in taken]
    if not demo:
        log("demonstrations: the package has no train-template tasks besides the run's; "
            "the warm start demonstrates the train tasks")
        return list(train)
    return demo


def manifest_for(run: Run, version: str, checksum: PolicyChecksum | None = None,
                 demo: bool = False) -> PolicyManifest:
    """The manifest of ``version`` under the run's scaffold, naming the weights ``checksum``
    (default: the trainer's as they are now).

    ``demo=True`` gives the scripted demonstrator's manifest: same scaffold, and a weight
    checksum that names the script, since no weights sampled those actions.
    """
    cfg, policy = run.cfg, run.policy
    if demo:
        script = sha256_hex(f"scripted-noisy-expert/{cfg.sft.noise_rate}")
        base = adapter = None
        version, combined = "scripted-noisy-expert", script
    else:
        if checksum is None:
            checksum = run.roles()[0].checksum()
        base, adapter, combined = checksum
    return build_manifest(
        policy_version=version, weight_checksum=combined,
        tokenizer_revision=policy.loaded.tokenizer_revision, renderer=policy.renderer,
        sampler=cfg.rollout.sampler, step_budget=cfg.environment.max_turns,
        max_action_tokens=cfg.rollout.max_action_tokens, model_id=policy.loaded.model_id,
        dtype=precision_label(run.ctx.precision.precision, cfg.training.dtype),
        base_weight_checksum=base, adapter_checksum=adapter)


def attach_roles(run: Run) -> None:
    """Wrap the (warm-started) base with a fresh RL adapter (the trainer role), give the
    generator worker its own inference copy, and set up the publisher; ``trainer.json``
    records the trainer's config."""
    cfg, ctx = run.cfg, run.ctx
    precision = ctx.precision.precision
    run.trainer = TrainerRole(run.policy.model, cfg, precision)
    parts = WorkerParts(ctx.directory.run_id, run.policy.renderer, ctx.package,
                        cfg.environment.max_turns, cfg.training.seed,
                        cfg.rollout.episode_deadline_s)
    run.worker = RolloutWorker(run.trainer.model, run.policy.tokenizer, ctx.registry, parts,
                               worker_id=GENERATOR_WORKER, seed=cfg.training.seed,
                               precision=precision)
    # The probe is a gate where a tolerance holds it (float32). In bf16 the merged decode copy
    # and the unmerged trainer formula round differently and no fixed tolerance separates a
    # stale copy from rounding: no worker scores a probe, and publication rests on the
    # workers' own hashes (docs/concepts.md, atomic weight publication).
    gated = precision == "float32"
    run.probe = (probe_of(run.policy.renderer, SamplerConfig(cfg.rollout.temperature))
                 if gated else None)
    replicas = None
    if cfg.weight_sync.replicas:
        replicas = ReplicaPool(cfg.weight_sync.replicas, policy_recipe(run),
                               timeout_s=cfg.weight_sync.ack_timeout_s)
        replicas.start()
    run.publisher = Publisher(
        ctx.registry, [GENERATOR_WORKER],
        lambda version, checksum: manifest_for(run, version, checksum), probe=run.probe,
        reference=ProbeReference(run.trainer.model, ctx.registry, precision) if gated else None,
        probe_tol=cfg.consistency.max_abs_tolerance if gated else None,
        replicas=replicas)
    from closedloop.training.scale_out import make_scale_out

    run.scale = make_scale_out(run)  # its workers must prove every version too
    if run.scale is not None:
        run.publisher.worker_ids += tuple(run.scale.worker_ids)
    run.queue.drift = lambda group: group_drift(run, group)
    ctx.directory.write_json("trainer.json", run.trainer.config.__dict__)


def policy_recipe(run: Run) -> PolicyRecipe:
    """How a replica process rebuilds this run's policy (``closedloop.training.replicas``)."""
    cfg, t = run.cfg, run.cfg.training
    env = cfg.environment
    sft = run.dir / "sft" / "adapter.pt"
    targets = tuple(t.lora_targets)
    return PolicyRecipe(
        model=cfg.model, dtype=t.dtype, precision=run.ctx.precision.precision,
        sft_adapter=str(sft) if cfg.sft.enabled else None,
        sft_lora=(t.lora_rank, t.lora_alpha, targets, t.seed),
        rl_lora=(t.lora_rank, t.lora_alpha, targets, t.seed + 1),
        environment={"id": env.id, "factory": env.factory, "domain": env.domain},
        registry_root=str(run.registry.root), run_id=run.ctx.directory.run_id, probe=run.probe)


def group_drift(run: Run, group: Any) -> float | None:
    """D_sample of a group's action tokens under the trainer's current weights (the drift
    gate's measure, ``closedloop.learn.logprob_audit.sample_drift``)."""
    trainer = run.roles()[0]
    return sample_drift(trainer.model, list(group.episodes), pad_id=run.policy.pad_id,
                        precision=run.ctx.precision.precision,
                        temperature=run.cfg.rollout.temperature)


def publish(run: Run, version: str, *,
            adapter: dict[str, torch.Tensor] | PreparedWeights | None = None,
            checksum: PolicyChecksum | None = None) -> PolicyManifest:
    """Stage the trainer's adapter as ``version`` (every replica proves it); the in-process
    worker loads it and proves what it holds; the version becomes active. ``adapter`` and
    ``checksum``: the trainer's, as already copied (or serialized: ``prepare_weights``) and
    computed (taken now when ``None``)."""
    trainer, _, publisher = run.roles()
    manifest = publisher.stage(version,
                               trainer.adapter_state() if adapter is None else adapter,
                               trainer.checksum() if checksum is None else checksum)
    prove_and_acknowledge(run, version)
    if run.scale is not None:  # Ray workers or the vLLM replica (training.scale_out)
        run.scale.publish(version)
    return manifest


def prove_and_acknowledge(run: Run, version: str) -> bool:
    """The in-process worker holds ``version`` and proves it to the publisher (``True`` once
    the version is active)."""
    _, worker, publisher = run.roles()
    return publisher.acknowledge(worker.prove(version, run.probe))


def write_summary(run: Run, data: dict[str, Any]) -> Path:
    """Write summary.json atomically and return its path, once every RL step of the config is
    committed and logged (``RunStateError`` otherwise)."""
    require_complete(run.dir, run.cfg.training.rl_steps, run.ctx.directory.metrics)
    run.ctx.directory.write_json("summary.json", data)
    return run.dir / "summary.json"
