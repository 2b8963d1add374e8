"""Gates that rebuild the run's environment: resets, restore+replay, fork isolation and sealing,
and the verifier on adjudicated fixtures.

The environment, its verifier and its fixtures come from the run's registered environment
package (``package_of``: the ``environment`` section of the run's ``config.json``, resolved by
``closedloop.envs.discovery``), never from the terminal tasks by default. An exception of the
environment's own type is reported with its type name as the gate's evidence, never raised.
What a package does not offer is said by name: an env that is not a ``SealingEnv`` cannot seal
(the seal checks do not apply, and the detail says so); a package without fixtures leaves the
FP/FN gate not measured.

Preregistered verifier bounds (docs/concepts.md, verifier FP/FN audit: FP/FN gates with
denominators and confidence intervals): the upper end of the Wilson 95% interval of the FP rate
must be at most :data:`FP_UPPER_BOUND` and of the FN rate at most :data:`FN_UPPER_BOUND`, every
tamper fixture must be quarantined, and the audit must cover every verifier version that scored
the run. A false positive reinforces a wrong artifact, so its bound is the tighter one. With the
terminal tasks' default fixture set (56 negatives, 32 positives) zero errors give upper bounds
0.064 and 0.107.
"""

from __future__ import annotations

import random
from typing import Any

from closedloop.contracts import Action, Episode, SealingEnv
from closedloop.contracts.package import EnvPackage
from closedloop.envs.check import check_env, check_reset, replay_property
from closedloop.envs.discovery import resolve_section
from closedloop.envs.verifier_audit import audit_verifier
from closedloop.errors import EpisodeDoneError, SealedSnapshotError
from closedloop.evaluate.gates.base import MAX_LISTED, Gate, GateOptions, make_gate
from closedloop.evaluate.rundir import RunDir
from closedloop.rollout.replay import replay_episode

__all__ = ["FN_UPPER_BOUND", "FP_UPPER_BOUND", "gate_fork_isolation", "gate_reset_state_hash",
           "gate_restore_replay", "gate_verifier_fp_fn", "package_of"]

FP_UPPER_BOUND = 0.10
FN_UPPER_BOUND = 0.15
SEAL_MAX_STEPS = 64


def package_of(run: RunDir) -> EnvPackage:
    """The run's environment package (its config's ``environment`` section)."""
    return resolve_section(run.section("environment"))


