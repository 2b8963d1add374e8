"""The registry/publisher role: a trained version made immutable, proved by every worker, and
active only once all of them have (atomic weight publication, docs/concepts.md).

    trainer done with u+1
    -> stage: an immutable version folder (adapter, manifest, checksum, per-tensor digests),
       verified on write
    -> every worker (the in-process generator at its round boundary; each replica process in
       a shadow slot) loads it, hashes what it now holds and scores the fixed probe: its Proof
    -> the publisher checks each proof: the worker's own checksum is the manifest's, its
       per-tensor digests are the staged ones, its probe log-probs are the trainer's scoring
       of the same fixed ids at that version (float32 runs: within consistency.max_abs_tolerance;
       bf16 runs score no probe: docs/concepts.md, atomic weight publication)
    -> every worker proved it: ACTIVE switches (one atomic rename), the replicas swap their
       shadow in

A worker whose proof fails is quarantined, its ACK is still written (the run directory keeps
the evidence: gate ``weight_checksums`` fails on it) and ``PublicationError`` stops the run:
the active version stays, no replica serves the new one, and nothing trains on a fleet that
disagrees.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from closedloop.contracts import PolicyManifest
from closedloop.engine import trainer_probe_reference
from closedloop.errors import PublicationError, RegistryError, ReplicaError
from closedloop.policy.lora import PolicyChecksum, SplitView
from closedloop.policy.registry import PolicyRegistry, PreparedWeights, version_index
from closedloop.training.replicas import ReplicaPool
from closedloop.training.weight_sync import Probe, Proof

__all__ = ["ProbeReference", "Publisher", "publication_latency"]

ManifestOf = Callable[[str, PolicyChecksum], PolicyManifest]
"""``(version, checksum) -> manifest template`` of the run's scaffold."""


class ProbeReference:
    """The trainer path's log-probs of the probe for a version's weights, on its own copy of
    the policy (``RolloutWorker.inference_copy`` of the trainer's), so the reference is the
    version's, whatever the trainer holds by then. The probe's ids are fixed, so the
    reference for one set of weights is computed once and compared with every worker's proof.

    The copy's weights are named by the version's ``weight_checksum``: ``logprobs`` loads a
    version from the registry (verified on read) unless the copy already holds weights of that
    checksum, which ``prime`` gives it straight from the trainer's adapter before the version
    is staged (``closedloop.training.resume.commit_step``). One call at a time holds and
    scores: under ``rollout.mode: async`` the trainer's thread primes while the generator's
    thread may be having an older version's proof checked. The copy's products are bound
    once (``trainer_probe_reference(..., packed=True)``): in float32 its frozen base weights
    are multiplied oneDNN-packed (``closedloop.engine.reference_products``: one more copy of
    the base, 540 MB for SmolLM2; the adapter stays unmerged, as the trainer computes it), in
    bf16 by the bf16 rule."""

    def __init__(self, model: Any, registry: PolicyRegistry, precision: str) -> None:
        from closedloop.training.rollout_worker import inference_copy

        self.model = inference_copy(model)
        self._split = SplitView(self.model)
        self.registry = registry
        self.precision = precision
        self.held: str | None = None  # the weight checksum of what the copy holds
        self._scored: dict[Probe, list[float]] = {}  # scores of the weights held
        self._lock = threading.Lock()

    def prime(self, checksum: str, adapter: Mapping[str, torch.Tensor], probe: Probe) -> None:
        """Hold ``adapter`` (whose policy checksum, base included, is ``checksum``) and score
        ``probe`` on it now."""
        with self._lock:
            if self.held != checksum:
                self._hold(checksum, adapter)
            self._score(probe)

    def logprobs(self, version: str, probe: Probe) -> list[float]:
        """``log π_version(ids[t] | ids[:t])`` for ``t = 1 .. n-1`` at the probe's temperature."""
        checksum = self.registry.manifest(version).weight_checksum
        with self._lock:
            if self.held != checksum:
                self._hold(checksum, self.registry.load_state_dict(version))
            return self._score(probe)

    def _hold(self, checksum: str, adapter: Mapping[str, torch.Tensor]) -> None:
        own = self._split()[1]
        if set(adapter) != set(own):
            raise RegistryError("the reference's adapter tensors are not the policy's adapter's")
        self.held, self._scored = None, {}
        with torch.no_grad():
            for name, tensor in adapter.items():
                own[name].copy_(tensor)
        self.held = checksum

    def _score(self, probe: Probe) -> list[float]:
        if probe not in self._scored:
            score = trainer_probe_reference(self.model, probe.sampler.temperature,
                                            self.precision, packed=True)
            self._scored[probe] = score(probe.ids[:1], probe.ids[1:])
        return self._scored[probe]


