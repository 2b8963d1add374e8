"""The held-out overlap gate: no held-out task duplicates or near-duplicates a train task.

A held-out gain means something only on tasks the policy was not trained on. A package that
declares an overlap rule (``EnvPackage.overlap_rule``; the terminal tasks': exact hash of the
normalized files and character 5-gram Jaccard at 0.8,
``closedloop.envs.terminal.families.overlap``) audits its task sets when they are built and the
run writes the audit into ``tasks.json`` (``overlap``: the contract is
``closedloop.contracts.package.EnvTaskSets``). The gate ``heldout_overlap`` fails when

- the audit lists an exact or a near-duplicate (train, held-out) pair, or a template shared by
  train and held-out tasks (the split is template-disjoint by construction);
- the audit's rule version is not the one the config names (``evaluation.dedup_rule_version``)
  or the package implements, or the audit counts other task sets than ``tasks.json`` holds;
- the package declares a rule but ``tasks.json`` holds no audit (fail closed).

A package that declares no overlap rule and recorded no audit leaves the gate N/A.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from closedloop.evaluate.gates.base import MAX_LISTED, Gate, GateOptions, make_gate
from closedloop.evaluate.gates.environment import package_of
from closedloop.evaluate.rundir import RunDir

__all__ = ["gate_heldout_overlap", "overlap_problems"]


def _pairs(audit: Mapping[str, Any], key: str) -> list[str]:
    value = audit.get(key)
    if not isinstance(value, Sequence) or isinstance(value, str):
        return [f"<{key} is not a list>"]
    return [f"{p.get('heldout_id')} ~ {p.get('train_id')} ({p.get('similarity')})"
            if isinstance(p, Mapping) else f"<malformed {key} entry>" for p in value]


def overlap_problems(audit: Mapping[str, Any], tasks: Mapping[str, Any], asked: str | None,
                     implemented: str | None) -> list[str]:
    """What keeps ``audit`` (``tasks.json`` ``overlap``) from proving the split clean."""
    problems = []
    version = audit.get("dedup_rule_version")
    if version != asked:
        problems.append(f"the audit applied overlap rule {version!r}, the config names "
                        f"{asked!r} (evaluation.dedup_rule_version)")
    if implemented is not None and version != implemented:
        problems.append(f"the package implements overlap rule {implemented!r}, the audit "
                        f"applied {version!r}")
    n_train = len(tasks.get("train") or [])
    n_held = len(tasks.get("heldout") or []) + len(tasks.get("family") or [])
    if (audit.get("n_train"), audit.get("n_heldout")) != (n_train, n_held):
        problems.append(f"the audit compared {audit.get('n_train')} train with "
                        f"{audit.get('n_heldout')} held-out tasks, tasks.json holds {n_train} "
                        f"and {n_held}")
    for key, what in (("exact_pairs", "duplicate"), ("near_pairs", "near-duplicate")):
        pairs = _pairs(audit, key)
        if pairs:
            problems.append(f"{len(pairs)} held-out tasks {what} a train task: "
                            f"{'; '.join(pairs[:3])}")
    shared = audit.get("shared_templates") or []
    if shared:
        problems.append(f"{len(shared)} templates are both trained on and held out: "
                        f"{', '.join(map(str, list(shared)[:3]))}")
    return problems


def gate_heldout_overlap(run: RunDir, opts: GateOptions) -> Gate:
    """The package's train / held-out overlap audit, as ``tasks.json`` recorded it, shows no
    duplicate, no near duplicate and no shared template under the rule the config names."""
    package = package_of(run)
    tasks = run.tasks or {}
    audit = tasks.get("overlap")
    asked = run.section("evaluation").get("dedup_rule_version")
    evidence: dict[str, Any] = {"env_id": package.env_id, "rule": package.overlap_rule,
                                "config_rule": asked}
    if audit is None and package.overlap_rule is None:
        return Gate("heldout_overlap", True, evidence, f"{package.env_id} declares no overlap "
                    "audit", applicable=False)
    if not isinstance(audit, Mapping):
        return Gate("heldout_overlap", False, evidence, f"{package.env_id} declares overlap rule "
                    f"{package.overlap_rule!r} but tasks.json holds no overlap audit")
    evidence.update({k: audit.get(k) for k in ("dedup_rule_version", "n_train", "n_heldout",
                                                "threshold", "max_similarity")})
    evidence["exact_pairs"] = _pairs(audit, "exact_pairs")[:MAX_LISTED]
    evidence["near_pairs"] = _pairs(audit, "near_pairs")[:MAX_LISTED]
    evidence["shared_templates"] = list(audit.get("shared_templates") or [])[:MAX_LISTED]
    problems = overlap_problems(audit, tasks, asked, package.overlap_rule)
    return make_gate("heldout_overlap", problems, evidence,
                     f"{audit.get('n_heldout')} held-out tasks against {audit.get('n_train')} "
                     f"train: no duplicate, no near duplicate (max similarity "
                     f"{audit.get('max_similarity')} < {audit.get('threshold')}), no shared "
                     f"template (rule {audit.get('dedup_rule_version')})")
