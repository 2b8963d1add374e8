"""A vLLM generator replica that proves which weights it serves before it is acknowledged.

Weight publication (``closedloop.policy.registry``) stages an immutable version (the LoRA
adapter's tensors, their checksum, the manifest), has every generator worker load it and ack
the checksum *it* computed, and only then switches ``ACTIVE``. A replica that acks the checksum
the trainer handed it proves nothing: an adapter that never reached the engine (an empty
adapter list, an id the engine had cached with older weights) keeps sampling the old policy
while every report says success. ``VLLMReplica.load_version`` acknowledges only what it can
show:

1. the version's tensors are read from the registry (checksum verified on read) and written as
   a peft adapter folder, ``adapter_config.json`` + ``adapter_model.safetensors``, in a folder
   of its own per attempt;
2. the engine registers it under a fresh (name, id) (``VLLMGenerator``'s versions), and the
   engine process hashes the file it read under the policy's tensor names: the adapter checksum
   and one digest per tensor (``vllm_server.hash_adapter_folder``); with the base checksum the
   engine hashed at start, ``checksum_loaded = combine_checksums(base, adapter)``;
3. a fixed probe is sampled through the engine under the new adapter and the trainer scores the
   same ids at the same temperature at that version (``ProbeReference``): max |δ| over the
   probe's tokens must be within the audit tolerance (``consistency.max_abs_tolerance``);
4. only then the adapter becomes the active one (the prefix cache is reset: keys/values of the
   old weights are never reused), the registry records the ack, and the proof is kept under
   ``proofs/<version>/<worker>.json``. Otherwise the new adapter is unloaded, nothing is acked
   and ``ReplicaProofError`` carries the proof: ``publish(..., require_acks_from=...)`` then
   refuses the version, and the ``weight_checksums`` gate fails a run directory that holds it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from closedloop.contracts import SamplerConfig
from closedloop.contracts.hashing import canonical_json
from closedloop.engine.vllm_generator import AdapterSlot, VLLMGenerator, action_seed
from closedloop.engine.vllm_server import hash_tensors, peft_name_to_policy
from closedloop.errors import AdapterError, ReplicaProofError
from closedloop.policy.registry import PolicyRegistry, atomic_write_bytes
from closedloop.policy.weights import combine_checksums

ProbeReference = Callable[[Sequence[int], Sequence[int]], list[float]]
"""(prompt ids, action ids) -> the trainer's log-probs of the action ids at the probe's
temperature, at the version being published."""


@dataclass(frozen=True)
class LoraLayout:
    """The adapter's shape as peft saves it: rank, alpha, target modules, adapter name."""

    r: int
    alpha: int
    target_modules: tuple[str, ...]
    adapter_name: str = "default"

    def peft_config(self) -> dict[str, Any]:
        """The ``adapter_config.json`` of this layout (what vLLM reads)."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.r,
                "lora_alpha": self.alpha, "target_modules": list(self.target_modules),
                "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
                "use_rslora": False, "use_dora": False, "modules_to_save": None,
                "base_model_name_or_path": None, "inference_mode": True}


def policy_name_to_peft(name: str, adapter_name: str) -> str:
    """The saved-file name of an in-memory peft tensor (``...lora_A.<adapter>.weight`` ->
    ``...lora_A.weight``); the inverse of ``vllm_server.peft_name_to_policy``."""
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.{adapter_name}.weight", f".{part}.weight")
    return name


def write_peft_adapter(state: Mapping[str, torch.Tensor], layout: LoraLayout,
                       folder: Path) -> Path:
    """Write ``state`` (the registry's adapter tensors, in-memory names) as a peft folder.

    Raises ``AdapterError`` for a tensor whose name does not survive the round trip to the
    saved name and back (it would hash under another name than the manifest's).
    """
    from safetensors.torch import save_file

    saved = {}
    for name, tensor in state.items():
        file_name = policy_name_to_peft(name, layout.adapter_name)
        if peft_name_to_policy(file_name, layout.adapter_name) != name or file_name == name:
            raise AdapterError(f"adapter tensor {name!r} is not a LoRA A/B weight of adapter "
                               f"{layout.adapter_name!r}")
        saved[file_name] = tensor.detach().to("cpu").contiguous().clone()
    folder.mkdir(parents=True, exist_ok=False)
    save_file(saved, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(layout.peft_config(), indent=1))
    return folder


@dataclass(frozen=True)
class Probe:
    """The fixed probe a replica samples to show what it serves: a prompt, the sampler, a
    length and a seed stream."""

    prompt_ids: tuple[int, ...]
    sampler: SamplerConfig
    max_new_tokens: int = 16
    stream: int = 0


def trainer_probe_reference(model: Any, temperature: float, precision: str = "float32",
                            packed: bool = False) -> ProbeReference:
    """A ``ProbeReference`` scoring with ``model`` as it is now, on the trainer's path
    (``trainer_path_logprobs`` at ``temperature``, matmul ``precision``), in eval mode: a
    model in training mode is switched to eval for the call and back; one already in eval
    mode (an inference copy) is left alone (switching walks every module). Its float32
    products run as ``closedloop.engine.reference_products`` says; ``packed``: ``model`` is a
    copy held for scoring only, whose Linears get their products bound for good: in float32
    the packed form (a packed copy of each frozen weight kept on its modules), in bf16 the
    bf16 rule (``bind_matmul_precision``)."""
    from contextlib import nullcontext

    from closedloop.engine.precision import bind_matmul_precision, matmul_precision
    from closedloop.engine.prefix_logprobs import trainer_path_logprobs
    from closedloop.engine.reference_products import bind_reference_products, reference_products

    if packed and precision == "float32":
        bind_reference_products(model)
    elif packed:
        bind_matmul_precision(model, precision)

    def reference(prompt_ids: Sequence[int], action_ids: Sequence[int]) -> list[float]:
        ids_1_T = torch.tensor([list(prompt_ids) + list(action_ids)])
        device = next(model.parameters()).device
        mask_1_Tm1 = torch.zeros(1, ids_1_T.shape[1] - 1, dtype=torch.bool)
        mask_1_Tm1[0, len(prompt_ids) - 1:] = True
        was_training = model.training
        if was_training:
            model.eval()
        try:
            with torch.no_grad(), matmul_precision(model, precision), (
                    reference_products(model) if precision == "float32" and not packed
                    else nullcontext()):
                lps = trainer_path_logprobs(model, ids_1_T.to(device),
                                            torch.ones_like(ids_1_T).to(device),
                                            mask_1_Tm1.to(device), False,
                                            temperature=temperature)
        finally:
            if was_training:
                model.train(True)
        return [float(v) for v in lps[0, len(prompt_ids) - 1:].cpu()]

    return reference


@dataclass(frozen=True)
class ReplicaProof:
    """What a replica showed for one version (module doc): the checksums it computed from
    what it loaded, the tensors whose digest differs from the registry's, and the probe."""

    worker_id: str
    version: str
    expected_checksum: str
    checksum_loaded: str
    base_checksum_loaded: str
    adapter_checksum_loaded: str
    digest_mismatches: tuple[str, ...]
    probe_tokens: int
    probe_max_abs: float
    tolerance: float
    load_s: float
    lora_name: str
    lora_id: int

    @property
    def weights_match(self) -> bool:
        """The hashed files are the manifest's weights, tensor by tensor."""
        return self.checksum_loaded == self.expected_checksum and not self.digest_mismatches

    @property
    def probe_matches(self) -> bool:
        """The engine's probe log-probs are the trainer's within the tolerance."""
        return self.probe_tokens > 0 and self.probe_max_abs <= self.tolerance

    @property
    def proven(self) -> bool:
        """Both: the replica may acknowledge the version."""
        return self.weights_match and self.probe_matches

    def to_dict(self) -> dict[str, Any]:
        """JSON form (with the verdicts)."""
        return {**asdict(self), "weights_match": self.weights_match,
                "probe_matches": self.probe_matches, "proven": self.proven}


class VLLMReplica:
    """One generator worker of the publication protocol, backed by a ``VLLMGenerator``.

    ``scratch`` holds the peft folders the engine reads (one per load attempt, never reused);
    ``tolerance`` bounds the probe's max |δ| (the audit's ``max_abs_tolerance``).
    """

    def __init__(self, generator: VLLMGenerator, worker_id: str, layout: LoraLayout,
                 scratch: str | Path, tolerance: float = 1e-3) -> None:
        self.generator = generator
        self.worker_id = worker_id
        self.layout = layout
        self.scratch = Path(scratch)
        self.tolerance = tolerance

    def _fresh_slot(self, version: str, folder: Path, checksum: str) -> AdapterSlot:
        """A (name, id) the engine has never seen: a cached id would serve its old weights."""
        lora_id = self.generator.engine.new_lora_id()
        return AdapterSlot(version, f"{version}#{lora_id}", lora_id, folder, checksum)

    def load_version(self, registry: PolicyRegistry, version: str, probe: Probe,
                     reference: ProbeReference) -> ReplicaProof:
        """Load, hash, probe; ack and activate only a proven version (module doc)."""
        t0 = time.perf_counter()
        manifest = registry.manifest(version)
        state = registry.load_state_dict(version)
        _, expected_digests = hash_tensors(state.items())
        attempt = len(list(self.scratch.glob(f"{version}-*"))) if self.scratch.exists() else 0
        folder = write_peft_adapter(state, self.layout, self.scratch / f"{version}-{attempt}")
        slot = self._fresh_slot(version, folder, manifest.weight_checksum)
        reply = self.generator.engine.call("load_lora", lora=slot.request())
        loaded_digests: dict[str, str] = reply["adapter_digests"]
        mismatches = tuple(sorted(n for n in set(expected_digests) | set(loaded_digests)
                                  if expected_digests.get(n) != loaded_digests.get(n)))
        base = self.generator.engine.base_checksum
        checksum_loaded = combine_checksums(base, str(reply["adapter_checksum"]))
        slot.checksum = checksum_loaded
        probe_max, n_tokens = self._probe(slot, probe, reference)
        proof = ReplicaProof(self.worker_id, version, manifest.weight_checksum, checksum_loaded,
                             base, str(reply["adapter_checksum"]), mismatches, n_tokens,
                             probe_max, self.tolerance, time.perf_counter() - t0,
                             slot.lora_name, slot.lora_id)
        self._keep(registry, proof)
        if not proof.proven:
            self.generator.engine.call("remove_lora", lora_id=slot.lora_id)
            raise ReplicaProofError(_why(proof), proof)
        self.generator.activate(slot)
        registry.ack(self.worker_id, version, checksum_loaded)
        return proof

    def _probe(self, slot: AdapterSlot, probe: Probe, reference: ProbeReference
               ) -> tuple[float, int]:
        """Sample the probe under ``slot``; return (max |engine - trainer|, tokens)."""
        gen = self.generator
        sid = gen.open_with(slot, probe.prompt_ids, stream=action_seed(probe.stream, 0))
        try:
            (sample,) = gen.generate_batch([sid], probe.sampler,
                                           max_new_tokens=probe.max_new_tokens)
        finally:
            gen.close(sid)
        trainer = reference(probe.prompt_ids, sample.action_token_ids)
        deltas = [abs(a - b) for a, b in zip(sample.behavior_logprobs, trainer, strict=True)]
        return max(deltas, default=float("inf")), len(deltas)

    def _keep(self, registry: PolicyRegistry, proof: ReplicaProof) -> None:
        """Record the proof beside the registry's acks (``proofs/<version>/<worker>.json``)."""
        folder = registry.root / "proofs" / proof.version
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(folder / f"{self.worker_id}.json",
                           canonical_json(proof.to_dict()).encode())


def _why(proof: ReplicaProof) -> str:
    parts = []
    if proof.checksum_loaded != proof.expected_checksum:
        parts.append(f"it hashed {proof.checksum_loaded}, the manifest says "
                     f"{proof.expected_checksum}")
    if proof.digest_mismatches:
        parts.append(f"{len(proof.digest_mismatches)} tensors differ (first "
                     f"{proof.digest_mismatches[0]})")
    if not proof.probe_matches:
        parts.append(f"its probe log-probs differ from the trainer's by up to "
                     f"{proof.probe_max_abs:.3g} > {proof.tolerance:g} over "
                     f"{proof.probe_tokens} tokens: the engine does not serve these weights")
    return f"replica {proof.worker_id} cannot prove {proof.version}: " + "; ".join(parts)


def publish_proven(registry: PolicyRegistry, version: str, replicas: Sequence[VLLMReplica],
                   probe: Probe, reference: ProbeReference) -> list[ReplicaProof]:
    """Have every replica prove ``version``, then publish it requiring all their acks.

    The first replica that cannot prove it raises ``ReplicaProofError``: nothing is published
    and ``ACTIVE`` keeps the previous version.
    """
    proofs = [r.load_version(registry, version, probe, reference) for r in replicas]
    registry.publish(version, require_acks_from=[r.worker_id for r in replicas])
    return proofs
