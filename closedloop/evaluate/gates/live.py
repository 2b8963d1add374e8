"""Gates that re-execute: environment resets, restore+replay, fork isolation and sealing, the
run's objective on its recorded batches, the verifier on adjudicated fixtures, and the
shuffled-reward arm.

Preregistered verifier bounds (seed 000 §7, "the verifier passes preregistered FP/FN gates with
denominators and confidence intervals"): the upper end of the Wilson 95% interval of the FP rate
must be at most :data:`FP_UPPER_BOUND` and of the FN rate at most :data:`FN_UPPER_BOUND`, every
tamper fixture must be quarantined, and the audit must cover every verifier version that scored
the run. A false positive reinforces a wrong artifact, so its bound is the tighter one. With the
default fixture set (56 negatives, 32 positives) zero errors give upper bounds 0.064 and 0.107.
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from closedloop.contracts import Action, ClosedloopError, Episode
from closedloop.envs.check import check_env, check_reset, replay_property
from closedloop.envs.errors import EpisodeDoneError, SealedSnapshotError
from closedloop.evaluate.gates.base import MAX_LISTED, Gate, GateOptions, make_gate
from closedloop.evaluate.gates.signal import learning_signal
from closedloop.evaluate.rundir import (
    RunDir,
    arm_evaluation,
    eval_summary,
    experiment_of,
    find_arms,
    load_run,
)
from closedloop.evaluate.stats import paired_bootstrap_ci
from closedloop.learn.objectives import ObjectiveInputs, get_objective
from closedloop.rollout.replay import replay_episode
from closedloop.rollout.tensors import build_training_batch, shift_targets
from closedloop.runtime import make_env
from closedloop.verify.audit import audit_verifier
from closedloop.verify.fixtures import build_fixtures
from closedloop.verify.verifier import Verifier

FP_UPPER_BOUND = 0.10
FN_UPPER_BOUND = 0.15
F64 = torch.float64


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


# --------------------------------------------------------------------------- environment
def gate_reset_state_hash(run: RunDir, opts: GateOptions) -> Gate:
    """Resetting each recorded (task, seed) reproduces its base snapshot id and state hash.

    Every distinct (task, seed) of every trace is reset once in a fresh environment (plus a
    second fresh reset and a reset after a step for ``check_reset``); each episode's base
    snapshot id and first ``state_before`` must equal the reset's.
    """
    cache: dict[tuple[str, int], tuple[str, str] | str] = {}
    checked = mismatched = 0
    examples: list[str] = []
    for name, ep in _episodes(run):
        traj = ep.trajectory
        key = (traj.task_id, traj.seed)
        if key not in cache:
            cache[key] = _reset_once(*key)
        got = cache[key]
        checked += 1
        want_state = ep.turns[0].state_before if ep.turns else None
        if isinstance(got, str) or got[0] != traj.base_snapshot_id or (
                want_state is not None and got[1] != want_state):
            mismatched += 1
            examples.append(f"{name}: {traj.episode_id} "
                            f"({got if isinstance(got, str) else 'hash differs'})")
    evidence = {"episodes": checked, "distinct_task_seed": len(cache), "mismatched": mismatched,
                "examples": examples[:MAX_LISTED]}
    problems = [f"{mismatched}/{checked} episodes: reset does not reproduce the recorded "
                f"base state ({examples[0]})"] if mismatched else []
    return make_gate("reset_state_hash", problems, evidence,
                     f"{checked} episodes over {len(cache)} (task, seed) resets reproduce",
                     measured=checked > 0, why_not="no episodes")


def _reset_once(task_id: str, seed: int) -> tuple[str, str] | str:
    try:
        env = make_env()
        env.reset(task_id, seed)
        ref = env.snapshot("base")
        check_reset(make_env, task_id, seed)
        return ref.snapshot_id, env.state_hash()
    except ClosedloopError as exc:  # env, check, task-registry and snapshot errors
        return f"{type(exc).__name__}: {exc}"


def gate_restore_replay(run: RunDir, opts: GateOptions) -> Gate:
    """Replaying recorded actions reproduces observations, state hashes and reward; restoring a
    mid-episode snapshot (in place and in a fork) and replaying the suffix reproduces it too."""
    sample = _sample(run, opts.sample_episodes, opts.seed)
    verifier = Verifier()
    replayed = reproduced = suffix_checked = suffix_ok = 0
    examples: list[str] = []
    for name, ep in sample:
        replayed += 1
        try:
            result = replay_episode(ep, make_env(), verifier)
        except ClosedloopError as exc:
            examples.append(f"{name}: {ep.trajectory.episode_id}: {type(exc).__name__}: {exc}")
            continue
        reproduced += result.ok
        if not result.ok:
            examples.append(f"{name}: {ep.trajectory.episode_id}: {'; '.join(result.mismatches)}")
        actions = [t.action_text for t in ep.turns if t.generation_finish != "length"
                   and t.observation_error != "infra_abort"]
        if len(actions) >= 2:
            suffix_checked += 1
            try:
                replay_property(make_env, ep.trajectory.task_id, ep.trajectory.seed, actions)
                suffix_ok += 1
            except ClosedloopError as exc:
                examples.append(f"{name}: {ep.trajectory.episode_id}: {exc}")
    evidence = {"episodes_replayed": replayed, "reproduced": reproduced,
                "suffix_replays": suffix_checked, "suffix_reproduced": suffix_ok,
                "examples": examples[:MAX_LISTED]}
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


def _seal_problems(task_id: str, seed: int) -> list[str]:
    """End an episode; its sealed terminal snapshot must be immutable and never restorable."""
    env = make_env()
    env.reset(task_id, seed)
    env.step(Action.tool("list_dir"))
    env.step(Action.finish())
    ref = env.sealed_terminal()
    first = env.export_sealed(ref)
    problems = []
    for what, attempt in (("restore", lambda: env.restore(ref)),
                          ("fork", lambda: env.fork(ref, "agent")),
                          ("step", lambda: env.step(Action.tool("list_dir")))):
        try:
            attempt()
            problems.append(f"{task_id}: {what} of a sealed terminal state succeeded")
        except (SealedSnapshotError, EpisodeDoneError):
            pass
    if env.export_sealed(ref) != first:
        problems.append(f"{task_id}: sealed bytes changed")
    return problems


def gate_fork_isolation(run: RunDir, opts: GateOptions) -> Gate:
    """``check_env`` (reset/step determinism, replay, fork isolation) on tasks of the run, and
    sealed terminal snapshots that cannot be restored, forked or stepped."""
    tasks = sorted({ep.trajectory.task_id for _, ep in _episodes(run)})
    seeds = sorted({ep.trajectory.seed for _, ep in _episodes(run)})
    if not tasks:
        return Gate("fork_isolation_and_seal", None, {}, "no episodes to take tasks from")
    chosen = random.Random(opts.seed).sample(tasks, min(opts.fork_tasks, len(tasks)))
    problems: list[str] = []
    report: dict[str, Any] = {}
    try:
        r = check_env(make_env, chosen, seeds[:1], n_random_sequences=1, sequence_length=6,
                      rng_seed=opts.seed)
        report = dict(r.__dict__)
    except ClosedloopError as exc:
        problems.append(f"check_env: {type(exc).__name__}: {exc}")
    for task in chosen:
        try:
            problems += _seal_problems(task, seeds[0])
        except ClosedloopError as exc:
            problems.append(f"seal check on {task}: {type(exc).__name__}: {exc}")
    evidence = {"tasks": chosen, "seed": seeds[0], **report, "seal_checks": len(chosen)}
    return make_gate("fork_isolation_and_seal", problems, evidence,
                     f"{report.get('fork_checks', 0)} fork checks and {len(chosen)} seal checks "
                     "hold")


# --------------------------------------------------------------------------- objective
def _recorded_batches(run: RunDir) -> list[tuple[str, list[Episode]]]:
    """Each step trace's episodes whose every turn recorded behaviour log-probs."""
    out = []
    for t in run.traces_of("step"):
        eps = [ep for ep in t.episodes if ep.turns
               and all(turn.behavior_logprobs is not None for turn in ep.turns)]
        if eps:
            out.append((t.name, eps))
    return out


