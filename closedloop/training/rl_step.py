"""One RL step as the roles taking turns, split at the admission queue:

generator side (``produce_round``; in its own thread under ``rollout.mode: async``)::

    order  = the round's work order (drawn by the trainer side; closedloop.rollout.work_orders)
    groups = the worker rolls the round out under the order's version, the verifier step
             scores it, the trace is committed; the round goes into the admission queue

trainer side (``train_step``)::

    taken    = queue.take(round, u): every group decided at the trainer's version u (complete,
               one behaviour version, u - v <= max_version_lag, drift, censoring) -> ledger
    batch    = credit by credit.estimator (group-relative advantages, the shuffled-reward null
               control; branching; turn-level GAE): ``credit_for_step``
    result   = trainer: no token older than the bound (StaleTokenError), loss -> one optimizer
               step (or the objective's declared number)
    commit   = sampler update, next order drawn, trainer checkpoint (the commit point), ledger
               marks the groups consumed, publisher stages v_{step+1}

The records at the seams are named: ``GroupSpec``/``WorkOrder`` (what to collect),
``QueuedRound`` (a round handed over), ``RoundTake`` (what admission decided), ``CreditBatch``
(what the trainer consumes), ``StepReport`` (what the step did, one ``rl_step`` metrics
record, with the three policies and their versions).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from closedloop.config import CreditSection, RunConfig
from closedloop.contracts import Episode, content_hash, load_episodes
from closedloop.errors import StaleTokenError
from closedloop.evaluate.scorable import require_scored
from closedloop.learn.credit import GroupCredit, group_advantages, summarize_credit
from closedloop.learn.null_control import control_rewards
from closedloop.policy.registry import version_index, version_name
from closedloop.progress import log
from closedloop.rollout.admission import AdmissionController
from closedloop.rollout.queues import AdmissionQueue, QueuedRound
from closedloop.rollout.verifier_step import CollectedGroup
from closedloop.rollout.work_orders import GroupSpec, WorkOrder, scheduled_version_index
from closedloop.training.collection import collect_with_worker, commit_trace
from closedloop.training.in_flight import in_flight_notes, roll_with_boundary
from closedloop.training.resume import commit_step
from closedloop.training.run import Run

__all__ = ["CreditBatch", "StepReport", "assign_credit", "collect_round", "credit_for_step",
           "draw_order",
           "produce_round", "require_within_lag", "rl_step", "train_step"]


@dataclass(frozen=True)
class StepReport:
    """What one RL step did (also one line of metrics.jsonl)."""

    step: int
    behavior_version: str
    output_version: str | None
    groups: int
    admitted: int
    zero_variance: int
    discarded: int
    mean_success: float | None
    metrics: dict[str, Any]
    seconds: dict[str, float]


@dataclass(frozen=True)
class CreditBatch:
    """What the trainer consumes: per group its credit, and the episodes that carry a
    gradient with their advantage and success flag (aligned). ``estimator`` names what made
    it; ``turn_advantages`` (turn-level credit) gives each episode one advantage per recorded
    turn, painted onto that turn's tokens in place of the episode's; ``record`` and
    ``seconds`` are the estimator's own figures for the step's metrics."""

    credits: tuple[GroupCredit, ...]
    episodes: tuple[Episode, ...]
    advantages: tuple[float, ...]
    success: tuple[bool, ...]
    estimator: str = "rloo"
    turn_advantages: tuple[tuple[float, ...], ...] | None = None
    record: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


# ----------------------------------------------------------------------------- generator side
def draw_order(run: Run, round_index: int) -> WorkOrder:
    """The work order of round ``round_index``: tasks from the difficulty-band sampler (each
    draw's stream and propensity logged), deterministic seeds and group ids, sampled by
    ``v_max(0, round - max_version_lag)``."""
    t = run.cfg.training
    rng = random.Random(f"{t.seed}/step/{round_index}")
    draws = run.state.sampler.sample(t.groups_per_step, round_index)
    run.ctx.log_metrics("task_draws", {"step": round_index,
                                       "draws": [d.to_dict() for d in draws]}, run.state.step)
    version = version_name(scheduled_version_index(round_index,
                                                   run.cfg.rollout.max_version_lag))
    return WorkOrder(round_index, version, tuple(
        GroupSpec(f"s{round_index:04d}-g{j}", d.task_id, rng.randrange(1, 10**6),
                  run.cfg.rollout.group_size) for j, d in enumerate(draws)))


def collect_round(run: Run, order: WorkOrder) -> list[CollectedGroup]:
    """The scored groups of a round: reloaded from its complete trace (a resumed run reuses
    buffered groups, never drops or re-collects them), else rolled out by the generator
    worker under the order's version and scored by the verifier step."""
    path = run.ctx.directory.trace(f"step-{order.round:04d}")
    if path.is_file():
        return reload_round(run, order.round)
    run.roles()[1].rng.manual_seed(int(content_hash(["step", order.round])[7:15], 16))
    if run.cfg.rollout.partial_rollout_turns is not None:
        queue, timeout = run.queue, run.cfg.rollout.queue_timeout_s

        def wait_for(version: str) -> None:
            queue.wait_until(lambda: queue.published_index >= version_index(version), timeout,
                             f"{version}, the version at round {order.round}'s boundary")

        return commit_trace(run, path, order.episodes, f"step {order.round} collect",
                            roll_with_boundary(run, order, wait_for))
    manifest = run.registry.manifest(order.behavior_version)
    if run.scale is not None:  # Ray workers or a vLLM engine (closedloop.training.scale_out)
        return run.scale.collect(manifest, path, order.groups, f"step {order.round} collect")
    return collect_with_worker(run, manifest, path, order.groups,
                               f"step {order.round} collect")


def reload_round(run: Run, round_index: int) -> list[CollectedGroup]:
    """A round's scored groups from its complete trace, in lease order."""
    path = run.ctx.directory.trace(f"step-{round_index:04d}")
    leases, episodes = load_episodes(path)
    by_group: dict[str, list[Episode]] = {}
    for ep in episodes:
        by_group.setdefault(ep.trajectory.group_id, []).append(ep)
    log(f"step {round_index}: reusing {len(leases)} buffered groups from {path.name}")
    return [CollectedGroup(lease, tuple(sorted(by_group[lease.group_id],
                                               key=lambda e: e.trajectory.sample_index)))
            for lease in leases]


def produce_round(run: Run, order: WorkOrder) -> QueuedRound:
    """The generator side of a round: collect it (or reload its committed trace) and hand it
    over, stamped with the time its trace was committed."""
    groups = collect_round(run, order)
    committed = run.ctx.directory.trace(f"step-{order.round:04d}").stat().st_mtime
    return QueuedRound(order.round, order.behavior_version, tuple(groups), committed,
                       in_flight=in_flight_notes(run, order.round))


# ----------------------------------------------------------------------------- trainer side
def assign_credit(groups: Sequence[CollectedGroup], credit: CreditSection) -> CreditBatch:
    """Group-relative advantages of the admitted groups (``credit.estimator``; censored and
    quarantined members excluded by the declared rule; a reward null relabels scored rewards
    within each group first: ``closedloop.learn.null_control``)."""
    credits, episodes, adv, success = [], [], [], []
    for g in groups:
        trajs = [ep.trajectory for ep in g.episodes]
        rewards = control_rewards([t.task_success for t in trajs], credit.reward_control,
                                  g.lease.group_id)
        censored = [t.termination.is_censored or t.quarantine_reason is not None
                    or t.task_success is None for t in trajs]
        group_credit = group_advantages(rewards, credit.estimator, censored, credit.censor_rule)
        credits.append(group_credit)
        if group_credit.advantages is None:
            continue
        a = group_credit.advantages
        if credit.group_reward_scale == "std":
            from closedloop.learn.reducers import apply_group_reward_scale

            scored = torch.tensor([rewards[i] for i in group_credit.member_indices])
            a = apply_group_reward_scale(a, scored, "std")
        for pos, i in enumerate(group_credit.member_indices):
            episodes.append(g.episodes[i])
            adv.append(float(a[pos]))
            success.append(bool((rewards[i] or 0) >= 1.0))
    return CreditBatch(tuple(credits), tuple(episodes), tuple(adv), tuple(success),
                       estimator=credit.estimator)


def credit_for_step(run: Run, step: int, groups: Sequence[CollectedGroup]) -> CreditBatch:
    """The step's credit by ``credit.estimator`` (docs/credit.md): a group-relative estimator
    (``assign_credit``); ``branching`` (RLOO over the siblings plus the branches forked at
    their branch points, ``closedloop.training.branch_step``); ``gae`` (turn advantages from
    the critic over the policy's hidden states, ``closedloop.training.gae_step``)."""
    credit = run.cfg.credit
    if credit.estimator == "branching":
        from closedloop.training.branch_step import branching_batch

        rloo = assign_credit(groups, dataclasses.replace(credit, estimator="rloo"))
        return branching_batch(run, step, groups, rloo)
    if credit.estimator == "gae":
        from closedloop.training.gae_step import gae_batch

        return gae_batch(run, groups, assign_credit(groups, dataclasses.replace(
            credit, estimator="rloo")))
    return assign_credit(groups, credit)


def relabelled_members(groups: Sequence[CollectedGroup], credit: CreditSection) -> int:
    """Members whose training reward the reward control changed (0 for the RL arm; a null
    whose relabelling were the identity would show 0 too)."""
    out = 0
    for g in groups:
        real = [ep.trajectory.task_success for ep in g.episodes]
        out += sum(a != b for a, b in zip(
            real, control_rewards(real, credit.reward_control, g.lease.group_id), strict=True))
    return out


def unscorable_budgets(cfg: RunConfig) -> dict[str, object]:
    """The values of the keys an unscorable step names (``closedloop.evaluate.scorable``)."""
    return {"environment.max_turns": cfg.environment.max_turns,
            "rollout.max_action_tokens": cfg.rollout.max_action_tokens,
            "rollout.episode_deadline_s": cfg.rollout.episode_deadline_s,
            "credit.censor_rule": cfg.credit.censor_rule}


def update_sampler(run: Run, groups: Sequence[CollectedGroup]) -> None:
    """Per-task success counts for the difficulty bands; infra failures count apart."""
    sampler = run.state.sampler
    for g in groups:
        trajs = [ep.trajectory for ep in g.episodes]
        scored = [t.task_success for t in trajs if t.task_success is not None]
        if scored:
            sampler.update(g.lease.task_id, sum(1 for s in scored if s >= 1.0), len(scored))
        for t in trajs:
            if t.quarantine_reason is not None or t.termination.value == "infra_abort":
                sampler.record_failure(g.lease.task_id, t.quarantine_reason or "infra_abort")
    run.log_metrics("task_sampler", sampler.to_dict(group_size=run.cfg.rollout.group_size))


def require_within_lag(episodes: Sequence[Episode], train_version: int,
                       max_version_lag: int) -> dict[str, int]:
    """The hard staleness bound on what is about to be trained: every action token's
    behaviour version v (its turn's) must satisfy ``0 <= u - v <= max_version_lag``
    (``StaleTokenError`` naming the episode otherwise). Returns action tokens per lag."""
    tokens: Counter[str] = Counter()
    for ep in episodes:
        for turn in ep.turns:
            lag = train_version - version_index(turn.behavior_policy_version)
            if not 0 <= lag <= max_version_lag:
                raise StaleTokenError(
                    f"{ep.trajectory.episode_id} turn {turn.turn}: sampled by "
                    f"{turn.behavior_policy_version}, {lag} versions from the trainer's "
                    f"v{train_version:04d} (max_version_lag {max_version_lag})")
            tokens[str(lag)] += len(turn.action_token_ids)
    return dict(sorted(tokens.items()))


def policies_record(run: Run, step: int, token_lags: dict[str, int],
                    metrics: dict[str, Any]) -> dict[str, Any]:
    """The three policies of an update and their versions: π_beh per token (action tokens
    per behaviour version), π_prox (its role and version), π_ref (its role), the trainer's
    version, and D_sample over the trained tokens (``ratio/abs_log_ratio_mean`` of the first
    pass: mean |log π_train^u - log π_beh^v|)."""
    u = run.cfg.update
    by_version = {version_name(step - int(lag)): n for lag, n in token_lags.items()}
    proximal = (f"{version_name(step)} (the trainer as the step starts)"
                if u.proximal_policy == "trainer_at_step_start" else "π_beh (per token)")
    return {"train_version": version_name(step), "behavior_tokens_by_version": by_version,
            "proximal": {"role": u.proximal_policy, "version": proximal},
            "reference": {"role": u.reference_policy,
                          "version": "the warm-started base, adapter disabled"},
            "d_sample": metrics.get("ratio/abs_log_ratio_mean")}


def train_step(run: Run, queue: AdmissionQueue, step: int, *, publish_inline: bool,
               seconds: dict[str, float] | None = None) -> StepReport:
    """The trainer side of RL step ``step`` (module doc). ``publish_inline``: the worker loads
    and acknowledges the new version now (synchronous mode); otherwise it does at its next
    round boundary (async)."""
    trainer = run.roles()[0]
    cfg = run.cfg
    times = dict(seconds or {})
    t1 = time.perf_counter()
    taken = queue.take(step, step, timeout_s=cfg.rollout.queue_timeout_s)
    times["admit_s"] = time.perf_counter() - t1
    require_scored((ep.trajectory for g in taken.groups for ep in g.episodes),
                   f"RL step {step}", cfg.credit.censor_rule, unscorable_budgets(cfg))
    t2 = time.perf_counter()
    batch = credit_for_step(run, step, taken.admitted)  # dispatched by credit.estimator
    times.update(batch.seconds)
    summary = summarize_credit(batch.credits)
    token_lags = require_within_lag(batch.episodes, step, cfg.rollout.max_version_lag)
    metrics: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    if batch.episodes:
        run.ctx.ledger.require_admitted([g.lease.group_id for g in taken.admitted])
        if cfg.rollout.mode == "async" and cfg.rollout.max_version_lag == 0:
            extra["async_equivalence"] = async_equivalence(run, step, batch)
        result = trainer.update(batch.episodes, batch.advantages, batch.success,
                                run.policy.pad_id, batch.turn_advantages)
        metrics = dict(result.metrics)
    times["update_s"] = time.perf_counter() - t2 - sum(batch.seconds.values())
    t3 = time.perf_counter()
    update_sampler(run, taken.groups)
    nxt = step + cfg.rollout.max_version_lag + 1
    if nxt < cfg.training.rl_steps and nxt not in run.state.orders:
        run.state.orders[nxt] = draw_order(run, nxt)
    output = version_name(step + 1)
    commit_step(run, step, taken.admitted, output, publish_inline=publish_inline)
    queue.publish(step + 1)
    times["publish_s"] = time.perf_counter() - t3
    scores = [ep.trajectory.task_success for g in taken.groups for ep in g.episodes
              if ep.trajectory.task_success is not None]
    report = StepReport(
        step=step, behavior_version=run.state.orders[step].behavior_version,
        output_version=output, groups=len(taken.groups), admitted=len(taken.admitted),
        zero_variance=summary.n_zero_variance, discarded=summary.n_discarded,
        mean_success=sum(scores) / len(scores) if scores else None,
        metrics=metrics, seconds=times)
    run.log_metrics("rl_step", {**report.__dict__, "credit": {
        **batch.record, "estimator": batch.estimator, "n_groups": summary.n_groups,
        "n_scored_groups": summary.n_scored_groups,
        "zero_variance_rate": summary.zero_variance_rate,
        "discard_reasons": dict(summary.discard_reasons),
        "relabelled_members": relabelled_members(taken.admitted, cfg.credit)},
        "policies": policies_record(run, step, token_lags, metrics),
        "admission": taken.report, "timing": taken.timing, **extra})
    run.state.orders.pop(step, None)
    run.state.step = step + 1
    return report


def async_equivalence(run: Run, step: int, batch: CreditBatch) -> dict[str, Any]:
    """What the ``async_equals_sync`` gate reads: the loss and gradient of this step's batch
    as the async path delivered it (the generator's thread, the queue, in memory), beside the
    loss and gradient the synchronous path computes from the committed trace (reloaded,
    decided by a fresh admission controller, credited the same way). At lag 0 they must
    agree within 1e-6."""
    cfg, trainer = run.cfg, run.roles()[0]
    controller = AdmissionController(cfg.rollout.max_version_lag,
                                     censor_rule=cfg.credit.censor_rule)
    groups = reload_round(run, step)
    admitted = [g for g in groups if controller.admit(
        [ep.trajectory for ep in g.episodes], g.lease, step).admitted]
    sync = assign_credit(admitted, cfg.credit)
    pad = run.policy.pad_id
    loss_a, grad_a = trainer.gradient(batch.episodes, batch.advantages, batch.success, pad)
    if not sync.episodes:
        return {"step": step, "loss_async": loss_a, "loss_sync": None, "same_episodes": False}
    loss_s, grad_s = trainer.gradient(sync.episodes, sync.advantages, sync.success, pad)
    ids = [[ep.trajectory.episode_id for ep in b.episodes] for b in (batch, sync)]
    return {"step": step, "loss_async": loss_a, "loss_sync": loss_s,
            "loss_abs_diff": abs(loss_a - loss_s),
            "grad_max_abs_diff": float((grad_a - grad_s).abs().max()),
            "grad_norm": float(grad_a.norm()), "same_episodes": ids[0] == ids[1],
            "advantages_max_abs_diff": max(abs(a - b) for a, b in zip(
                batch.advantages, sync.advantages, strict=False)) if ids[0] == ids[1] else None}


def rl_step(run: Run, step: int) -> StepReport:
    """One synchronous step: the round produced inline, then the trainer side (the queue holds
    one round at a time)."""
    order = run.state.orders.get(step) or draw_order(run, step)
    run.state.orders[step] = order
    queue = run.queue
    t0 = time.perf_counter()
    queue.start(step, published_index=step)
    queue.put(produce_round(run, order))
    return train_step(run, queue, step, publish_inline=True,
                      seconds={"collect_s": time.perf_counter() - t0})
