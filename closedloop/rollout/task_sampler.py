"""Difficulty-band task sampler with four auditable streams (docs/concepts.md, difficulty
bands).

Per task it keeps counts: successes s and scored attempts n (one ``update`` per scored group),
the sizes of the groups seen and how many were zero-variance, infrastructure/verifier failures,
and a quarantine reason. From s and n it derives p̂ = s/n and the Wilson interval [lo, hi] at
``z`` (center (p̂ + z²/2n)/(1 + z²/n), half-width z·sqrt(p̂(1−p̂)/n + z²/4n²)/(1 + z²/n)).

Streams, for a band (b_lo, b_hi), in this order of precedence:

- ``quarantined``: a reason is set, by hand (``quarantine``) or by rule (``record_failure``
  reaching ``max_failures``: the environment or verifier failed on it that many times). Never
  sampled until ``release``.
- ``learnable``: n = 0 (unknown), or [lo, hi] overlaps the band: success and failure both
  remain plausible.
- ``mastered``: lo > b_hi, confidently above the band (the retain stream that watches for
  forgetting).
- ``hard``: hi < b_lo, confidently below the band (the frontier stream; ``rare_successes``
  says whether any positive example was seen).

With z = 1.96 and the band (0.2, 0.8), one unanimous group of 8 keeps a task learnable
(0/8 -> hi = 0.324; 8/8 -> lo = 0.676); it takes two (0/16 -> hi = 0.194; 16/16 -> lo = 0.806)
to leave it, so a task is never moved after one unlucky group.

Sampling. Each draw is independent (with replacement): a stream s is chosen with probability
w_s / Σ w over the non-empty sampled streams, then a task uniformly inside it, so the
*propensity* of task i in stream s is

    π_i = w_s / (Σ_{s' non-empty} w_{s'}) · 1 / |s|,      Σ_i π_i = 1,

and the expected number of draws of i among n is n·π_i. ``sample(n, step)`` is a pure function
of (seed, step, the counts): the RNG is ``random.Random(f"task-sampler/{seed}/{step}")``.
Every ``TaskDraw`` carries its task's family, stream and π_i, to be stored with the sample.

Informative groups (docs/concepts.md, difficulty bands): a Bernoulli(p) group of m siblings is
zero-variance with
probability P_deg(p, m) = p^m + (1−p)^m. ``informative_stats`` compares the observed
zero-variance rate with Σ_groups P̂_deg / #groups, where P̂_deg for a task with n ≥ m is the
unbiased [C(s, m) + C(n−s, m)] / C(n, m) (else the plug-in at p̃ = (s+1)/(n+2)), and predicts the
next step's rate Σ_i π_i P̂_deg(i, G).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from closedloop.errors import (
    NoCandidateTasksError,
    TaskSamplerError,
    UnknownSamplerTaskError,
)
from closedloop.intervals import wilson_interval

Stream = Literal["learnable", "hard", "mastered", "quarantined"]
STREAMS: tuple[Stream, ...] = ("learnable", "hard", "mastered", "quarantined")
SAMPLED_STREAMS: tuple[Stream, ...] = ("learnable", "hard", "mastered")
DEFAULT_STREAM_WEIGHTS: Mapping[str, float] = {"learnable": 0.7, "hard": 0.15, "mastered": 0.15}
SAMPLER_VERSION = "difficulty-band-v1"


@dataclass(frozen=True)
class TaskCounts:
    """The evidence kept per task (the sampler's whole mutable state, one record per task).

    group_sizes: (m, number of scored groups of m siblings); failures: environment/verifier
    failures recorded since the last release; quarantine_reason: set while quarantined.
    """

    successes: int = 0
    attempts: int = 0
    group_sizes: tuple[tuple[int, int], ...] = ()
    zero_variance_groups: int = 0
    failures: int = 0
    quarantine_reason: str | None = None

    @property
    def groups(self) -> int:
        """Scored groups seen."""
        return sum(c for _, c in self.group_sizes)


@dataclass(frozen=True)
class TaskEstimate:
    """A task's success estimate, interval and stream at the current counts."""

    task_id: str
    family: str
    successes: int
    attempts: int
    p_hat: float | None
    wilson_lo: float
    wilson_hi: float
    stream: Stream
    quarantine_reason: str | None

    @property
    def rare_successes(self) -> bool:
        """A hard task with at least one success seen."""
        return self.stream == "hard" and self.successes > 0


@dataclass(frozen=True)
class TaskDraw:
    """One sampled task: store it with the sample (propensity = π_i of this draw)."""

    step: int
    index: int
    task_id: str
    family: str
    stream: Stream
    propensity: float

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return dict(self.__dict__)


@dataclass(frozen=True)
class InformativeStats:
    """Observed vs predicted zero-variance group rates (P(informative) = 1 − rate).

    observed_ci: Wilson interval of the observed rate (``None`` before any group).
    predicted_rate: Σ_groups P̂_deg(task, m) / groups over the groups seen.
    predicted_next_rate: Σ_i π_i P̂_deg(i, group_size) under the current propensities.
    """

    group_size: int
    groups: int
    zero_variance_groups: int
    observed_rate: float | None
    observed_ci: tuple[float, float] | None
    predicted_rate: float | None
    predicted_next_rate: float

    @property
    def predicted_next_informative(self) -> float:
        """1 − predicted_next_rate."""
        return 1.0 - self.predicted_next_rate

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {**self.__dict__, "predicted_next_informative": self.predicted_next_informative}


def wilson_bounds(successes: int, n: int, z: float) -> tuple[float, float]:
    """Wilson score interval (``closedloop.intervals.wilson_interval``);
    (0, 1) when n = 0 (no evidence yet)."""
    if n == 0:
        return 0.0, 1.0
    return wilson_interval(successes, n, z)


def p_zero_variance_estimate(successes: int, attempts: int, m: int) -> float:
    """Estimate P_deg(p, m) = p^m + (1−p)^m from s successes in n attempts.

    n ≥ m: [C(s, m) + C(n−s, m)] / C(n, m), unbiased for Binomial(n, p) counts. Otherwise the
    plug-in at the posterior mean p̃ = (s+1)/(n+2) (0.5 with no evidence).
    """
    if m < 1:
        raise TaskSamplerError(f"group size must be >= 1, got {m}")
    if attempts >= m:
        total = math.comb(attempts, m)
        return (math.comb(successes, m) + math.comb(attempts - successes, m)) / total
    p = (successes + 1) / (attempts + 2)
    return p**m + (1.0 - p) ** m


def classify(counts: TaskCounts, band: tuple[float, float], z: float) -> Stream:
    """The stream of a task from its counts (precedence as in the module docstring)."""
    if counts.quarantine_reason is not None:
        return "quarantined"
    if counts.attempts == 0:
        return "learnable"
    lo, hi = wilson_bounds(counts.successes, counts.attempts, z)
    if lo > band[1]:
        return "mastered"
    if hi < band[0]:
        return "hard"
    return "learnable"


def _check_config(band: tuple[float, float], z: float, weights: Mapping[str, float],
                  max_failures: int) -> None:
    if not 0.0 <= band[0] < band[1] <= 1.0:
        raise TaskSamplerError(f"band must satisfy 0 <= lo < hi <= 1, got {band}")
    if not z > 0:
        raise TaskSamplerError(f"z must be positive, got {z}")
    unknown = sorted(set(weights) - set(SAMPLED_STREAMS))
    if unknown:
        raise TaskSamplerError(f"stream_weights: unknown streams {unknown}; sampled streams are "
                               f"{list(SAMPLED_STREAMS)}")
    if any(not (w >= 0.0 and math.isfinite(w)) for w in weights.values()) or \
            not sum(weights.values()) > 0:
        raise TaskSamplerError(f"stream_weights must be finite, >= 0 and not all 0: {weights}")
    if max_failures < 1:
        raise TaskSamplerError(f"max_failures must be >= 1, got {max_failures}")


def _family_map(task_ids: Sequence[str],
                families: Mapping[str, str] | Sequence[str]) -> dict[str, str]:
    if len(set(task_ids)) != len(task_ids) or not task_ids:
        raise TaskSamplerError("task_ids must be non-empty and unique")
    if isinstance(families, Mapping):
        missing = [t for t in task_ids if t not in families]
        if missing:
            raise TaskSamplerError(f"no family for tasks {missing[:5]}")
        return {t: str(families[t]) for t in task_ids}
    if isinstance(families, str) or len(families) != len(task_ids):
        raise TaskSamplerError("families must be a mapping or a sequence aligned with task_ids")
    return dict(zip(task_ids, families, strict=True))


class DifficultyBandSampler:
    """The sampler (see the module docstring). Its state changes only through its methods.

    task_ids: the candidate tasks (their order fixes the draw order); families: task id ->
    family, or a sequence aligned with task_ids; band: (b_lo, b_hi); stream_weights: w per
    sampled stream (missing streams get 0); z: Wilson z; max_failures: failures that
    quarantine a task.
    """

    def __init__(self, task_ids: Sequence[str], families: Mapping[str, str] | Sequence[str],
                 seed: int, band: tuple[float, float] = (0.2, 0.8),
                 stream_weights: Mapping[str, float] | None = None, z: float = 1.96,
                 max_failures: int = 3) -> None:
        weights = dict(DEFAULT_STREAM_WEIGHTS if stream_weights is None else stream_weights)
        self.band = (float(band[0]), float(band[1]))
        _check_config(self.band, z, weights, max_failures)
        self.task_ids: tuple[str, ...] = tuple(task_ids)
        self.family_of: dict[str, str] = _family_map(self.task_ids, families)
        self.seed = seed
        self.stream_weights: dict[str, float] = {s: float(weights.get(s, 0.0))
                                                 for s in SAMPLED_STREAMS}
        self.z = z
        self.max_failures = max_failures
        self._counts: dict[str, TaskCounts] = {t: TaskCounts() for t in self.task_ids}

    # ------------------------------------------------------------------ evidence
    def counts(self, task_id: str) -> TaskCounts:
        """The counts of one task."""
        try:
            return self._counts[task_id]
        except KeyError:
            raise UnknownSamplerTaskError(f"task {task_id!r} is not in the sampler") from None

    def update(self, task_id: str, successes: int, attempts: int) -> None:
        """Record one scored group: ``successes`` of its ``attempts`` scored siblings.

        Censored or quarantined siblings are not attempts (never scored 0); a group with no
        scored sibling is not recorded (call ``record_failure`` for infrastructure failures).
        """
        c = self.counts(task_id)
        if isinstance(attempts, bool) or isinstance(successes, bool) or \
                not (isinstance(attempts, int) and isinstance(successes, int)) or \
                attempts < 1 or not 0 <= successes <= attempts:
            raise TaskSamplerError(f"update({task_id!r}): need ints 0 <= successes <= attempts "
                                   f"and attempts >= 1, got {successes}/{attempts}")
        sizes = dict(c.group_sizes)
        sizes[attempts] = sizes.get(attempts, 0) + 1
        degenerate = successes in (0, attempts)
        self._counts[task_id] = replace(
            c, successes=c.successes + successes, attempts=c.attempts + attempts,
            group_sizes=tuple(sorted(sizes.items())),
            zero_variance_groups=c.zero_variance_groups + degenerate)

    def record_prior(self, task_id: str, successes: int, attempts: int) -> None:
        """Add evidence from outside the RL groups (the cold start's evaluation on the train
        tasks): successes and attempts only, no group, so the zero-variance statistics stay
        those of the RL groups."""
        c = self.counts(task_id)
        if not (isinstance(attempts, int) and isinstance(successes, int)) or \
                isinstance(attempts, bool) or attempts < 1 or not 0 <= successes <= attempts:
            raise TaskSamplerError(f"record_prior({task_id!r}): need ints 0 <= successes <= "
                                   f"attempts and attempts >= 1, got {successes}/{attempts}")
        self._counts[task_id] = replace(c, successes=c.successes + successes,
                                        attempts=c.attempts + attempts)

    def record_failure(self, task_id: str, reason: str) -> None:
        """Count an environment or verifier failure; ``max_failures`` of them quarantine it."""
        c = self.counts(task_id)
        failures = c.failures + 1
        quarantine = c.quarantine_reason
        if quarantine is None and failures >= self.max_failures:
            quarantine = f"rule: {failures} environment/verifier failures (last: {reason})"
        self._counts[task_id] = replace(c, failures=failures, quarantine_reason=quarantine)

    def quarantine(self, task_id: str, reason: str) -> None:
        """Quarantine a task by hand (infeasible environment, untrusted verifier...)."""
        if not reason:
            raise TaskSamplerError("a quarantine needs a reason")
        self._counts[task_id] = replace(self.counts(task_id), quarantine_reason=reason)

    def release(self, task_id: str) -> None:
        """Lift a quarantine and reset the failure count (the success counts are kept)."""
        self._counts[task_id] = replace(self.counts(task_id), quarantine_reason=None,
                                        failures=0)

    # ------------------------------------------------------------------ derived views
    def estimate(self, task_id: str) -> TaskEstimate:
        """The task's estimate, interval and stream."""
        c = self.counts(task_id)
        lo, hi = wilson_bounds(c.successes, c.attempts, self.z)
        return TaskEstimate(task_id, self.family_of[task_id], c.successes, c.attempts,
                            c.successes / c.attempts if c.attempts else None, lo, hi,
                            classify(c, self.band, self.z), c.quarantine_reason)

    def estimates(self) -> tuple[TaskEstimate, ...]:
        """Every task's estimate, in task order."""
        return tuple(self.estimate(t) for t in self.task_ids)

    def stream_of(self) -> dict[str, Stream]:
        """Task id -> its current stream."""
        return {t: classify(self._counts[t], self.band, self.z) for t in self.task_ids}

    def streams(self) -> dict[str, tuple[str, ...]]:
        """Stream -> its task ids, in task order (every stream present, possibly empty)."""
        of = self.stream_of()
        return {s: tuple(t for t in self.task_ids if of[t] == s) for s in STREAMS}

    def propensities(self) -> dict[str, float]:
        """Task id -> π_i for one draw (0 for quarantined tasks); sums to 1."""
        streams = self.streams()
        live = {s: self.stream_weights[s] for s in SAMPLED_STREAMS
                if streams[s] and self.stream_weights[s] > 0}
        total = sum(live.values())
        if not total > 0:
            raise NoCandidateTasksError(
                f"no task to draw: stream sizes {({s: len(v) for s, v in streams.items()})}, "
                f"weights {dict(self.stream_weights)}")
        out = dict.fromkeys(self.task_ids, 0.0)
        for s, w in live.items():
            for t in streams[s]:
                out[t] = w / total / len(streams[s])
        return out

    # ------------------------------------------------------------------ sampling
    def sample(self, n: int, step: int) -> list[TaskDraw]:
        """Draw ``n`` tasks for step ``step`` (independent draws; pure in seed, step, counts)."""
        if n < 0:
            raise TaskSamplerError(f"n must be >= 0, got {n}")
        props = self.propensities()
        candidates = [t for t in self.task_ids if props[t] > 0.0]
        rng = random.Random(f"task-sampler/{self.seed}/{step}")
        chosen = rng.choices(candidates, weights=[props[t] for t in candidates], k=n)
        stream = self.stream_of()
        return [TaskDraw(step, j, t, self.family_of[t], stream[t], props[t])
                for j, t in enumerate(chosen)]

    # ------------------------------------------------------------------ informative groups
    def informative_stats(self, group_size: int) -> InformativeStats:
        """Observed vs predicted zero-variance rates (module docstring formulas)."""
        groups = zero = 0
        predicted = 0.0
        for c in self._counts.values():
            zero += c.zero_variance_groups
            for m, k in c.group_sizes:
                groups += k
                predicted += k * p_zero_variance_estimate(c.successes, c.attempts, m)
        props = self.propensities()
        next_rate = sum(pi * p_zero_variance_estimate(self._counts[t].successes,
                                                      self._counts[t].attempts, group_size)
                        for t, pi in props.items() if pi > 0.0)
        return InformativeStats(
            group_size=group_size, groups=groups, zero_variance_groups=zero,
            observed_rate=zero / groups if groups else None,
            observed_ci=wilson_bounds(zero, groups, self.z) if groups else None,
            predicted_rate=predicted / groups if groups else None,
            predicted_next_rate=next_rate)

    # ------------------------------------------------------------------ logging / resume
    def to_dict(self, group_size: int | None = None) -> dict[str, Any]:
        """JSON state: config, per-task counts/estimates/stream/π, stream sizes, family mass.

        ``family_share`` is the original (candidate) distribution, ``family_propensity`` the
        sampling distribution; with ``group_size`` the informative-group stats are included.
        """
        props = self.propensities()
        tasks = []
        for est in self.estimates():
            c = self._counts[est.task_id]
            tasks.append({**est.__dict__, "group_sizes": [list(g) for g in c.group_sizes],
                          "zero_variance_groups": c.zero_variance_groups,
                          "failures": c.failures, "propensity": props[est.task_id]})
        fam_share: dict[str, float] = {}
        fam_prop: dict[str, float] = {}
        for t in self.task_ids:
            f = self.family_of[t]
            fam_share[f] = fam_share.get(f, 0.0) + 1.0 / len(self.task_ids)
            fam_prop[f] = fam_prop.get(f, 0.0) + props[t]
        out: dict[str, Any] = {
            "version": SAMPLER_VERSION, "seed": self.seed, "band": list(self.band), "z": self.z,
            "stream_weights": dict(self.stream_weights), "max_failures": self.max_failures,
            "tasks": tasks, "streams": {s: len(v) for s, v in self.streams().items()},
            "family_share": fam_share, "family_propensity": fam_prop}
        if group_size is not None:
            out["informative"] = self.informative_stats(group_size).to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DifficultyBandSampler:
        """Rebuild a sampler from ``to_dict`` output (counts restored, derived fields ignored)."""
        if data.get("version") != SAMPLER_VERSION:
            raise TaskSamplerError(f"sampler state version {data.get('version')!r} is not "
                                   f"{SAMPLER_VERSION!r}")
        rows = data["tasks"]
        sampler = cls([r["task_id"] for r in rows], [r["family"] for r in rows],
                      int(data["seed"]), band=(data["band"][0], data["band"][1]),
                      stream_weights=data["stream_weights"], z=float(data["z"]),
                      max_failures=int(data["max_failures"]))
        for r in rows:
            sampler._counts[r["task_id"]] = TaskCounts(
                successes=int(r["successes"]), attempts=int(r["attempts"]),
                group_sizes=tuple((int(m), int(k)) for m, k in r["group_sizes"]),
                zero_variance_groups=int(r["zero_variance_groups"]),
                failures=int(r["failures"]), quarantine_reason=r["quarantine_reason"])
        return sampler


__all__ = [
    "DEFAULT_STREAM_WEIGHTS", "SAMPLED_STREAMS", "STREAMS", "DifficultyBandSampler",
    "InformativeStats", "NoCandidateTasksError", "Stream", "TaskCounts", "TaskDraw",
    "TaskEstimate", "TaskSamplerError", "UnknownSamplerTaskError", "classify",
    "p_zero_variance_estimate", "wilson_bounds",
]
