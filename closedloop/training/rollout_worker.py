"""The generator role: an inference-only copy of the policy, π_beh^v, that collects groups.

A ``RolloutWorker`` never shares trainable tensors with the trainer. It holds its own copy of
the policy (``inference_copy``: the frozen base tensors are shared, read-only; the adapter
tensors are its own), and its weights change only through ``load(version)``, which reads a
published version from the registry, copies it in, **hashes what the worker now holds** and
refuses the version if that hash is not the manifest's. So the trainer can update its weights
while a worker samples (bounded asynchrony), and a version that never reached the worker can
never pass for one that did (the stale-weights failure: a generator left sampling the initial
policy while every report says it was updated).

``rollout`` collects complete groups under the version the worker holds and writes their
lease and turn records; scoring is the verifier step's (``closedloop.rollout.verifier_step``).
A version switch drops every KV cache (``HFGenerator.refresh_weights``): keys and values
computed under old weights are never reused under new ones.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from closedloop.contracts import PolicyManifest, TraceWriter
from closedloop.contracts.package import EnvPackage
from closedloop.engine import HFGenerator
from closedloop.errors import ChecksumMismatchError, RegistryError
from closedloop.policy.lora import PolicyChecksum, PolicyChecksummer
from closedloop.policy.registry import PolicyRegistry
from closedloop.rollout.source import GeneratorSource
from closedloop.rollout.verifier_step import RolloutGroup
from closedloop.rollout.work_orders import GroupSpec
from closedloop.training.weight_sync import Probe, Proof, score_probe
from closedloop.training.wiring import CollectorParts, make_collector

__all__ = ["RolloutWorker", "WorkerParts", "inference_copy"]


def inference_copy(model: Any) -> Any:
    """A copy of a (LoRA-wrapped) policy that shares its frozen base tensors and owns the
    rest (the adapter), with no tensor requiring a gradient.

    Sharing is safe because a LoRA run never writes its base after the warm start; the
    adapter, which the trainer updates, is the copy's own.
    """
    memo = {id(t): t for name, t in model.named_parameters()
            if not t.requires_grad and "lora_" not in name}
    clone = copy.deepcopy(model, memo)
    clone.eval()
    for p in clone.parameters():
        p.requires_grad_(False)
    return clone


@dataclass(frozen=True)
class WorkerParts:
    """What a worker's collections share besides the weights: the run id, the chat renderer,
    the environment package (environments and task families), the turn limit, the
    per-episode sampling streams' salt and the episode deadline (``scheduler_cancel``)."""

    run_id: str
    renderer: Any
    package: EnvPackage
    max_turns: int
    sampling_salt: int | None
    episode_deadline_s: float | None = None


class RolloutWorker:
    """One generator worker (module doc). ``worker_id`` names it in the registry's ACKs."""

    def __init__(self, policy_model: Any, tokenizer: Any, registry: PolicyRegistry,
                 parts: WorkerParts, *, worker_id: str = "generator-0", seed: int = 0,
                 precision: str = "float32") -> None:
        self.worker_id = worker_id
        self.registry = registry
        self.parts = parts
        self.model = inference_copy(policy_model)
        self._checksum = PolicyChecksummer(self.model)
        self.generator = HFGenerator(self.model, tokenizer, seed=seed, precision=precision,
                                     weight_checksum=self._checksum().combined)
        self.version: str | None = None
        self.manifest: PolicyManifest | None = None

    @property
    def rng(self) -> torch.Generator:
        """The generator's default sampling stream (a checkpoint keeps its state)."""
        return self.generator.rng

    def held_checksum(self) -> PolicyChecksum:
        """The checksum of the weights this worker holds, hashed from its own tensors."""
        return self._checksum()

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The worker's own adapter tensors (live, not copies)."""
        return self._checksum.split()[1]

    def load(self, version: str) -> PolicyManifest:
        """Hold the published ``version``: read it from the registry (verified on read), copy
        it into the worker's own adapter, hash what the worker now holds and keep it only if
        that is the manifest's ``weight_checksum`` (``ChecksumMismatchError`` otherwise, the
        previous weights restored). Every KV cache is dropped. A no-op when already held."""
        if self.version != version:
            self._hold(version)
        return self.held_manifest()

    def _hold(self, version: str) -> tuple[PolicyChecksum, dict[str, str]]:
        """``load``'s work (``version`` not held yet); the checksums of what is held after it
        (the policy's, each adapter tensor's)."""
        manifest = self.registry.manifest(version)
        state = self.registry.load_state_dict(version)
        own = self.adapter_tensors()
        if set(state) != set(own):
            raise RegistryError(f"{version}: its adapter tensors are not this policy's adapter's")
        previous = {k: v.detach().clone() for k, v in own.items()}
        self._copy_in(own, state)
        held, digests = self._checksum.with_digests()
        if held.combined != manifest.weight_checksum:
            self._copy_in(own, previous)
            self.generator.refresh_weights(self.held_checksum().combined)
            raise ChecksumMismatchError(f"{self.worker_id} loaded {version} but holds "
                                        f"{held.combined}, not {manifest.weight_checksum}")
        self.generator.refresh_weights(held.combined)
        self.version, self.manifest = version, manifest
        return held, digests

    @staticmethod
    def _copy_in(own: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in state.items():
                own[name].copy_(tensor)

    def prove(self, version: str, probe: Probe | None) -> Proof:
        """Hold ``version`` (``load``) and prove it from what the worker holds: its own
        checksum, each adapter tensor's checksum, and the fixed probe scored by its own
        generator (``closedloop.training.weight_sync``; ``None``: a run whose publication
        gates no probe, docs/concepts.md, atomic weight publication)."""
        t0 = time.monotonic()
        held, digests = (self._hold(version) if self.version != version
                         else self._checksum.with_digests())
        ids, logprobs = score_probe(self.generator, probe)
        return Proof(self.worker_id, version, held.combined, digests, ids, logprobs,
                     time.monotonic() - t0)

    def held_manifest(self) -> PolicyManifest:
        """The manifest of the version held (``RegistryError`` before the first ``load``)."""
        if self.manifest is None:
            raise RegistryError(f"{self.worker_id} holds no published version yet")
        return self.manifest

    def source(self, manifest: PolicyManifest) -> GeneratorSource:
        """An action source sampling the held weights, which must be ``manifest``'s."""
        if self.generator.weight_checksum != manifest.weight_checksum:
            raise RegistryError(f"{self.worker_id}: the weights it holds are not "
                                f"{manifest.policy_version}'s")
        return GeneratorSource(self.generator, self.parts.renderer.action_text,
                               manifest.sampler, manifest.max_action_tokens,
                               manifest.generator_build)

    def rollout(self, manifest: PolicyManifest, specs: Sequence[GroupSpec],
                writer: TraceWriter | None, progress: Callable[[int], None] | None = None
                ) -> list[RolloutGroup]:
        """Collect ``specs`` under ``manifest`` (the version held): complete, unscored groups
        in spec order; lease and turn records go to ``writer`` as they happen."""
        p = self.parts
        collector = make_collector(self.source(manifest), manifest, CollectorParts(
            p.renderer, None, p.run_id, writer, p.max_turns, p.package,
            sampling_salt=p.sampling_salt, episode_deadline_s=p.episode_deadline_s))
        leases = [collector.make_lease(s.group_id, s.task_id, s.seed, s.group_size)
                  for s in specs]
        return collector.rollout(leases, progress=progress)
