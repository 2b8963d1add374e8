"""Atomic trainer checkpoints: weights, optimizer, RNG and the consumed group ids, together.

Exactly-once groups (docs/concepts.md): consumed_group_ids + optimizer_step +
output_policy_version commit atomically in the trainer checkpoint. One checkpoint is one directory::

    <dir>/step-000012/model.safetensors   model state dict
    <dir>/step-000012/optimizer.safetensors  optimizer state dict (closedloop.learn.optimizer_codec:
                                          its tensors flat, its structure as JSON)
    <dir>/step-000012/rng.pt              RNG states (see capture_rng_states)
    <dir>/step-000012/checkpoint.json     step, output_policy_version, consumed_group_ids,
                                          extra, sha256 of every file, and its own hash
    <dir>/LATEST                          {"step", "path"}: a convenience pointer

Write protocol: every file goes into ``<dir>/.tmp-step-000012-*`` and is fsynced (written
around the page cache where the file system allows: ``closedloop.policy.uncached_write``),
``checkpoint.json`` last; the temporary directory is fsynced and renamed to ``step-000012``
(the commit point: a rename is atomic), the parent is fsynced, then ``LATEST`` is replaced
atomically and checkpoints older than the last ``keep_last`` are removed (renamed aside first).

Read protocol: :func:`load_latest` takes the ``step-*`` directories from the highest step down
and returns the first whose manifest and file hashes verify; temporary directories are never
read. ``LATEST`` may lag one step behind after a crash between the rename and its update, so it
is never trusted over a verified newer directory. See ``closedloop.rollout.ledger`` for how the
checkpoint and the group ledger stay exactly-once across crashes.

Fault injection for tests: the environment variable ``CLOSEDLOOP_TEST_CHECKPOINT_PAUSE_S``
(seconds, read at call time) makes :func:`save_checkpoint` sleep after each file it writes.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_safetensors

from closedloop.contracts.hashing import canonical_json, content_hash
from closedloop.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
)
from closedloop.learn.optimizer_codec import decode_optimizer_state, encode_optimizer_state
from closedloop.policy.registry import (
    atomic_write_bytes,
    fsync_dir,
    state_dict_checksum,
    tensors_to_bytes,
)
from closedloop.policy.uncached_write import write_uncached

__all__ = [
    "CHECKPOINT_FORMAT",
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "capture_rng_states",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest",
    "restore_rng_states",
    "save_checkpoint",
]

CHECKPOINT_FORMAT = "closedloop-checkpoint-v2"
_FILES = {
    # format -> (the optimizer's file, its reader); v1 checkpoints (optimizer state pickled
    # by torch.save) still load
    "closedloop-checkpoint-v1": ("optimizer.pt",
                                 lambda b: torch.load(io.BytesIO(b), weights_only=True)),
    CHECKPOINT_FORMAT: ("optimizer.safetensors", decode_optimizer_state),
}
PAUSE_ENV = "CLOSEDLOOP_TEST_CHECKPOINT_PAUSE_S"
_MANIFEST = "checkpoint.json"
_STEP_RE = re.compile(r"^step-(\d{6,})$")
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    """One verified checkpoint, loaded.

    ``consumed_group_ids`` is cumulative: every group applied up to and including ``step``.
    ``model_checksum`` is ``state_dict_checksum(model_state)`` (the registry's recipe).
    """

    path: Path
    step: int
    output_policy_version: str
    consumed_group_ids: frozenset[str]
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    rng_states: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    model_checksum: str = ""
    created_at: float = 0.0


# ----------------------------------------------------------------------------- save
def save_checkpoint(
    directory: str | Path,
    step: int,
    model_state: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, Any],
    output_policy_version: str,
    consumed_group_ids: Iterable[str],
    rng_states: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    *,
    keep_last: int = 3,
    model_checksum: str | None = None,
    model_bytes: bytes | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically and return its directory.

    ``consumed_group_ids`` must be cumulative (all groups applied so far); ``extra`` must be
    JSON. ``model_checksum``: ``state_dict_checksum(model_state)`` when the caller has just
    computed it from these very tensors (else it is computed here); ``model_bytes``: their
    safetensors bytes when already serialized (``closedloop.policy.registry.prepare_weights``,
    written as ``model.safetensors``). Raises
    ``CheckpointExistsError`` when a valid checkpoint at ``step`` or later exists (a corrupt
    one in the way is moved aside). Assumes a single writer per ``directory``: leftover
    temporary directories of a crashed writer are deleted.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be an int >= 0, got {step!r}")
    if keep_last < 1:
        raise CheckpointError("keep_last must be >= 1")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(root)
    _clear_the_way(root, step)
    name = f"step-{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    try:
        manifest = _write_files(
            tmp,
            step,
            model_state,
            optimizer_state,
            output_policy_version,
            consumed_group_ids,
            rng_states,
            extra,
            model_checksum,
            model_bytes,
        )
        fsync_dir(tmp)
        os.rename(tmp, root / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(root)
    _pause()
    atomic_write_bytes(
        root / "LATEST",
        canonical_json(
            {"step": step, "path": name, "manifest_hash": manifest["self_hash"]}
        ).encode(),
    )
    _prune(root, keep_last)
    return root / name


def _write_files(
    tmp: Path,
    step: int,
    model_state: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, Any],
    output_policy_version: str,
    consumed_group_ids: Iterable[str],
    rng_states: Mapping[str, Any] | None,
    extra: Mapping[str, Any] | None,
    model_checksum: str | None,
    model_bytes: bytes | None,
) -> dict[str, Any]:
    payloads = {
        "model.safetensors": tensors_to_bytes(model_state) if model_bytes is None else model_bytes,
        _FILES[CHECKPOINT_FORMAT][0]: _optimizer_bytes(optimizer_state),
        "rng.pt": _torch_bytes(dict(rng_states or {})),
    }
    hashes: dict[str, str] = {}
    for fname, data in payloads.items():
        write_uncached(tmp / fname, data)
        hashes[fname] = "sha256:" + hashlib.sha256(data).hexdigest()
        _pause()
    manifest: dict[str, Any] = {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "output_policy_version": output_policy_version,
        "consumed_group_ids": sorted(set(consumed_group_ids)),
        "model_checksum": model_checksum or state_dict_checksum(model_state),
        "files": hashes,
        "extra": dict(extra or {}),
        "created_at": time.time(),
    }
    manifest["self_hash"] = content_hash(manifest)
    write_uncached(tmp / _MANIFEST, canonical_json(manifest).encode())
    _pause()
    return manifest


def _optimizer_bytes(state: Mapping[str, Any]) -> bytes:
    try:
        return encode_optimizer_state(dict(state))
    except TypeError as exc:
        raise CheckpointError(str(exc)) from None


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _pause() -> None:
    seconds = os.environ.get(PAUSE_ENV)
    if seconds:
        time.sleep(float(seconds))


def _remove_leftovers(root: Path) -> None:
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith((".tmp-", ".trash-")):
            shutil.rmtree(p, ignore_errors=True)


def _clear_the_way(root: Path, step: int) -> None:
    for other_step, path in _step_dirs(root):
        if other_step < step:
            continue
        try:
            load_checkpoint(path, tensors=False)
        except CheckpointCorruptError:
            _log.warning("moving corrupt checkpoint %s aside", path)
            _remove(path)
            continue
        raise CheckpointExistsError(
            f"a valid checkpoint {path.name} exists; refusing to write step {step}"
        )


def _prune(root: Path, keep_last: int) -> None:
    dirs = _step_dirs(root)
    for _, path in dirs[:-keep_last]:
        _remove(path)


def _remove(path: Path) -> None:
    """Rename aside (atomic), then delete: a crash never leaves a half-deleted step dir."""
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    os.rename(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


# ----------------------------------------------------------------------------- load
def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    out = []
    for p in root.iterdir() if root.is_dir() else ():
        match = _STEP_RE.match(p.name)
        if match and p.is_dir():
            out.append((int(match.group(1)), p))
    return sorted(out)


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Return the committed ``step-*`` directories in step order (not verified)."""
    return [p for _, p in _step_dirs(Path(directory))]


def load_checkpoint(path: str | Path, *, tensors: bool = True) -> Checkpoint:
    """Load and verify one checkpoint directory; ``CheckpointCorruptError`` on any mismatch.

    With ``tensors=False`` only the manifest and file hashes are checked and the returned
    states are empty (cheap validation).
    """
    folder = Path(path)
    manifest = _read_manifest(folder)
    blobs: dict[str, bytes] = {}
    for fname, expected in manifest["files"].items():
        try:
            data = (folder / fname).read_bytes()
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{folder}: {fname} is missing") from None
        if "sha256:" + hashlib.sha256(data).hexdigest() != expected:
            raise CheckpointCorruptError(f"{folder}: {fname} does not match its hash")
        blobs[fname] = data
    model: dict[str, torch.Tensor] = {}
    optimizer: dict[str, Any] = {}
    rng: dict[str, Any] = {}
    if tensors:
        model = load_safetensors(blobs["model.safetensors"])
        opt_file, read_optimizer = _FILES[manifest["format"]]
        try:
            optimizer = read_optimizer(blobs[opt_file])
        except ValueError as exc:
            raise CheckpointCorruptError(f"{folder}: {opt_file}: {exc}") from None
        rng = torch.load(io.BytesIO(blobs["rng.pt"]), weights_only=True)
        if state_dict_checksum(model) != manifest["model_checksum"]:
            raise CheckpointCorruptError(f"{folder}: model checksum mismatch")
    return Checkpoint(
        path=folder,
        step=manifest["step"],
        output_policy_version=manifest["output_policy_version"],
        consumed_group_ids=frozenset(manifest["consumed_group_ids"]),
        model_state=model,
        optimizer_state=optimizer,
        rng_states=rng,
        extra=manifest["extra"],
        model_checksum=manifest["model_checksum"],
        created_at=manifest["created_at"],
    )


def _read_manifest(folder: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((folder / _MANIFEST).read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptError(f"{folder}: no readable {_MANIFEST} ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in _FILES:
        raise CheckpointCorruptError(f"{folder}: not a {CHECKPOINT_FORMAT} manifest")
    body = {k: v for k, v in manifest.items() if k != "self_hash"}
    if content_hash(body) != manifest.get("self_hash"):
        raise CheckpointCorruptError(f"{folder}: {_MANIFEST} does not match its own hash")
    if folder.name != f"step-{manifest['step']:06d}":
        raise CheckpointCorruptError(f"{folder}: directory name disagrees with step")
    if set(manifest["files"]) != {"model.safetensors", _FILES[manifest["format"]][0], "rng.pt"}:
        raise CheckpointCorruptError(f"{folder}: unexpected file list")
    return manifest


def load_latest(directory: str | Path) -> Checkpoint | None:
    """Return the newest checkpoint that verifies, or ``None`` when there is none.

    Corrupt or partial directories are skipped with a warning; temporary directories of an
    interrupted write are ignored.
    """
    for _, path in reversed(_step_dirs(Path(directory))):
        try:
            return load_checkpoint(path)
        except CheckpointCorruptError as exc:
            _log.warning("skipping checkpoint: %s", exc)
    return None


# ----------------------------------------------------------------------------- RNG
def capture_rng_states(generators: Mapping[str, torch.Generator] | None = None
                       ) -> dict[str, Any]:
    """Return the Python, NumPy, torch CPU (and CUDA, where present) RNG states and those of
    the named ``generators`` (e.g. the policy's sampler), in a ``weights_only``-loadable form."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.array(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
        "generators": {name: g.get_state() for name, g in (generators or {}).items()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["torch_cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: Mapping[str, Any],
                       generators: Mapping[str, torch.Generator] | None = None) -> None:
    """Restore RNG states captured by :func:`capture_rng_states`, ``generators`` included.

    ``CheckpointError`` when a generator asked for has no saved state.
    """
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    n = states["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"])
    )
    torch.set_rng_state(states["torch"])
    if "torch_cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["torch_cuda"])
    saved = states.get("generators", {})
    for name, g in (generators or {}).items():
        if name not in saved:
            raise CheckpointError(f"the checkpoint holds no state of the {name!r} generator")
        g.set_state(saved[name])
