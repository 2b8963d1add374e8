"""``ratio_on_policy`` in bf16 over many seeds (closedloop.evaluate.gates.signal): each step's
p99 |log πθ/π_beh| against the audit's p99 bound (2 × the p99 of the bf16 same-engine
baseline, floored at ``consistency.max_abs_log_ratio``), the step max kept as a figure.

bf16 is emulated (slow) on CPUs without native bf16, so the log-ratios are synthetic, drawn from
a model of bf16 rounding: each side's log-prob moves by ε·s_t, ε ~ N(0, 1), s_t = 0.004·(1 +
|log p_t|), with a rare-token tail (2% of the sampled tokens twelve times as unlikely). The
baseline b_t is one rounding (the audit: bf16 against fp32 in one engine), a step's log r is the
generator's rounding minus the trainer's. Over 200 seeds a healthy run passes every time on the
p99 rule, where a max against 2 × the baseline's max fails more than a third of them (a max grows
with the tokens it is taken over: 32 000 per run against 2 000 audited); a trainer that scores
at temperature 1 what was sampled at 0.7 fails on every one of 50 seeds even where its recorded
temperature matches."""

from __future__ import annotations

from pathlib import Path

import torch

from closedloop.evaluate.gates.base import GateOptions
from closedloop.evaluate.gates.signal import gate_ratio_on_policy
from closedloop.evaluate.rundir import RunDir
from closedloop.learn.objectives import ratio_stats

SEEDS = 200
TAU = 1e-3
AUDITED, STEP_TOKENS, STEPS = 2000, 8000, 4


def rounding(g: torch.Generator, n: int) -> torch.Tensor:
    """One bf16 rounding of n sampled tokens' log-probs (the noise model above)."""
    logp = -torch.empty(n, dtype=torch.float64).exponential_(2.0, generator=g)
    rare = torch.rand(n, generator=g) < 0.02
    logp = torch.where(rare, logp * 6, logp)
    return 0.004 * (1 + logp.abs()) * torch.randn(n, generator=g, dtype=torch.float64)


def tempered_shift(g: torch.Generator, n: int, sampled: float = 0.7,
                   scored: float = 1.0) -> torch.Tensor:
    """log softmax(z/scored)[a] − log softmax(z/sampled)[a] for a ~ softmax(z/sampled)."""
    z = 2.0 * torch.randn(n, 32, generator=g, dtype=torch.float64)
    a = torch.multinomial(torch.softmax(z / sampled, dim=1), 1, generator=g).squeeze(1)
    rows = torch.arange(n)
    return (torch.log_softmax(z / scored, dim=1)[rows, a]
            - torch.log_softmax(z / sampled, dim=1)[rows, a])


def run_of(steps: list[torch.Tensor], baseline: torch.Tensor) -> RunDir:
    """A bf16 run audited against the bf16 same-engine baseline, its rl_step metrics the
    trainer's ``ratio_stats`` of each step's log-ratios."""
    audit = {"tolerance_source": "bf16_same_engine_baseline",
             "tolerance_max": max(TAU, 2 * float(baseline.max())),
             "tolerance_p99": max(TAU, 2 * float(torch.quantile(baseline, 0.99)))}
    metrics = []
    for k, log_r in enumerate(steps):
        stats = ratio_stats(log_r)
        metrics.append({"kind": "rl_step", "step": k, "metrics": {
            "ratio/abs_log_ratio_max": stats["abs_log_ratio_max"],
            "ratio/abs_log_ratio_p99": stats["abs_log_ratio_p99"]}})
    config = {"rollout": {"temperature": 0.7}, "consistency": {"max_abs_log_ratio": TAU},
              "training": {"precision": "bfloat16"}, "update": {"objective": "reinforce_with_kl"}}
    return RunDir(path=Path("/nonexistent"), config=config, config_meta={},
                  trainer={"objective": "reinforce_with_kl", "temperature": 0.7}, tasks=None,
                  summary=None, audit=audit, metrics=tuple(metrics), traces={})


def test_a_healthy_bf16_run_passes_on_every_seed_where_a_max_rule_fails_by_chance() -> None:
    passed = max_rule_failed = 0
    for seed in range(SEEDS):
        g = torch.Generator().manual_seed(seed)
        baseline = rounding(g, AUDITED).abs()
        steps = [rounding(g, STEP_TOKENS) - rounding(g, STEP_TOKENS) for _ in range(STEPS)]
        run = run_of(steps, baseline)
        gate = gate_ratio_on_policy(run, GateOptions())
        passed += gate.passed is True
        assert gate.evidence["statistic"] == "ratio/abs_log_ratio_p99"
        assert gate.evidence["max_abs_log_ratio"] == max(float(s.abs().max()) for s in steps)
        max_rule_failed += gate.evidence["max_abs_log_ratio"] > run.audit["tolerance_max"]
    assert passed == SEEDS
    assert max_rule_failed > SEEDS // 3  # the rule this one replaced failed by chance


def test_a_run_scored_at_the_wrong_temperature_fails_on_every_seed() -> None:
    for seed in range(SEEDS // 4):
        g = torch.Generator().manual_seed(10_000 + seed)
        baseline = rounding(g, AUDITED).abs()
        steps = [tempered_shift(g, STEP_TOKENS // 4) + rounding(g, STEP_TOKENS // 4)
                 for _ in range(STEPS)]
        gate = gate_ratio_on_policy(run_of(steps, baseline), GateOptions())
        assert gate.passed is False, (seed, gate.detail)
        assert gate.evidence["steps_over"] == STEPS  # the ratio itself, not the config
