"""Gates read from the ledger, checkpoints, config and metrics: staleness, exactly-once groups,
provenance, stratified drop rates, the three policies' roles and the consistency audit."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

from closedloop.contracts import TrajectoryRecord
from closedloop.errors import CheckpointCorruptError, RegistryError
from closedloop.evaluate.gates.base import (
    MAX_LISTED,
    Gate,
    GateOptions,
    make_gate,
    ratio_free,
)
from closedloop.evaluate.rundir import RunDir
from closedloop.learn.checkpoint import Checkpoint, list_checkpoints
from closedloop.learn.checkpoint import load_checkpoint as _load_checkpoint
from closedloop.policy.registry import version_index
from closedloop.rollout.admission import AdmissionStats
from closedloop.rollout.ledger import GroupRow

FINAL_STATES = ("consumed", "quarantined", "discarded")


def latest_checkpoint(run: RunDir) -> tuple[Checkpoint | None, int]:
    """The newest checkpoint that verifies (without tensors) and how many were skipped."""
    skipped = 0
    for path in reversed(list_checkpoints(run.path / "checkpoints")):
        try:
            return _load_checkpoint(path, tensors=False), skipped
        except CheckpointCorruptError:
            skipped += 1
    return None, skipped


def _rows(run: RunDir) -> dict[str, GroupRow]:
    with run.ledger() as ledger:
        return {gid: ledger.get(gid) for gid in ledger.group_ids()}


def _step_leases(run: RunDir) -> list[tuple[int, str, str]]:
    """(step, group id, behaviour version) of every lease in the RL step traces."""
    return [(t.step or 0, str(r.get("group_id")), str(r.get("behavior_policy_version")))
            for t in run.traces_of("step") for r in t.raw("group")]


# --------------------------------------------------------------------------- staleness
def gate_max_version_lag(run: RunDir, opts: GateOptions) -> Gate:
    """No consumed group is older than ``rollout.max_version_lag``.

    A group sampled by v_k and applied by optimizer step s (the ledger's ``consumed_step``:
    the update that produced v_s) was ``lag = (s - 1) - k`` versions behind the weights it
    updated; the synchronous loop applies v_k's groups at step k + 1, lag 0.
    """
    if not run.has_ledger or not run.traces_of("step"):
        return Gate("max_version_lag", None, {}, "no ledger or no RL step traces")
    bound = int(run.section("rollout").get("max_version_lag", 0))
    lags: Counter[int] = Counter()
    over: list[str] = []
    for gid, row in _rows(run).items():
        if row.state != "consumed":
            continue
        try:
            lag = (row.consumed_step or 0) - 1 - version_index(row.lease.behavior_policy_version)
        except RegistryError:
            over.append(f"{gid}: unreadable version {row.lease.behavior_policy_version!r}")
            continue
        lags[lag] += 1
        if not 0 <= lag <= bound:
            over.append(f"{gid}: lag {lag} (v{version_index(row.lease.behavior_policy_version)}"
                        f" applied at step {row.consumed_step})")
    n = sum(lags.values())
    evidence = {"consumed_groups": n, "max_version_lag": bound,
                "lag_histogram": {str(k): v for k, v in sorted(lags.items())},
                "beyond_bound": len(over), "examples": over[:MAX_LISTED]}
    problems = [f"{len(over)}/{n} consumed groups beyond max_version_lag={bound}: "
                f"{', '.join(over[:3])}"] if over else []
    return make_gate("max_version_lag", problems, evidence,
                     f"{n} consumed groups, every lag within [0, {bound}]")


EQUIVALENCE_TOL = 1e-6
"""Loss and gradient agreement the asynchronous path must reach at lag 0 (absolute)."""


def gate_async_equals_sync(run: RunDir, opts: GateOptions) -> Gate:
    """At ``max_version_lag: 0`` the async path gives the synchronous path's loss and gradient.

    Reads each ``rl_step`` record's ``async_equivalence`` (``training.rl_step``: the step's
    loss and adapter gradient as the generator's thread and the queue delivered the batch,
    beside those the synchronous path computes from the committed trace). Passes when every
    step that trained holds one with the same episodes, |Δloss| and max |Δgrad| within 1e-6.
    Not applicable to a synchronous run, nor at lag >= 1 (where the async data are, by
    design, another version's).
    """
    rollout = run.section("rollout")
    mode, lag = rollout.get("mode", "synchronous"), int(rollout.get("max_version_lag", 0) or 0)
    evidence: dict[str, Any] = {"rollout_mode": mode, "max_version_lag": lag,
                                "tolerance": EQUIVALENCE_TOL}
    if mode == "synchronous":
        return Gate("async_equals_sync", True, evidence, "not applicable: the run used only the "
                    "synchronous path", applicable=False)
    if lag != 0:
        return Gate("async_equals_sync", True, evidence, f"not applicable: the equivalence is "
                    f"defined at lag 0; this run trains at lag {lag}", applicable=False)
    trained = [m for m in run.metrics_of("rl_step") if m.get("metrics")]
    problems: list[str] = []
    worst_loss = worst_grad = 0.0
    for m in trained:
        rec = m.get("async_equivalence")
        where = f"step {m.get('step')}"
        if not isinstance(rec, dict) or rec.get("loss_sync") is None:
            problems.append(f"{where}: no async/sync equivalence record")
            continue
        if not rec.get("same_episodes"):
            problems.append(f"{where}: the async batch holds other episodes than the sync one")
        dl, dg = rec.get("loss_abs_diff"), rec.get("grad_max_abs_diff")
        if not isinstance(dl, int | float) or not isinstance(dg, int | float):
            problems.append(f"{where}: the record lacks loss or gradient differences")
            continue
        worst_loss, worst_grad = max(worst_loss, float(dl)), max(worst_grad, float(dg))
        if not (dl <= EQUIVALENCE_TOL and dg <= EQUIVALENCE_TOL):
            problems.append(f"{where}: |Δloss| {dl:.3g}, max |Δgrad| {dg:.3g} > "
                            f"{EQUIVALENCE_TOL:g}")
    evidence.update(steps_trained=len(trained), max_loss_abs_diff=worst_loss,
                    max_grad_abs_diff=worst_grad, examples=problems[:MAX_LISTED])
    return make_gate("async_equals_sync", problems, evidence,
                     f"{len(trained)} steps: async and sync loss and gradient agree within "
                     f"{EQUIVALENCE_TOL:g} (max |Δgrad| {worst_grad:.2g})",
                     measured=bool(trained), why_not="no step trained")


# --------------------------------------------------------------------------- exactly once
def _trace_duplicates(run: RunDir) -> tuple[list[str], list[str], list[str]]:
    """(duplicate group ids, duplicate episode ids, incomplete group ids) in the step traces."""
    leased = Counter(gid for _, gid, _ in _step_leases(run))
    size = {str(r.get("group_id")): r.get("group_size") for t in run.traces_of("step")
            for r in t.raw("group")}
    episodes: Counter[str] = Counter()
    members: Counter[str] = Counter()
    for t in run.traces_of("step"):
        for r in t.raw("trajectory"):
            episodes[str(r.get("episode_id"))] += 1
            members[str(r.get("group_id"))] += 1
    dup_groups = sorted(g for g, n in leased.items() if n > 1)
    dup_eps = sorted(e for e, n in episodes.items() if n > 1)
    incomplete = sorted(g for g, n in size.items() if isinstance(n, int) and members[g] < n)
    return dup_groups, dup_eps, incomplete


def gate_exactly_once(run: RunDir, opts: GateOptions) -> Gate:
    """Every collected group is consumed at most once, none lost; counts kept apart.

    Expected groups are the leases of the step traces. Duplicates in the traces (a group or
    episode recorded twice), lost, pending and unexpected groups, consumed incomplete groups,
    and a ledger that disagrees with the latest checkpoint's consumed ids all fail; refused
    duplicate attempts in the ledger are counted (they never reached the gradient).
    """
    if not run.has_ledger:
        return Gate("exactly_once_groups", None, {}, "no ledger")
    expected = {gid for _, gid, _ in _step_leases(run)}
    dup_groups, dup_eps, incomplete = _trace_duplicates(run)
    with run.ledger() as ledger:
        report = ledger.exactly_once_report(expected)
        consumed = set(ledger.group_ids("consumed"))
    ckpt, _ = latest_checkpoint(run)
    in_ckpt = set(ckpt.consumed_group_ids) if ckpt is not None else set()
    consumed_incomplete = sorted(set(incomplete) & consumed)
    evidence: dict[str, Any] = {"expected_groups": len(expected), **report.counts(),
                                "duplicate_groups_in_traces": len(dup_groups),
                                "duplicate_episodes_in_traces": len(dup_eps),
                                "incomplete_in_traces": len(incomplete),
                                "consumed_incomplete": len(consumed_incomplete),
                                "checkpoint_only": len(in_ckpt - consumed),
                                "ledger_only": len(consumed - in_ckpt)}
    problems = []
    for name, items in (("duplicate groups in traces", dup_groups),
                        ("duplicate episodes in traces", dup_eps),
                        ("lost", list(report.lost)), ("pending", list(report.pending)),
                        ("unexpected consumed", list(report.unexpected)),
                        ("consumed incomplete", consumed_incomplete),
                        ("in checkpoint, not consumed in ledger", sorted(in_ckpt - consumed)),
                        ("consumed in ledger, not in checkpoint", sorted(consumed - in_ckpt))):
        if items:
            problems.append(f"{name}: {len(items)} ({', '.join(items[:3])})")
    return make_gate("exactly_once_groups", problems, evidence,
                     f"{len(expected)} groups: {len(report.consumed_once)} consumed once, "
                     f"{len(report.discarded)} discarded, {len(report.quarantined)} quarantined",
                     measured=bool(expected), why_not="no RL step traces")


def gate_stale_drop_stratified(run: RunDir, opts: GateOptions) -> Gate:
    """Stale and dropped sample rates by task family, length band and reward band.

    Each step-trace sample takes its group's final ledger state (consumed = admitted; a
    censored member of a consumed group was excluded from the gradient: dropped, reason
    ``censored_member_excluded``). A sample whose group has no final state cannot be
    stratified and fails the gate, as does a run whose own admission records (each
    ``rl_step`` record's ``admission.rates``, written when the queue decided) count other
    samples or admissions than its ledger and traces show.
    """
    if not run.has_ledger:
        return Gate("stale_drop_stratified", None, {}, "no ledger")
    rows = _rows(run)
    bands = AdmissionStats()
    table: dict[str, dict[str, Counter[str]]] = {"task_family": {}, "length_band": {},
                                                  "reward_band": {}}
    unplaced: list[str] = []
    for t in run.traces_of("step"):
        for ep in t.episodes:
            traj: TrajectoryRecord = ep.trajectory
            row = rows.get(traj.group_id)
            if row is None or row.state not in FINAL_STATES:
                unplaced.append(traj.episode_id)
                continue
            outcome = _outcome(row, traj)
            keys = {"task_family": traj.task_family,
                    "length_band": bands.length_band(traj.num_action_tokens),
                    "reward_band": bands.reward_band(traj)}
            for dim, value in keys.items():
                table[dim].setdefault(value, Counter())[outcome] += 1
    samples = sum(sum(c.values()) for c in table["task_family"].values())
    admitted = sum(c["admitted"] for c in table["task_family"].values())
    evidence: dict[str, Any] = {dim: {v: _rates(c) for v, c in sorted(cells.items())}
                                for dim, cells in table.items()}
    evidence.update(samples=samples, unstratified_samples=len(unplaced))
    problems = [f"{len(unplaced)} samples have no final ledger state (first: {unplaced[0]})"
                ] if unplaced else []
    recorded = _recorded_rates(run)
    if recorded is not None:
        evidence["recorded_by_admission"] = {"samples": recorded[0], "admitted": recorded[1]}
        if recorded != (samples, admitted):
            problems.append(f"the admission records count {recorded[0]} samples, {recorded[1]} "
                            f"admitted; the ledger and traces show {samples}, {admitted}")
    return make_gate("stale_drop_stratified", problems, evidence,
                     f"{samples} samples stratified by family, length, reward",
                     measured=samples > 0 or bool(unplaced),
                     why_not="no RL samples")


def _outcome(row: GroupRow, traj: TrajectoryRecord) -> str:
    """A sample's fate: admitted, excluded as a censored member of a consumed group, or its
    group's ledger reason."""
    if row.state != "consumed":
        return row.reason or row.state
    if traj.termination.is_censored:
        return "censored_member_excluded"
    return "admitted"


def _recorded_rates(run: RunDir) -> tuple[int, int] | None:
    """(samples, admitted samples) the queue's own records counted, over every RL step that
    has one (``None`` for a run written before the records existed)."""
    totals = [0, 0]
    seen = False
    for m in run.metrics_of("rl_step"):
        overall = ((m.get("admission") or {}).get("rates") or {}).get("overall")
        if not overall:
            continue
        seen = True
        totals[0] += int(overall[0].get("n_samples", 0))
        totals[1] += int(overall[0].get("n_admitted", 0))
    return (totals[0], totals[1]) if seen else None


def _rates(c: Counter[str]) -> dict[str, Any]:
    n = sum(c.values())
    stale = c["stale_policy"] + c["negative_lag"]
    return {"n": n, "admitted": c["admitted"], "stale_rate": stale / n,
            "drop_rate": (n - c["admitted"]) / n,
            "reasons": {k: v for k, v in sorted(c.items()) if k != "admitted"}}


# --------------------------------------------------------------------------- provenance
def _lease_members(run: RunDir) -> tuple[int, list[str]]:
    """Check every trajectory against its lease; return (trajectories, problems)."""
    n = 0
    problems: list[str] = []
    for t in run.traces_of("step") + run.traces_of("eval") + run.traces_of("demo"):
        leases = {str(r.get("group_id")): r for r in t.raw("group")}
        seen: dict[str, list[Any]] = {}
        for r in t.raw("trajectory"):
            n += 1
            gid = str(r.get("group_id"))
            lease = leases.get(gid)
            if lease is None:
                problems.append(f"{t.name}: {r.get('episode_id')} has no lease")
                continue
            for key in ("task_id", "seed", "base_snapshot_id"):
                if r.get(key) != lease.get(key) or r.get(key) in (None, ""):
                    problems.append(f"{t.name}: {r.get('episode_id')} {key} differs from lease")
            seen.setdefault(gid, []).append(r.get("sample_index"))
        for gid, idx in seen.items():
            size = leases[gid].get("group_size")
            if sorted(idx, key=str) != list(range(size if isinstance(size, int) else 0)):
                problems.append(f"{t.name}: group {gid} sample indices {sorted(idx, key=str)}")
        for r in t.raw("turn"):
            if (r.get("group_id") not in leases or r.get("task_id") != leases[r["group_id"]]
                    .get("task_id") or r.get("seed") != leases[r["group_id"]].get("seed")):
                problems.append(f"{t.name}: turn {r.get('episode_id')}#{r.get('turn')} "
                                "task/seed/group differs from its lease")
    return n, problems


def gate_provenance(run: RunDir, opts: GateOptions) -> Gate:
    """Sample index, task id, seed and checkpoint are complete for every sample.

    Every trajectory matches its lease (task, seed, base snapshot) and each group's sample
    indices are exactly 0..G-1; the latest checkpoint is at the last RL step and names a
    registry version; every RL step's behaviour version is in the registry.
    """
    n, problems = _lease_members(run)
    steps = [int(m.get("step", -1)) for m in run.metrics_of("rl_step")]
    ckpt, skipped = latest_checkpoint(run)
    reg = run.registry()
    versions = set(reg.versions()) if reg is not None else set()
    if steps:
        want = max(steps) + 1
        if ckpt is None:
            problems.append(f"no checkpoint for {want} RL steps")
        elif ckpt.step != want or ckpt.output_policy_version not in versions:
            problems.append(f"latest checkpoint step {ckpt.step} "
                            f"({ckpt.output_policy_version}) != {want} RL steps/registry")
    missing = sorted({v for _, _, v in _step_leases(run)} - versions)
    if missing:
        problems.append(f"behaviour versions not in the registry: {missing}")
    evidence = {"trajectories": n, "rl_steps": len(steps),
                "checkpoint_step": None if ckpt is None else ckpt.step,
                "checkpoint_version": None if ckpt is None else ckpt.output_policy_version,
                "corrupt_checkpoints_skipped": skipped, "problems": len(problems),
                "examples": problems[:MAX_LISTED]}
    return make_gate("sample_provenance_complete", problems, evidence,
                     f"{n} trajectories with lease-consistent index/task/seed; checkpoint at "
                     f"step {evidence['checkpoint_step']}",
                     measured=n > 0, why_not="no trajectories")


# --------------------------------------------------------------------------- roles and audit
ROLE_VALUES: Mapping[str, tuple[str, ...]] = {
    "behavior_policy": ("rollout_manifest",),
    "proximal_policy": ("behavior_policy", "trainer_at_step_start"),
    "reference_policy": ("initial_sft", "initial")}


def gate_policy_roles(run: RunDir, opts: GateOptions) -> Gate:
    """π_beh, π_prox and π_ref are declared, consistent with the trainer and actually used."""
    if run.trainer is None and not run.metrics_of("rl_step"):
        return Gate("policy_roles_unambiguous", None, {"roles": {k: run.section("update").get(k)
                                                               for k in ROLE_VALUES}},
                    "no trainer.json and no RL step: the update never started")
    update, trainer = run.section("update"), run.trainer or {}
    problems = [f"update.{k} = {update.get(k)!r}, expected one of {v}"
                for k, v in ROLE_VALUES.items() if update.get(k) not in v]
    for key in ("objective", "kl_beta", "kl_estimator"):
        if key not in trainer:
            problems.append(f"trainer.json lacks {key}")
        elif update.get(key) is not None and trainer[key] != update.get(key):
            problems.append(f"trainer.json {key}={trainer[key]!r} but config {update.get(key)!r}")
    objective = update.get("objective")
    if (objective is not None and ratio_free(str(objective))
            and update.get("optimizer_steps_per_fresh_batch", 1) != 1):
        problems.append(f"{objective} has no ratio, so it needs π_prox = π_beh: one optimizer "
                        "step per batch")
    if update.get("proximal_policy", "behavior_policy") != trainer.get(
            "proximal_policy", "behavior_policy"):
        problems.append(f"trainer.json proximal_policy={trainer.get('proximal_policy')!r} but "
                        f"config {update.get('proximal_policy')!r}")
    unnamed = [m.get("step") for m in run.metrics_of("rl_step")
               if m.get("metrics") and "policies" in m and not (
        m["policies"].get("behavior_tokens_by_version") and m["policies"].get("proximal")
        and m["policies"].get("reference"))]
    if unnamed:
        problems.append(f"steps {unnamed[:3]} record an update without its three policies")
    if update.get("reference_policy") == "initial_sft" and not run.section("sft").get(
            "enabled", False):
        problems.append("reference_policy initial_sft but no SFT warm start")
    updates = [m for m in run.metrics_of("rl_step") if m.get("metrics")]
    beta = float(trainer.get("kl_beta", 0) or 0)
    no_kl = [m.get("step") for m in updates if beta > 0
             and m["metrics"].get("losses/kl") is None]
    if no_kl:
        problems.append(f"kl_beta={beta} but steps {no_kl[:3]} logged no KL (π_ref unused)")
    no_beh = sum(1 for t in run.traces_of("step") for r in t.raw("turn")
                 if not r.get("behavior_policy_version") or "raw_model_logprobs" not in r)
    if no_beh:
        problems.append(f"{no_beh} RL turns lack π_beh version or raw log-prob field")
    evidence = {"roles": {k: update.get(k) for k in ROLE_VALUES},
                "kl": {"beta": trainer.get("kl_beta"), "estimator": trainer.get("kl_estimator"),
                       "sampling": "behavior", "placement": "loss"},
                "objective": trainer.get("objective"), "reducer": trainer.get("reducer"),
                "steps_with_update": len(updates), "steps_without_kl": len(no_kl)}
    prox = ("π_train at the step's start" if update.get("proximal_policy") ==
            "trainer_at_step_start" else "π_beh")
    return make_gate("policy_roles_unambiguous", problems, evidence,
                     f"π_beh = rollout manifest, π_prox = {prox}, π_ref = "
                     f"{update.get('reference_policy')}; KL {trainer.get('kl_estimator')} "
                     f"β={trainer.get('kl_beta')}",
                     measured=bool(run.config), why_not="no config.json")


def _audit_gate(run: RunDir, audit: Mapping[str, Any]) -> Gate:
    tol = float(run.section("consistency").get("max_abs_tolerance", 1e-3))
    tol_max = float(audit.get("tolerance_max", tol))
    tol_p95 = float(audit.get("tolerance_p95", tol / 10))
    bounds = {"abs_p95": tol_p95, "abs_max": tol_max, "k3": tol_max * tol_max / 2}
    values = {k: audit.get(k) for k in bounds}
    problems = [f"{k} = {v} > {bounds[k]:.3g}" if isinstance(v, int | float) else f"{k} missing"
                for k, v in values.items()
                if not isinstance(v, int | float) or not math.isfinite(v) or v > bounds[k]]
    if not audit.get("n_tokens"):
        problems.append("the audit covered no action token")
    reg = run.registry()
    version = str(audit.get("version"))
    if reg is not None and version in reg.versions() and \
            reg.manifest(version).weight_checksum != audit.get("weight_checksum"):
        problems.append(f"the audited weights are not the registry's {version}")
    evidence = {**values, "bounds": bounds, "n_tokens": audit.get("n_tokens"),
                "version": audit.get("version"), "label": audit.get("label"),
                "trainer_dtype": audit.get("trainer_dtype"), "source": "audit.json"}
    ok = "" if problems else (f"at {version}: p95 |Δ| {values['abs_p95']:.2g}, max |Δ| "
                              f"{values['abs_max']:.2g}, k3 {values['k3']:.2g} within bounds")
    return make_gate("train_inference_mismatch", problems, evidence, ok)


def gate_train_inference_mismatch(run: RunDir, opts: GateOptions) -> Gate:
    """Generator/trainer p95 and max |Δlogp| and k3 at a frozen checkpoint within tolerance.

    Reads ``audit.json`` (``closedloop.training.run_evaluation.audit_frozen``:
    ``closedloop.learn.logprob_audit.AuditResult``
    plus ``label`` and ``version``): ``abs_p95 <= tolerance_p95``, ``abs_max <= tolerance_max``,
    ``k3 <= tolerance_max² / 2`` (k3 ≈ δ²/2, so the max bound implies it), at least one token,
    and the audited weight checksum must be the registry's for that version. Without the file
    the gate is not measured, unless the step metrics already show a violation (``|log
    ratio_max|`` at step start above the max tolerance): then it fails.
    """
    if run.audit is not None:
        return _audit_gate(run, run.audit)
    tol = {"abs_max": float(run.section("consistency").get("max_abs_tolerance", 1e-3))}
    ratio_max = [m["metrics"].get("ratio/ratio_max") for m in run.metrics_of("rl_step")
                 if m.get("metrics")]
    seen = [float(r) for r in ratio_max if isinstance(r, int | float) and r > 0]
    worst = max((abs(math.log(r)) for r in seen), default=None)
    evidence = {"source": "metrics.jsonl ratio/ratio_max (partial)", "steps": len(seen),
                "max_abs_log_ratio_max": worst, "tolerance": tol}
    if worst is not None and worst > tol["abs_max"]:
        return Gate("train_inference_mismatch", False, evidence,
                    f"at step start |log ratio_max| = {worst:.3g} > {tol['abs_max']}")
    return Gate("train_inference_mismatch", None, evidence,
                "no audit.json: p95/max |Δlogp| and k3 at a frozen checkpoint not measured")
