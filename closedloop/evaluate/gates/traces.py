"""Gates read from the trace records: validity, log-probs, versions, termination, manifests."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from closedloop.contracts import PolicyManifest, Termination, content_hash
from closedloop.errors import RegistryError
from closedloop.evaluate.gates.base import MAX_LISTED, Gate, GateOptions, make_gate
from closedloop.evaluate.rundir import RunDir, TraceFile


def _model_traces(run: RunDir) -> list[TraceFile]:
    """Traces sampled from registry policies: RL steps and held-out evaluations."""
    return run.traces_of("step") + run.traces_of("eval")


# --------------------------------------------------------------------------- trace gates
def gate_trace_records_valid(run: RunDir, opts: GateOptions) -> Gate:
    """Every trace line is a valid record and every trajectory assembles with its turns."""
    invalid = [f"{t.name}:{ln.lineno}: {ln.error}" for t in run.traces.values()
               for ln in t.invalid_lines]
    assembly = [f"{t.name}: {e}" for t in run.traces.values() for e in t.episode_errors]
    orphans = []
    for t in run.traces.values():
        known = {r.get("episode_id") for r in t.raw("trajectory")}
        orphans += sorted({f"{t.name}: {r.get('episode_id')}" for r in t.raw("turn")
                           if r.get("episode_id") not in known})
    partial = sorted(p.name for p in (run.path / "traces").glob("*.partial"))
    evidence = {"files": len(run.traces), "lines": sum(len(t.lines) for t in run.traces.values()),
                "invalid_lines": len(invalid), "episodes": sum(len(t.episodes) for t in
                                                               run.traces.values()),
                "unassembled_episodes": len(assembly), "orphan_turn_episodes": len(orphans),
                "partial_files_ignored": partial, "examples": (invalid + assembly + orphans)[:3]}
    problems = ([f"{len(invalid)} invalid trace lines (first: {invalid[0]})"] if invalid else [])
    problems += [f"{len(assembly)} episodes do not assemble"] if assembly else []
    problems += [f"{len(orphans)} episodes have turns but no trajectory"] if orphans else []
    return make_gate("trace_records_valid", problems, evidence,
                 f"{evidence['lines']} lines in {len(run.traces)} files are valid records",
                 measured=bool(run.traces), why_not="the run has no traces")


def _lp_problems(raw: Mapping[str, Any]) -> Counter[str]:
    """Count the log-prob contract violations of one raw turn record."""
    c: Counter[str] = Counter()
    ids, beh, mask = raw.get("action_token_ids"), raw.get("behavior_logprobs"), raw.get(
        "action_mask")
    rawlp = raw.get("raw_model_logprobs")
    if not isinstance(ids, list) or not isinstance(beh, list) or not isinstance(mask, list):
        c["missing_fields"] += 1
        return c
    c["tokens"] += len(ids)
    if len(beh) != len(ids) or len(mask) != len(ids) or (isinstance(rawlp, list)
                                                         and len(rawlp) != len(ids)):
        c["misaligned_turns"] += 1
    values = [v for v in beh if isinstance(v, int | float)]
    c["non_numeric"] += len(beh) - len(values)
    c["non_finite"] += sum(not math.isfinite(v) for v in values)
    c["positive"] += sum(math.isfinite(v) and v > 1e-6 for v in values)
    if isinstance(rawlp, list):
        c["raw_non_finite"] += sum(not (isinstance(v, int | float) and math.isfinite(v))
                                   for v in rawlp)
    c["masked_out_tokens"] += sum(1 for m in mask if m == 0)
    return c


def _batch_alignment(run: RunDir, limit: int = 16) -> tuple[int, int]:
    """Build trainer tensors for some RL episodes; count masked targets that are misaligned."""
    from closedloop.rollout.tensors import build_training_batch, shift_targets

    eps = [ep for t in run.traces_of("step") for ep in t.episodes if ep.turns][:limit]
    if not eps:
        return 0, 0
    shifted = shift_targets(build_training_batch(eps))
    checked = bad = 0
    for i, ep in enumerate(eps):
        on = shifted.mask_B_T[i] > 0
        got_ids = shifted.target_ids_B_T[i][on].tolist()
        got_lp = shifted.behavior_logprobs_B_T[i][on].tolist()
        want = [(tok, lp) for t in ep.turns for tok, lp, m in
                zip(t.action_token_ids, t.behavior_logprobs, t.action_mask, strict=True) if m]
        checked += len(want)
        if got_ids != [w[0] for w in want] or any(abs(a - b[1]) > 1e-5
                                                  for a, b in zip(got_lp, want, strict=False)):
            bad += 1
    return checked, bad


def gate_behavior_logprobs(run: RunDir, opts: GateOptions) -> Gate:
    """Every action token has a finite (<= 0), length-aligned behaviour log-prob.

    Raw turn lines are checked (the record class refuses misaligned ones, so they would
    otherwise vanish), then trainer tensors are built for RL episodes and the masked targets
    compared with the recorded ids and log-probs.
    """
    total: Counter[str] = Counter()
    turns = sampled_turns = 0
    for t in run.traces.values():
        for raw in t.raw("turn"):
            turns += 1
            sampled_turns += raw.get("generation_finish") != "scripted"
            total += _lp_problems(raw)
    checked, bad_rows = _batch_alignment(run)
    keys = ("missing_fields", "misaligned_turns", "non_numeric", "non_finite", "positive",
            "raw_non_finite")
    evidence = {"turns": turns, "model_sampled_turns": sampled_turns,
                "action_tokens": total["tokens"], **{k: total[k] for k in keys},
                "masked_out_tokens": total["masked_out_tokens"],
                "trainer_batch_tokens_checked": checked, "trainer_batch_rows_misaligned": bad_rows}
    problems = [f"{k.replace('_', ' ')}: {total[k]}" for k in keys if total[k]]
    if bad_rows:
        problems.append(f"{bad_rows} trainer rows misaligned with the recorded ids/log-probs")
    return make_gate("behavior_logprobs_finite_aligned", problems, evidence,
                 f"{total['tokens']} action tokens in {turns} turns: finite, aligned",
                 measured=sampled_turns > 0, why_not="no model-sampled action tokens")


def gate_one_behavior_version(run: RunDir, opts: GateOptions) -> Gate:
    """Each episode and each sibling group has exactly one behaviour version (and manifest)."""
    episodes = groups = mixed_eps = mixed_groups = 0
    examples: list[str] = []
    for t in run.traces.values():
        versions: dict[str, set[tuple[Any, Any]]] = {}
        for raw in t.raw("turn") + t.raw("trajectory"):
            key = (raw.get("behavior_policy_version"), raw.get("policy_manifest_hash"))
            versions.setdefault(str(raw.get("episode_id")), set()).add(key)
        for raw in t.raw("trajectory"):
            if raw.get("mixed_policy") is not False:
                versions[str(raw.get("episode_id"))].add(("mixed_policy", True))
        episodes += len(versions)
        bad = [e for e, v in versions.items() if len(v) != 1]
        mixed_eps += len(bad)
        examples += [f"{t.name}: episode {e}" for e in bad]
        by_group: dict[str, set[tuple[Any, Any]]] = {}
        for raw in t.raw("group"):
            by_group.setdefault(str(raw.get("group_id")), set()).add(
                (raw.get("behavior_policy_version"), raw.get("behavior_manifest_hash")))
        for raw in t.raw("trajectory"):
            by_group.setdefault(str(raw.get("group_id")), set()).add(
                (raw.get("behavior_policy_version"), raw.get("policy_manifest_hash")))
        groups += len(by_group)
        bad_g = [g for g, v in by_group.items() if len(v) != 1]
        mixed_groups += len(bad_g)
        examples += [f"{t.name}: group {g}" for g in bad_g]
    evidence = {"episodes": episodes, "mixed_episodes": mixed_eps, "groups": groups,
                "mixed_groups": mixed_groups, "examples": examples[:MAX_LISTED]}
    problems = []
    if mixed_eps:
        problems.append(f"{mixed_eps}/{episodes} episodes mix behaviour versions")
    if mixed_groups:
        problems.append(f"{mixed_groups}/{groups} groups mix behaviour versions")
    return make_gate("one_behavior_version", problems, evidence,
                 f"{episodes} episodes and {groups} groups: one behaviour version each",
                 measured=episodes > 0, why_not="no episodes")


def gate_termination_codes(run: RunDir, opts: GateOptions) -> Gate:
    """Distinct termination codes; censored episodes never scored; terminal ones scored."""
    codes = {t.value for t in Termination}
    dist: Counter[str] = Counter()
    unknown = censored_scored = censored_zero = unscored_terminal = last_turn_mismatch = 0
    for t in run.traces.values():
        last: dict[str, Any] = {}
        for raw in t.raw("turn"):
            ep = str(raw.get("episode_id"))
            if ep not in last or raw.get("turn", -1) > last[ep].get("turn", -1):
                last[ep] = raw
        for raw in t.raw("trajectory"):
            code, reward = raw.get("termination"), raw.get("reward")
            dist[str(code)] += 1
            if code not in codes:
                unknown += 1
                continue
            if Termination(code).is_censored:
                censored_scored += reward is not None
                censored_zero += isinstance(reward, dict) and reward.get("task_success") == 0
            elif reward is None and raw.get("quarantine_reason") is None:
                unscored_terminal += 1
            final = last.get(str(raw.get("episode_id")))
            if final is not None and final.get("termination_reason") not in (None, code):
                last_turn_mismatch += 1
    evidence = {"trajectories": sum(dist.values()), "distribution": dict(sorted(dist.items())),
                "unknown_codes": unknown, "censored_with_reward": censored_scored,
                "censored_scored_zero": censored_zero,
                "terminal_unscored_unquarantined": unscored_terminal,
                "last_turn_code_mismatch": last_turn_mismatch}
    problems = [f"{k.replace('_', ' ')}: {evidence[k]}" for k in
                ("unknown_codes", "censored_with_reward", "terminal_unscored_unquarantined",
                 "last_turn_code_mismatch") if evidence[k]]
    return make_gate("termination_codes", problems, evidence,
                 f"{sum(dist.values())} trajectories; censored never scored",
                 measured=bool(dist), why_not="no trajectories")


# --------------------------------------------------------------------------- policy identity
def _manifests(run: RunDir) -> dict[str, PolicyManifest]:
    reg = run.registry()
    return {} if reg is None else {v: reg.manifest(v) for v in reg.versions()}


def _demo_manifest_ok(template: PolicyManifest, raw: Mapping[str, Any]) -> bool:
    """A scripted demonstration's manifest: the run's scaffold with the recorded identity.

    The record carries the version and weight checksum; the base/adapter checksums of a
    script are not recorded, so the two completions a demonstrator uses are tried (no base,
    or base = the recorded checksum; no adapter).
    """
    data = template.to_dict()
    w = raw.get("behavior_weight_checksum")
    for base in (None, w):
        data.update(policy_version=raw.get("behavior_policy_version"), weight_checksum=w,
                    base_weight_checksum=base, adapter_checksum=None)
        if content_hash(data) == raw.get("policy_manifest_hash"):
            return True
    return False


def gate_scaffold_drift(run: RunDir, opts: GateOptions) -> Gate:
    """One scaffold for every registry version; every record points at a registry manifest.

    Rollouts and evaluations must carry the manifest hash of their version in the registry;
    scripted demonstrations (pre-registry weights) must hash to the run's scaffold with their
    recorded weight checksum.
    """
    manifests = _manifests(run)
    if not manifests:
        return Gate("manifest_scaffold_drift", None, {"registry_versions": 0},
                    "no policy registry: manifests cannot be checked")
    by_hash = {m.manifest_hash(): v for v, m in manifests.items()}
    scaffolds = Counter(m.scaffold_hash() for m in manifests.values())
    unknown: Counter[str] = Counter()
    wrong_version = checked = demo_bad = 0
    for t in _model_traces(run):
        for raw in t.raw("turn") + t.raw("trajectory") + t.raw("group"):
            checked += 1
            h = raw.get("policy_manifest_hash", raw.get("behavior_manifest_hash"))
            if h not in by_hash:
                unknown[t.name] += 1
            elif by_hash[h] != raw.get("behavior_policy_version"):
                wrong_version += 1
    template = next(iter(manifests.values()))
    demos = [raw for t in run.traces_of("demo") for raw in t.raw("turn") + t.raw("trajectory")]
    demo_bad = sum(not _demo_manifest_ok(template, raw) for raw in demos)
    evidence = {"registry_versions": len(manifests), "scaffold_hashes": len(scaffolds),
                "records_checked": checked, "records_with_unregistered_manifest":
                sum(unknown.values()), "unregistered_by_file": dict(unknown),
                "records_with_wrong_version": wrong_version, "demo_records": len(demos),
                "demo_records_off_scaffold": demo_bad,
                "lock_scaffold_across_checkpoints": run.section("policy").get(
                    "lock_scaffold_across_checkpoints")}
    problems = []
    if len(scaffolds) != 1:
        problems.append(f"{len(scaffolds)} scaffold hashes across {len(manifests)} versions")
    if unknown:
        problems.append(f"{sum(unknown.values())}/{checked} records name a manifest not in the "
                        f"registry ({', '.join(sorted(unknown))})")
    if wrong_version:
        problems.append(f"{wrong_version} records pair a manifest with another version")
    if demo_bad:
        problems.append(f"{demo_bad}/{len(demos)} demonstration records are off the scaffold")
    return make_gate("manifest_scaffold_drift", problems, evidence,
                 f"{len(manifests)} versions share one scaffold; {checked} records registered")


def gate_weight_checksums(run: RunDir, opts: GateOptions) -> Gate:
    """Registry versions verify; every worker ack and publication matches its manifest.

    A worker's ACK carries its own hash of the weights it holds (and, from a worker that
    proves, the hash of its per-tensor checksums): one that differs from the manifest (a
    generator left on stale weights) or from the staged tensors fails the gate."""
    reg = run.registry()
    if reg is None:
        return Gate("weight_checksums", None, {}, "no policy registry")
    manifests = _manifests(run)
    unverified, ack_bad, no_ack = [], [], []
    acks = 0
    for v, m in manifests.items():
        try:
            reg.verify(v)
        except RegistryError as exc:
            unverified.append(f"{v}: {exc}")
        files = sorted((reg.root / "acks" / v).glob("*.json"))
        if not files:
            no_ack.append(v)
        digests = _staged_digests(reg, v)
        for f in files:
            acks += 1
            ack = _read_json(f)
            proved = ack.get("digests_hash")
            if ack.get("checksum_loaded") != m.weight_checksum or (
                    proved is not None and digests is not None and proved != digests):
                ack_bad.append(f"{v}/{f.stem}")
    published = reg.history()
    pub_bad = [str(p.get("version")) for p in published if p.get("version") not in manifests or
               manifests[p["version"]].weight_checksum != p.get("checksum")]
    checksums = {v: m.weight_checksum for v, m in manifests.items()}
    trace_bad = sum(1 for t in _model_traces(run) for raw in t.raw("trajectory")
                    if checksums.get(str(raw.get("behavior_policy_version")))
                    != raw.get("behavior_weight_checksum"))
    evidence = {"versions": len(manifests), "verified": len(manifests) - len(unverified),
                "acks": acks, "ack_mismatches": ack_bad, "versions_without_ack": no_ack,
                "publications": len(published), "publication_mismatches": pub_bad,
                "trajectories_with_other_checksum": trace_bad,
                "require_all_worker_checksums": run.section("weight_sync").get(
                    "require_all_worker_checksums")}
    problems = [*unverified[:2]]
    problems += [f"worker acks differ from the manifest: {ack_bad}"] if ack_bad else []
    problems += [f"versions without a worker ack: {no_ack}"] if no_ack else []
    problems += [f"publications with another checksum: {pub_bad}"] if pub_bad else []
    problems += [f"{trace_bad} trajectories sampled with other weights"] if trace_bad else []
    return make_gate("weight_checksums", problems, evidence,
                 f"{len(manifests)} versions verify; {acks} worker acks match",
                 measured=bool(manifests), why_not="the registry holds no version")


def _staged_digests(reg: Any, version: str) -> str | None:
    """The content hash of a version's staged per-tensor checksums (what a worker's ACK
    ``digests_hash`` must equal); ``None`` when the version has none or they do not read."""
    try:
        return content_hash(dict(sorted(reg.tensor_digests(version).items())))
    except RegistryError:
        return None


def _read_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text("utf-8"))
    return data if isinstance(data, dict) else {}
