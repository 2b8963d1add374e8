"""Shared machinery of the task families: drafts, the family protocol, and bundle assembly.

A *family* (``json-repair-v1``...) owns a few *base templates* (kinds of breakage). A base
template is a pure function of a seeded ``random.Random`` that returns a ``TaskDraft``: the
public files, the objective at each hint level, the gold actions, and the hidden grader's
``checks``. ``assemble_bundle`` turns a draft into a ``TaskBundle`` with a stable, content-hashed
task id::

    task_id = f"{family}/{template}/{index:03d}-{hash8}"

where ``hash8`` is 8 hex digits of the sha256 of the canonical JSON of everything the posed task
holds.

*Hint levels* (``HINT_LEVELS``) grade how much the objective gives away:

- ``exact``: the exact edit (the file and, for a ``replace``, the old and new text verbatim; for
  a ``write_file``, the full new content);
- ``located``: the file and the key / line / field / function that is wrong and the kind of fix,
  not the replacement text;
- ``symptom``: only what fails.

A leveled family's templates are named ``<base>.<level>`` (``wrong-type.exact``); the RNG is
``random.Random(f"{family}/{base}/{index}")`` (the *base* name), so the levels of one index are
the same breakage (same files, checks and gold actions) posed with different objectives, and
their ids differ only through the objective. A family built with ``levels=()`` (the retain
suites) has unleveled templates: the template is the base. No global state is read.

Contracts a draft must satisfy (``TaskGenerationError`` otherwise): every file is smaller than
``MAX_FILE_CHARS``; protected and validator paths exist in the initial files; the gold solution
has at most ``MAX_GOLD_ACTIONS`` actions and fits the step budget; ``checks`` names a grader
``kind``; the workspace holds no reserved (grader-looking) path.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from closedloop.contracts import Action, content_hash, sha256_hex
from closedloop.envs.task_records import HiddenGrader, Split, TaskBundle, TaskSpec
from closedloop.errors import TaskGenerationError, UnknownTaskError

MAX_FILE_CHARS = 2048
MAX_GOLD_ACTIONS = 6
DEFAULT_STEP_BUDGET = 8
DEFAULT_TOOLS: tuple[str, ...] = ("list_dir", "read_file", "write_file", "replace", "run")
ENV_VERSION = "terminal-repair-v1"
GENERATOR_VERSION = "task-gen-v1"
# Paths an agent must never create or touch: anything that looks like grader material.
RESERVED_PREFIXES: tuple[str, ...] = (".grader", ".verifier", ".closedloop", "grader", "hidden",
                                      "expected_")
HINT_LEVELS: tuple[str, ...] = ("exact", "located", "symptom")
"""Hint levels, most to least informative; ``symptom`` is the draft's own ``objective``."""
LEVEL_SEP = "."


@dataclass(frozen=True)
class TaskDraft:
    """What one template produces for one seeded RNG, before ids are assigned.

    objective: 1-3 sentences naming the files and the goal, stating only the symptom (the
        ``symptom`` hint level).
    hints: the objectives of the other hint levels (``exact``, ``located``), same form.
    initial_files: the workspace at reset (path -> text).
    commands: the ``run`` allowlist (name -> argv run inside the workspace).
    protected_paths: data files that must stay unchanged (collateral damage).
    validator_paths: visible validators (``check.py``); changing one is tampering.
    checks: hidden grader data; ``checks["kind"]`` selects the grader in
    ``closedloop.envs.terminal``.
    gold_actions: a solution through the tools, ending with ``finish``.
    """

    objective: str
    initial_files: Mapping[str, str]
    commands: Mapping[str, tuple[str, ...]]
    protected_paths: tuple[str, ...]
    validator_paths: tuple[str, ...]
    checks: Mapping[str, Any]
    gold_actions: tuple[Action, ...]
    allowed_tools: tuple[str, ...] = DEFAULT_TOOLS
    step_budget: int = DEFAULT_STEP_BUDGET
    hints: Mapping[str, str] = field(default_factory=dict)

    def objective_at(self, level: str) -> str:
        """The objective at hint ``level``; ``TaskGenerationError`` if the draft lacks it."""
        if level == "symptom":
            return self.objective
        hint = self.hints.get(level) if level in HINT_LEVELS else None
        if not isinstance(hint, str) or not hint.strip():
            raise TaskGenerationError(f"draft has no objective for hint level {level!r}")
        return hint

    def at_level(self, level: str) -> TaskDraft:
        """This draft posed at hint ``level`` (``objective`` replaced, everything else kept)."""
        return dataclasses.replace(self, objective=self.objective_at(level))


