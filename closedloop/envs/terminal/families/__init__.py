"""Task families for the terminal-repair environment and their overlap audit.

Four versioned training families (``file-repair-v1``, ``json-repair-v1``, ``schema-repair-v1``,
``cli-repair-v1``), each with six base templates, two held out, every one posed at the three hint
levels (``exact``, ``located``, ``symptom``); one family-disjoint held-out family
(``env-repair-v1``, ``HELDOUT_FAMILIES``). Tasks are generated deterministically; ids are
content-hashed (``family/<base>.<level>/NNN-hash8``).
"""

from closedloop.envs.terminal.families.base import (
    HINT_LEVELS,
    TaskDraft,
    TaskFamily,
    TemplateFamily,
    build_bundle,
    is_reserved_path,
    template_level,
)
from closedloop.envs.terminal.families.overlap import OverlapPair, OverlapReport, audit_overlap
from closedloop.envs.terminal.families.registry import (
    FAMILIES,
    FAMILY_IDS,
    HELDOUT_FAMILIES,
    generate_task,
    get_bundle,
    get_family,
    get_grader,
    get_spec,
    parse_task_id,
)
from closedloop.errors import TaskGenerationError, UnknownTaskError

__all__ = [
    "FAMILIES", "FAMILY_IDS", "HELDOUT_FAMILIES", "HINT_LEVELS", "OverlapPair", "OverlapReport",
    "TaskDraft", "TaskFamily", "TaskGenerationError", "TemplateFamily", "UnknownTaskError",
    "audit_overlap", "build_bundle", "generate_task", "get_bundle", "get_family", "get_grader",
    "get_spec", "is_reserved_path", "parse_task_id", "template_level",
]
