"""A run's RL-step collection beyond the embedded in-process generator (docs/scale-out.md).

``rollout.workers: ray`` (``train --workers ray``): the step's groups are collected by Ray
generator workers over environment workers (``closedloop.rollout.ray_workers``); every worker
loads each published version's adapter, hashes what it holds, and the registry records its
acknowledgement. ``rollout.generator: vllm``: the step's actions are sampled by a vLLM engine
process (``closedloop.engine.VLLMGenerator``) whose replica acknowledges a version only after
hashing the adapter file its engine read and matching the trainer's probe log-probs
(``VLLMReplica``); the auditor then compares the engine's recorded log-probs with the trainer
path on the step's own episodes (``generator_audit`` in metrics.jsonl, the run stops when it
fails). Evaluations, the warm start and the frozen-checkpoint audit stay in process.

Both start from the run's base (the warm-started policy the RL adapter sits on), written once
to ``engine-base/`` as a model folder and checked against the trainer's base checksum.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from closedloop.contracts import GroupLease, PolicyManifest, TraceWriter
from closedloop.errors import ConfigError, ConsistencyGateError, EngineUnavailableError
from closedloop.policy.lora import policy_weight_checksum, split_state_dict
from closedloop.progress import log
from closedloop.rollout.collector import CollectedGroup, Collector, CollectorConfig

BASE_DIR = "engine-base"
VLLM_WORKER = "vllm-0"
PROBE_TEXT = "Probe: list the files of the workspace."


def export_base(run: Any) -> Path:
    """The run's base as a model folder (``engine-base/``: config, safetensors, tokenizer),
    written once; its tensors hash to the trainer's base checksum (``RunStateError``-free:
    a folder that does not is rewritten)."""
    from closedloop.engine import hash_model_folder

    folder = run.dir / BASE_DIR
    expected = policy_weight_checksum(run.model).base_checksum
    if (folder / "config.json").is_file() and hash_model_folder(folder)[0] == expected:
        return folder
    from safetensors.torch import save_file

    base = split_state_dict(run.model)[0]
    config = run.model.get_base_model().config if hasattr(run.model, "get_base_model") \
        else run.model.config
    if getattr(config, "tie_word_embeddings", False):
        base.pop("lm_head.weight", None)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().contiguous().clone() for k, v in base.items()},
              str(tmp / "model.safetensors"))
    config.save_pretrained(tmp)
    run.tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    if hash_model_folder(folder)[0] != expected:
        raise ConsistencyGateError(f"{folder} does not hash to the trainer's base {expected}")
    return folder


def collector_config(run: Any) -> CollectorConfig:
    """The run's collector limits and per-episode sampling streams."""
    return CollectorConfig(max_turns=run.cfg.environment.max_turns,
                           sampling_salt=run.cfg.training.seed)


class RayScaleOut:
    """Ray generator and environment workers for the RL steps (module doc)."""

    def __init__(self, run: Any) -> None:
        from closedloop.rollout.ray_workers import (
            HFPolicyBuilder,
            PolicySpec,
            RayCollection,
            RayWorkersConfig,
            ray_cluster,
        )

        self.run = run
        cfg, t = run.cfg, run.cfg.training
        workers = RayWorkersConfig(**asdict(cfg.ray))
        self._stack = ExitStack()
        resources = self._stack.enter_context(ray_cluster(workers))
        log(f"ray cluster: {resources.get('CPU')} CPUs; {workers.generator_workers} generator "
            f"and {workers.env_workers} environment workers")
        builder = HFPolicyBuilder(str(export_base(run)), lora_rank=t.lora_rank,
                                  lora_alpha=t.lora_alpha, lora_targets=tuple(t.lora_targets),
                                  seed=t.seed, precision=run.precision.precision)
        spec = PolicySpec(builder, run.renderer, run.renderer.action_text, run.verifier,
                          run.package.family_split, run.run_id, collector_config(run),
                          threads=max(1, int(workers.generator_worker_cpus)))
        self.collection = RayCollection(spec, run.package.make_env, workers)

    def hold(self, manifest: PolicyManifest) -> None:
        """Make every worker hold ``manifest``'s version (after a resume they hold none)."""
        if self.collection.held is None or self.collection.held[1] != manifest.weight_checksum:
            version = manifest.policy_version
            self.publish(version, self.run.registry.load_state_dict(version),
                         manifest.weight_checksum)

    def publish(self, version: str, adapter: dict[str, torch.Tensor], expected: str
                ) -> list[str]:
        """Every generator worker loads ``version`` and acks what it hashed; their ids."""
        held = self.collection.load(adapter, expected)
        for worker, checksum in held.items():
            self.run.registry.ack(worker, version, checksum)
        return list(held)

    def collect(self, manifest: PolicyManifest, leases: Sequence[GroupLease],
                writer: TraceWriter) -> list[CollectedGroup]:
        """Collect on the workers; write each returned group's records (lease, turns,
        trajectory) to ``writer``."""
        groups = self.collection.collect(manifest, leases)
        for group in groups:
            writer.write(group.lease)
            for ep in group.episodes:
                for turn in ep.turns:
                    writer.write(turn)
                writer.write(ep.trajectory)
        return groups

    def close(self) -> None:
        """Stop the workers; shut the cluster down if this run started it."""
        try:
            self.collection.shutdown()
        finally:
            self._stack.close()