TemplateBuilder = Callable[[random.Random], TaskDraft]


class TaskFamily(Protocol):
    """A versioned family of task templates with a fixed train/held-out template assignment."""

    @property
    def family_id(self) -> str:
        """The versioned id, e.g. ``json-repair-v1``."""
        ...

    @property
    def templates(self) -> tuple[str, ...]:
        """All template names (leveled where the family is), in a fixed order."""
        ...

    @property
    def base_templates(self) -> tuple[str, ...]:
        """The base template names (kinds of breakage), in a fixed order."""
        ...

    @property
    def heldout_templates(self) -> tuple[str, ...]:
        """The base templates reserved for held-out evaluation (never trained on)."""
        ...

    @property
    def levels(self) -> tuple[str, ...]:
        """The hint levels every base template is posed at (``()``: unleveled)."""
        ...

    def draft(self, template: str, rng: random.Random) -> TaskDraft:
        """Build one draft of ``template`` from ``rng``."""
        ...


@dataclass(frozen=True)
class TemplateFamily:
    """A ``TaskFamily`` made of a mapping base template name -> builder function.

    levels: the hint levels every base template is posed at (``HINT_LEVELS``); ``()`` makes the
    family unleveled (its templates are the base names and the draft's objective is used as is).
    """

    family_id: str
    builders: Mapping[str, TemplateBuilder]
    heldout_templates: tuple[str, ...]
    description: str = ""
    levels: tuple[str, ...] = HINT_LEVELS

    @property
    def base_templates(self) -> tuple[str, ...]:
        """The base template names in definition order."""
        return tuple(self.builders)

    @property
    def templates(self) -> tuple[str, ...]:
        """``<base>.<level>`` for every base (definition order) and level (``levels`` order)."""
        if not self.levels:
            return self.base_templates
        return tuple(leveled_name(b, lv) for b in self.builders for lv in self.levels)

    def draft(self, template: str, rng: random.Random) -> TaskDraft:
        """Run the base template's builder and pose the draft at the template's level.

        ``UnknownTaskError`` for an unknown template (a base name is unknown in a leveled
        family); ``TaskGenerationError`` if the builder's draft lacks that level's objective.
        """
        base, level = template_parts(self, template)
        draft = self.builders[base](rng)
        return draft if level is None else draft.at_level(level)


def leveled_name(base: str, level: str) -> str:
    """The template name of ``base`` at hint ``level``: ``f"{base}.{level}"``."""
    return f"{base}{LEVEL_SEP}{level}"


def template_level(name: str) -> tuple[str, str]:
    """Split a leveled template name into ``(base, level)``; ``UnknownTaskError`` otherwise."""
    base, sep, level = name.rpartition(LEVEL_SEP)
    if not sep or not base or level not in HINT_LEVELS:
        raise UnknownTaskError(f"template {name!r} is not <base>.<level> with a level in "
                               f"{HINT_LEVELS}")
    return base, level


def base_template(template: str) -> str:
    """The base of a leveled template name (``wrong-type.exact`` -> ``wrong-type``); an
    unleveled name is its own base."""
    try:
        return template_level(template)[0]
    except UnknownTaskError:
        return template


def template_parts(family: TaskFamily, template: str) -> tuple[str, str | None]:
    """``(base, level)`` of one of ``family``'s templates (level ``None``: unleveled family)."""
    if template not in family.templates:
        raise UnknownTaskError(f"family {family.family_id!r} has no template {template!r}")
    if template in family.base_templates:
        return template, None
    return template_level(template)


def template_split(family: TaskFamily, template: str) -> Split:
    """``heldout`` iff the template's *base* is one of the family's held-out templates."""
    base, _ = template_parts(family, template)
    return "heldout" if base in family.heldout_templates else "train"


def task_rng(family_id: str, template: str, index: int) -> random.Random:
    """The only source of randomness of a task, seeded by family, *base* template and index."""
    return random.Random(f"{family_id}/{template}/{index}")


