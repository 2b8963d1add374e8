"""``SnapshotBook``: the snapshot, restore, fork and sealing bookkeeping of an env whose states
are immutable records (``TerminalRepairEnv``, ``SimEnv``), per the transition contract
(``closedloop.contracts.transition``).

One book belongs to one env and holds:

- the entries, snapshot id -> immutable ``SnapshotEntry``, shared with the env's forks
  (``branch``) and replaced by a new, empty map at ``reset``, so snapshots belong to one
  episode and its forks;
- the head: the snapshot last captured or restored, the parent of the next one;
- the sealed terminal reference, set by ``seal`` when the episode ends and cleared by
  ``restore``.

A snapshot id is ``"snap-"`` + the first 32 hex digits of the content hash of
``{"parent", "state", "rng", "label"}`` (the head, the state and RNG hashes and the label; with
``"sealed"`` too where the env's ids name it), so re-capturing a state is a no-op. A sealed
entry keeps the terminal state's bytes and their sha256, never a live state: it is never
restored or forked (``SealedSnapshotError``), and ``export_sealed`` returns its bytes only after
the sha256 and the env's own check against the reference pass. ``restore`` refuses a reference
that differs from the stored one, a foreign ``env_version``, and a stored state whose content,
rehashed by the env, no longer gives the reference's hashes (``SnapshotMismatchError``).

``BookedEnv`` is the part of such an env that only delegates to its book: a fork's placement
(a new env on ``branch()`` of the book, restored to the snapshot and labelled) and the sealed
terminal's reference and bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from closedloop.contracts import SnapshotRef, content_hash, sha256_hex
from closedloop.errors import (
    ContractError,
    EpisodeDoneError,
    EpisodeNotDoneError,
    SealedSnapshotError,
    SnapshotMismatchError,
    UnknownSnapshotError,
)


class BookState(Protocol):
    """What a book needs of an env's immutable state."""

    @property
    def env_version(self) -> str:
        """The env version that produced the state."""
        ...

    @property
    def state_hash(self) -> str:
        """The content hash of the state (``SnapshotRef.state_hash``)."""
        ...

    @property
    def rng_hash(self) -> str:
        """The content hash of the entropy sources (``SnapshotRef.rng_state_hash``)."""
        ...

    @property
    def done(self) -> bool:
        """Whether the episode has ended."""
        ...

    def to_bytes(self) -> bytes:
        """The canonical bytes of the state (what ``export_state`` returns)."""
        ...


S = TypeVar("S", bound=BookState)


@dataclass(frozen=True)
class SnapshotEntry(Generic[S]):
    """One stored snapshot: a live ``state``, or a sealed terminal's bytes and their sha256."""

    ref: SnapshotRef
    state: S | None = None
    sealed_bytes: bytes | None = None
    sealed_bytes_hash: str | None = None


