"""Gates that re-execute the learning side: the run's objective on its recorded batches and the
shuffled-reward arm. (The environment and verifier gates are in
``closedloop.evaluate.gates.environment``.)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from closedloop.contracts import Episode
from closedloop.contracts.update import ObjectiveInputs
from closedloop.evaluate.gates.base import Gate, GateOptions, make_gate
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
from closedloop.learn.objectives import get_objective
from closedloop.rollout.tensors import build_training_batch, shift_targets

F64 = torch.float64


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