def shown(text: str) -> str:
    """How an objective quotes file text verbatim: each newline as the two characters ``\\n``
    (as in the tool call's JSON), everything else unchanged."""
    return text.replace("\n", "\\n")


def is_reserved_path(path: str) -> bool:
    """Say whether ``path`` (or any of its components) looks like grader material."""
    parts = [p for p in path.replace("\\", "/").split("/") if p]
    return any(p.lower().startswith(RESERVED_PREFIXES) for p in parts)


def build_bundle(family: TaskFamily, template: str, index: int) -> TaskBundle:
    """Generate task ``index`` of ``template`` deterministically and assemble its bundle."""
    if index < 0:
        raise UnknownTaskError(f"task index must be >= 0, got {index}")
    base, level = template_parts(family, template)
    draft = family.draft(template, task_rng(family.family_id, base, index))
    return assemble_bundle(family.family_id, template, index, template_split(family, template),
                           draft, hint_level=level or "symptom")


def assemble_bundle(family_id: str, template: str, index: int, split: Split,
                    draft: TaskDraft, *, hint_level: str = "symptom") -> TaskBundle:
    """Check the draft's contract and build the ``TaskBundle`` with its content-hashed id.

    ``draft.objective`` is the posed objective (``TaskDraft.at_level`` already applied);
    ``hint_level`` labels the spec. The hash covers the template name, so it covers the level.
    """
    check_draft(draft)
    body = {
        "family": family_id, "template": template, "index": index, "split": split,
        "objective": draft.objective, "files": dict(draft.initial_files),
        "commands": {k: list(v) for k, v in draft.commands.items()},
        "protected": list(draft.protected_paths), "validators": list(draft.validator_paths),
        "checks": dict(draft.checks), "gold": [a.to_dict() for a in draft.gold_actions],
        "tools": list(draft.allowed_tools), "budget": draft.step_budget,
        "generator": GENERATOR_VERSION,
    }
    digest = content_hash(body).split(":", 1)[1][:8]
    task_id = f"{family_id}/{template}/{index:03d}-{digest}"
    spec = TaskSpec(
        task_id=task_id, family=family_id, template=template, split=split,
        objective=draft.objective, initial_files=dict(draft.initial_files),
        allowed_tools=draft.allowed_tools, commands=dict(draft.commands),
        protected_paths=draft.protected_paths, step_budget=draft.step_budget,
        env_version=ENV_VERSION, hint_level=hint_level,
    )
    grader = HiddenGrader(
        task_id=task_id, family=family_id, checks=dict(draft.checks),
        protected_hashes={p: sha256_hex(draft.initial_files[p]) for p in draft.protected_paths},
        gold_actions=draft.gold_actions,
        extra={"validator_hashes": {p: sha256_hex(draft.initial_files[p])
                                    for p in draft.validator_paths},
               "template": template, "hint_level": hint_level, "index": index,
               "split": split, "content_hash": content_hash(body)},
    )
    return TaskBundle(spec=spec, grader=grader)


def check_draft(draft: TaskDraft) -> None:
    """Raise ``TaskGenerationError`` naming the first broken rule of the draft contract."""
    for path, text in draft.initial_files.items():
        if len(text) >= MAX_FILE_CHARS:
            raise TaskGenerationError(f"file {path!r} has {len(text)} chars (max "
                                      f"{MAX_FILE_CHARS - 1})")
        if is_reserved_path(path):
            raise TaskGenerationError(f"file {path!r} is a reserved grader path")
    for path in (*draft.protected_paths, *draft.validator_paths):
        if path not in draft.initial_files:
            raise TaskGenerationError(f"protected/validator path {path!r} is not in the files")
    n_gold = len(draft.gold_actions)
    if n_gold == 0 or n_gold > min(MAX_GOLD_ACTIONS, draft.step_budget):
        raise TaskGenerationError(f"gold solution has {n_gold} actions (allowed 1.."
                                  f"{min(MAX_GOLD_ACTIONS, draft.step_budget)})")
    if draft.gold_actions[-1].kind not in ("finish", "abstain"):
        raise TaskGenerationError("gold solution must end with finish or abstain")
    if not isinstance(draft.checks.get("kind"), str):
        raise TaskGenerationError("checks must name a grader 'kind'")
    if not draft.objective.strip():
        raise TaskGenerationError("objective is empty")
