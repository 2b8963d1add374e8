"""Shared machinery of the task families: drafts, the family protocol, and bundle assembly.

A *family* (``json-repair-v1``...) owns a few *templates* (kinds of breakage). A template is a
pure function of a seeded ``random.Random`` that returns a ``TaskDraft``: the public files and
objective, the gold actions, and the hidden grader's ``checks``. ``assemble_bundle`` turns a draft
into a ``TaskBundle`` with a stable, content-hashed task id::

    task_id = f"{family}/{template}/{index:03d}-{hash8}"

where ``hash8`` is 8 hex digits of the sha256 of the canonical JSON of everything the draft holds.
The RNG is always ``random.Random(f"{family}/{template}/{index}")``; no global state is read.

Contracts a draft must satisfy (``TaskGenerationError`` otherwise): every file is smaller than
``MAX_FILE_CHARS``; protected and validator paths exist in the initial files; the gold solution
has at most ``MAX_GOLD_ACTIONS`` actions and fits the step budget; ``checks`` names a grader
``kind``; the workspace holds no reserved (grader-looking) path.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from closedloop.contracts import Action, ClosedloopError, content_hash, sha256_hex
from closedloop.envs.task import HiddenGrader, Split, TaskBundle, TaskSpec

MAX_FILE_CHARS = 2048
MAX_GOLD_ACTIONS = 6
DEFAULT_STEP_BUDGET = 8
DEFAULT_TOOLS: tuple[str, ...] = ("list_dir", "read_file", "write_file", "replace", "run")
ENV_VERSION = "terminal-repair-v1"
GENERATOR_VERSION = "task-gen-v1"
# Paths an agent must never create or touch: anything that looks like grader material.
RESERVED_PREFIXES: tuple[str, ...] = (".grader", ".verifier", ".closedloop", "grader", "hidden",
                                      "expected_")


class TaskGenerationError(ClosedloopError):
    """A template produced a draft that breaks the task contract; the message says which rule."""


class UnknownTaskError(ClosedloopError):
    """A task id, family or template is not known to the registry."""


@dataclass(frozen=True)
class TaskDraft:
    """What one template produces for one seeded RNG, before ids are assigned.

    objective: 1-3 sentences naming the files and the goal.
    initial_files: the workspace at reset (path -> text).
    commands: the ``run`` allowlist (name -> argv run inside the workspace).
    protected_paths: data files that must stay unchanged (collateral damage).
    validator_paths: visible validators (``check.py``); changing one is tampering.
    checks: hidden grader data; ``checks["kind"]`` selects the grader in ``closedloop.verify``.
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


TemplateBuilder = Callable[[random.Random], TaskDraft]


class TaskFamily(Protocol):
    """A versioned family of task templates with a fixed train/held-out template assignment."""

    @property
    def family_id(self) -> str:
        """The versioned id, e.g. ``json-repair-v1``."""
        ...

    @property
    def templates(self) -> tuple[str, ...]:
        """All template names, in a fixed order."""
        ...

    @property
    def heldout_templates(self) -> tuple[str, ...]:
        """The templates reserved for held-out evaluation (never trained on)."""
        ...

    def draft(self, template: str, rng: random.Random) -> TaskDraft:
        """Build one draft of ``template`` from ``rng``."""
        ...


@dataclass(frozen=True)
class TemplateFamily:
    """A ``TaskFamily`` made of a mapping template name -> builder function."""

    family_id: str
    builders: Mapping[str, TemplateBuilder]
    heldout_templates: tuple[str, ...]
    description: str = ""

    @property
    def templates(self) -> tuple[str, ...]:
        """All template names in definition order."""
        return tuple(self.builders)

    def draft(self, template: str, rng: random.Random) -> TaskDraft:
        """Run the template's builder; ``UnknownTaskError`` for an unknown template."""
        builder = self.builders.get(template)
        if builder is None:
            raise UnknownTaskError(f"family {self.family_id!r} has no template {template!r}")
        return builder(rng)


def template_split(family: TaskFamily, template: str) -> Split:
    """Return ``heldout`` for the family's held-out templates and ``train`` for the others."""
    if template not in family.templates:
        raise UnknownTaskError(f"family {family.family_id!r} has no template {template!r}")
    return "heldout" if template in family.heldout_templates else "train"


def task_rng(family_id: str, template: str, index: int) -> random.Random:
    """The only source of randomness of a task: seeded by family, template and index."""
    return random.Random(f"{family_id}/{template}/{index}")


def is_reserved_path(path: str) -> bool:
    """Say whether ``path`` (or any of its components) looks like grader material."""
    parts = [p for p in path.replace("\\", "/").split("/") if p]
    return any(p.lower().startswith(RESERVED_PREFIXES) for p in parts)


def build_bundle(family: TaskFamily, template: str, index: int) -> TaskBundle:
    """Generate task ``index`` of ``template`` deterministically and assemble its bundle."""
    if index < 0:
        raise UnknownTaskError(f"task index must be >= 0, got {index}")
    draft = family.draft(template, task_rng(family.family_id, template, index))
    return assemble_bundle(family.family_id, template, index, template_split(family, template),
                           draft)


def assemble_bundle(family_id: str, template: str, index: int, split: Split,
                    draft: TaskDraft) -> TaskBundle:
    """Check the draft's contract and build the ``TaskBundle`` with its content-hashed id."""
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
        env_version=ENV_VERSION,
    )
    grader = HiddenGrader(
        task_id=task_id, family=family_id, checks=dict(draft.checks),
        protected_hashes={p: sha256_hex(draft.initial_files[p]) for p in draft.protected_paths},
        gold_actions=draft.gold_actions,
        extra={"validator_hashes": {p: sha256_hex(draft.initial_files[p])
                                    for p in draft.validator_paths},
               "template": template, "index": index, "split": split,
               "content_hash": content_hash(body)},
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
