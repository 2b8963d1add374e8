"""The recurrent actor–critic on a feature environment (key-and-door by default), trained
through closedloop's contracts, with sparse reward and with potential-based shaping
(the recurrent actor–critic, docs/credit.md).

One *arm* is one run directory. Each iteration:

1. the current weights are a policy version (``v0000``, ``v0001``, …) with a ``PolicyManifest``
   (weight checksum, the feature scaffold's hashes, the sampler);
2. the collector plays ``group_size`` episodes of every train task with the
   ``FeatureSource`` (per-episode sampling streams, behaviour log-probs recorded), the
   package's verifier scores the terminal ones, and termination codes are the collector's;
3. the update is rebuilt from those episode records alone (``closedloop.learn.ac_update``):
   turn-level GAE with the recurrent critic, the clipped surrogate against the recorded
   behaviour log-probs, ``epochs`` Adam steps on the batch;
4. with ``shaping``, each episode's per-turn rewards add F_k = γΦ'(s_{k+1}) − Φ(s_k) from the
   package's potential over its replayed states (``closedloop.learn.shaping``), and the
   iteration records the largest deviation from "shaped return − sparse return = −Φ(s_0) +
   γ^K Φ'(s_K)" over its episodes.

Every ``eval_every`` iterations (and at the end) the greedy policy (arg-max, a point mass)
plays each train and held-out task once; success is reported per task stratum (the package's
``task_strata``: key-and-door's exit colour). Traces: every ``trace_every``-th iteration's
episodes and every evaluation (``traces/``); ``metrics.jsonl`` has one record per iteration and
per evaluation; ``model.pt`` the final weights.

Run both arms and the report: ``python -m closedloop.experiments.recurrent_ac_report --run-dir
DIR``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from closedloop.contracts import Episode, SamplerConfig, TraceWriter, sha256_hex
from closedloop.contracts.package import EnvPackage, TaskSetRequest
from closedloop.envs.discovery import resolve_package
from closedloop.errors import LearnError
from closedloop.learn.ac_update import ACConfig, ac_loss, turn_batch
from closedloop.learn.credit import returns_to_go
from closedloop.learn.recurrent_ac import FeatureRenderer, FeatureSource, RecurrentActorCritic
from closedloop.learn.shaping import recorded_shaping
from closedloop.learn.turn_credit import episode_boundary, turn_rewards
from closedloop.policy import weights_checksum
from closedloop.training.wiring import CollectorParts, build_manifest, make_collector

__all__ = ["ACRunConfig", "train_arm"]


@dataclass(frozen=True)
class ACRunConfig:
    """Everything one arm does (recorded in its ``config.json``)."""

    env_id: str = "keydoor-v1"
    train_tasks: int = 32
    heldout_tasks: int = 16
    iterations: int = 80
    group_size: int = 4
    max_turns: int = 12
    hidden: int = 64
    learning_rate: float = 3e-3
    epochs: int = 4
    gamma: float = 0.99
    lam: float = 0.95
    clip_eps: float = 0.2
    value_coef: float = 0.5
    entropy_coef: float = 0.05
    max_grad_norm: float = 1.0
    eval_every: int = 5
    trace_every: int = 10
    seed: int = 0

    def ac(self) -> ACConfig:
        """The loss hyperparameters."""
        return ACConfig(self.gamma, self.lam, self.clip_eps, self.value_coef, self.entropy_coef)


class _Arm:
    """The state of one arm's run (see the module docstring)."""

    def __init__(self, cfg: ACRunConfig, run_dir: Path, shaping: bool) -> None:
        self.cfg, self.dir, self.shaping = cfg, run_dir, shaping
        self.package: EnvPackage = resolve_package(cfg.env_id)
        if self.package.feature_codec is None or (shaping and self.package.potential is None):
            raise LearnError(f"{cfg.env_id} needs a feature codec (and a potential to shape)")
        self.codec = self.package.feature_codec
        self.renderer = FeatureRenderer(self.package)
        sets = self.package.task_sets(TaskSetRequest(cfg.train_tasks, cfg.heldout_tasks,
                                                     seed=cfg.seed))
        self.train, self.heldout = sets.train, sets.heldout
        torch.manual_seed(cfg.seed)
        self.model = RecurrentActorCritic(self.codec.n_features, len(self.codec.actions),
                                          cfg.hidden, cfg.seed)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.learning_rate)
        (self.dir / "traces").mkdir(parents=True, exist_ok=True)
        self.metrics = (self.dir / "metrics.jsonl").open("w", encoding="utf-8")

    def log(self, record: dict[str, Any]) -> None:
        self.metrics.write(json.dumps(record, sort_keys=True) + "\n")
        self.metrics.flush()

    def collect(self, version: str, tasks: tuple[str, ...], group_size: int, greedy: bool,
                salt: int, trace: Path | None) -> list[Episode]:
        """Episodes of ``tasks`` under the current weights as policy ``version``."""
        sampler = SamplerConfig(greedy=greedy)
        manifest = build_manifest(
            policy_version=version, weight_checksum=weights_checksum(self.model),
            tokenizer_revision=sha256_hex(self.codec.version), renderer=self.renderer,
            sampler=sampler, step_budget=self.cfg.max_turns, max_action_tokens=1,
            model_id=f"recurrent-ac-h{self.cfg.hidden}")
        source = FeatureSource(self.model, self.codec, sampler)
        writer = TraceWriter(trace) if trace is not None else None
        try:
            collector = make_collector(source, manifest, CollectorParts(
                self.renderer, self.package.verifier(), self.dir.name, writer,
                self.cfg.max_turns, self.package, sampling_salt=salt))
            leases = [collector.make_lease(f"{version}-{'e' if greedy else 'g'}{i}", t, 1,
                                           group_size) for i, t in enumerate(tasks)]
            return [ep for g in collector.collect(leases) for ep in g.episodes]
        finally:
            if writer is not None:
                writer.close()

    def shaping_rewards(self, episodes: list[Episode]) -> tuple[dict[str, list[float]], float]:
        """Per-episode shaping terms, and the largest |(shaped − sparse) − boundary| over
        the episodes (the returns as the update sees them, discounted by γ)."""
        assert self.package.potential is not None
        terms: dict[str, list[float]] = {}
        worst = 0.0
        gamma = self.cfg.gamma
        for ep in episodes:
            shaped = recorded_shaping(ep, self.package.make_env(), self.package.potential, gamma)
            bound = episode_boundary(ep.trajectory.termination, len(ep.turns))
            if shaped is None or bound is None or bound.n_turns == 0:
                continue
            terms[ep.trajectory.episode_id] = list(shaped.terms)
            outcome = None if bound.bootstrap else ep.trajectory.task_success
            if not bound.bootstrap and outcome is None:
                continue
            sparse = turn_rewards(bound.n_turns, outcome, bound.bootstrap)
            dense = turn_rewards(bound.n_turns, outcome, bound.bootstrap, shaped.terms)
            gap = float(returns_to_go(dense, gamma)[0] - returns_to_go(sparse, gamma)[0])
            worst = max(worst, abs(gap - shaped.boundary_term))
        return terms, worst

    def update(self, episodes: list[Episode], step_rewards: dict[str, list[float]] | None
               ) -> dict[str, float]:
        """``epochs`` clipped actor–critic steps on the batch; the first pass's figures."""
        batch = turn_batch(episodes, self.codec, step_rewards)
        first: dict[str, float] = {}
        for epoch in range(self.cfg.epochs):
            out = ac_loss(self.model, batch, self.cfg.ac())
            self.optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
            self.optimizer.step()
            if epoch == 0:
                first = {"policy_loss": out.policy_loss, "value_loss": out.value_loss,
                         "entropy": out.entropy, "ratio_max": out.ratio_max}
        return first

    def evaluate(self, iteration: int, version: str) -> dict[str, Any]:
        """Greedy success on each suite, per stratum (exit colour), recorded and returned."""
        out: dict[str, Any] = {"kind": "eval", "iteration": iteration, "policy_version": version}
        for suite, tasks in (("train", self.train), ("heldout", self.heldout)):
            trace = self.dir / "traces" / f"eval-{suite}-{iteration:04d}.jsonl"
            eps = self.collect(version, tasks, 1, True, 0, trace)
            out[suite] = _by_stratum(self.package, eps)
        self.log(out)
        return out


