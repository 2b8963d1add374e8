"""The registry/publisher role: a trained version made immutable, loaded by every worker, and
active only once every worker has proved it holds it (atomic publication, docs/concepts.md).

    trainer done with u+1
    -> stage: immutable version folder (adapter + manifest + checksum), verified on write
    -> every worker loads it, hashes the weights it now holds and acknowledges that hash
    -> all acknowledged with the manifest's checksum: ACTIVE switches (one atomic rename)

A worker whose hash is not the manifest's is quarantined and publication stops with
``PublicationError``: the run never trains on, or samples from, a fleet that disagrees.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from closedloop.contracts import PolicyManifest
from closedloop.errors import PublicationError, RegistryError
from closedloop.policy.lora import PolicyChecksum
from closedloop.policy.registry import PolicyRegistry, version_index

__all__ = ["Publisher"]

ManifestOf = Callable[[str, PolicyChecksum], PolicyManifest]
"""``(version, checksum) -> manifest template`` of the run's scaffold."""


class Publisher:
    """Stages versions and activates them once ``worker_ids`` all acknowledged them."""

    def __init__(self, registry: PolicyRegistry, worker_ids: Sequence[str],
                 manifest_of: ManifestOf) -> None:
        self.registry = registry
        self.worker_ids = tuple(worker_ids)
        self.manifest_of = manifest_of
        self.quarantined: dict[str, str] = {}
        self._lock = threading.Lock()

    def stage(self, version: str, adapter: dict, checksum: PolicyChecksum) -> PolicyManifest:
        """Stage the trainer's adapter as ``version`` (immutable). A version staged before a
        crash is kept when it holds these very weights (``RegistryError`` otherwise)."""
        template = self.manifest_of(version, checksum)
        try:
            return self.registry.stage(adapter, template, kind="adapter",
                                       version=version).manifest
        except RegistryError:
            manifest = self.registry.manifest(version)  # staged before a crash: must match
            if manifest.weight_checksum != template.weight_checksum:
                raise
            return manifest

    def acknowledge(self, worker_id: str, version: str, held: PolicyChecksum) -> bool:
        """Record that ``worker_id`` holds ``held`` for ``version``; when every worker has
        acknowledged it with the manifest's checksum, make ``version`` active. Returns whether
        it is active now. A worker whose hash differs is quarantined and
        ``PublicationError`` raised (``version`` does not become active). An acknowledgement of
        a version older than the active one (a worker re-collecting a round pinned to it after
        a resume) is recorded and never moves the active version back."""
        expected = self.registry.manifest(version).weight_checksum
        with self._lock:
            if held.combined != expected:
                self.quarantined[worker_id] = (f"{version}: holds {held.combined}, the "
                                               f"manifest says {expected}")
                raise PublicationError(f"worker {worker_id} does not hold {version} "
                                       f"({self.quarantined[worker_id]}); quarantined, the "
                                       "active version stays")
            self.registry.ack(worker_id, version, held.combined)
            acked = self._acked(version)
            if acked != set(self.worker_ids):
                return False
            active = self.registry.active()
            if active is None or version_index(active.version) < version_index(version):
                self.registry.publish(version, require_acks_from=list(self.worker_ids))
            return True

    def _acked(self, version: str) -> set[str]:
        folder = self.registry.root / "acks" / version
        return {p.stem for p in folder.glob("*.json")} & set(self.worker_ids)
