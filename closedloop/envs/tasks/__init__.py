"""Task families for the terminal-repair environment, their train/held-out split and audit.

Four versioned training families (``file-repair-v1``, ``json-repair-v1``, ``schema-repair-v1``,
``cli-repair-v1``), each with six base templates, two held out, every one posed at the three hint
levels (``exact``, ``located``, ``symptom``); one family-disjoint held-out family
(``env-repair-v1``, ``HELDOUT_FAMILIES``). Tasks are generated deterministically; ids are
content-hashed (``family/<base>.<level>/NNN-hash8``).
"""

from closedloop.envs.tasks.base import (
    HINT_LEVELS,
    TaskDraft,
    TaskFamily,
    TemplateFamily,
    build_bundle,
    is_reserved_path,
    template_level,
)
from closedloop.envs.tasks.overlap import OverlapPair, OverlapReport, audit_overlap
from closedloop.envs.tasks.registry import (
    FAMILIES,
    FAMILY_IDS,
    HELDOUT_FAMILIES,
    generate_task,
    get_bundle,
    get_family,
    get_grader,
    get_spec,
    list_tasks,
    parse_task_id,
)
from closedloop.envs.tasks.split import (
    DiscardedTask,
    TaskSets,
    build_family_disjoint_set,
    build_task_sets,
    default_task_sets,
)
from closedloop.errors import TaskGenerationError, UnknownTaskError

__all__ = [
    "FAMILIES", "FAMILY_IDS", "HELDOUT_FAMILIES", "HINT_LEVELS", "DiscardedTask", "OverlapPair",
    "OverlapReport", "TaskDraft", "TaskFamily", "TaskGenerationError", "TaskSets",
    "TemplateFamily", "UnknownTaskError", "audit_overlap", "build_bundle",
    "build_family_disjoint_set", "build_task_sets", "default_task_sets", "generate_task",
    "get_bundle", "get_family", "get_grader", "get_spec", "is_reserved_path", "list_tasks",
    "parse_task_id", "template_level",
]
