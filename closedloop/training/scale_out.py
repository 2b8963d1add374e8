"""A run's RL rounds beyond the in-process generator worker (docs/scale-out.md).

``rollout.workers: ray`` (``train --workers ray``): each round is rolled out by Ray generator
workers over environment workers (``closedloop.rollout.ray_workers``); every worker loads each
published version's adapter, hashes what it then holds, scores the run's fixed probe on its own
generator and acknowledges that to the publisher, which checks the probe against the trainer
path at that version and activates a version only once every worker has.
``rollout.generator: vllm``: each round's actions are sampled by a vLLM engine process
(``closedloop.engine.VLLMGenerator``) whose replica acknowledges a version only after hashing
the adapter file its engine read and matching the trainer's probe log-probs (``VLLMReplica``;
``replica_proof`` in metrics.jsonl); the auditor then compares the engine's recorded log-probs
with the trainer path on the round's own episodes (``generator_audit``; the run stops when it
fails).

Either way the run's verifier step scores the rollouts and commits the trace
(``closedloop.training.collection.commit_trace``), and evaluations, the warm start and the
frozen-checkpoint audit stay with the in-process worker. Both start from the run's base (the
warm-started policy the RL adapter sits on), written once to ``engine-base/`` as a model folder
and checked against the trainer's base checksum.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

from closedloop.contracts import PolicyManifest, TraceWriter
from closedloop.errors import ConfigError, ConsistencyGateError, EngineUnavailableError
from closedloop.policy.chat import ChatMessage
from closedloop.policy.lora import PolicyChecksum, policy_weight_checksum, split_state_dict
from closedloop.progress import log
from closedloop.rollout.collector import Collector, CollectorConfig
from closedloop.rollout.verifier_step import CollectedGroup, RolloutGroup
from closedloop.rollout.work_orders import GroupSpec
from closedloop.training.collection import commit_trace
from closedloop.training.weight_sync import Proof
from closedloop.training.wiring import CollectorParts, make_collector

BASE_DIR = "engine-base"
VLLM_WORKER = "vllm-0"
PROBE_TEXT = "Probe: list the files of the workspace."

__all__ = ["RayScaleOut", "VLLMScaleOut", "export_base", "make_scale_out"]


def export_base(model: Any, tokenizer: Any, folder: Path) -> Path:
    """``model``'s base (the weights its LoRA adapter sits on) as a model folder: config,
    safetensors, tokenizer; written once, rewritten if it does not hash to the base checksum
    (``ConsistencyGateError`` if the written folder does not either)."""
    from safetensors.torch import save_file

    from closedloop.engine import hash_model_folder

    expected = policy_weight_checksum(model).base_checksum
    if (folder / "config.json").is_file() and hash_model_folder(folder)[0] == expected:
        return folder
    base = split_state_dict(model)[0]
    config = model.get_base_model().config if hasattr(model, "get_base_model") \
        else model.config
    if getattr(config, "tie_word_embeddings", False):
        base.pop("lm_head.weight", None)  # saved once, as the input embedding
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in base.items()},
              str(tmp / "model.safetensors"))
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    if hash_model_folder(folder)[0] != expected:
        raise ConsistencyGateError(f"{folder} does not hash to the trainer's base {expected}")
    return folder


class _ScaleOut:
    """What both scale-outs share: the run, how to acknowledge, how to commit a round."""

    worker_ids: list[str]

    def __init__(self, run: Any) -> None:
        self.run = run
        self.trainer = run.roles()[0]

    def collector_config(self) -> CollectorConfig:
        """The run's collector limits and per-episode sampling streams."""
        return CollectorConfig(max_turns=self.run.cfg.environment.max_turns,
                               sampling_salt=self.run.cfg.training.seed)

    def base(self) -> Path:
        """The run's exported base (``engine-base/``)."""
        return export_base(self.trainer.model, self.run.policy.tokenizer,
                           self.run.dir / BASE_DIR)

    def acknowledge(self, version: str,
                    held: dict[str, tuple[PolicyChecksum, dict[str, str], tuple[float, ...]]],
                    load_s: float, probe_proved: bool = False) -> None:
        """Each worker's proof of what it holds (its own checksum, per-tensor digests and the
        run's probe scored by its engine) to the publisher, which checks them against the staged
        version. ``probe_proved``: the workers' probes were already checked where they were
        served (the vLLM replica samples its own probe and sends no scores here)."""
        publisher = self.run.roles()[2]
        probe = self.run.probe
        for worker, (checksum, digests, scored) in held.items():
            ids = probe.ids if scored and probe is not None else ()
            publisher.acknowledge(Proof(worker, version, checksum.combined, dict(digests),
                                        ids, tuple(scored), load_s), probe_proved)

    def held(self) -> str | None:
        """The combined checksum the workers hold (None before the first load)."""
        raise NotImplementedError

    def publish(self, version: str) -> None:
        """Every worker loads ``version`` from the registry and acknowledges what it holds."""
        raise NotImplementedError

    def roll(self, manifest: PolicyManifest, leases: Sequence[Any], writer: TraceWriter,
             progress: Callable[[int], None]) -> list[RolloutGroup]:
        """Roll out ``leases`` under ``manifest``, records to ``writer``."""
        raise NotImplementedError

    def collect(self, manifest: PolicyManifest, path: Path, specs: Sequence[GroupSpec],
                desc: str) -> list[CollectedGroup]:
        """A round: the workers hold ``manifest``'s version (after a resume they hold none),
        roll out ``specs``, the run's verifier step scores them, the trace is committed."""
        run = self.run
        run.roles()[1].load(manifest.policy_version)  # the in-process worker: the leases
        if self.held() != manifest.weight_checksum:
            self.publish(manifest.policy_version)
        probe = make_collector(self.trainer_source(manifest), manifest, CollectorParts(
            run.policy.renderer, run.ctx.verifier, run.ctx.directory.run_id, None,
            run.cfg.environment.max_turns, run.ctx.package))

        def roll(writer: TraceWriter, progress: Callable[[int], None]) -> list[RolloutGroup]:
            leases = [probe.make_lease(s.group_id, s.task_id, s.seed, s.group_size)
                      for s in specs]
            return self.roll(manifest, leases, writer, progress)

        groups = commit_trace(run, path, sum(s.group_size for s in specs), desc, roll)
        self.after(manifest, groups)
        return groups

    def trainer_source(self, manifest: PolicyManifest) -> Any:
        """The in-process worker's source (only its environments are used: leases)."""
        return self.run.roles()[1].source(manifest)

    def after(self, manifest: PolicyManifest, groups: Sequence[CollectedGroup]) -> None:
        """What follows a committed round (nothing by default)."""

    def close(self) -> None:
        """Stop the workers."""


