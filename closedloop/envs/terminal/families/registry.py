"""The task registry: versioned family ids, deterministic generation and cheap lookup.

``generate_task(family, template, index)`` is a pure function of its arguments (memoized).
A task id ``family/template/NNN-hash8`` (``template`` = ``<base>.<level>``, e.g.
``json-repair-v1/wrong-type.exact/003-1a2b3c4d``) names its own generator inputs, so
``get_bundle`` parses the id, regenerates (from the cache after the first call) and checks that
the content hash still matches: an id from an older generator version is an
``UnknownTaskError``, never a different task.

``get_spec`` is the public part (for environments); ``get_grader`` is for the verifier only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import lru_cache
from types import MappingProxyType

from closedloop.envs.task_records import HiddenGrader, TaskBundle, TaskSpec
from closedloop.envs.terminal.families import (
    cli_repair,
    env_repair,
    file_repair,
    json_repair,
    retain_suites,
    schema_repair,
)
from closedloop.envs.terminal.families.base import TaskFamily, build_bundle
from closedloop.errors import UnknownTaskError

FAMILIES: Mapping[str, TaskFamily] = MappingProxyType({
    f.family_id: f for f in (file_repair.FAMILY, json_repair.FAMILY, schema_repair.FAMILY,
                             cli_repair.FAMILY)
})
FAMILY_IDS: tuple[str, ...] = tuple(FAMILIES)
"""The training families: ``closedloop.envs.terminal.task_sets.build_task_sets`` draws train and
template-disjoint held-out tasks from these only."""
HELDOUT_FAMILIES: Mapping[str, TaskFamily] = MappingProxyType({
    f.family_id: f for f in (env_repair.FAMILY,)
})
"""Family-disjoint held-out families (``environment_family_disjoint``): resolvable by
``get_bundle``, never in ``FAMILIES``, so never trained on; see
``closedloop.envs.terminal.task_sets.build_family_disjoint_set``."""
_ID_RE = re.compile(r"^(?P<family>[a-z0-9-]+)/(?P<template>[a-z0-9.-]+)/(?P<index>\d{3,})-"
                    r"(?P<digest>[0-9a-f]{8})$")


def get_family(family_id: str) -> TaskFamily:
    """Return the training or held-out family with this id; ``UnknownTaskError`` otherwise."""
    family = FAMILIES.get(family_id) or HELDOUT_FAMILIES.get(family_id)
    if family is None:
        raise UnknownTaskError(f"unknown task family {family_id!r}; known: "
                               f"{[*FAMILIES, *HELDOUT_FAMILIES]}")
    return family


@lru_cache(maxsize=8192)
def generate_task(family: str, template: str, index: int) -> TaskBundle:
    """Generate task ``index`` of ``family``/``template`` (deterministic, memoized).

    Retain families (``retain_suites.RETAIN_FAMILIES``) and the family-disjoint ``HELDOUT_FAMILIES``
    resolve here too, but are not in ``FAMILIES``: they never enter ``build_task_sets``.
    """
    if family in retain_suites.RETAIN_FAMILIES:
        return retain_suites.build_retain_bundle(family, template, index)
    return build_bundle(get_family(family), template, index)


def parse_task_id(task_id: str) -> tuple[str, str, int]:
    """Split a task id into (family, template, index); ``UnknownTaskError`` if malformed."""
    m = _ID_RE.match(task_id) if isinstance(task_id, str) else None
    if m is None:
        raise UnknownTaskError(f"malformed task id {task_id!r}")
    return m["family"], m["template"], int(m["index"])


def get_bundle(task_id: str) -> TaskBundle:
    """Return the bundle of ``task_id``; the id's content hash must match the generator's."""
    family, template, index = parse_task_id(task_id)
    bundle = generate_task(family, template, index)
    if bundle.spec.task_id != task_id:
        raise UnknownTaskError(f"task id {task_id!r} does not match the current generator "
                               f"(it now yields {bundle.spec.task_id!r})")
    return bundle


def get_spec(task_id: str) -> TaskSpec:
    """Return the public spec of ``task_id`` (what an environment may materialize)."""
    return get_bundle(task_id).spec


def get_grader(task_id: str) -> HiddenGrader:
    """Return the hidden grader of ``task_id``. Verifier-side use only."""
    return get_bundle(task_id).grader
