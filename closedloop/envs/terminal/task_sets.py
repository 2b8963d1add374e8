"""Train / held-out task sets, split by template, with a solvability filter (docs/concepts.md,
held-out evaluation).

Each family assigns its templates to ``train`` or ``heldout`` (``TaskFamily.heldout_templates``),
so the two sets are template-disjoint: held-out success measures transfer to a kind of breakage
never trained on, not recall of a few changed numbers (``template_disjoint``).

Disjointness is at the *base* template level: a leveled template ``<base>.<level>`` is held
out iff its base is, so no kind of breakage is trained on at any hint level and evaluated at
another.

``build_task_sets`` fills each split's quota balanced over families (remainders go to the first
families in ``FAMILY_IDS`` order), then over each family's base templates of that split, then
over the split's hint levels (a base's remainder goes to the levels after those that got the
previous remainder, round-robin over the split, so small quotas still cover every level).
Candidate indices are a seeded permutation per *base* template, shared by its levels: the levels
of one base draw the same indices first, so their tasks are paired (same breakage, different
hint). Each candidate passes the *solvability filter* (replay the gold actions through the real
environment and grade the final state; the untouched initial state must fail) or is discarded
with its reason and replaced by the next candidate, at most ``max_attempts_factor`` times the
quota per leveled template. A template that cannot fill its quota leaves its split short; the
shortfall is visible as ``TaskSets.shortfall``.

``build_family_disjoint_set`` draws the family-disjoint held-out suite from
``registry.HELDOUT_FAMILIES`` (families never in ``FAMILIES``, so never trained on).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from closedloop.envs.task_records import Split, TaskBundle
from closedloop.envs.terminal.families.base import (
    HINT_LEVELS,
    TaskFamily,
    build_bundle,
    leveled_name,
    template_parts,
)
from closedloop.envs.terminal.families.registry import FAMILIES, HELDOUT_FAMILIES
from closedloop.envs.terminal.verifier import check_solvable
from closedloop.errors import UnknownTaskError

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


def _check_levels(levels: Sequence[str]) -> tuple[str, ...]:
    out = tuple(levels)
    bad = [lv for lv in out if lv not in HINT_LEVELS]
    if not out or bad or len(set(out)) != len(out):
        raise UnknownTaskError(f"hint levels must be distinct names from {HINT_LEVELS}, "
                               f"got {out}")
    return out


def template_quotas(families: Sequence[TaskFamily], split: Split, total: int,
                    levels: Sequence[str] = HINT_LEVELS) -> list[tuple[TaskFamily, str, int]]:
    """Return (family, template, quota) for ``split``: families, then bases, then levels.

    ``template`` is ``<base>.<level>`` for each of ``levels`` the family has; a base's
    remainder over the levels starts where the previous base's stopped (round-robin).
    """
    lv = _check_levels(levels)
    wanted = split == "heldout"
    eligible = [f for f in families if any((b in f.heldout_templates) == wanted
                                           for b in f.base_templates)]
    if not eligible:
        return []
    out: list[tuple[TaskFamily, str, int]] = []
    cursor = 0
    for family, fam_quota in zip(eligible, _spread(total, len(eligible)), strict=True):
        bases = [b for b in family.base_templates if (b in family.heldout_templates) == wanted]
        fam_levels = [level for level in lv if level in family.levels]
        for base, quota in zip(bases, _spread(fam_quota, len(bases)), strict=True):
            if not family.levels:  # an unleveled family: the base is the template
                out.append((family, base, quota))
                continue
            if not fam_levels:
                raise UnknownTaskError(f"family {family.family_id!r} has none of the hint "
                                       f"levels {lv} (it has {family.levels})")
            even, rem = divmod(quota, len(fam_levels))
            parts = [even] * len(fam_levels)
            for i in range(rem):
                parts[(cursor + i) % len(parts)] += 1
            cursor = (cursor + rem) % len(parts)
            out.extend((family, leveled_name(base, level), q)
                       for level, q in zip(fam_levels, parts, strict=True))
    return out


def candidate_indices(seed: int, family_id: str, base: str, n: int) -> list[int]:
    """The first ``n`` candidate indices of a base template for ``seed`` (seeded permutation).

    Shared by the base's hint levels, so its levels draw the same indices first.
    """
    rng = random.Random(f"task-sets/{seed}/{family_id}/{base}")
    return rng.sample(range(INDEX_SPACE), n)


def _fill(family: TaskFamily, template: str, quota: int, split: Split, seed: int,
          solvable: SolvabilityFilter, factor: int) -> tuple[list[TaskBundle],
                                                             list[DiscardedTask]]:
    kept: list[TaskBundle] = []
    dropped: list[DiscardedTask] = []
    if quota == 0:
        return kept, dropped
    base, _ = template_parts(family, template)
    for index in candidate_indices(seed, family.family_id, base, quota * factor):
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
                    max_attempts_factor: int = 2,
                    train_levels: Sequence[str] = HINT_LEVELS,
                    heldout_levels: Sequence[str] = HINT_LEVELS) -> TaskSets:
    """Build template-disjoint train and held-out sets, filtered for solvability.

    families: defaults to the four registered families (leveled ``TemplateFamily``s);
    solvability: defaults to ``closedloop.envs.terminal.check_solvable`` (gold replay through the
    real
    environment + grader); train_levels / heldout_levels: the hint levels each split is posed at.
    """
    fams = list(families) if families is not None else list(FAMILIES.values())
    solvable = check_solvable if solvability is None else solvability
    out: dict[str, list[TaskBundle]] = {"train": [], "heldout": []}
    discarded: list[DiscardedTask] = []
    splits: tuple[tuple[Split, int, Sequence[str]], ...] = (
        ("train", train_tasks, train_levels), ("heldout", heldout_tasks, heldout_levels))
    for split, total, levels in splits:
        for family, template, quota in template_quotas(fams, split, total, levels):
            kept, dropped = _fill(family, template, quota, split, seed, solvable,
                                  max_attempts_factor)
            out[split].extend(kept)
            discarded.extend(dropped)
    return TaskSets(train=tuple(out["train"]), heldout=tuple(out["heldout"]),
                    discarded=tuple(discarded), seed=seed, requested=(train_tasks, heldout_tasks))


def build_family_disjoint_set(n: int, seed: int = 0, levels: Sequence[str] = HINT_LEVELS, *,
                              solvability: SolvabilityFilter | None = None,
                              max_attempts_factor: int = 2) -> tuple[TaskBundle, ...]:
    """``n`` held-out tasks from ``HELDOUT_FAMILIES`` (families absent from training).

    Balanced over those families, then their base templates, then ``levels``, exactly as
    ``build_task_sets`` balances its held-out split; every task passes the solvability filter
    (default ``closedloop.envs.terminal.check_solvable``) and has split ``heldout``. A template that
    cannot fill its quota leaves the suite short (fewer than ``n`` tasks).
    """
    solvable = check_solvable if solvability is None else solvability
    out: list[TaskBundle] = []
    for family, template, quota in template_quotas(list(HELDOUT_FAMILIES.values()), "heldout", n,
                                                   levels):
        kept, _ = _fill(family, template, quota, "heldout", seed, solvable, max_attempts_factor)
        out.extend(kept)
    return tuple(out)


@lru_cache(maxsize=1)
def default_task_sets() -> TaskSets:
    """The default 48/16 sets (seed 0), built and filtered once per process."""
    return build_task_sets()


def list_tasks(split: Split | None = None) -> tuple[str, ...]:
    """Return the ids of the default task sets (train then held-out, or one ``split``)."""
    sets = default_task_sets()
    if split is None:
        return tuple(b.spec.task_id for b in (*sets.train, *sets.heldout))
    if split not in ("train", "heldout"):
        raise UnknownTaskError(f"split must be 'train' or 'heldout', got {split!r}")
    chosen = sets.train if split == "train" else sets.heldout
    return tuple(b.spec.task_id for b in chosen)
