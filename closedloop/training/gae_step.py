"""Turn-level GAE in an LLM run (``credit.estimator: gae``; turn-level credit, docs/credit.md).

The critic (``closedloop.learn.critic.TurnCritic``) reads the policy's final-layer hidden state
at every turn boundary of the step's admitted episodes (one extra forward pass without
gradient); each episode's turn advantages are its GAE with the termination taxonomy's
boundary rule (terminal: V(h_K) = 0; the collector's turn limit: V(h_K) bootstraps from the
context after the rendered last observation; a cut-off last action: credited up to it; system
events, quarantined and unscored terminal episodes: no credit), painted onto each turn's own
action tokens. The critic is then fit to the GAE targets R^λ_k (``CRITIC_EPOCHS`` Adam steps
on the cached features, ``credit.critic_learning_rate``).

The critic and its optimizer are state beside the policy: ``critic/step-NNNNNN.pt`` is written
(atomically, before the trainer checkpoint of that step) and a resume loads the one of the
checkpoint's step, so a resumed run continues with exactly the critic it had.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from closedloop.contracts import Episode, Termination
from closedloop.errors import CheckpointError
from closedloop.learn.critic import TurnCritic, boundary_features, fit_values
from closedloop.learn.turn_credit import episode_boundary, gae, turn_rewards

__all__ = ["CRITIC_EPOCHS", "credited", "critic_path", "load_critic", "new_critic", "save_critic",
           "turn_gae"]

CRITIC_EPOCHS = 4
"""Adam steps of the critic on each RL step's boundary features."""


def credited(episode: Episode) -> bool:
    """Whether GAE credits the episode (module docstring)."""
    traj = episode.trajectory
    bound = episode_boundary(traj.termination, len(episode.turns))
    if bound is None or bound.n_turns == 0 or traj.quarantine_reason is not None:
        return False
    return bound.bootstrap or traj.task_success is not None


def new_critic(model: Any, seed: int, learning_rate: float
               ) -> tuple[TurnCritic, torch.optim.Optimizer]:
    """A fresh critic over ``model``'s hidden size, and its Adam optimizer."""
    critic = TurnCritic(int(model.config.hidden_size), seed=seed)
    return critic, torch.optim.Adam(critic.parameters(), lr=learning_rate)


def critic_path(run_dir: Path, step: int) -> Path:
    """Where the critic of checkpoint ``step`` is kept."""
    return run_dir / "critic" / f"step-{step:06d}.pt"


def save_critic(run_dir: Path, step: int, critic: TurnCritic,
                optimizer: torch.optim.Optimizer) -> None:
    """Write the critic and its optimizer for checkpoint ``step`` (temporary file, fsync,
    rename)."""
    path = critic_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        torch.save({"critic": critic.state_dict(), "optimizer": optimizer.state_dict()}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load_critic(run_dir: Path, step: int, critic: TurnCritic,
                optimizer: torch.optim.Optimizer) -> None:
    """Load the critic of checkpoint ``step`` (``CheckpointError`` when it is missing)."""
    path = critic_path(run_dir, step)
    if not path.is_file():
        raise CheckpointError(f"{path}: the critic of checkpoint step {step} is missing")
    state = torch.load(path, weights_only=True)
    critic.load_state_dict(state["critic"])
    optimizer.load_state_dict(state["optimizer"])


def turn_gae(run: Any, critic: TurnCritic, optimizer: torch.optim.Optimizer,
             episodes: list[Episode]) -> tuple[list[list[float]], dict[str, Any]]:
    """Each episode's per-turn advantages (one per recorded turn, 0 on a turn it does not
    credit) and the record of the critic's work; fits the critic on the way."""
    c = run.cfg.credit
    final = {}
    for ep in episodes:
        if ep.trajectory.termination == Termination.MAX_STEP_TRUNCATION:
            last = ep.turns[-1]
            final[ep.trajectory.episode_id] = run.renderer.render_observation(
                last.observation, turn_closed=run.renderer.turn_closed(last.action_token_ids))
    feats = boundary_features(run.model, episodes, run.pad_id, final,
                              precision=run.precision.precision)
    with torch.no_grad():
        values = [critic(f).double() for f in feats]
    advantages, targets = [], []
    for ep, v in zip(episodes, values, strict=True):
        bound = episode_boundary(ep.trajectory.termination, len(ep.turns))
        assert bound is not None
        outcome = None if bound.bootstrap else ep.trajectory.task_success
        res = gae(turn_rewards(bound.n_turns, outcome, bound.bootstrap), v, c.gamma,
                  c.gae_lambda, bound.bootstrap)
        advantages.append(res.advantages_K.tolist() + [0.0] * (len(ep.turns) - bound.n_turns))
        targets.append(res.returns_K)
    loss = fit_values(critic, optimizer, feats, targets, CRITIC_EPOCHS)
    flat = [a for adv in advantages for a in adv]
    return advantages, {"gamma": c.gamma, "lambda": c.gae_lambda, "value_loss": loss,
                        "mean_value_h0": float(sum(float(v[0]) for v in values) / len(values)),
                        "mean_turn_advantage": sum(flat) / len(flat) if flat else None,
                        "bootstrapped": len(final)}
