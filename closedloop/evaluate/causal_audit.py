"""The causal audit of a credit estimator (causal audit, docs/credit.md).

A dense score is not causal credit: a per-turn score can correlate with success while the
action it scores changes nothing. The audit intervenes on recorded actions at fixed snapshots
and asks whether an estimator's credit ranks actions by their effect on the terminal return.

Intervention (open loop, every other action held fixed): for turn t of a recorded, terminal,
scored episode, restore S_t by verified replay (``closedloop.rollout.prefix.restore_state``),
fork it, and replay the recorded actions after t with action t

- ``delete``: not executed at all, or
- ``replace``: replaced by ``replacement(episode, t)``;

the effect is Δ_t = R(τ) − R(τ^{t←x}), the recorded verified return minus the intervened one
(scored by the package's verifier). When the recorded actions run out before the intervened
episode ends (a deletion freed budget the recording spent), it is closed by ``close`` (default
``finish``, the contract's end-of-episode action); one that still does not reach a terminal
state is *unmeasured* (counted, never scored 0).

For each arm (an estimator's per-turn credits; keep an outcome-only arm, whose credit is the
episode's return on every turn, and a within-episode shuffle of the estimator as its null):

- ``within``: the mean over episodes of the Spearman rank correlation between an episode's turn
  credits and their effects (episodes where either is constant are undefined and counted), with
  a percentile-bootstrap interval over episodes: does the estimator rank *an episode's own*
  actions by effect? Outcome-only credit cannot rank them (all ties);
- ``pooled``: the Spearman correlation over all measured (credit, effect) pairs, with a cluster
  bootstrap over episodes (between-episode differences included);
- ``top_minus_bottom``: per episode, the mean effect of the measured actions ranked highest
  minus that of those ranked lowest (ties share a rank; ``which="extremes"`` intervenes only on
  the turns an arm ranks highest and lowest), bootstrap over episodes.

The audit can reject a score unrelated to action effect; it cannot prove an estimator right.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from closedloop.contracts import Action, AgentEnv, Episode, TaskVerifier
from closedloop.errors import CausalAuditError
from closedloop.evaluate.stats import BootstrapCI, bootstrap_mean_ci
from closedloop.rollout.prefix import executed_turns, restore_state

__all__ = ["AuditArm", "TurnEffect", "audit_arm", "causal_audit", "intervention_effect",
           "outcome_only_credit", "shuffled_credit", "spearman"]

Kind = Literal["delete", "replace"]
Replacement = Callable[[Episode, int], "Action | str"]
_FINISH = Action.finish()
Credits = Mapping[str, Sequence[float]]
"""Per-turn credit by episode id (one value per executed turn)."""


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's ρ with average ranks for ties; ``None`` when either side is constant or
    there are fewer than two pairs."""
    a, b = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if a.size < 2 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return None
    ra, rb = _ranks(a), _ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])


def _ranks(v: np.ndarray) -> np.ndarray:
    order = np.argsort(v, kind="mergesort")
    ranks = np.empty(v.size)
    ranks[order] = np.arange(v.size, dtype=np.float64)
    for value in np.unique(v):
        tie = v == value
        ranks[tie] = ranks[tie].mean()
    return ranks


def intervention_effect(episode: Episode, turn: int, make_env: Callable[[], AgentEnv],
                        verifier: TaskVerifier, kind: Kind,
                        replacement: Replacement | None = None,
                        close: Action | None = _FINISH) -> float | None:
    """Δ_t of the module docstring, or ``None`` when the intervened sequence does not end."""
    traj = episode.trajectory
    if traj.task_success is None or not traj.termination.is_terminal:
        raise CausalAuditError(f"episode {traj.episode_id} is not a scored terminal episode")
    env = make_env()
    snapshot = restore_state(episode, turn, env)
    fork = env.fork(snapshot, branch_id=f"audit-{kind}-{turn}")
    n = executed_turns(episode)
    actions: list[Action | str] = [t.action_text for t in episode.turns[turn + 1:n]]
    if kind == "replace":
        if replacement is None:
            raise CausalAuditError("kind 'replace' needs a replacement")
        actions.insert(0, replacement(episode, turn))
    if close is not None:
        actions.append(close)
    done = False
    for action in actions:
        done = fork.step(action).done
        if done:
            break
    if not done:
        return None
    result = verifier.score_or_quarantine(traj.task_id, fork.export_state())
    if result.reward is None:
        return None
    return float(traj.task_success) - float(result.reward.get("task_success", 0.0))


@dataclass(frozen=True)
class TurnEffect:
    """One intervened turn: its episode, turn, the arm's credit and the measured effect."""

    episode_id: str
    turn: int
    credit: float
    effect: float | None


@dataclass(frozen=True)
class AuditArm:
    """One arm's audit (module docstring); an interval is ``None`` where it is undefined."""

    name: str
    within: BootstrapCI | None
    within_undefined: int
    pooled: BootstrapCI | None
    top_minus_bottom: BootstrapCI | None
    n_pairs: int
    n_unmeasured: int
    n_episodes: int

    def to_dict(self) -> dict[str, object]:
        """The JSON form (intervals as estimate, lo, hi, n)."""
        def ci(c: BootstrapCI | None) -> dict[str, float] | None:
            return None if c is None else {"estimate": c.estimate, "lo": c.lo, "hi": c.hi,
                                           "n": c.n}
        return {"name": self.name, "within": ci(self.within),
                "within_undefined": self.within_undefined, "pooled": ci(self.pooled),
                "top_minus_bottom": ci(self.top_minus_bottom), "n_pairs": self.n_pairs,
                "n_unmeasured": self.n_unmeasured, "n_episodes": self.n_episodes}


