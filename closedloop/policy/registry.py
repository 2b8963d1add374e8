"""The policy registry: immutable staged versions, checksum ACKs and atomic publication.

Layout under ``root``::

    versions/v0003/weights.safetensors   (or adapter.safetensors for a LoRA adapter)
    versions/v0003/manifest.json         PolicyManifest.to_dict()
    versions/v0003/checksum              state_dict_checksum of the stored tensors
    versions/v0003/digests.json          the checksum of each stored tensor (tensor_digests)
    staging/                             temporary directories, renamed into versions/
    acks/v0003/<worker_id>.json          what each generator worker holds: its own hash of its
                                         weights, the digest of its per-tensor hashes, its
                                         probe (ids and log-probs) and its load latency
    ACTIVE                               {"version", "checksum", "manifest_hash", ...}
    publish_log.jsonl                    one line per publication

Publication protocol (docs/concepts.md, atomic weight publication)::

    stage (hash the tensors as the file will hold them, write to staging, fsync, re-read and
           compare byte for byte, rename into versions/)
    -> workers load the version and ack(worker_id, version, checksum_loaded)
    -> require_all_worker_checksums(version, workers)
    -> publish(version): re-verify, then replace ACTIVE atomically (write temp + os.replace)

Until a version is published, the registry object that staged it keeps its files' bytes:
verifying it, or reading its tensors, compares the files with them byte for byte (files
unchanged still hold what staging checked: tensors, checksum, digests and manifest agreeing)
instead of parsing and re-hashing the tensors one by one. Any other version, and every other
process, verifies in full.

Episode-level policy leases give ``finish_old`` semantics: :meth:`PolicyRegistry.lease_for_episode`
returns an immutable :class:`PolicyLease` naming the version active *when the episode starts*;
a later publication changes what new leases get, never what an open lease holds, and version
folders are immutable, so the old weights stay loadable until the episode ends.

Checksums are those of ``closedloop.policy.weights`` (:func:`state_dict_checksum` over the stored
tensors, :func:`combine_checksums` for base + adapter), the one recipe generators ack with.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from closedloop.contracts.hashing import canonical_json
from closedloop.contracts.manifest import PolicyManifest
from closedloop.errors import (
    ChecksumMismatchError,
    ClosedloopError,
    MissingAckError,
    RegistryError,
    UnknownVersionError,
)
from closedloop.policy.weights import (
    checksum_and_digests,
    combine_checksums,
    state_dict_checksum,
    tensor_digests,
)

__all__ = [
    "ChecksumMismatchError",
    "MissingAckError",
    "PolicyLease",
    "PolicyRegistry",
    "PublishedVersion",
    "RegistryError",
    "StagedVersion",
    "UnknownVersionError",
    "WorkerAck",
    "atomic_write_bytes",
    "combine_checksums",
    "fsync_dir",
    "state_dict_checksum",
    "version_index",
    "version_name",
]

WeightsKind = Literal["full", "adapter"]
_FILES: dict[str, str] = {"full": "weights.safetensors", "adapter": "adapter.safetensors"}
_KEPT_UNPUBLISHED = 4  # staged versions whose bytes a registry keeps until they are published
_VERSION_RE = re.compile(r"^v(\d{4,})$")
_WORKER_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


# ----------------------------------------------------------------------------- versions
def version_name(index: int) -> str:
    """Return the version string of ``index``: ``3 -> "v0003"`` (``"v%04d"``)."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise RegistryError(f"a version index must be an int >= 0, got {index!r}")
    return f"v{index:04d}"


def version_index(version: str) -> int:
    """Parse a version string: ``"v0003" -> 3``. Raises ``RegistryError`` on other forms."""
    match = _VERSION_RE.match(version) if isinstance(version, str) else None
    if match is None:
        raise RegistryError(f"policy version {version!r} is not of the form v%04d")
    return int(match.group(1))


