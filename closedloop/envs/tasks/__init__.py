"""Task families for the terminal-repair environment, their train/held-out split and audit.

Four versioned families (``file-repair-v1``, ``json-repair-v1``, ``schema-repair-v1``,
``cli-repair-v1``), each with four templates, one held out. Tasks are generated
deterministically; ids are content-hashed (``family/template/NNN-hash8``).
"""

from closedloop.envs.tasks.base import (
    TaskDraft,
    TaskFamily,
    TaskGenerationError,
    TemplateFamily,
    UnknownTaskError,
    build_bundle,
    is_reserved_path,
)
from closedloop.envs.tasks.overlap import OverlapPair, OverlapReport, audit_overlap
from closedloop.envs.tasks.registry import (
    FAMILIES,
    FAMILY_IDS,
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
    build_task_sets,
    default_task_sets,
)

__all__ = [
    "FAMILIES", "FAMILY_IDS", "DiscardedTask", "OverlapPair", "OverlapReport", "TaskDraft",
    "TaskFamily", "TaskGenerationError", "TaskSets", "TemplateFamily", "UnknownTaskError",
    "audit_overlap", "build_bundle", "build_task_sets", "default_task_sets", "generate_task",
    "get_bundle", "get_family", "get_grader", "get_spec", "is_reserved_path", "list_tasks",
    "parse_task_id",
]
