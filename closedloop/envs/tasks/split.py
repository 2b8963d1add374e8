"""Train / held-out task sets, split by template, with a solvability filter (seed 003).

Each family assigns its templates to ``train`` or ``heldout`` (``TaskFamily.heldout_templates``),
so the two sets are template-disjoint: held-out success measures transfer to a kind of breakage
never trained on, not recall of a few changed numbers (seed 000 §7, ``template_disjoint``).

``build_task_sets`` fills each split's quota balanced over families (remainders go to the first
families in ``FAMILY_IDS`` order), then over each family's templates of that split. Candidate
indices of a template are a seeded permutation; each candidate passes the *solvability filter*
(replay the gold actions through the real environment and grade the final state; the untouched
initial state must fail) or is discarded with its reason and replaced by the next candidate, at
most ``max_attempts_factor`` times the quota per template. A template that cannot fill its quota
leaves its split short; the shortfall is visible as ``TaskSets.shortfall``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from closedloop.envs.task import Split, TaskBundle
from closedloop.envs.tasks.base import TaskFamily, build_bundle
from closedloop.envs.tasks.registry import FAMILIES

SolvabilityFilter = Callable[[TaskBundle], str | None]
"""Return ``None`` if the task is solvable and well-posed, else the reason to discard it."""

INDEX_SPACE = 10_000


@dataclass(frozen=True)
class DiscardedTask:
    """A candidate the solvability filter rejected."""

    task_id: str
    split: Split
    reason: str


@dataclass(frozen=True)
class TaskSets:
    """The train and held-out task sets and what the filter discarded on the way.

    requested: (train, heldout) sizes asked for; ``shortfall`` says how many are missing.
    """

    train: tuple[TaskBundle, ...]
    heldout: tuple[TaskBundle, ...]
    discarded: tuple[DiscardedTask, ...]
    seed: int
    requested: tuple[int, int]

    @property
    def train_ids(self) -> tuple[str, ...]:
        """Ids of the train tasks."""
        return tuple(b.spec.task_id for b in self.train)

    @property
    def heldout_ids(self) -> tuple[str, ...]:
        """Ids of the held-out tasks."""
        return tuple(b.spec.task_id for b in self.heldout)

    @property
    def shortfall(self) -> tuple[int, int]:
        """(train, heldout) tasks missing from the requested sizes."""
        return (self.requested[0] - len(self.train), self.requested[1] - len(self.heldout))


def _spread(total: int, n: int) -> list[int]:
    """Split ``total`` into ``n`` near-equal parts, larger parts first."""
    base, rem = divmod(total, n)
    return [base + (1 if i < rem else 0) for i in range(n)]


def template_quotas(families: Sequence[TaskFamily], split: Split,
                    total: int) -> list[tuple[TaskFamily, str, int]]:
    """Return (family, template, quota) for ``split``, balanced over families then templates."""
    eligible = [f for f in families
                if any((t in f.heldout_templates) == (split == "heldout") for t in f.templates)]
    if not eligible:
        return []
    out: list[tuple[TaskFamily, str, int]] = []
    for family, fam_quota in zip(eligible, _spread(total, len(eligible)), strict=True):
        templates = [t for t in family.templates
                     if (t in family.heldout_templates) == (split == "heldout")]
        for template, quota in zip(templates, _spread(fam_quota, len(templates)), strict=True):
            out.append((family, template, quota))
    return out


def candidate_indices(seed: int, family_id: str, template: str, n: int) -> list[int]:
    """The first ``n`` candidate indices of a template for ``seed`` (a seeded permutation)."""
    rng = random.Random(f"task-sets/{seed}/{family_id}/{template}")
    return rng.sample(range(INDEX_SPACE), n)


def _fill(family: TaskFamily, template: str, quota: int, split: Split, seed: int,
          solvable: SolvabilityFilter, factor: int) -> tuple[list[TaskBundle],
                                                             list[DiscardedTask]]:
    kept: list[TaskBundle] = []
    dropped: list[DiscardedTask] = []
    for index in candidate_indices(seed, family.family_id, template, quota * factor):
        if len(kept) == quota:
            break
        bundle = build_bundle(family, template, index)
        reason = solvable(bundle)
        if reason is None:
            kept.append(bundle)
        else:
            dropped.append(DiscardedTask(bundle.spec.task_id, split, reason))
    return kept, dropped


def build_task_sets(train_tasks: int = 48, heldout_tasks: int = 16, seed: int = 0, *,
                    families: Sequence[TaskFamily] | None = None,
                    solvability: SolvabilityFilter | None = None,
                    max_attempts_factor: int = 2) -> TaskSets:
    """Build template-disjoint train and held-out sets, filtered for solvability.

    families: defaults to the four registered families; solvability: defaults to
    ``closedloop.verify.check_solvable`` (gold replay through the real environment + grader).
    """
    fams = list(families) if families is not None else list(FAMILIES.values())
    if solvability is None:
        from closedloop.verify.verifier import check_solvable  # verify sits above envs

        solvability = check_solvable
    out: dict[str, list[TaskBundle]] = {"train": [], "heldout": []}
    discarded: list[DiscardedTask] = []
    splits: tuple[tuple[Split, int], ...] = (("train", train_tasks), ("heldout", heldout_tasks))
    for split, total in splits:
        for family, template, quota in template_quotas(fams, split, total):
            kept, dropped = _fill(family, template, quota, split, seed, solvability,
                                  max_attempts_factor)
            out[split].extend(kept)
            discarded.extend(dropped)
    return TaskSets(train=tuple(out["train"]), heldout=tuple(out["heldout"]),
                    discarded=tuple(discarded), seed=seed, requested=(train_tasks, heldout_tasks))


@lru_cache(maxsize=1)
def default_task_sets() -> TaskSets:
    """The default 48/16 sets (seed 0), built and filtered once per process."""
    return build_task_sets()