# ----------------------------------------------------------------------------- checksums
# One recipe for every checksum: closedloop.policy.weights (state dict and base+adapter).
# ----------------------------------------------------------------------------- durable files
def fsync_dir(path: Path) -> None:
    """Flush a directory entry (a rename or a new file inside it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file and fsync it (not atomic on its own)."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically: temp file, fsync, ``os.replace``, fsync dir.

    A reader sees either the old content or the new one, never a mix, even after a crash.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def tensors_to_bytes(state: Mapping[str, torch.Tensor]) -> bytes:
    """Serialize a state dict as safetensors. A tensor that shares its storage with another
    (tied tensors) or is a view of a larger one is copied first (safetensors stores each
    tensor's own bytes); the rest are written as they are."""
    plain: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for k, v in state.items():
        t = v.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() != t.nbytes or t.storage_offset():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        plain[k] = t
    return save_safetensors(plain)


@dataclass(frozen=True)
class PreparedWeights:
    """A state dict serialized once and hashed as read back (``prepare_weights``): what
    ``stage`` writes, and what a checkpoint can write as its own copy of the same tensors."""

    payload: bytes
    checksum: str
    digests: dict[str, str]


def prepare_weights(state: Mapping[str, torch.Tensor]) -> PreparedWeights:
    """Serialize ``state`` (``tensors_to_bytes``) and hash the tensors the bytes hold
    (``checksum_and_digests`` of the payload read back, not of ``state``)."""
    payload = tensors_to_bytes(state)
    checksum, digests = checksum_and_digests(load_safetensors(payload))
    return PreparedWeights(payload, checksum, digests)


# ----------------------------------------------------------------------------- records
@dataclass(frozen=True)
class StagedVersion:
    """A verified, immutable version folder that is not necessarily active."""

    version: str
    checksum: str
    manifest: PolicyManifest
    path: Path


@dataclass(frozen=True)
class PublishedVersion:
    """The version the ACTIVE pointer names. ``checksum`` is ``manifest.weight_checksum``."""

    version: str
    manifest: PolicyManifest
    checksum: str
    path: Path
    published_at: float


@dataclass(frozen=True)
class PolicyLease:
    """An episode-level policy lease: the episode samples ``version`` until it ends."""

    lease_id: int
    version: str
    checksum: str
    manifest_hash: str


@dataclass(frozen=True)
class WorkerAck:
    """A worker's report on the weights it holds for ``version``: ``checksum_loaded`` is the
    worker's own hash of its weights (never a checksum it was handed); ``digests_hash`` the
    content hash of its per-tensor checksums; ``probe_ids``/``probe_logprobs`` what it scored
    on the fixed probe; ``load_s`` how long loading and proving took;
    ``probe_max_abs_delta`` the largest gap between its probe log-probs and the trainer's
    scoring of the same ids at that version."""

    worker_id: str
    version: str
    checksum_loaded: str
    at: float
    digests_hash: str | None = None
    probe_ids: tuple[int, ...] | None = None
    probe_logprobs: tuple[float, ...] | None = None
    load_s: float | None = None
    probe_max_abs_delta: float | None = None


# ----------------------------------------------------------------------------- registry
class PolicyRegistry:
    """Versions on disk under ``root_dir``; see the module docstring for the protocol.

    One process stages and publishes (the trainer; staging deletes leftovers of a crashed
    stage); any number of processes may lease, load and ack. Version folders are never
    modified after the rename that creates them.
    """

    def __init__(self, root_dir: str | Path) -> None:
        self.root = Path(root_dir)
        for sub in ("versions", "staging", "acks"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._lease_ids = itertools.count(1)
        self._open: dict[int, PolicyLease] = {}
        self._written: dict[str, dict[str, bytes]] = {}  # unpublished version -> its files

    # ------------------------------------------------------------------ versions
    def versions(self) -> list[str]:
        """Return the staged version names in index order."""
        names = [p.name for p in (self.root / "versions").iterdir()
                 if p.is_dir() and _VERSION_RE.match(p.name)]
        return sorted(names, key=version_index)

    def path(self, version: str) -> Path:
        """Return the folder of a staged version; ``UnknownVersionError`` if absent."""
        folder = self.root / "versions" / version_name(version_index(version))
        if not (folder / "manifest.json").is_file():
            raise UnknownVersionError(f"policy version {version} is not in {self.root}")
        return folder

    def manifest(self, version: str) -> PolicyManifest:
        """Return the manifest of a staged version (``RegistryError`` naming the file if it
        cannot be read or is not a manifest)."""
        path = self.path(version) / "manifest.json"
        data = _read_json(path)
        try:
            return PolicyManifest.from_dict(data)
        except (ClosedloopError, KeyError, TypeError, ValueError) as exc:
            raise RegistryError(f"{path}: not a policy manifest ({exc!r})") from None

    def stage(self, state_dict: Mapping[str, torch.Tensor] | PreparedWeights,
              manifest_template: PolicyManifest, *, kind: WeightsKind = "full",
              version: str | None = None) -> StagedVersion:
        """Write a new immutable version and return it verified (not yet active).
        ``state_dict`` may come already serialized and hashed (``prepare_weights``).

        ``kind="full"``: ``state_dict`` is the whole model; ``weight_checksum`` is its checksum.
        ``kind="adapter"``: ``state_dict`` holds LoRA adapter tensors; the template must carry
        ``base_weight_checksum``; ``adapter_checksum`` is the adapter's checksum and
        ``weight_checksum`` is ``combine_checksums(base, adapter)`` (one indivisible version).
        ``version`` defaults to one past the highest staged index (``v0000`` first). The folder
        is written under ``staging/``, fsynced, re-read and compared byte for byte with what was
        hashed, then renamed into place.
        """
        if kind not in _FILES:
            raise RegistryError(f"weights kind must be 'full' or 'adapter', got {kind!r}")
        with self._lock:
            existing = self.versions()
            if version is None:
                version = version_name(version_index(existing[-1]) + 1 if existing else 0)
            version = version_name(version_index(version))
            if version in existing:
                raise RegistryError(f"policy version {version} already exists (immutable)")
            prepared = (state_dict if isinstance(state_dict, PreparedWeights)
                        else prepare_weights(state_dict))  # hashed as the file will hold it
            payload, checksum, digests = prepared.payload, prepared.checksum, prepared.digests
            manifest = _manifest_for(manifest_template, version, checksum, kind)
            files = {_FILES[kind]: payload,
                     "manifest.json": canonical_json(manifest.to_dict()).encode(),
                     "checksum": checksum.encode(),
                     "digests.json": canonical_json(digests).encode()}
            final = self.root / "versions" / version
            _clear_staging(self.root / "staging")
            tmp = Path(tempfile.mkdtemp(prefix=f"{version}-", dir=self.root / "staging"))
            try:
                for name, data in files.items():
                    write_durably(tmp / name, data)
                for name, data in files.items():
                    if (tmp / name).read_bytes() != data:
                        raise ChecksumMismatchError(f"{tmp / name}: read back other bytes "
                                                    "than were written")
                fsync_dir(tmp)
                os.rename(tmp, final)
            except (OSError, ChecksumMismatchError) as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                if isinstance(exc, ChecksumMismatchError):
                    raise
                raise RegistryError(f"could not stage {version}: {exc}") from exc
            fsync_dir(final.parent)
            self._written[version] = files
            for old in sorted(self._written, key=version_index)[:-_KEPT_UNPUBLISHED]:
                del self._written[old]
        return StagedVersion(version, checksum, manifest, final)

    def verify(self, version: str) -> str:
        """Re-read a version's tensors and check them against its ``checksum`` file, its
        per-tensor ``digests.json`` and its manifest.

        Returns the tensor checksum; raises ``ChecksumMismatchError``. A version this object
        staged is checked file by file against the hashes taken when it was written (module
        doc).
        """
        folder = self.path(version)
        recorded = _recorded_checksum(folder)
        if self._unchanged(version) is not None:
            return recorded
        tensors = _verify_folder(folder, recorded)
        if (folder / "digests.json").is_file() and \
                self.tensor_digests(version) != tensor_digests(tensors):
            raise ChecksumMismatchError(f"{version}: digests.json does not match its tensors")
        manifest = self.manifest(version)
        kind = _kind_of(folder)
        declared = manifest.weight_checksum if kind == "full" else manifest.adapter_checksum
        if declared != recorded or manifest.policy_version != folder.name:
            raise ChecksumMismatchError(f"{version}: manifest does not match its weights")
        return recorded

    def tensor_digests(self, version: str) -> dict[str, str]:
        """The per-tensor checksums staged with ``version`` (``digests.json``); a version
        staged before they were kept gets them computed from its verified tensors."""
        folder = self.path(version)
        path = folder / "digests.json"
        if not path.is_file():
            return tensor_digests(self.load_state_dict(version))
        data = _read_json(path)
        if not isinstance(data, dict):
            raise ChecksumMismatchError(f"{path}: not a map of tensor checksums")
        return {str(k): str(v) for k, v in data.items()}

    def load_state_dict(self, version: str) -> dict[str, torch.Tensor]:
        """Load a version's tensors, verifying their checksum (``ChecksumMismatchError``)."""
        folder = self.path(version)
        recorded = _recorded_checksum(folder)
        weights = self._unchanged(version)
        if weights is not None:
            return load_safetensors(weights)
        return _verify_folder(folder, recorded)

    def _unchanged(self, version: str) -> bytes | None:
        """For a version this object staged and has not published: check its files are the
        bytes it wrote (``ChecksumMismatchError`` naming the first that is not) and return the
        weights file's bytes; ``None`` for any other version (module doc)."""
        written = self._written.get(version)
        if written is None:
            return None
        folder = self.path(version)
        kind_file = _FILES[_kind_of(folder)]  # one weights file, as when it was staged
        for name, expected in written.items():
            path = folder / name
            if not path.is_file() or path.read_bytes() != expected:
                raise ChecksumMismatchError(f"{path}: not the file staged")
        return written[kind_file]

    # ------------------------------------------------------------------ publication
    def publish(self, version: str, *,
                require_acks_from: Sequence[str] | None = None) -> PublishedVersion:
        """Atomically make ``version`` the active one, after verifying it (and worker ACKs).

        ``require_acks_from`` lists workers that must have acked this version with the
        manifest's ``weight_checksum`` first. Open episode leases keep their version.
        """
        self.verify(version)
        if require_acks_from is not None:
            self.require_all_worker_checksums(version, require_acks_from)
        manifest = self.manifest(version)
        now = time.time()
        pointer = {"version": version, "checksum": manifest.weight_checksum,
                   "manifest_hash": manifest.manifest_hash(), "published_at": now}
        atomic_write_bytes(self.root / "ACTIVE", canonical_json(pointer).encode())
        with open(self.root / "publish_log.jsonl", "ab") as log:
            log.write(canonical_json(pointer).encode() + b"\n")
            log.flush()
            os.fsync(log.fileno())
        self._written.pop(version, None)
        return PublishedVersion(version, manifest, manifest.weight_checksum, self.path(version),
                                now)

    def active(self) -> PublishedVersion | None:
        """Return the active version, or ``None`` before the first publication."""
        path = self.root / "ACTIVE"
        if not path.exists():
            return None
        pointer = _read_json(path)
        try:
            version, checksum = str(pointer["version"]), str(pointer["checksum"])
            published_at = float(pointer["published_at"])
        except (KeyError, TypeError, ValueError) as exc:
            raise RegistryError(f"{path}: not an ACTIVE pointer ({exc!r})") from None
        manifest = self.manifest(version)
        if manifest.weight_checksum != checksum:
            raise ChecksumMismatchError(f"ACTIVE names {version} with another checksum")
        return PublishedVersion(version, manifest, checksum, self.path(version), published_at)

    def history(self) -> list[dict[str, Any]]:
        """Return every publication in order (the publish log)."""
        log = self.root / "publish_log.jsonl"
        if not log.exists():
            return []
        out = []
        for lineno, line in enumerate(log.read_text("utf-8").splitlines(), start=1):
            try:
                out.append(json.loads(line))
            except ValueError as exc:
                raise RegistryError(f"{log}:{lineno}: not valid JSON ({exc})") from None
        return out

    # ------------------------------------------------------------------ leases and ACKs
    def lease_for_episode(self) -> PolicyLease:
        """Pin the currently active version for one episode (finish_old semantics)."""
        current = self.active()
        if current is None:
            raise RegistryError("no policy version has been published yet")
        with self._lock:
            lease = PolicyLease(next(self._lease_ids), current.version, current.checksum,
                                current.manifest.manifest_hash())
            self._open[lease.lease_id] = lease
        return lease

    def release(self, lease: PolicyLease) -> None:
        """End an episode lease (at the episode boundary)."""
        with self._lock:
            self._open.pop(lease.lease_id, None)

    def open_leases(self) -> tuple[PolicyLease, ...]:
        """Return the leases of this process that are still open, oldest first."""
        with self._lock:
            return tuple(self._open[k] for k in sorted(self._open))

    def ack(self, worker_id: str, version: str, checksum_loaded: str,
            **proof: Any) -> WorkerAck:
        """Record that ``worker_id`` holds ``version`` with its own hash ``checksum_loaded``
        (``proof``: the other ``WorkerAck`` fields, e.g. its probe)."""
        if not isinstance(worker_id, str) or not _WORKER_RE.match(worker_id):
            raise RegistryError(f"worker id {worker_id!r} must match {_WORKER_RE.pattern}")
        self.path(version)
        ack = WorkerAck(worker_id, version, checksum_loaded, time.time(), **proof)
        folder = self.root / "acks" / version
        folder.mkdir(exist_ok=True)
        atomic_write_bytes(folder / f"{worker_id}.json",
                           canonical_json(asdict(ack)).encode())
        return ack

    def require_all_worker_checksums(self, version: str,
                                     workers: Iterable[str]) -> dict[str, WorkerAck]:
        """Check every worker acked ``version`` with the manifest's ``weight_checksum``.

        Raises ``MissingAckError`` for a worker without an ack and ``ChecksumMismatchError``
        naming each worker that reported another checksum.
        """
        expected = self.manifest(version).weight_checksum
        acks: dict[str, WorkerAck] = {}
        for worker in workers:
            try:
                data = json.loads((self.root / "acks" / version / f"{worker}.json").read_text())
            except FileNotFoundError:
                raise MissingAckError(f"worker {worker!r} has not acked {version}") from None
            for key in ("probe_ids", "probe_logprobs"):
                if data.get(key) is not None:
                    data[key] = tuple(data[key])
            acks[worker] = WorkerAck(**data)
        bad = sorted(w for w, a in acks.items() if a.checksum_loaded != expected)
        if bad:
            raise ChecksumMismatchError(f"{version}: workers {bad} loaded other weights than "
                                        f"{expected}")
        return acks


# ----------------------------------------------------------------------------- helpers
def _manifest_for(template: PolicyManifest, version: str, checksum: str,
                  kind: WeightsKind) -> PolicyManifest:
    if kind == "full":
        return template.with_weights(version, checksum)
    base = template.base_weight_checksum
    if base is None:
        raise RegistryError("staging an adapter needs manifest_template.base_weight_checksum")
    return template.with_weights(version, combine_checksums(base, checksum),
                                 adapter_checksum=checksum)


def _recorded_checksum(folder: Path) -> str:
    """A version folder's ``checksum`` file; ``ChecksumMismatchError`` naming it if unreadable."""
    try:
        return (folder / "checksum").read_text("utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ChecksumMismatchError(f"{folder / 'checksum'}: cannot be read ({exc})") from None


def _read_json(path: Path) -> Any:
    """A registry file's JSON; ``RegistryError`` naming the file if unreadable or not JSON."""
    try:
        return json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise RegistryError(f"{path}: cannot be read as JSON ({exc})") from None


def _clear_staging(staging: Path) -> None:
    """Delete what a crashed stage left behind (one stager per registry is assumed)."""
    for leftover in staging.iterdir():
        shutil.rmtree(leftover, ignore_errors=True)


def _kind_of(folder: Path) -> WeightsKind:
    present = [k for k, name in _FILES.items() if (folder / name).is_file()]
    if len(present) != 1:
        raise ChecksumMismatchError(f"{folder}: expected exactly one weights file")
    return "full" if present[0] == "full" else "adapter"


def _verify_folder(folder: Path, recorded: str) -> dict[str, torch.Tensor]:
    """Load the folder's tensors and check their checksum equals ``recorded``."""
    data = (folder / _FILES[_kind_of(folder)]).read_bytes()
    try:
        tensors = load_safetensors(data)
    except Exception as exc:  # safetensors raises its own error type for corrupt headers
        raise ChecksumMismatchError(f"{folder}: unreadable weights ({exc})") from None
    actual = state_dict_checksum(tensors)
    if actual != recorded:
        raise ChecksumMismatchError(f"{folder}: weights checksum {actual} != {recorded}")
    return tensors
