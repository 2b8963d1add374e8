"""Train / held-out overlap audit (docs/concepts.md, held-out evaluation;
``exact_and_semantic``).

A task's *fingerprint text* is its objective followed by its workspace files (sorted by path,
each prefixed by its path), normalized: lower-cased, every run of whitespace collapsed to one
space, digits kept; its *files text* is the same without the objective. The objective only poses
the workspace's breakage at a hint level, so the levels of one base task (same files, different
objectives) count as one task. Two checks run over every (train, held-out) pair:

- **exact**: equal sha256 of the normalized files text over *all* files (so a train task and a
  held-out task that differ only in hint level, or only in the objective's wording, are exact);
- **near-duplicate**: the larger of two Jaccard similarities of the sets of character
  ``SHINGLE_N``-grams, of the fingerprint texts and of the files texts, both without the
  *scaffold* files (default ``check.py``: the family's visible validator, shared by design
  across a family's templates), flagged at ``>= threshold`` (declared, default ``0.8``). The
  files-only similarity keeps a light edit posed at another hint level from hiding behind a
  different objective. Measured on the default sets (v2): two different tasks of one base
  template reach about 0.86, tasks of different templates of one family at most about 0.75.

The near-duplicate check is a lexical proxy for semantic overlap: it catches a held-out task that
is a light edit of a train task (renamed file, changed numbers), not a paraphrase. Template and
family sharing are reported beside it, templates by *base* name (``wrong-type.exact`` and
``wrong-type.symptom`` are one template): the default split is template-disjoint but not
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

from closedloop.envs.task_records import TaskBundle, TaskSpec
from closedloop.envs.terminal.families.base import base_template

DEDUP_RULE_VERSION = "v2"
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
    shared_templates: ``family/base`` names that occur in both sets (template leakage, at any
        hint levels).
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


def fingerprint_text(task: TaskSpec | TaskBundle, exclude: Collection[str] = (), *,
                     objective: bool = True) -> str:
    """The normalized text a task is compared by: its objective (unless ``objective=False``)
    and its files not in ``exclude``."""
    spec = _spec(task)
    parts = ([spec.objective] if objective else []) + [
        f"{p}\n{spec.initial_files[p]}" for p in sorted(spec.initial_files) if p not in exclude]
    return _WS.sub(" ", "\n".join(parts).lower()).strip()


def exact_hash(task: TaskSpec | TaskBundle) -> str:
    """sha256 hex of the normalized files text (all files, no objective)."""
    return hashlib.sha256(fingerprint_text(task, objective=False).encode("utf-8")).hexdigest()


def similarity(a: TaskSpec | TaskBundle, b: TaskSpec | TaskBundle,
               scaffold_paths: Collection[str] = DEFAULT_SCAFFOLD) -> float:
    """The near-duplicate similarity: max of the shingle Jaccards with and without objectives."""
    return max(jaccard(shingles(fingerprint_text(a, scaffold_paths, objective=o)),
                       shingles(fingerprint_text(b, scaffold_paths, objective=o)))
               for o in (True, False))


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
    """Compare every (train, held-out) pair by exact files hash and ``similarity``."""
    scaffold = tuple(sorted(scaffold_paths))

    def prints(t: TaskSpec | TaskBundle) -> tuple[str, str, tuple[frozenset[str], ...]]:
        return (_spec(t).task_id, exact_hash(t),
                tuple(shingles(fingerprint_text(t, scaffold, objective=o)) for o in (True, False)))

    tr = [prints(t) for t in train]
    ho = [prints(t) for t in heldout]
    exact: list[OverlapPair] = []
    near: list[OverlapPair] = []
    best = 0.0
    for t_id, t_hash, t_sh in tr:
        for h_id, h_hash, h_sh in ho:
            sim = 1.0 if t_hash == h_hash else max(
                jaccard(x, y) for x, y in zip(t_sh, h_sh, strict=True))
            best = max(best, sim)
            if t_hash == h_hash:
                exact.append(OverlapPair(t_id, h_id, sim))
            elif sim >= threshold:
                near.append(OverlapPair(t_id, h_id, sim))
    shared = sorted({f"{s.family}/{base_template(s.template)}" for s in map(_spec, train)}
                    & {f"{s.family}/{base_template(s.template)}" for s in map(_spec, heldout)})
    families = sorted({s.family for s in map(_spec, train)}
                      & {s.family for s in map(_spec, heldout)})
    return OverlapReport(exact_pairs=tuple(exact), near_pairs=tuple(near), max_similarity=best,
                         threshold=threshold, n_train=len(train), n_heldout=len(heldout),
                         shared_templates=tuple(shared), shared_families=tuple(families),
                         scaffold_paths=scaffold)