def _coefficients(objective: str, reducer: str, eps: list[Episode]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """∂L/∂log πθ of the run's objective and reducer on one recorded batch, at πθ = π_beh
    (float64), with advantages A_i = ±1 alternating; returns (coefficients, mask, A)."""
    shifted = shift_targets(build_training_batch(eps))
    mask = shifted.mask_B_T
    adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(eps))], dtype=F64)
    beh = torch.where(mask > 0, shifted.behavior_logprobs_B_T.double(), 0.0)
    new = beh.clone().requires_grad_(True)
    out = get_objective(objective)(ObjectiveInputs(
        new_logprobs_B_T=new, behavior_logprobs_B_T=beh, advantages_B=adv, mask_B_T=mask,
        turn_ids_B_T=shifted.turn_ids_B_T, reducer=reducer))
    (grad,) = torch.autograd.grad(out.loss, [new])
    return grad, mask, adv


def gate_episode_sum(run: RunDir, opts: GateOptions) -> Gate:
    """On the run's own recorded RL batches, the run's objective and reducer (``trainer.json``)
    weight the tokens as the score function does, or are labelled a different surrogate.

    For every step trace, the recorded episodes are built into the trainer's tensors (their
    masks, turn ids and behaviour log-probs) and the run's objective is differentiated at
    πθ = π_beh with A_i = ±1: with ``episode_sum`` every action token of episode i must get
    ∂L/∂log πθ(a_it) = -A_i / B and every other position 0 (the score-function term
    -(1/B) Σ_i A_i Σ_t ∇log π, independent of the episode's length), to 1e-12 in float64. Any
    other reducer passes as a labelled surrogate, with the spread of its per-token weight over
    the batch's episodes as evidence. Not measured without a step trace.
    """
    trainer = run.trainer or {}
    objective = str(trainer.get("objective", "reinforce_with_kl"))
    reducer = str(trainer.get("reducer", "episode_sum"))
    batches = _recorded_batches(run)
    if not batches:
        return Gate("episode_sum_score_function", None, {"objective": objective,
                                                         "reducer": reducer},
                    "not measured: no recorded RL batch (step trace)")
    err = 0.0
    spread: list[float] = []
    n_eps = n_tok = 0
    for _, eps in batches:
        grad, mask, adv = _coefficients(objective, reducer, eps)
        weight = -grad / adv[:, None]  # the per-token weight w_it the reducer gave
        want = mask.to(F64) / len(eps)
        err = max(err, float((weight - want).abs().max()))
        on = weight[mask > 0]
        spread.append(float(on.max() / on.min()) if on.numel() and float(on.min()) > 0
                      else math.inf)
        n_eps, n_tok = n_eps + len(eps), n_tok + int(mask.sum())
    score_function = reducer == "episode_sum"
    evidence = {"objective": objective, "reducer": reducer, "steps": len(batches),
                "episodes": n_eps, "action_tokens": n_tok, "max_abs_weight_diff": err,
                "token_weight_spread": max(spread), "run_uses_score_function": score_function}
    if not score_function:
        return make_gate("episode_sum_score_function", [], evidence,
                         f"the run's reducer {reducer!r} is a different, labelled surrogate "
                         f"(per-token weights vary up to {max(spread):.3g}x over {n_eps} "
                         "recorded episodes)")
    problems = [f"episode_sum on the recorded batches differs from the score-function weight "
                f"1/B by {err:.3g}"] if err > 1e-12 else []
    return make_gate("episode_sum_score_function", problems, evidence,
                     f"{objective} with episode_sum = score function on {n_eps} recorded "
                     f"episodes of {len(batches)} steps (|Δw| {err:.1e})")