def _by_stratum(package: EnvPackage, episodes: list[Episode]) -> dict[str, Any]:
    """Success (scored episodes' mean task_success) overall and per ``exit`` stratum."""
    groups: dict[str, list[float]] = {}
    for ep in episodes:
        label = (package.task_strata(ep.trajectory.task_id).get("exit", "all")
                 if package.task_strata else "all")
        groups.setdefault(label, []).append(float(ep.trajectory.task_success or 0.0))
    every = [v for vs in groups.values() for v in vs]
    return {"all": sum(every) / len(every) if every else None, "n": len(every),
            **{k: sum(v) / len(v) for k, v in sorted(groups.items())}}


def train_arm(cfg: ACRunConfig, run_dir: str | Path, shaping: bool) -> dict[str, Any]:
    """Train one arm in ``run_dir`` (module docstring) and return its summary."""
    arm = _Arm(cfg, Path(run_dir), shaping)
    (arm.dir / "config.json").write_text(json.dumps({
        **asdict(cfg), "shaping": shaping, "codec": arm.codec.version,
        "train": list(arm.train), "heldout": list(arm.heldout)}, indent=2, sort_keys=True))
    t0 = time.perf_counter()
    evals = [arm.evaluate(0, "v0000")]
    for it in range(cfg.iterations):
        t1 = time.perf_counter()
        version = f"v{it:04d}"
        trace = (arm.dir / "traces" / f"iter-{it:04d}.jsonl") if it % cfg.trace_every == 0 \
            else None
        episodes = arm.collect(version, arm.train, cfg.group_size, False, cfg.seed * 10**6 + it,
                               trace)
        terms, worst = arm.shaping_rewards(episodes) if shaping else (None, None)
        figures = arm.update(episodes, terms)
        scores = [ep.trajectory.task_success for ep in episodes]
        arm.log({"kind": "iteration", "iteration": it, "policy_version": version,
                 "episodes": len(episodes),
                 "train_success": sum(s or 0.0 for s in scores) / len(scores),
                 "boundary_max_dev": worst, **figures,
                 "seconds": time.perf_counter() - t1, "elapsed_s": time.perf_counter() - t0})
        if (it + 1) % cfg.eval_every == 0 or it + 1 == cfg.iterations:
            evals.append(arm.evaluate(it + 1, f"v{it + 1:04d}"))
    torch.save(arm.model.state_dict(), arm.dir / "model.pt")
    arm.metrics.close()
    summary = {"shaping": shaping, "wall_s": time.perf_counter() - t0, "final": evals[-1],
               "evaluations": evals}
    (arm.dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    return summary