class VLLMScaleOut:
    """A vLLM engine process sampling the RL steps (module doc)."""

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

        reason = vllm_unavailable_reason()
        if reason is not None:
            raise EngineUnavailableError(reason)
        if run.precision.precision != "float32":
            raise ConfigError("training.precision", f"resolved to {run.precision.precision}; "
                              "the vLLM engine runs float32 (set training.precision: float32)")
        self.run = run
        cfg, t, v = run.cfg, run.cfg.training, run.cfg.vllm
        self.engine = VLLMEngine(EngineConfig(
            model=str(export_base(run)), seed=t.seed, max_model_len=v.max_model_len,
            max_lora_rank=max(16, t.lora_rank), max_loras=3, threads=v.threads,
            kv_cache_gib=v.kv_cache_gib, startup_timeout_s=v.startup_timeout_s,
            request_timeout_s=v.request_timeout_s), log_path=run.dir / "logs" / "vllm.log")
        log(f"vllm engine: {self.engine.hello.get('vllm_version')} started in "
            f"{self.engine.startup_s:.0f} s")
        base = policy_weight_checksum(run.model).base_checksum
        self.generator = VLLMGenerator(self.engine, run.tokenizer, base_checksum=base,
                                       seed=t.seed, max_context=v.max_model_len)
        self.replica = VLLMReplica(self.generator, VLLM_WORKER,
                                   LoraLayout(t.lora_rank, t.lora_alpha, tuple(t.lora_targets)),
                                   run.dir / "vllm-adapters", cfg.consistency.max_abs_tolerance)
        self.probe = Probe(tuple(run.renderer.render_prompt(PROBE_TEXT)), cfg.rollout.sampler,
                           max_new_tokens=v.probe_tokens, stream=t.seed)
        self.build = (f"vllm:{self.engine.hello.get('vllm_version')}/float32/"
                      f"{self.engine.hello.get('logprobs_mode')}")

    def hold(self, manifest: PolicyManifest) -> None:
        """Make the replica serve ``manifest``'s version (after a resume it serves none)."""
        if self.generator.weight_checksum != manifest.weight_checksum:
            version = manifest.policy_version
            self.publish(version, self.run.registry.load_state_dict(version),
                         manifest.weight_checksum)

    def publish(self, version: str, adapter: dict[str, torch.Tensor], expected: str
                ) -> list[str]:
        """The replica proves ``version`` (hash + probe) and acks it; its id."""
        from closedloop.engine import trainer_probe_reference

        reference = trainer_probe_reference(self.run.model, self.run.cfg.rollout.temperature,
                                            self.run.precision.precision)
        proof = self.replica.load_version(self.run.registry, version, self.probe, reference)
        self.run.log_metrics("replica_proof", {"label": version, **proof.to_dict()})
        return [self.replica.worker_id]

    def collect(self, manifest: PolicyManifest, leases: Sequence[GroupLease],
                writer: TraceWriter) -> list[CollectedGroup]:
        """Collect through the engine, then audit its log-probs against the trainer path."""
        from closedloop.learn.logprob_audit import audit_logprobs
        from closedloop.rollout.source import GeneratorSource

        run = self.run
        source = GeneratorSource(self.generator, run.renderer.action_text, manifest.sampler,
                                 manifest.max_action_tokens, self.build)
        collector = Collector(source, run.renderer, run.package.make_env, run.verifier,
                              run.package.family_split, manifest, run.run_id, writer,
                              collector_config(run))
        groups = collector.collect(list(leases))
        episodes = [ep for g in groups for ep in g.episodes if ep.turns]
        episodes = episodes[:run.cfg.consistency.audit_episodes]
        if episodes:
            tol = run.cfg.consistency.max_abs_tolerance
            audit = audit_logprobs(run.model, episodes, manifest.weight_checksum,
                                   tolerance_max=tol, tolerance_p95=tol / 10, pad_id=run.pad_id,
                                   precision=run.precision.precision, sampler=manifest.sampler)
            run.log_metrics("generator_audit", {"label": manifest.policy_version,
                                                "generator": self.build, **audit.to_dict()})
            if not audit.passed:
                raise ConsistencyGateError(
                    f"the vLLM engine's log-probs differ from the trainer's at "
                    f"{manifest.policy_version}: max |δ| {audit.abs_max:.3g}, p95 "
                    f"{audit.abs_p95:.3g} (tolerance {tol:g})")
        return groups

    def close(self) -> None:
        """Stop the engine process."""
        self.engine.close()


def make_scale_out(run: Any) -> RayScaleOut | VLLMScaleOut | None:
    """The run's scale-out (module doc), or None for the in-process generator."""
    if run.cfg.rollout.generator == "vllm":
        return VLLMScaleOut(run)
    if run.cfg.rollout.workers == "ray":
        return RayScaleOut(run)
    return None


def collect_traced(scale: RayScaleOut | VLLMScaleOut, make_lease: Any, manifest: PolicyManifest,
                   path: Path, groups: Sequence[tuple[str, str, int, int]]
                   ) -> list[CollectedGroup]:
    """Collect ``groups`` through ``scale`` into the trace ``path`` (a ``.partial`` file renamed
    into place once complete, as the in-process collection does)."""
    partial = path.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    with TraceWriter(partial) as writer:
        leases = [make_lease(gid, task, seed, size) for gid, task, seed, size in groups]
        collected = scale.collect(manifest, leases, writer)
    os.replace(partial, path)
    return collected


__all__ = ["RayScaleOut", "VLLMScaleOut", "collect_traced", "export_base", "make_scale_out"]
