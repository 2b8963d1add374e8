"""The policy a training run samples with: its RL adapter and trainer, the manifest that names
its weights, publication through the registry, and collection of groups under a manifest."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from closedloop.contracts import PolicyManifest, TraceWriter, sha256_hex
from closedloop.engine import HFGenerator, precision_label
from closedloop.errors import RegistryError
from closedloop.learn.trainer import Trainer, TrainerConfig
from closedloop.policy import attach_lora
from closedloop.policy.lora import policy_weight_checksum, split_state_dict
from closedloop.progress import Progress
from closedloop.rollout.collector import CollectedGroup
from closedloop.rollout.source import ActionSource, GeneratorSource
from closedloop.training.state import RunState
from closedloop.training.wiring import CollectorParts, build_manifest, make_collector

GENERATOR_WORKER = "generator-0"


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """A detached copy of the LoRA tensors: exactly those ``adapter_checksum`` covers."""
    return {k: v.detach().clone() for k, v in split_state_dict(model)[1].items()}


class RunPolicy(RunState):
    """The run's policy identity, publication and collection (a ``TrainingRun`` part)."""

    def attach_rl_adapter(self) -> None:
        """Wrap the (warm-started) base with a fresh LoRA adapter; build the trainer."""
        t = self.cfg.training
        self.model = attach_lora(self.model, r=t.lora_rank, alpha=t.lora_alpha,
                                 seed=t.seed + 1, target_modules=tuple(t.lora_targets))
        u = self.cfg.update
        trainer_cfg = TrainerConfig(objective=u.objective, reducer=self.cfg.credit.reduction,
                                    learning_rate=t.learning_rate, kl_beta=u.kl_beta,
                                    kl_estimator=u.kl_estimator, clip_eps=u.clip_eps,
                                    precision=self.precision.precision,
                                    temperature=self.cfg.rollout.temperature,
                                    optimizer_steps_per_batch=u.optimizer_steps_per_fresh_batch)
        self.trainer = Trainer(self.model, trainer_cfg, reference=self.model.disable_adapter)
        self.generator = HFGenerator(self.model, self.tokenizer, seed=t.seed,
                                     precision=self.precision.precision)
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
            dtype=precision_label(self.precision.precision, self.cfg.training.dtype),
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
        scale = self.scale_out()  # Ray or vLLM workers prove the version too
        extra = [] if scale is None else scale.publish(version, adapter,
                                                       template.weight_checksum)
        self.registry.publish(version, require_acks_from=[GENERATOR_WORKER, *extra])
        return manifest

    def scale_out(self) -> Any:
        """The RL steps' Ray workers or vLLM engine (``closedloop.training.scale_out``),
        started on first use; None for the in-process generator."""
        if not hasattr(self, "_scale_out"):
            from closedloop.training.scale_out import make_scale_out

            self._scale_out = make_scale_out(self)
        return self._scale_out

    def load_version(self, version: str) -> PolicyManifest:
        """Load a published version's adapter into the policy and the generator (to evaluate
        an earlier policy of a finished run; the run's checkpoint is untouched, and the run
        must not train or checkpoint afterwards). Raises ``RegistryError`` unless the loaded
        weights are exactly the manifest's."""
        manifest = self.registry.manifest(version)
        state = self.registry.load_state_dict(version)  # checksum verified on read
        current = split_state_dict(self.model)[1]
        if set(state) != set(current):
            raise RegistryError(f"{version}: its adapter tensors are not this run's adapter's")
        with torch.no_grad():
            for name, tensor in state.items():
                current[name].copy_(tensor)
        combined = policy_weight_checksum(self.model).combined
        if combined != manifest.weight_checksum:
            raise RegistryError(f"{version}: the loaded weights are not the manifest's")
        self.generator.refresh_weights(combined)
        return manifest

    # ------------------------------------------------------------------ collection
    def _collect(self, source: ActionSource, manifest: PolicyManifest, path: Path,
                 groups: Sequence[tuple[str, str, int, int]], desc: str
                 ) -> list[CollectedGroup]:
        partial = path.with_suffix(".partial")
        partial.unlink(missing_ok=True)
        with TraceWriter(partial) as writer:
            parts = CollectorParts(self.renderer, self.verifier, self.run_id, writer,
                                   self.cfg.environment.max_turns, self.package,
                                   sampling_salt=self.cfg.training.seed)
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
