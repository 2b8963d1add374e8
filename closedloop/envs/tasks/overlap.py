"""Train / held-out overlap audit (seed 000 §8.5 EvalFirewall, ``exact_and_semantic``).

A task's *fingerprint text* is its objective followed by workspace files (sorted by path, each
prefixed by its path), normalized: lower-cased, every run of whitespace collapsed to one space,
digits kept. Two checks run over every (train, held-out) pair:

- **exact**: equal sha256 of the normalized text over *all* files;
- **near-duplicate**: Jaccard similarity of the sets of character ``SHINGLE_N``-grams of the
  normalized text without the *scaffold* files (default ``check.py``: the family's visible
  validator, shared by design across a family's templates), flagged at ``>= threshold``
  (declared, default ``0.8``). Measured on the default sets: two tasks of one template reach
  about 0.88, tasks of different templates of one family at most about 0.61.

The near-duplicate check is a lexical proxy for semantic overlap: it catches a held-out task that
is a light edit of a train task (renamed file, changed numbers), not a paraphrase. Template and
family sharing are reported beside it: the default split is template-disjoint but not
family-disjoint (every family has train and held-out templates). ``dedup_rule_version`` names
this rule; change it whenever normalization, scaffold, ``SHINGLE_N`` or the threshold change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from closedloop.envs.task import TaskBundle, TaskSpec

DEDUP_RULE_VERSION = "v1"
SHINGLE_N = 5
DEFAULT_THRESHOLD = 0.8
DEFAULT_SCAFFOLD: tuple[str, ...] = ("check.py",)
_WS = re.compile(r"\s+")


@dataclass(frozen=True)
class OverlapPair:
    """One flagged (train, held-out) pair and its shingle Jaccard similarity."""

    train_id: str
    heldout_id: str
    similarity: float


@dataclass(frozen=True)
class OverlapReport:
    """The audit result; the split is clean when ``exact_pairs`` and ``near_pairs`` are empty.

    max_similarity: the largest Jaccard similarity over all pairs (0.0 if a set is empty).
    shared_templates: ``family/template`` names that occur in both sets (template leakage).
    shared_families: family ids that occur in both sets (reported; not a leak by this rule).
    """

    exact_pairs: tuple[OverlapPair, ...]
    near_pairs: tuple[OverlapPair, ...]
    max_similarity: float
    threshold: float
    n_train: int
    n_heldout: int
    shared_templates: tuple[str, ...]
    shared_families: tuple[str, ...]
    scaffold_paths: tuple[str, ...]
    dedup_rule_version: str = DEDUP_RULE_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (pairs as objects), with ``disjoint``."""
        return {**dataclasses.asdict(self), "disjoint": self.disjoint}

    @property
    def disjoint(self) -> bool:
        """True when no exact pair, no near pair and no shared template was found."""
        return not (self.exact_pairs or self.near_pairs or self.shared_templates)


def _spec(task: TaskSpec | TaskBundle) -> TaskSpec:
    return task.spec if isinstance(task, TaskBundle) else task


def fingerprint_text(task: TaskSpec | TaskBundle, exclude: Collection[str] = ()) -> str:
    """The normalized text a task is compared by (objective + files not in ``exclude``)."""
    spec = _spec(task)
    parts = [spec.objective] + [f"{p}\n{spec.initial_files[p]}"
                                for p in sorted(spec.initial_files) if p not in exclude]
    return _WS.sub(" ", "\n".join(parts).lower()).strip()


def exact_hash(task: TaskSpec | TaskBundle) -> str:
    """sha256 hex of the fingerprint text."""
    return hashlib.sha256(fingerprint_text(task).encode("utf-8")).hexdigest()


def shingles(text: str, n: int = SHINGLE_N) -> frozenset[str]:
    """The set of character ``n``-grams of ``text`` (the text itself if shorter than ``n``)."""
    if len(text) <= n:
        return frozenset({text})
    return frozenset(text[i:i + n] for i in range(len(text) - n + 1))


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    """|a & b| / |a | b|; 1.0 for two empty sets."""
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def audit_overlap(train: Sequence[TaskSpec | TaskBundle], heldout: Sequence[TaskSpec | TaskBundle],
                  threshold: float = DEFAULT_THRESHOLD,
                  scaffold_paths: Collection[str] = DEFAULT_SCAFFOLD) -> OverlapReport:
    """Compare every (train, held-out) pair by exact hash and shingle Jaccard."""
    scaffold = tuple(sorted(scaffold_paths))
    tr = [(_spec(t).task_id, exact_hash(t), shingles(fingerprint_text(t, scaffold)))
          for t in train]
    ho = [(_spec(t).task_id, exact_hash(t), shingles(fingerprint_text(t, scaffold)))
          for t in heldout]
    exact: list[OverlapPair] = []
    near: list[OverlapPair] = []
    best = 0.0
    for t_id, t_hash, t_sh in tr:
        for h_id, h_hash, h_sh in ho:
            sim = 1.0 if t_hash == h_hash else jaccard(t_sh, h_sh)
            best = max(best, sim)
            if t_hash == h_hash:
                exact.append(OverlapPair(t_id, h_id, sim))
            elif sim >= threshold:
                near.append(OverlapPair(t_id, h_id, sim))
    shared = sorted({f"{s.family}/{s.template}" for s in map(_spec, train)}
                    & {f"{s.family}/{s.template}" for s in map(_spec, heldout)})
    families = sorted({s.family for s in map(_spec, train)}
                      & {s.family for s in map(_spec, heldout)})
    return OverlapReport(exact_pairs=tuple(exact), near_pairs=tuple(near), max_similarity=best,
                         threshold=threshold, n_train=len(train), n_heldout=len(heldout),
                         shared_templates=tuple(shared), shared_families=tuple(families),
                         scaffold_paths=scaffold)