class Publisher:
    """Stages versions and activates them once ``worker_ids`` (and every replica) proved
    them (module doc). ``reference``/``probe_tol``: the probe check (``None``: recorded, not
    gated)."""

    def __init__(self, registry: PolicyRegistry, worker_ids: Sequence[str],
                 manifest_of: ManifestOf, *, probe: Probe | None = None,
                 reference: ProbeReference | None = None, probe_tol: float | None = None,
                 replicas: ReplicaPool | None = None) -> None:
        self.registry = registry
        self.replicas = replicas
        self.worker_ids = tuple(worker_ids) + tuple(replicas.worker_ids if replicas else ())
        self.manifest_of = manifest_of
        self.probe = probe
        self.reference = reference
        self.probe_tol = probe_tol
        self.quarantined: dict[str, str] = {}
        self._lock = threading.Lock()

    def stage(self, version: str, adapter: dict | PreparedWeights,
              checksum: PolicyChecksum) -> PolicyManifest:
        """Stage the trainer's adapter as ``version`` (immutable; one staged before a crash is
        kept when it holds these very weights), then have every replica prove it."""
        template = self.manifest_of(version, checksum)
        try:
            manifest = self.registry.stage(adapter, template, kind="adapter",
                                           version=version).manifest
        except RegistryError:
            manifest = self.registry.manifest(version)  # staged before a crash: must match
            if manifest.weight_checksum != template.weight_checksum:
                raise
        if self.replicas is not None:
            self.prove_replicas(version)
        return manifest

    def prove_replicas(self, version: str) -> None:
        """Each replica loads ``version`` into its shadow slot and proves it; a replica that
        dies, times out or fails is quarantined (``PublicationError``)."""
        assert self.replicas is not None
        for replica in self.replicas.replicas:
            try:
                proof = replica.stage(version)
            except ReplicaError as exc:
                self._quarantine(replica.worker_id, str(exc))
                raise PublicationError(f"{exc}; quarantined, the active version stays") from exc
            self.acknowledge(proof)

    def acknowledge(self, proof: Proof, probe_proved: bool = False) -> bool:
        """Check a worker's proof and record its ACK; when every worker has proved the
        version, make it active (and swap it into every replica). Returns whether it is active
        now. A failing proof quarantines the worker and raises ``PublicationError``. An ACK of
        a version older than the active one (a worker re-collecting a round pinned to it
        after a resume) is recorded and never moves the active version back.

        With a probe reference, a proof must carry the probe's log-probs, unless
        ``probe_proved``: the worker's probe was checked against the trainer path where it was
        served (the vLLM replica's own proof, ``VLLMReplica.load_version``)."""
        version, worker = proof.version, proof.worker_id
        with self._lock:
            problem, delta = self._check(proof, probe_proved)
            self.registry.ack(worker, version, proof.checksum, **proof.ack_fields(),
                              probe_max_abs_delta=delta)
            if problem is not None:
                self._quarantine(worker, problem)
                raise PublicationError(f"worker {worker} does not hold {version}: {problem}; "
                                       "quarantined, the active version stays")
            if self._acked(version) != set(self.worker_ids):
                return False
            active = self.registry.active()
            if active is None or version_index(active.version) < version_index(version):
                self.registry.publish(version, require_acks_from=list(self.worker_ids))
                for replica in self.replicas.replicas if self.replicas else ():
                    replica.activate(version)
            return True

    def _check(self, proof: Proof, probe_proved: bool) -> tuple[str | None, float | None]:
        manifest = self.registry.manifest(proof.version)
        if proof.checksum != manifest.weight_checksum:
            return (f"it hashes its weights to {proof.checksum}, the manifest says "
                    f"{manifest.weight_checksum}"), None
        staged = self.registry.tensor_digests(proof.version)
        differ = sorted(k for k in set(staged) | set(proof.digests)
                        if staged.get(k) != proof.digests.get(k))
        if differ:
            return f"{len(differ)} tensors differ from the staged ones ({differ[0]})", None
        if self.reference is None or self.probe is None:
            return None, None
        if not proof.probe_ids and not proof.probe_logprobs:
            return (None if probe_proved else "it sent no probe log-probs"), None
        if tuple(proof.probe_ids) != self.probe.ids or len(proof.probe_logprobs) != len(
                self.probe.ids) - 1:
            return (f"it scored another probe ({len(proof.probe_ids)} ids, "
                    f"{len(proof.probe_logprobs)} log-probs; the probe has "
                    f"{len(self.probe.ids)} ids)"), None
        ref = self.reference.logprobs(proof.version, self.probe)
        delta = max(abs(a - b) for a, b in zip(ref, proof.probe_logprobs, strict=True))
        if self.probe_tol is not None and delta > self.probe_tol:
            return (f"its probe log-probs are {delta:.3g} from the trainer's at that version "
                    f"(tolerance {self.probe_tol:g})"), delta
        return None, delta

    def _quarantine(self, worker: str, why: str) -> None:
        self.quarantined[worker] = why

    def _acked(self, version: str) -> set[str]:
        folder = self.registry.root / "acks" / version
        return {p.stem for p in folder.glob("*.json")} & set(self.worker_ids) - set(
            self.quarantined)


def publication_latency(registry: PolicyRegistry) -> dict[str, dict[str, float | int]]:
    """Per worker, over every version it acknowledged: how long loading and proving took
    (``load_s``) and how long after the version was staged its ACK came (``ack_s``), each as
    p50 and p95 (seconds; a list's nearest-rank quantiles)."""
    import json

    by_worker: dict[str, dict[str, list[float]]] = {}
    for folder in sorted((registry.root / "acks").iterdir()):
        if not (registry.root / "versions" / folder.name).is_dir():
            continue
        staged = (registry.root / "versions" / folder.name).stat().st_mtime
        for path in folder.glob("*.json"):
            ack = json.loads(path.read_text("utf-8"))
            row = by_worker.setdefault(path.stem, {"load_s": [], "ack_s": []})
            if ack.get("load_s") is not None:
                row["load_s"].append(float(ack["load_s"]))
            row["ack_s"].append(max(0.0, float(ack["at"]) - staged))
    out: dict[str, dict[str, float | int]] = {}
    for worker, row in sorted(by_worker.items()):
        stats: dict[str, float | int] = {"versions": len(row["ack_s"])}
        for key, values in row.items():
            ordered = sorted(values)
            for q in (50, 95):
                if ordered:
                    stats[f"{key.removesuffix('_s')}_p{q}_s"] = ordered[
                        min(len(ordered) - 1, max(0, -(-q * len(ordered) // 100) - 1))]
        out[worker] = stats
    return out
