"""What the reward caused, suite by suite (docs/null-control.md).

A gain that a shuffled reward also produces is not the reward's. In an experiment with the
four controls (docs/concepts.md, four controls) every suite the arms were evaluated on is
compared three ways, each a paired bootstrap interval over the suite's tasks
(``closedloop.evaluate.heldout.paired_difference``):

- **RL − shuffled** (the reward's share: the headline of the claim),
- **RL − frozen** (what the whole update did, beside it),
- **shuffled − frozen** (what an update without reward information did: the null).

Suites: ``heldout`` (template-disjoint held-out tasks; the frozen arm's evaluation is its
final one, else its start one), ``family`` (families never trained on), ``train`` (the tasks
RL drew its groups from: in distribution, not a capability), and one ``retain:<name>`` per
retain suite of the package (``eval-retain-start`` of the frozen arm against the arms'
``eval-retain-final``). The null gate (``shuffled_reward_control``) reads the null rows of the
held-out, family-disjoint and retain suites (:data:`NULL_GATE_SUITES`).

``arm_diagnostics`` says what an arm changed beside success, on each suite: turns used per
episode, the share of episodes truncated (turn limit, action-token limit), action tokens per
turn, parse failures per turn, and the share that finished by the agent's own ``finish``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from closedloop.contracts import Episode, Termination
from closedloop.envs.discovery import resolve_section
from closedloop.errors import EnvPackageError, RetainSuiteMismatchError
from closedloop.evaluate.heldout import EvalSummary, paired_difference, summarize_eval
from closedloop.evaluate.retain import retain_suite_tasks, split_by_suite
from closedloop.evaluate.rundir import (
    RunDir,
    arm_evaluation,
    eval_summary,
    experiment_of,
    find_arms,
    load_run,
)

__all__ = ["NULL_GATE_SUITES", "SUITE_TITLES", "Arms", "SuiteArms", "arm_diagnostics",
           "claim_by_suite", "episode_diagnostics", "experiment_arms", "suite_arms",
           "update_diagnostics"]

SUITE_TITLES = {"heldout": "held-out, template-disjoint", "family": "family-disjoint",
                "train": "train tasks, in distribution"}
"""Titles of the suites besides the retain ones (``retain:<name>``)."""
NULL_GATE_SUITES = ("heldout", "family", "retain")
"""The suites (``retain`` stands for every ``retain:<name>``) whose null row the null gate
reads: a stable gain of the shuffled arm on any of them fails it."""


@dataclass(frozen=True)
class SuiteArms:
    """One suite's evaluations: the frozen baseline, the RL arm's final and the shuffled arm's
    final (each ``None`` when not evaluated), with the episodes behind each."""

    suite: str
    title: str
    frozen: EvalSummary | None
    rl: EvalSummary | None
    shuffled: EvalSummary | None
    episodes: dict[str, tuple[Episode, ...]]


@dataclass(frozen=True)
class Arms:
    """The RL run and, when it belongs to an experiment, its frozen and shuffled arms."""

    rl: RunDir
    frozen: RunDir | None
    shuffled: RunDir | None


def experiment_arms(run: RunDir) -> Arms:
    """The RL run (``run``) and its experiment's frozen and shuffled arms (``None`` when
    absent)."""
    exp = experiment_of(run.path)
    arms = find_arms(exp) if exp is not None else {}

    def pick(word: str) -> RunDir | None:
        path = next((p for n, p in sorted(arms.items()) if word in n.lower()), None)
        return None if path is None or Path(path).resolve() == run.path.resolve() \
            else load_run(path)
    return Arms(run, pick("frozen"), pick("shuffl"))


def _episodes(run: RunDir | None, label: str) -> tuple[Episode, ...]:
    trace = None if run is None else run.eval_trace(label)
    return () if trace is None else trace.episodes


def _summary(run: RunDir | None, label: str, seed: int) -> EvalSummary | None:
    return None if run is None else eval_summary(run, label)


def _plain_suites(arms: Arms, seed: int) -> list[SuiteArms]:
    rl, frozen, shuffled = arms.rl, arms.frozen, arms.shuffled
    out = []
    for suite in ("heldout", "family", "train"):
        tag = "" if suite == "heldout" else f"-{suite}"
        if frozen is not None and suite == "heldout":
            base_label, base = arm_evaluation(frozen)
            base_run: RunDir | None = frozen
        else:
            base_run = frozen if frozen is not None else rl
            base_label, base = f"start{tag}", _summary(base_run, f"start{tag}", seed)
        entry = SuiteArms(suite, SUITE_TITLES[suite], base, _summary(rl, f"final{tag}", seed),
                          _summary(shuffled, f"final{tag}", seed), {
                              "frozen": _episodes(base_run, base_label),
                              "rl": _episodes(rl, f"final{tag}"),
                              "shuffled": _episodes(shuffled, f"final{tag}")})
        if entry.rl is not None or entry.shuffled is not None:
            out.append(entry)
    return out


def _retain_suites(arms: Arms, seed: int) -> list[SuiteArms]:
    rl, frozen, shuffled = arms.rl, arms.frozen, arms.shuffled
    names = rl.section("evaluation").get("retain_suites") or []
    if not names or rl.eval_trace("retain-final") is None:
        return []
    try:
        tasks = retain_suite_tasks(resolve_section(rl.section("environment")), names)
    except EnvPackageError:
        return []
    base_run = frozen if frozen is not None and frozen.eval_trace("retain-start") else rl
    split = {}
    for role, run, label in (("frozen", base_run, "retain-start"), ("rl", rl, "retain-final"),
                             ("shuffled", shuffled, "retain-final")):
        try:
            split[role] = split_by_suite(_episodes(run, label), tasks)
        except RetainSuiteMismatchError:
            split[role] = {}
    out = []
    for name in names:
        eps = {role: tuple(split[role].get(name, ())) for role in split}
        summaries = {role: summarize_eval(list(e), k=1, seed=seed) if e else None
                     for role, e in eps.items()}
        out.append(SuiteArms(f"retain:{name}", f"retain: {name}", summaries["frozen"],
                             summaries["rl"], summaries["shuffled"], eps))
    return out


def suite_arms(run: RunDir, seed: int) -> list[SuiteArms]:
    """Every suite the RL arm (``run``) or its shuffled null was evaluated on."""
    arms = experiment_arms(run)
    return _plain_suites(arms, seed) + _retain_suites(arms, seed)


def claim_by_suite(suites: Sequence[SuiteArms], seed: int) -> dict[str, dict[str, Any]]:
    """Per suite: RL − shuffled (the reward's share), RL − frozen and shuffled − frozen."""
    out = {}
    for s in suites:
        out[s.suite] = {
            "title": s.title,
            "rl_minus_null": paired_difference(s.rl, s.shuffled, seed,
                                               f"RL final - shuffled final ({s.title})"),
            "rl_minus_frozen": paired_difference(s.rl, s.frozen, seed,
                                                 f"RL final - frozen ({s.title})"),
            "null_minus_frozen": paired_difference(s.shuffled, s.frozen, seed,
                                                   f"shuffled final - frozen ({s.title})")}
    return out


_TRUNCATED = (Termination.MAX_STEP_TRUNCATION, Termination.MAX_TOKEN_TRUNCATION)


def episode_diagnostics(episodes: Sequence[Episode]) -> dict[str, Any] | None:
    """What a policy did beside succeeding, over ``episodes``: mean turns per episode, the
    share truncated (turn or action-token limit), the share ended by the agent's ``finish``,
    mean action tokens per turn and parse failures per turn (``None`` without episodes)."""
    if not episodes:
        return None
    turns = [t for ep in episodes for t in ep.turns]
    n = len(episodes)
    return {"episodes": n,
            "turns_per_episode": sum(len(ep.turns) for ep in episodes) / n,
            "truncated_rate": sum(ep.trajectory.termination in _TRUNCATED
                                  for ep in episodes) / n,
            "agent_finish_rate": sum(ep.trajectory.termination == Termination.AGENT_FINISH
                                     for ep in episodes) / n,
            "action_tokens_per_turn": (sum(len(t.action_token_ids) for t in turns) / len(turns)
                                       if turns else None),
            "parse_failures_per_turn": (sum(t.parse_error is not None for t in turns)
                                        / len(turns) if turns else None)}


def arm_diagnostics(suites: Sequence[SuiteArms]) -> dict[str, dict[str, Any]]:
    """Per suite and arm (frozen, rl, shuffled): ``episode_diagnostics`` of its evaluation."""
    return {s.suite: {role: episode_diagnostics(eps) for role, eps in s.episodes.items()}
            for s in suites}


def update_diagnostics(run: RunDir) -> list[dict[str, Any]]:
    """Per RL step of ``run`` (its ``rl_step`` metrics): the correlation of advantage with
    episode length, the gradient mass and the mass a clip removed by advantage sign, and, for a
    batch reused by several optimizer passes, each pass's ratio tails and clip fractions per
    granularity (``closedloop.learn.trainer.PASS_KEYS``)."""
    out = []
    for rec in sorted(run.metrics_of("rl_step"), key=lambda r: int(r.get("step", 0))):
        m = rec.get("metrics") or {}
        n_passes = int(m.get("optim/steps_on_batch") or (1 if m else 0))
        passes = [{key.split("/", 2)[2]: value for key, value in m.items()
                   if key.startswith(f"pass{k}/")} for k in range(n_passes)] \
            if n_passes > 1 else []
        out.append({"step": rec.get("step"), "adv_len_corr": m.get("credit/adv_len_corr"),
                    "grad_mass_total": m.get("grad_mass/grad_mass_total"),
                    "clipped_mass_pos": m.get("grad_mass/grad_mass_clipped_pos"),
                    "clipped_mass_neg": m.get("grad_mass/grad_mass_clipped_neg"),
                    "clip_frac_token": m.get("clip/clip_frac_token"),
                    "abs_log_ratio_max": m.get("ratio/abs_log_ratio_max"),
                    "passes": passes})
    return out