class RayScaleOut(_ScaleOut):
    """Ray generator and environment workers for the RL rounds (module doc)."""

    def __init__(self, run: Any) -> None:
        from closedloop.rollout.ray_workers import (
            HFPolicyBuilder,
            PolicySpec,
            RayCollection,
            RayWorkersConfig,
            ray_cluster,
        )

        super().__init__(run)
        cfg, t = run.cfg, run.cfg.training
        workers = RayWorkersConfig(**asdict(cfg.ray))
        self._stack = ExitStack()
        resources = self._stack.enter_context(ray_cluster(workers))
        log(f"ray cluster: {resources.get('CPU')} CPUs; {workers.generator_workers} generator "
            f"and {workers.env_workers} environment workers")
        try:
            builder = HFPolicyBuilder(str(self.base()), lora_rank=t.lora_rank,
                                      lora_alpha=t.lora_alpha,
                                      lora_targets=tuple(t.lora_targets), seed=t.seed,
                                      precision=run.ctx.precision.precision)
            renderer = run.policy.renderer
            spec = PolicySpec(builder, renderer, renderer.action_text,
                              run.ctx.package.family_split, run.ctx.directory.run_id,
                              self.collector_config(),
                              threads=max(1, int(workers.generator_worker_cpus)))
            self.collection = RayCollection(spec, run.ctx.package.make_env, workers)
        except BaseException:
            self._stack.close()
            raise
        self.worker_ids = [self.collection.name(i) for i in range(workers.generator_workers)]

    def held(self) -> str | None:
        """The combined checksum the generator workers hold."""
        return None if self.collection.held is None else self.collection.held[1]

    def publish(self, version: str) -> None:
        """Every generator worker loads ``version`` and acknowledges what it hashed and how it
        scored the run's probe."""
        manifest = self.run.registry.manifest(version)
        t0 = time.monotonic()
        state = self.run.registry.load_state_dict(version)  # checksum verified on read
        held = self.collection.load(state, manifest.weight_checksum, self.run.probe)
        self.acknowledge(version, held, time.monotonic() - t0)

    def roll(self, manifest: PolicyManifest, leases: Sequence[Any], writer: TraceWriter,
             progress: Callable[[int], None]) -> list[RolloutGroup]:
        """Roll out on the workers; write each returned group's lease and turn records."""
        groups = self.collection.collect(manifest, leases)
        for group in groups:
            writer.write(group.lease)
            for rollout in group.rollouts:
                for turn in rollout.turns:
                    writer.write(turn)
                progress(1)
        return groups

    def close(self) -> None:
        """Stop the workers; shut the cluster down if this run started it."""
        try:
            self.collection.shutdown()
        finally:
            self._stack.close()