class SnapshotBook(Generic[S]):
    """The snapshot bookkeeping of one env (see the module docstring).

    ``rehash(state)`` recomputes (state hash, RNG hash) from the state's content, bypassing
    any cache; ``check_sealed(ref, data)`` raises ``SnapshotMismatchError`` unless ``data``
    decodes to the state ``ref`` names; ``seal_in_id`` puts the sealed flag into snapshot ids.
    """

    def __init__(self, env_version: str, rehash: Callable[[S], tuple[str, str]],
                 check_sealed: Callable[[SnapshotRef, bytes], object], *,
                 seal_in_id: bool = False,
                 entries: dict[str, SnapshotEntry[S]] | None = None) -> None:
        self.env_version = env_version
        self._rehash = rehash
        self._check_sealed = check_sealed
        self._seal_in_id = seal_in_id
        self._entries: dict[str, SnapshotEntry[S]] = {} if entries is None else entries
        self.head: str | None = None
        self.sealed: SnapshotRef | None = None

    def reset(self) -> None:
        """Start a new episode: a new, empty entry map (forks keep the old one), no head."""
        self._entries = {}
        self.head = None
        self.sealed = None

    def branch(self) -> SnapshotBook[S]:
        """A book for a fork: the same entries, its own head and sealed reference."""
        return SnapshotBook(self.env_version, self._rehash, self._check_sealed,
                            seal_in_id=self._seal_in_id, entries=self._entries)

    def get(self, ref: SnapshotRef) -> SnapshotEntry[S]:
        """The entry of ``ref``; ``UnknownSnapshotError``, or a mismatch if its fields differ."""
        entry = self._entries.get(ref.snapshot_id)
        if entry is None:
            raise UnknownSnapshotError(f"snapshot {ref.snapshot_id!r} is not in this store")
        if entry.ref != ref:
            raise SnapshotMismatchError(f"snapshot {ref.snapshot_id!r}: the reference's fields "
                                        "differ from the stored snapshot's")
        return entry

    def __len__(self) -> int:
        return len(self._entries)

    def _ref(self, state: S, label: str, *, sealed: bool) -> SnapshotRef:
        if not isinstance(label, str):
            raise ContractError("snapshot label must be a string")
        fields: dict[str, object] = {"parent": self.head, "state": state.state_hash,
                                     "rng": state.rng_hash, "label": label}
        if self._seal_in_id:
            fields["sealed"] = sealed
        snapshot_id = "snap-" + content_hash(fields).split(":", 1)[1][:32]
        return SnapshotRef(snapshot_id, self.head, state.env_version, state.state_hash,
                           state.rng_hash, label)

    def _put(self, entry: SnapshotEntry[S]) -> None:
        self._entries.setdefault(entry.ref.snapshot_id, entry)  # ids are content-derived

    def snapshot(self, state: S, label: str) -> SnapshotRef:
        """Capture ``state`` (not a terminal one: it is sealed) and make it the head."""
        if state.done:
            raise EpisodeDoneError("the terminal state is sealed; use sealed_terminal()")
        ref = self._ref(state, label, sealed=False)
        self._put(SnapshotEntry(ref, state=state))
        self.head = ref.snapshot_id
        return ref

    def restore(self, ref: SnapshotRef) -> S:
        """The stored state of ``ref`` after re-checking its hashes; it becomes the head and
        nothing is sealed. Sealed snapshots raise ``SealedSnapshotError``."""
        entry = self.get(ref)
        if entry.sealed_bytes is not None or entry.state is None:
            raise SealedSnapshotError(f"snapshot {ref.snapshot_id!r} is a sealed terminal "
                                      "state; it is never restored into an agent-facing env")
        if ref.env_version != self.env_version:
            raise SnapshotMismatchError(f"snapshot env_version {ref.env_version!r} != "
                                        f"{self.env_version!r}")
        if self._rehash(entry.state) != (ref.state_hash, ref.rng_state_hash):
            raise SnapshotMismatchError(f"snapshot {ref.snapshot_id!r}: stored state hashes "
                                        "to a different value than the reference")
        self.head = ref.snapshot_id
        self.sealed = None
        return entry.state

    def seal(self, state: S) -> SnapshotRef:
        """Store the terminal ``state`` as sealed bytes (label ``terminal``); return its ref."""
        data = state.to_bytes()
        ref = self._ref(state, "terminal", sealed=True)
        self._put(SnapshotEntry(ref, sealed_bytes=data, sealed_bytes_hash=sha256_hex(data)))
        self.sealed = ref
        return ref

    def sealed_terminal(self) -> SnapshotRef:
        """The sealed snapshot of the ended episode (``EpisodeNotDoneError`` before the end)."""
        if self.sealed is None:
            raise EpisodeNotDoneError("the episode has not ended; nothing is sealed")
        return self.sealed

    def export_sealed(self, ref: SnapshotRef) -> bytes:
        """A sealed snapshot's bytes after checking their sha256 and content against ``ref``."""
        entry = self.get(ref)
        if entry.sealed_bytes is None or entry.sealed_bytes_hash is None:
            raise SnapshotMismatchError(f"snapshot {ref.snapshot_id!r} is not sealed")
        if sha256_hex(entry.sealed_bytes) != entry.sealed_bytes_hash:
            raise SnapshotMismatchError(f"sealed snapshot {ref.snapshot_id!r} bytes changed")
        self._check_sealed(ref, entry.sealed_bytes)
        return entry.sealed_bytes


class _Forkable(Protocol):
    """What ``BookedEnv.fork_from`` needs of the child env it places."""

    branch_id: str | None

    def restore(self, snapshot: SnapshotRef) -> None:
        """Return to a stored snapshot."""
        ...


E = TypeVar("E", bound=_Forkable)


class BookedEnv(Generic[S]):
    """Mixin of an env whose snapshots live in a ``SnapshotBook`` at ``self._store``: the
    fork placement and the sealing delegation of the transition contract, written once."""

    _store: SnapshotBook[S]

    def fork_from(self, make_child: Callable[[SnapshotBook[S]], E], snapshot: SnapshotRef,
                  branch_id: str) -> E:
        """``make_child(book)`` (a new env on a branch of this env's book) restored to
        ``snapshot`` and labelled ``branch_id``, which never changes the state or the RNG."""
        if not isinstance(branch_id, str):
            raise ContractError("branch_id must be a string")
        child = make_child(self._store.branch())
        child.restore(snapshot)
        child.branch_id = branch_id
        return child

    def sealed_terminal(self) -> SnapshotRef:
        """The sealed snapshot of the episode's terminal state (``EpisodeNotDoneError``
        before the end)."""
        return self._store.sealed_terminal()

    def export_sealed(self, ref: SnapshotRef) -> bytes:
        """A sealed snapshot's bytes after checking their sha256 and content against ``ref``."""
        return self._store.export_sealed(ref)
