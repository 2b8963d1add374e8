"""Task catalogs of the simulated environments: versioned families, content-hashed task ids.

A family (``SimFamily``) has a versioned id (``keydoor-v1``), templates each assigned to a split
(``train`` or ``heldout``: the two sets are template-disjoint), optionally the number of valid
indices of each template (``index_space``; default ``INDEX_SPACE``), and a pure
``build(template, index, rng)`` that returns a ``TaskDraft``: the objective shown to the
model, the public data the environment materializes, the hidden data only the verifier reads,
and the time budget.

A task id ``family/template/NNN-hash8`` names its generator inputs; ``hash8`` is the content hash
of the draft. ``TaskCatalog.task`` parses an id, regenerates the task (memoized) and checks the
hash, so an id from an older generator is a ``TaskError``, never silently a different task.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from closedloop.contracts import canonical_json, content_hash
from closedloop.envs.task_records import Split
from closedloop.errors import TaskError

_ID_RE = re.compile(r"^(?P<family>[a-z0-9-]+)/(?P<template>[a-z0-9-]+)/(?P<index>\d{3,})-"
                    r"(?P<digest>[0-9a-f]{8})$")


@dataclass(frozen=True)
class TaskDraft:
    """A generated task before it has an id (every value is JSON)."""

    objective: str
    public: Mapping[str, Any]
    hidden: Mapping[str, Any]
    budget: int


@dataclass(frozen=True)
class SimTask:
    """A task: its id, family, template, split, the draft's content and its index."""

    task_id: str
    family: str
    template: str
    index: int
    split: Split
    objective: str
    public: Mapping[str, Any]
    hidden: Mapping[str, Any]
    budget: int


Builder = Callable[[str, int, random.Random], TaskDraft]
INDEX_SPACE = 1000


@dataclass(frozen=True)
class SimFamily:
    """A versioned task family: templates by split, a pure builder, each template's indices.

    index_space: template -> number of valid indices (``0..n-1``); ``None``: ``INDEX_SPACE``.
    """

    family_id: str
    templates: Mapping[str, Split]
    build: Builder
    index_space: Callable[[str], int] | None = None

    def indices(self, template: str) -> int:
        """How many indices ``template`` has."""
        return INDEX_SPACE if self.index_space is None else self.index_space(template)

    def __post_init__(self) -> None:
        if not re.match(r"^[a-z0-9-]+-v\d+$", self.family_id):
            raise TaskError(f"family id {self.family_id!r} must be versioned (name-vN)")
        if not set(self.templates.values()) <= {"train", "heldout"}:
            raise TaskError(f"family {self.family_id!r}: template splits must be train/heldout")


def make_task_id(family: str, template: str, index: int, draft: TaskDraft) -> str:
    """``family/template/NNN-hash8``, the hash over the draft's canonical content."""
    digest = content_hash({"family": family, "template": template, "index": index,
                           "objective": draft.objective, "public": draft.public,
                           "hidden": draft.hidden, "budget": draft.budget})
    return f"{family}/{template}/{index:03d}-{digest.split(':', 1)[1][:8]}"


class TaskCatalog:
    """The tasks of one environment: lookup by id and the default train / held-out sets.

    per_template: how many indices (0, 1, ...) of each template the default sets hold.
    """

    def __init__(self, families: Sequence[SimFamily], per_template: int) -> None:
        if per_template < 1:
            raise TaskError("per_template must be >= 1")
        self.families: dict[str, SimFamily] = {f.family_id: f for f in families}
        self.per_template = per_template
        self._generate = lru_cache(maxsize=4096)(self._build)

    def _build(self, family_id: str, template: str, index: int) -> SimTask:
        family = self.families.get(family_id)
        if family is None:
            raise TaskError(f"unknown task family {family_id!r}; known: {sorted(self.families)}")
        split = family.templates.get(template)
        if split is None:
            raise TaskError(f"family {family_id!r} has no template {template!r}")
        if not 0 <= index < family.indices(template):
            raise TaskError(f"{family_id}/{template} has indices 0..{family.indices(template) - 1}"
                            f", not {index}")
        rng = random.Random(f"{family_id}/{template}/{index}")
        draft = family.build(template, index, rng)
        canonical_json([draft.public, draft.hidden])  # JSON values only, or TypeError here
        task_id = make_task_id(family_id, template, index, draft)
        return SimTask(task_id, family_id, template, index, split, draft.objective,
                       draft.public, draft.hidden, draft.budget)

    def generate(self, family: str, template: str, index: int) -> SimTask:
        """Task ``index`` of ``family``/``template`` (deterministic, memoized)."""
        return self._generate(family, template, index)

    def task(self, task_id: str) -> SimTask:
        """The task with this id; ``TaskError`` if malformed, unknown, or from another build."""
        m = _ID_RE.match(task_id) if isinstance(task_id, str) else None
        if m is None:
            raise TaskError(f"malformed task id {task_id!r}")
        task = self.generate(m["family"], m["template"], int(m["index"]))
        if task.task_id != task_id:
            raise TaskError(f"task id {task_id!r} does not match the current generator "
                            f"(it now yields {task.task_id!r})")
        return task

    def task_ids(self, split: Split) -> tuple[str, ...]:
        """The default set of ``split``: indices 0..per_template-1 of its templates (fewer where
        a template has fewer)."""
        if split not in ("train", "heldout"):
            raise TaskError(f"split must be 'train' or 'heldout', got {split!r}")
        return tuple(self.generate(f.family_id, template, i).task_id
                     for f in self.families.values()
                     for template, s in f.templates.items() if s == split
                     for i in range(min(self.per_template, f.indices(template))))
