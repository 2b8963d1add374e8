"""The RL phase of a run: the generator and the trainer, in turns or side by side.

Placement and freshness are separate choices (docs/concepts.md):

- freshness, ``rollout.max_version_lag`` = L: round r (what step r trains on) is sampled by
  ``v_max(0, r - L)``; the admission queue's capacity rule and the trainer's hard bound keep
  every trained token within L versions;
- placement, ``rollout.mode``: ``synchronous`` runs the roles in turns in one thread (round r
  produced, then step r trained); ``async`` runs the generator worker in its own thread, which
  samples the next rounds while the trainer updates (at L = 0 it can only wait: the async code
  path, to check against the synchronous one).

The schedule is deterministic whatever the threads' timing: round r's work order is drawn by
the trainer at the end of step r - L - 1 (and committed in checkpoint r - L), its version is
fixed by the schedule, each episode samples from its own stream. So an async run at lag L
trains on exactly the data of a synchronous run at lag L, and a killed async run resumes to
the same weights as an uninterrupted one.

On two CPU cores the two roles share the cores: the overlap can hide at most the shorter of
(generation, update) per step, and each role runs slower while the other computes
(``benchmarks/bench_async.py`` measures both).

Publication under async: the trainer stages v_{s+1} and goes on; the worker loads the version
its next round needs at that round's boundary, hashes what it holds and acknowledges
(``Publisher.acknowledge``); the active version moves once every worker has. A round never
switches versions part way (``in_flight_policy: finish_old``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from closedloop.errors import ClosedloopError
from closedloop.policy.registry import version_index, version_name
from closedloop.progress import log, phase
from closedloop.rollout.queues import QueuedRound
from closedloop.training.rl_step import (
    StepReport,
    draw_order,
    produce_round,
    rl_step,
    train_step,
)
from closedloop.training.run import Run, prove_and_acknowledge

__all__ = ["GeneratorThread", "run_rl"]

OnStep = Callable[[StepReport], None]


def ensure_orders(run: Run) -> None:
    """Draw the work orders of rounds ``step .. step + L`` that are not held yet (a new run,
    or a checkpoint written before they were drawn)."""
    cfg, state = run.cfg, run.state
    last = min(state.step + cfg.rollout.max_version_lag, cfg.training.rl_steps - 1)
    for r in range(state.step, last + 1):
        if r not in state.orders:
            state.orders[r] = draw_order(run, r)


def run_rl(run: Run, on_step: OnStep | None = None) -> list[StepReport]:
    """Train from ``run.state.step`` to ``training.rl_steps`` (module doc); ``on_step`` is
    called after each step in the trainer's thread (curve-point evaluations: synchronous mode
    only, since the worker is busy under async)."""
    cfg, state = run.cfg, run.state
    run.queue.restore(consumed_rounds=state.step, buffered=())
    run.queue.publish(state.step)
    if cfg.rollout.mode == "async":
        return _run_async(run, on_step)
    reports = []
    for step in range(state.step, cfg.training.rl_steps):
        ensure_orders(run)
        with phase(f"rl step {step}"):
            reports.append(rl_step(run, step))
        if on_step is not None:
            on_step(reports[-1])
    return reports


def _run_async(run: Run, on_step: OnStep | None) -> list[StepReport]:
    cfg, state = run.cfg, run.state
    ensure_orders(run)
    generator = GeneratorThread(run, state.step, cfg.training.rl_steps - 1)
    reports: list[StepReport] = []
    started = time.monotonic()
    generator.start()
    try:
        for step in range(state.step, cfg.training.rl_steps):
            with phase(f"rl step {step} (the generator ahead)"):
                reports.append(train_step(run, run.queue, step, publish_inline=False))
            if on_step is not None:
                on_step(reports[-1])
    except BaseException as exc:
        run.queue.close(exc)
        generator.join(5.0)  # a daemon: it ends with the process if still collecting
        if generator.error is not None and not isinstance(exc, KeyboardInterrupt):
            raise generator.error from exc
        raise
    generator.join(cfg.rollout.queue_timeout_s)
    generator.raise_if_failed()
    # the last version: no round needs it, the in-process worker still proves it
    prove_and_acknowledge(run, version_name(cfg.training.rl_steps))
    wall = time.monotonic() - started
    run.log_metrics("pipeline", {"label": "rl", "mode": "async",
                                 "max_version_lag": cfg.rollout.max_version_lag,
                                 "steps": len(reports), "timing": {
                                     "wall_s": wall, "generator_busy_s": generator.busy_s,
                                     "generator_wait_s": generator.wait_s,
                                     "trainer_busy_s": sum(_trainer_busy(r)
                                                           for r in reports)}})
    return reports


def _trainer_busy(report: StepReport) -> float:
    """A step's trainer seconds net of its wait for the queue (``trainer_wait_s``: the take
    blocked on a round the generator had not finished)."""
    total = sum(v for k, v in report.seconds.items() if k != "wait_s")
    waited = float((report.metrics.get("timing") or {}).get("trainer_wait_s") or 0.0)
    return max(0.0, total - waited)


class GeneratorThread(threading.Thread):
    """The generator role under async: rounds ``first .. last`` in order, each started when
    the queue's capacity rule allows it, sampled by its scheduled version (loaded and
    acknowledged at the round boundary), scored by the verifier step and handed to the
    queue. Its first failure closes the queue (the trainer stops with it) and is re-raised in
    the trainer's thread by ``raise_if_failed``."""

    def __init__(self, run: Run, first: int, last: int) -> None:
        super().__init__(name="closedloop-generator", daemon=True)
        self.run_ = run
        self.first, self.last = first, last
        self.error: BaseException | None = None
        self.busy_s = 0.0
        self.wait_s = 0.0

    def run(self) -> None:
        """The thread's body (module and class doc)."""
        try:
            for r in range(self.first, self.last + 1):
                self._one_round(r)
        except BaseException as exc:  # handed to the trainer's thread
            self.error = exc
            self.run_.queue.close(exc)

    def _one_round(self, r: int) -> None:
        run = self.run_
        queue, state, timeout = run.queue, run.state, run.cfg.rollout.queue_timeout_s
        t0 = time.monotonic()
        queue.wait_until(lambda: r in state.orders, timeout, f"the work order of round {r}")
        order = state.orders[r]
        queue.wait_to_start(r, timeout)
        if version_index(order.behavior_version) > queue.published_index:
            raise ClosedloopError(f"round {r} is scheduled for {order.behavior_version}, "
                                  f"past the published v{queue.published_index:04d}")
        t1 = time.monotonic()
        prove_and_acknowledge(run, order.behavior_version)
        queued = produce_round(run, order)
        t2 = time.monotonic()
        self.wait_s += t1 - t0
        self.busy_s += t2 - t1
        queue.put(QueuedRound(queued.round, queued.behavior_version, queued.groups,
                              queued.queued_at, {"generator_wait_s": t1 - t0,
                                                 "generator_busy_s": t2 - t1},
                              queued.in_flight))
        log(f"generator: round {r} ({order.behavior_version}) queued")

    def raise_if_failed(self) -> None:
        """Re-raise the thread's failure (or a hang past the join) in the caller's thread."""
        if self.error is not None:
            raise self.error
        if self.is_alive():
            raise ClosedloopError("the generator thread did not end after the last step")
