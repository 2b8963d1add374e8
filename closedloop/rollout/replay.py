"""Environment-side replay of a trace (docs/concepts.md, snapshot fidelity).

Given the recorded actions, a fresh environment must reproduce every observation, every state
hash and the verifier's reward exactly. Token sampling is not replayed (it need not be
reproducible across engines); the recorded action text is re-executed as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from closedloop.contracts import AgentEnv, Episode, TaskVerifier, load_episodes


@dataclass(frozen=True)
class EpisodeReplay:
    """The replay verdict for one episode; ``mismatches`` names the first differences."""

    episode_id: str
    task_id: str
    turns: int
    observations_match: bool
    state_hashes_match: bool
    reward_match: bool | None
    mismatches: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        """True when everything recorded was reproduced."""
        return self.observations_match and self.state_hashes_match and self.reward_match is not \
            False


@dataclass(frozen=True)
class ReplayReport:
    """Replay verdicts for a whole trace."""

    path: str
    episodes: tuple[EpisodeReplay, ...]

    @property
    def ok(self) -> bool:
        """True when every episode reproduced."""
        return all(e.ok for e in self.episodes)

    def counts(self) -> dict[str, int]:
        """Totals for a one-line report."""
        return {"episodes": len(self.episodes), "reproduced": sum(e.ok for e in self.episodes),
                "turns": sum(e.turns for e in self.episodes)}


def replay_episode(episode: Episode, env: AgentEnv, scorer: TaskVerifier | None
                   ) -> EpisodeReplay:
    """Re-execute one episode's recorded actions in ``env`` and compare."""
    traj = episode.trajectory
    problems: list[str] = []
    env.reset(traj.task_id, traj.seed)
    base = env.snapshot("base")
    if base.snapshot_id != traj.base_snapshot_id:
        problems.append(f"base snapshot {base.snapshot_id} != {traj.base_snapshot_id}")
    obs_ok = states_ok = True
    for turn in episode.turns:
        if env.state_hash() != turn.state_before:
            states_ok = False
            problems.append(f"turn {turn.turn}: state before differs")
        if turn.generation_finish == "length" or turn.observation_error == "infra_abort":
            break  # the collector never executed this action
        tr = env.step(turn.action_text)
        if tr.observation != turn.observation:
            obs_ok = False
            problems.append(f"turn {turn.turn}: observation differs")
        if tr.state_version != turn.state_after or env.state_hash() != turn.state_after:
            states_ok = False
            problems.append(f"turn {turn.turn}: state after differs")
    reward_ok: bool | None = None
    if traj.reward is not None and scorer is not None:
        result = scorer.score_or_quarantine(traj.task_id, env.export_state())
        reward_ok = result.reward == traj.reward
        if not reward_ok:
            problems.append(f"reward {result.reward} != recorded {traj.reward}")
    return EpisodeReplay(traj.episode_id, traj.task_id, len(episode.turns), obs_ok, states_ok,
                         reward_ok, tuple(problems[:5]))


def replay_trace(path: str | Path, env_factory: Callable[[], AgentEnv],
                 scorer: TaskVerifier | None, episode_ids: Sequence[str] | None = None
                 ) -> ReplayReport:
    """Replay every episode (or the named ones) of a trace file on fresh environments."""
    _, episodes = load_episodes(path)
    chosen = [e for e in episodes if episode_ids is None
              or e.trajectory.episode_id in episode_ids]
    return ReplayReport(str(path), tuple(replay_episode(e, env_factory(), scorer)
                                         for e in chosen))