class VLLMScaleOut(_ScaleOut):
    """A vLLM engine process sampling the RL rounds (module doc)."""

    def __init__(self, run: Any) -> None:
        from closedloop.engine import (
            EngineConfig,
            LoraLayout,
            Probe,
            VLLMEngine,
            VLLMGenerator,
            VLLMReplica,
            vllm_unavailable_reason,
        )

        super().__init__(run)
        reason = vllm_unavailable_reason()
        if reason is not None:
            raise EngineUnavailableError(reason)
        precision = run.ctx.precision.precision
        if precision != "float32":
            raise ConfigError("training.precision", f"resolved to {precision}; the vLLM engine "
                              "runs float32 (set training.precision: float32)")
        cfg, t, v = run.cfg, run.cfg.training, run.cfg.vllm
        self.engine = VLLMEngine(EngineConfig(
            model=str(self.base()), seed=t.seed, max_model_len=v.max_model_len,
            max_lora_rank=max(16, t.lora_rank), max_loras=3, threads=v.threads,
            kv_cache_gib=v.kv_cache_gib, startup_timeout_s=v.startup_timeout_s,
            request_timeout_s=v.request_timeout_s), log_path=run.dir / "logs" / "vllm.log")
        log(f"vllm engine: {self.engine.hello.get('vllm_version')} started in "
            f"{self.engine.startup_s:.0f} s")
        base = policy_weight_checksum(self.trainer.model).base_checksum
        self.generator = VLLMGenerator(self.engine, run.policy.tokenizer, base_checksum=base,
                                       seed=t.seed, max_context=v.max_model_len)
        self.replica = VLLMReplica(self.generator, VLLM_WORKER,
                                   LoraLayout(t.lora_rank, t.lora_alpha, tuple(t.lora_targets)),
                                   run.dir / "vllm-adapters", cfg.consistency.max_abs_tolerance)
        self.probe = Probe(_probe_prompt(run.policy.renderer, PROBE_TEXT),
                           cfg.rollout.sampler, max_new_tokens=v.probe_tokens, stream=t.seed)
        self.build = (f"vllm:{self.engine.hello.get('vllm_version')}/float32/"
                      f"{self.engine.hello.get('logprobs_mode')}")
        self.worker_ids = [VLLM_WORKER]

    def held(self) -> str | None:
        """The combined checksum the replica proved for what it serves."""
        return None if self.generator.active is None else self.generator.weight_checksum

    def publish(self, version: str) -> None:
        """The replica proves ``version`` (hash + probe against the trainer path on the
        in-process worker's copy of that version, loaded and hashed from the registry) and
        acknowledges it."""
        from closedloop.engine import trainer_probe_reference

        run = self.run
        worker = run.roles()[1]
        worker.load(version)
        reference = trainer_probe_reference(worker.model, run.cfg.rollout.temperature,
                                            run.ctx.precision.precision)
        proof = self.replica.load_version(run.registry, version, self.probe, reference)
        run.log_metrics("replica_proof", {"label": version, **proof.to_dict()})
        # the replica matched the registry's digests tensor by tensor (ReplicaProof.
        # digest_mismatches is empty, or load_version raised): those are what it holds
        digests = {} if proof.digest_mismatches else run.registry.tensor_digests(version)
        self.acknowledge(version, {self.replica.worker_id: (PolicyChecksum(
            proof.base_checksum_loaded, proof.adapter_checksum_loaded, proof.checksum_loaded),
            digests, ())}, proof.load_s, probe_proved=True)

    def roll(self, manifest: PolicyManifest, leases: Sequence[Any], writer: TraceWriter,
             progress: Callable[[int], None]) -> list[RolloutGroup]:
        """Roll out through the engine, records to ``writer`` as they happen."""
        from closedloop.rollout.source import GeneratorSource

        run = self.run
        source = GeneratorSource(self.generator, run.policy.renderer.action_text,
                                 manifest.sampler, manifest.max_action_tokens, self.build)
        collector = Collector(source, run.policy.renderer, run.ctx.package.make_env, None,
                              run.ctx.package.family_split, manifest,
                              run.ctx.directory.run_id, writer, self.collector_config())
        return collector.rollout(list(leases), progress=progress)

    def after(self, manifest: PolicyManifest, groups: Sequence[CollectedGroup]) -> None:
        """Audit the engine's recorded log-probs against the trainer path (module doc)."""
        from closedloop.learn.logprob_audit import audit_logprobs

        run = self.run
        episodes = [ep for g in groups for ep in g.episodes if ep.turns]
        episodes = episodes[:run.cfg.consistency.audit_episodes]
        if not episodes:
            return
        tol = run.cfg.consistency.max_abs_tolerance
        audit = audit_logprobs(self.trainer.model, episodes, manifest.weight_checksum,
                               tolerance_max=tol, tolerance_p95=tol / 10,
                               pad_id=run.policy.pad_id,
                               precision=run.ctx.precision.precision, sampler=manifest.sampler)
        run.log_metrics("generator_audit", {"label": manifest.policy_version,
                                            "generator": self.build, **audit.to_dict()})
        if not audit.passed:
            raise ConsistencyGateError(
                f"the vLLM engine's log-probs differ from the trainer's at "
                f"{manifest.policy_version}: max |δ| {audit.abs_max:.3g}, p95 "
                f"{audit.abs_p95:.3g} (tolerance {tol:g})")

    def close(self) -> None:
        """Stop the engine process."""
        self.engine.close()


def make_scale_out(run: Any) -> _ScaleOut | None:
    """The run's scale-out (module doc), or None for the in-process worker alone."""
    if run.cfg.rollout.generator == "vllm":
        return VLLMScaleOut(run)
    if run.cfg.rollout.workers == "ray":
        return RayScaleOut(run)
    return None


def _probe_prompt(renderer: Any, text: str) -> tuple[int, ...]:
    """The vLLM replica's probe prompt: ``text`` as the only user message of the run's chat
    template, then the assistant header (the replica samples its probe from there, so its
    sampling path is proved on the engine the run's rollouts come from)."""
    template = renderer.template
    return tuple(renderer.encode(template.render_messages([ChatMessage("user", text)],
                                                          add_generation_prompt=True)))
