"""Task records: what the environment may see (``TaskSpec``) and what only the verifier may see
(``HiddenGrader``).

The split matters: a ``TaskSpec`` is materialized into the agent's workspace; a ``HiddenGrader``
(reference artifacts, checks, gold solution) never is. Task families are versioned ids such as
``json-repair-v1``; task ids are stable and content-hashed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from closedloop.contracts import Action

Split = Literal["train", "heldout"]


@dataclass(frozen=True)
class TaskSpec:
    """The public part of a task.

    initial_files: workspace path -> text content at reset.
    allowed_tools: tool names the agent may call (``finish``/``abstain`` are always allowed).
    commands: the ``run`` tool's allowlist, command name -> argv (executed inside the workspace).
    protected_paths: files that must stay unchanged (collateral damage is measured on them).
    step_budget: steps per episode; running out is ``task_budget_exhausted_terminal``.
    template: the template name (``<base>.<level>`` in a leveled family).
    hint_level: how much the objective gives away (``exact``, ``located`` or ``symptom``; see
        ``closedloop.envs.terminal.families.base.HINT_LEVELS``).
    """

    task_id: str
    family: str
    template: str
    split: Split
    objective: str
    initial_files: Mapping[str, str]
    allowed_tools: tuple[str, ...]
    commands: Mapping[str, tuple[str, ...]]
    protected_paths: tuple[str, ...]
    step_budget: int
    env_version: str = "terminal-repair-v1"
    hint_level: str = "symptom"


@dataclass(frozen=True)
class HiddenGrader:
    """The verifier-only part of a task: how to score a final state, and the gold solution.

    checks: family-specific grader data (expected values, reference artifacts), JSON values.
    protected_hashes: path -> sha256 of the content that must stay unchanged.
    gold_actions: a sequence of actions that solves the task through the tools.
    """

    task_id: str
    family: str
    checks: Mapping[str, Any]
    protected_hashes: Mapping[str, str]
    gold_actions: tuple[Action, ...]
    grader_version: str = "grader-v1"
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskBundle:
    """A generated task: its public spec and its hidden grader."""

    spec: TaskSpec
    grader: HiddenGrader