def _pooled_ci(by_episode: list[list[TurnEffect]], n_boot: int, seed: int,
               alpha: float) -> BootstrapCI | None:
    pairs = [e for eps in by_episode for e in eps]
    est = spearman([e.credit for e in pairs], [e.effect or 0.0 for e in pairs])
    if est is None:
        return None
    rng = np.random.default_rng(seed)
    stats = []
    for _ in range(n_boot):
        pick = rng.integers(0, len(by_episode), size=len(by_episode))
        sample = [e for i in pick for e in by_episode[i]]
        rho = spearman([e.credit for e in sample], [e.effect or 0.0 for e in sample])
        if rho is not None:
            stats.append(rho)
    if not stats:
        return None
    lo, hi = np.quantile(stats, [alpha / 2, 1 - alpha / 2])
    return BootstrapCI(est, float(lo), float(hi), len(pairs), n_boot, alpha)


def _extremes(effects: list[TurnEffect]) -> float | None:
    """Mean effect of the measured turns ranked highest minus that of those ranked lowest
    (ties share a rank); None when the credits of the measured turns are all equal."""
    measured = [e for e in effects if e.effect is not None]
    if not measured:
        return None
    credits = [e.credit for e in measured]
    top, bottom = max(credits), min(credits)
    if top == bottom:
        return None
    hi = [float(e.effect or 0) for e in measured if e.credit == top]
    lo = [float(e.effect or 0) for e in measured if e.credit == bottom]
    return sum(hi) / len(hi) - sum(lo) / len(lo)


def audit_arm(name: str, effects: Sequence[TurnEffect], *, n_boot: int = 2000, seed: int = 0,
              alpha: float = 0.05) -> AuditArm:
    """The statistics of one arm over its intervened turns (module docstring)."""
    by_id: dict[str, list[TurnEffect]] = {}
    for e in effects:
        by_id.setdefault(e.episode_id, []).append(e)
    measured = [[e for e in eps if e.effect is not None] for eps in by_id.values()]
    measured = [eps for eps in measured if eps]
    rhos = [spearman([e.credit for e in eps], [float(e.effect or 0) for e in eps])
            for eps in measured]
    defined = [r for r in rhos if r is not None]
    within = bootstrap_mean_ci(defined, n_boot, seed=seed, alpha=alpha) if defined else None
    diffs = [d for d in (_extremes(eps) for eps in by_id.values()) if d is not None]
    tmb = bootstrap_mean_ci(diffs, n_boot, seed=seed, alpha=alpha) if diffs else None
    return AuditArm(name, within, len(rhos) - len(defined),
                    _pooled_ci(measured, n_boot, seed, alpha) if measured else None, tmb,
                    sum(len(eps) for eps in measured),
                    sum(1 for e in effects if e.effect is None), len(by_id))


def outcome_only_credit(episodes: Sequence[Episode]) -> dict[str, list[float]]:
    """The outcome-only arm: every executed turn gets its episode's verified return."""
    return {ep.trajectory.episode_id: [float(ep.trajectory.task_success or 0.0)]
            * executed_turns(ep) for ep in episodes}


def shuffled_credit(credits: Credits, seed: int) -> dict[str, list[float]]:
    """The null of an estimator: its credits permuted within each episode (seeded)."""
    out = {}
    for eid in sorted(credits):
        values = list(credits[eid])
        random.Random(f"audit-shuffle/{seed}/{eid}").shuffle(values)
        out[eid] = values
    return out


def _turns(credit: Sequence[float], which: str) -> list[int]:
    if which == "all":
        return list(range(len(credit)))
    top, bottom = max(credit), min(credit)
    return sorted({credit.index(top), credit.index(bottom)})


def causal_audit(episodes: Sequence[Episode], arms: Mapping[str, Credits],
                 make_env: Callable[[], AgentEnv], verifier: TaskVerifier, *,
                 kind: Kind = "delete", which: Literal["all", "extremes"] = "all",
                 replacement: Replacement | None = None, close: Action | None = _FINISH,
                 n_boot: int = 2000, seed: int = 0) -> dict[str, AuditArm]:
    """Audit every arm on the scored terminal ``episodes`` (module docstring).

    Each (episode, turn) is intervened on once and its effect shared by every arm that needs
    it. ``arms[name][episode_id]`` holds one credit per executed turn of that episode.
    """
    scored = [ep for ep in episodes if ep.trajectory.termination.is_terminal
              and ep.trajectory.task_success is not None and executed_turns(ep) >= 2]
    cache: dict[tuple[str, int], float | None] = {}
    out = {}
    for name, credits in arms.items():
        effects = []
        for ep in scored:
            eid = ep.trajectory.episode_id
            credit = list(credits[eid])
            if len(credit) != executed_turns(ep):
                raise CausalAuditError(f"arm {name}: {len(credit)} credits for the "
                                 f"{executed_turns(ep)} turns of {eid}")
            for t in _turns(credit, which):
                if (eid, t) not in cache:
                    cache[(eid, t)] = intervention_effect(ep, t, make_env, verifier, kind,
                                                          replacement, close)
                effects.append(TurnEffect(eid, t, credit[t], cache[(eid, t)]))
        out[name] = audit_arm(name, effects, n_boot=n_boot, seed=seed)
    return out
