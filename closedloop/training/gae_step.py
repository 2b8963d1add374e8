"""Turn-level GAE in an LLM run (``credit.estimator: gae``; turn-level credit, docs/credit.md).

The critic (``closedloop.learn.critic.TurnCritic``) reads the trainer's policy's final-layer
hidden state at every turn boundary of the step's admitted episodes (one extra forward pass
without gradient; at lag 0 the trainer's weights are the behaviour policy's); each episode's
turn advantages are its GAE with the termination taxonomy's boundary rule (terminal:
V(h_K) = 0; the collector's turn limit: V(h_K) bootstraps from the context after the rendered
last observation; a cut-off last action: credited up to it; system events, quarantined and
unscored terminal episodes: no credit), painted onto each turn's own action tokens by the
trainer role. The critic is then fit to the GAE targets R^λ_k (``CRITIC_EPOCHS`` Adam steps on
the cached features, ``credit.critic_learning_rate``).

The critic and its optimizer are state beside the policy, held in ``Run.credit_state``:
``critic/step-NNNNNN.pt`` is written (atomically, before the trainer checkpoint of that step)
and a resume loads the one of the checkpoint's step, so a resumed run continues with exactly
the critic it had.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from closedloop.contracts import Episode, Termination
from closedloop.errors import CheckpointError
from closedloop.learn.critic import TurnCritic, boundary_features, fit_values
from closedloop.learn.turn_credit import episode_boundary, gae, turn_rewards
from closedloop.rollout.verifier_step import CollectedGroup

if TYPE_CHECKING:
    from collections.abc import Sequence

    from closedloop.training.rl_step import CreditBatch
    from closedloop.training.run import Run

__all__ = ["CRITIC_EPOCHS", "credited", "critic_path", "gae_batch", "load_critic", "save_critic"]

CRITIC_EPOCHS = 4
"""Adam steps of the critic on each RL step's boundary features."""


def credited(episode: Episode) -> bool:
    """Whether GAE credits the episode (module docstring)."""
    traj = episode.trajectory
    bound = episode_boundary(traj.termination, len(episode.turns))
    if bound is None or bound.n_turns == 0 or traj.quarantine_reason is not None:
        return False
    return bound.bootstrap or traj.task_success is not None


def _critic(run: Run) -> tuple[TurnCritic, torch.optim.Optimizer]:
    """The run's critic and its optimizer (created at first use, seeded by the run)."""
    if "critic" not in run.credit_state:
        model = run.roles()[0].model
        critic = TurnCritic(int(model.config.hidden_size), seed=run.cfg.training.seed + 7)
        run.credit_state["critic"] = (critic, torch.optim.Adam(
            critic.parameters(), lr=run.cfg.credit.critic_learning_rate))
    out: tuple[TurnCritic, torch.optim.Optimizer] = run.credit_state["critic"]
    return out


def critic_path(run_dir: Path, step: int) -> Path:
    """Where the critic of checkpoint ``step`` is kept."""
    return run_dir / "critic" / f"step-{step:06d}.pt"


def save_critic(run: Run, step: int) -> None:
    """Write the critic and its optimizer for checkpoint ``step`` (temporary file, fsync,
    rename); nothing unless the run's estimator is gae."""
    if run.cfg.credit.estimator != "gae":
        return
    critic, optimizer = _critic(run)
    path = critic_path(run.dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        torch.save({"critic": critic.state_dict(), "optimizer": optimizer.state_dict()}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load_critic(run: Run, step: int) -> None:
    """Load the critic of checkpoint ``step`` (``CheckpointError`` when it is missing);
    nothing unless the run's estimator is gae."""
    if run.cfg.credit.estimator != "gae":
        return
    path = critic_path(run.dir, step)
    if not path.is_file():
        raise CheckpointError(f"{path}: the critic of checkpoint step {step} is missing")
    critic, optimizer = _critic(run)
    state = torch.load(path, weights_only=True)
    critic.load_state_dict(state["critic"])
    optimizer.load_state_dict(state["optimizer"])


def _final_ids(run: Run, episodes: list[Episode]) -> dict[str, list[int]]:
    """The rendered last observation of each turn-limit truncation (its h_K context)."""
    renderer = run.policy.renderer
    out = {}
    for ep in episodes:
        if ep.trajectory.termination == Termination.MAX_STEP_TRUNCATION:
            last = ep.turns[-1]
            out[ep.trajectory.episode_id] = renderer.render_observation(
                last.observation, turn_closed=renderer.turn_closed(last.action_token_ids))
    return out


def gae_batch(run: Run, groups: Sequence[CollectedGroup], summary: CreditBatch) -> CreditBatch:
    """The step's batch under GAE: every credited episode of the admitted groups with its
    per-turn advantages (one per recorded turn, 0 on a turn it does not credit; the episode's
    reported advantage is their mean). ``summary`` (RLOO over the groups) keeps its group
    credits for the zero-variance counts only. Fits the critic on the way."""
    c = run.cfg.credit
    t0 = time.perf_counter()
    episodes = [ep for g in groups for ep in g.episodes if credited(ep)]
    if not episodes:
        return dataclasses.replace(summary, estimator="gae", episodes=(), advantages=(),
                                   success=(), turn_advantages=(),
                                   seconds={"critic_s": time.perf_counter() - t0})
    critic, optimizer = _critic(run)
    final = _final_ids(run, episodes)
    feats = boundary_features(run.roles()[0].model, episodes, run.policy.pad_id, final,
                              precision=run.ctx.precision.precision)
    with torch.no_grad():
        values = [critic(f).double() for f in feats]
    advantages, targets = [], []
    for ep, v in zip(episodes, values, strict=True):
        bound = episode_boundary(ep.trajectory.termination, len(ep.turns))
        assert bound is not None
        outcome = None if bound.bootstrap else ep.trajectory.task_success
        res = gae(turn_rewards(bound.n_turns, outcome, bound.bootstrap), v, c.gamma,
                  c.gae_lambda, bound.bootstrap)
        advantages.append(tuple(res.advantages_K.tolist())
                          + (0.0,) * (len(ep.turns) - bound.n_turns))
        targets.append(res.returns_K)
    loss = fit_values(critic, optimizer, feats, targets, CRITIC_EPOCHS)
    flat = [a for adv in advantages for a in adv]
    record: dict[str, Any] = {
        "gamma": c.gamma, "lambda": c.gae_lambda, "value_loss": loss,
        "mean_value_h0": sum(float(v[0]) for v in values) / len(values),
        "mean_turn_advantage": sum(flat) / len(flat), "bootstrapped": len(final)}
    return dataclasses.replace(
        summary, estimator="gae", episodes=tuple(episodes),
        advantages=tuple(sum(a) / len(a) for a in advantages),
        success=tuple(bool((ep.trajectory.task_success or 0) >= 1.0) for ep in episodes),
        turn_advantages=tuple(advantages), record=record,
        seconds={"critic_s": time.perf_counter() - t0})