# --------------------------------------------------------------------------- verifier
def gate_verifier_fp_fn(run: RunDir, opts: GateOptions) -> Gate:
    """FP/FN of the verifier on adjudicated fixtures within the preregistered bounds."""
    audit = audit_verifier(build_fixtures(opts.fixture_task_ids), Verifier())
    used = sorted({str(r.get("verifier_version")) for t in run.traces.values()
                   for r in t.raw("trajectory") if r.get("verifier_version") is not None})
    evidence = {**audit.to_dict(), "fp_upper_bound": FP_UPPER_BOUND,
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


# --------------------------------------------------------------------------- controls
def _arm_success(path: Any, label: str | None = None) -> tuple[str, dict[str, float] | None]:
    run = load_run(path)
    used, summary = arm_evaluation(run) if label is None else (label, eval_summary(run, label))
    return used, None if summary is None else summary.per_task_success()


def gate_shuffled_control(run: RunDir, opts: GateOptions) -> Gate:
    """The shuffled-reward arm shows no stable held-out gain: the paired bootstrap interval of
    (shuffled final - baseline) by task must not lie above 0. Counted only when the RL arm had
    a learning signal (``learning_signal``); otherwise not measured. Baseline: the frozen arm's
    evaluation (its final one, else its start one), else the shuffled arm's own start."""
    signal = learning_signal(run)
    if not signal.sufficient:
        return Gate("shuffled_reward_control", None, signal.to_dict(),
                    "not measured: the null control counts only when the RL arm had a learning "
                    "signal (see learning_signal)")
    exp = experiment_of(run.path)
    arms = find_arms(exp) if exp is not None else {}
    shuffled = next((p for n, p in sorted(arms.items()) if "shuffl" in n.lower()), None)
    if shuffled is None:
        return Gate("shuffled_reward_control", None, {"arms": sorted(arms)},
                    "not measured: no experiment with a shuffled-reward arm")
    frozen = next((p for n, p in sorted(arms.items()) if "frozen" in n.lower()), None)
    _, treated = _arm_success(shuffled, "final")
    used, base = _arm_success(frozen) if frozen is not None else _arm_success(shuffled, "start")
    baseline = f"frozen {used}" if frozen is not None else "shuffled start"
    if treated is None or base is None:
        return Gate("shuffled_reward_control", None, {"arms": sorted(arms)},
                    "not measured: the shuffled arm or its baseline has no scored evaluation")
    common = sorted(set(treated) & set(base))
    if len(common) < 2:
        return Gate("shuffled_reward_control", None, {"tasks": len(common)},
                    "not measured: fewer than 2 tasks scored in both arms")
    ci = paired_bootstrap_ci({k: treated[k] for k in common}, {k: base[k] for k in common},
                             n_boot=opts.bootstrap, seed=opts.seed)
    evidence = {"baseline": baseline,
                "tasks": len(common), "estimate": ci.estimate, "ci": [ci.lo, ci.hi],
                "experiment": str(exp)}
    problems = [f"shuffled rewards gained {ci.estimate:+.3f} [{ci.lo:+.3f}, {ci.hi:+.3f}] over "
                f"{len(common)} tasks"] if ci.lo > 0 else []
    return make_gate("shuffled_reward_control", problems, evidence,
                     f"shuffled - baseline {ci.estimate:+.3f} [{ci.lo:+.3f}, {ci.hi:+.3f}], "
                     f"{len(common)} tasks: no stable gain")