def _named(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _episodes(run: RunDir) -> list[tuple[str, Episode]]:
    return [(t.name, ep) for t in run.traces.values() for ep in t.episodes]


def _sample(run: RunDir, n: int, seed: int) -> list[tuple[str, Episode]]:
    """Up to ``n`` episodes, at least one per trace kind present (deterministic)."""
    rng = random.Random(seed)
    by_kind: dict[str, list[tuple[str, Episode]]] = {}
    for t in run.traces.values():
        by_kind.setdefault(t.kind, []).extend((t.name, ep) for ep in t.episodes if ep.turns)
    chosen = [rng.choice(eps) for _, eps in sorted(by_kind.items()) if eps][:n]
    rest = [e for eps in by_kind.values() for e in eps if e not in chosen]
    chosen += rng.sample(rest, min(len(rest), n - len(chosen)))
    return chosen


def gate_reset_state_hash(run: RunDir, opts: GateOptions) -> Gate:
    """Resetting each recorded (task, seed) reproduces its base snapshot id and state hash.

    Every distinct (task, seed) of every trace is reset once in a fresh environment (plus a
    second fresh reset and a reset after a step for ``check_reset``); each episode's base
    snapshot id and first ``state_before`` must equal the reset's.
    """
    package = package_of(run)
    cache: dict[tuple[str, int], tuple[str, str] | str] = {}
    checked = mismatched = 0
    examples: list[str] = []
    for name, ep in _episodes(run):
        traj = ep.trajectory
        key = (traj.task_id, traj.seed)
        if key not in cache:
            cache[key] = _reset_once(package, *key)
        got = cache[key]
        checked += 1
        want_state = ep.turns[0].state_before if ep.turns else None
        if isinstance(got, str) or got[0] != traj.base_snapshot_id or (
                want_state is not None and got[1] != want_state):
            mismatched += 1
            examples.append(f"{name}: {traj.episode_id} "
                            f"({got if isinstance(got, str) else 'hash differs'})")
    evidence = {"env_id": package.env_id, "episodes": checked, "distinct_task_seed": len(cache),
                "mismatched": mismatched, "examples": examples[:MAX_LISTED]}
    problems = [f"{mismatched}/{checked} episodes: reset does not reproduce the recorded "
                f"base state ({examples[0]})"] if mismatched else []
    return make_gate("reset_state_hash", problems, evidence,
                     f"{checked} episodes over {len(cache)} (task, seed) resets of "
                     f"{package.env_id} reproduce", measured=checked > 0, why_not="no episodes")


def _reset_once(package: EnvPackage, task_id: str, seed: int) -> tuple[str, str] | str:
    try:
        env = package.make_env()
        env.reset(task_id, seed)
        ref = env.snapshot("base")
        check_reset(package.make_env, task_id, seed)
        return ref.snapshot_id, env.state_hash()
    except Exception as exc:  # the env's own error types are evidence, not crashes
        return _named(exc)


def gate_restore_replay(run: RunDir, opts: GateOptions) -> Gate:
    """Replaying recorded actions reproduces observations, state hashes and reward; restoring a
    mid-episode snapshot (in place and in a fork) and replaying the suffix reproduces it too."""
    package = package_of(run)
    sample = _sample(run, opts.sample_episodes, opts.seed)
    verifier = package.verifier()
    replayed = reproduced = suffix_checked = suffix_ok = 0
    examples: list[str] = []
    for name, ep in sample:
        replayed += 1
        where = f"{name}: {ep.trajectory.episode_id}"
        try:
            result = replay_episode(ep, package.make_env(), verifier)
        except Exception as exc:  # the env's own error types are evidence, not crashes
            examples.append(f"{where}: {_named(exc)}")
            continue
        reproduced += result.ok
        if not result.ok:
            examples.append(f"{where}: {'; '.join(result.mismatches)}")
        actions = [t.action_text for t in ep.turns if t.generation_finish != "length"
                   and t.observation_error != "infra_abort"]
        if len(actions) >= 2:
            suffix_checked += 1
            try:
                replay_property(package.make_env, ep.trajectory.task_id, ep.trajectory.seed,
                                actions)
                suffix_ok += 1
            except Exception as exc:
                examples.append(f"{where}: {_named(exc)}")
    evidence = {"env_id": package.env_id, "episodes_replayed": replayed,
                "reproduced": reproduced, "suffix_replays": suffix_checked,
                "suffix_reproduced": suffix_ok, "examples": examples[:MAX_LISTED]}
    problems = []
    if reproduced < replayed:
        problems.append(f"{replayed - reproduced}/{replayed} recorded episodes do not replay")
    if suffix_ok < suffix_checked:
        problems.append(f"{suffix_checked - suffix_ok}/{suffix_checked} restore+suffix replays "
                        "differ")
    problems += examples[:1] if problems else []
    return make_gate("restore_replay", problems, evidence,
                     f"{reproduced}/{replayed} episodes replay exactly; {suffix_ok}/"
                     f"{suffix_checked} restore+suffix replays equal",
                     measured=replayed > 0, why_not="no episodes")


def _end_episode(env: Any, package: EnvPackage, task_id: str, seed: int) -> None:
    """Step ``finish`` (then sampler actions, then unparsable text) until the episode ends."""
    rng = random.Random(f"seal/{task_id}/{seed}")
    if env.step(Action.finish()).done:
        return
    for _ in range(SEAL_MAX_STEPS):
        action = package.action_sampler(rng, task_id) if package.action_sampler else ""
        if env.step(action).done:
            return
    raise EpisodeDoneError(f"{task_id}: no episode end within {SEAL_MAX_STEPS} steps; "
                           "nothing to seal")


def _seal_problems(package: EnvPackage, task_id: str, seed: int) -> list[str] | None:
    """End an episode; its sealed terminal snapshot must be immutable and never restorable.
    ``None`` when the env cannot seal (it is not a ``SealingEnv``)."""
    env = package.make_env()
    if not isinstance(env, SealingEnv):
        return None
    env.reset(task_id, seed)
    _end_episode(env, package, task_id, seed)
    ref = env.sealed_terminal()
    first = env.export_sealed(ref)
    problems = []
    for what, attempt in (("restore", lambda: env.restore(ref)),
                          ("fork", lambda: env.fork(ref, "agent")),
                          ("step", lambda: env.step(Action.finish()))):
        try:
            attempt()
            problems.append(f"{task_id}: {what} of a sealed terminal state succeeded")
        except (SealedSnapshotError, EpisodeDoneError):
            pass
    if env.export_sealed(ref) != first:
        problems.append(f"{task_id}: sealed bytes changed")
    return problems


def gate_fork_isolation(run: RunDir, opts: GateOptions) -> Gate:
    """``check_env`` with the package's own actions and fork probe (reset/step determinism,
    replay, unparsable text, fork isolation) on tasks of the run, and sealed terminal
    snapshots that cannot be restored, forked or stepped (or: the env cannot seal, said)."""
    package = package_of(run)
    tasks = sorted({ep.trajectory.task_id for _, ep in _episodes(run)})
    seeds = sorted({ep.trajectory.seed for _, ep in _episodes(run)})
    if not tasks:
        return Gate("fork_isolation_and_seal", None, {}, "no episodes to take tasks from")
    chosen = random.Random(opts.seed).sample(tasks, min(opts.fork_tasks, len(tasks)))
    problems: list[str] = []
    report: dict[str, Any] = {}
    try:
        report = check_env(package.make_env, chosen, seeds[:1], n_random_sequences=1,
                           sequence_length=6, rng_seed=opts.seed,
                           sampler=package.action_sampler, probe=package.fork_probe,
                           tool_names=package.tool_names).to_dict()
    except Exception as exc:  # check failures and the env's own errors alike
        problems.append(f"check_env: {_named(exc)}")
    sealed, cannot_seal = 0, False
    for task in chosen:
        try:
            found = _seal_problems(package, task, seeds[0])
        except Exception as exc:
            problems.append(f"seal check on {task}: {_named(exc)}")
            continue
        cannot_seal = found is None
        if found is None:
            break
        sealed += 1
        problems += found
    evidence = {"env_id": package.env_id, "tasks": chosen, "seed": seeds[0], **report,
                "seal_checks": sealed, "cannot_seal": [package.env_id] if cannot_seal else []}
    forks = report.get("fork_checks", 0)
    seal_text = (f"{package.env_id} cannot seal terminal states (not a SealingEnv): no seal "
                 "checks" if cannot_seal else f"{sealed} seal checks hold")
    missing = report.get("missing") or []
    return make_gate("fork_isolation_and_seal", problems, evidence,
                     f"{forks} fork checks hold; {seal_text}"
                     + (f"; not offered: {', '.join(missing)}" if missing else ""),
                     measured=forks > 0 or sealed > 0,
                     why_not=f"{package.env_id}: no fork check and no seal check could run "
                             f"(not offered: {', '.join(missing) or 'sealing'})")


def gate_verifier_fp_fn(run: RunDir, opts: GateOptions) -> Gate:
    """FP/FN of the run's verifier on its package's adjudicated fixtures within the
    preregistered bounds (not measured when the package ships no fixtures)."""
    package = package_of(run)
    if package.fixtures is None:
        return Gate("verifier_fp_fn", None, {"env_id": package.env_id},
                    f"not measured: environment package {package.env_id!r} ships no verifier "
                    "fixtures")
    audit = audit_verifier(package.fixtures(opts.fixture_task_ids), package.verifier())
    used = sorted({str(r.get("verifier_version")) for t in run.traces.values()
                   for r in t.raw("trajectory") if r.get("verifier_version") is not None})
    evidence = {"env_id": package.env_id, **audit.to_dict(), "fp_upper_bound": FP_UPPER_BOUND,
                "fn_upper_bound": FN_UPPER_BOUND, "run_verifier_versions": used}
    evidence.pop("by_family")
    evidence["by_family"] = {k: v.__dict__ for k, v in audit.by_family.items()}
    problems = []
    if audit.fp_ci is None or audit.fn_ci is None:
        problems.append(f"no denominator: {audit.n_negative} negatives, {audit.n_positive} "
                        "positives")
    else:
        if audit.fp_ci[1] > FP_UPPER_BOUND:
            problems.append(f"FP {audit.fp}/{audit.n_negative}: upper CI {audit.fp_ci[1]:.3f}"
                            f" > {FP_UPPER_BOUND}")
        if audit.fn_ci[1] > FN_UPPER_BOUND:
            problems.append(f"FN {audit.fn}/{audit.n_positive}: upper CI {audit.fn_ci[1]:.3f}"
                            f" > {FN_UPPER_BOUND}")
    if audit.tamper_missed:
        problems.append(f"{audit.tamper_missed}/{audit.n_tamper} tamper fixtures not quarantined")
    other = [v for v in used if v != audit.verifier_version]
    if other:
        problems.append(f"the audit ({audit.verifier_version}) does not cover {other}")
    return make_gate("verifier_fp_fn", problems, evidence, audit.summary())
