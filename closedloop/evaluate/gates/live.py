"""Gates that re-execute the learning side: the run's objective on its recorded batches and the
shuffled-reward arm. (The environment and verifier gates are in
``closedloop.evaluate.gates.environment``.)
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from closedloop.contracts import Episode
from closedloop.contracts.update import ObjectiveInputs
from closedloop.evaluate.claim import NULL_GATE_SUITES, SuiteArms, experiment_arms, suite_arms
from closedloop.evaluate.gates.base import Gate, GateOptions, make_gate
from closedloop.evaluate.gates.signal import learning_signal
from closedloop.evaluate.heldout import paired_difference
from closedloop.evaluate.rundir import RunDir, eval_summary, experiment_of, find_arms
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
def _null_suites(run: RunDir) -> list[SuiteArms]:
    """The suites whose null row the gate reads (``NULL_GATE_SUITES``)."""
    return [s for s in suite_arms(run, opts_seed(run))
            if s.suite.split(":")[0] in NULL_GATE_SUITES]


def opts_seed(run: RunDir) -> int:
    """The run's training seed (the bootstrap seed of the report's intervals)."""
    return int(run.section("training").get("seed", 0))


def gate_shuffled_control(run: RunDir, opts: GateOptions) -> Gate:
    """The shuffled-reward arm shows no stable gain on any suite: on the held-out, the
    family-disjoint and every retain suite (``closedloop.evaluate.claim``), the paired bootstrap
    interval of (shuffled final − frozen) by task must not lie above 0. A suite the RL arm was
    evaluated on but the shuffled arm was not is not measured, and so is the gate (a null
    checked on fewer suites than the claim proves nothing about the others). A suite where
    every attempt of both arms failed (or every one succeeded) cannot show a gain: it is listed
    as without signal, not counted as passing; with no suite left, the gate is not measured.
    Counted only when the RL arm had a learning signal (``learning_signal``); otherwise not
    measured. Baseline:
    the frozen arm (held-out: its final evaluation, else its start one; other suites: its
    start), else the shuffled arm's own start."""
    signal = learning_signal(run)
    if not signal.sufficient:
        return Gate("shuffled_reward_control", None, signal.to_dict(),
                    "not measured: the null control counts only when the RL arm had a learning "
                    "signal (see learning_signal)")
    arms = experiment_arms(run)
    if arms.shuffled is None:
        exp = experiment_of(run.path)
        return Gate("shuffled_reward_control", None,
                    {"arms": sorted(find_arms(exp)) if exp is not None else []},
                    "not measured: no experiment with a shuffled-reward arm")
    suites = _null_suites(run)
    if arms.frozen is None:  # the shuffled arm's own start stands in for the frozen arm
        start = eval_summary(arms.shuffled, "start")
        suites = [replace(s, frozen=start) if s.suite == "heldout" else s for s in suites]
    rows: dict[str, Any] = {}
    problems, unmeasured, silent = [], [], []
    for s in suites:
        c = paired_difference(s.shuffled, s.frozen, opts.seed,
                              f"shuffled final - {'frozen' if arms.frozen else 'start'} "
                              f"({s.title})", n_boot=opts.bootstrap)
        rows[s.suite] = c
        if not c["measured"]:
            if c.get("no_signal"):
                silent.append(f"{s.suite} (every attempt of both arms {c['no_signal']})")
            elif s.rl is not None:
                unmeasured.append(f"{s.suite} ({c.get('detail')})")
            continue
        lo, hi = c["ci"]
        if lo > 0:
            problems.append(f"{s.suite}: shuffled rewards gained {c['estimate']:+.3f} "
                            f"[{lo:+.3f}, {hi:+.3f}] over {c['tasks']} tasks")
    evidence = {"baseline": "frozen" if arms.frozen else "shuffled start", "suites": rows,
                "not_measured": unmeasured, "without_signal": silent,
                "experiment": str(experiment_of(run.path))}
    measured = [k for k, c in rows.items() if c["measured"]]
    if problems:
        return make_gate("shuffled_reward_control", problems, evidence, "")
    if unmeasured or not measured:
        return Gate("shuffled_reward_control", None, evidence,
                    "not measured on every suite: " + (", ".join(unmeasured + silent)
                                                       or "no suite with both arms evaluated"))
    spans = "; ".join(f"{k} {rows[k]['estimate']:+.3f} [{rows[k]['ci'][0]:+.3f}, "
                      f"{rows[k]['ci'][1]:+.3f}]" for k in measured)
    untested = f"; without signal, so untested: {', '.join(silent)}" if silent else ""
    return make_gate("shuffled_reward_control", [], evidence,
                     f"shuffled - baseline, no stable gain on {len(measured)} suites: "
                     f"{spans}{untested}")
