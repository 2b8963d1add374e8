"""The real ``rl_step`` as a benchmark side: a run in a temporary directory through
closedloop.training's roles, every contract on, and where each step's wall time went.

``RealStep(cfg, folder)`` opens the run (``open_run``: the directory locked and proved, tasks,
policy), optionally warm-starts it, attaches the roles (trainer, generator worker, publisher),
writes the step-0 checkpoint and publishes v0000 (``resume``/``publish``, as ``closedloop
train`` does). ``step(order)`` runs ``closedloop.training.rl_step.rl_step`` on the next step,
with the work order given (the benchmark's groups) or drawn by the run's sampler, and returns
its breakdown (seconds):

- ``generation``: the generator's decoding (the collector's ``source.act`` calls; trace
  timings ``decode_s``), ``environment``: resets and tool steps (``reset_s`` + ``env_s``);
- ``update``: the trainer's optimizer step itself (``Trainer.step``: π_θ and π_ref forwards,
  backward, optimizer), timed by wrapping the trainer's method;
- ``bookkeeping``: everything else of the step's wall time, the contracts' share: leases and
  base snapshots, rendering observation deltas, turn records and the trace (``render_s``,
  ``bookkeeping_s``, the rest of collection), the clean-room verifier step (``verify_s``),
  admission and the ledger (``admit_s``), credit and the padded batch, the checkpoint, the
  publication (stage; the worker's load and its proof: the fixed probe its engine scores, the
  publisher's trainer-path reference for it, and the acknowledgement) and the metrics record.
  Itemized in ``items``.

The timers only read ``time.perf_counter`` around calls the step makes anyway; the run does
what ``closedloop train`` does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from closedloop.config import RunConfig
from closedloop.contracts import load_episodes
from closedloop.policy.registry import version_name
from closedloop.rollout.work_orders import WorkOrder
from closedloop.training.frozen_objects import frozen_objects
from closedloop.training.resume import resume
from closedloop.training.rl_step import rl_step
from closedloop.training.run import Run, attach_roles, open_run, publish
from closedloop.training.warm_start import warm_start

TRACE_KEYS = ("decode_s", "env_s", "reset_s", "render_s", "bookkeeping_s", "verify_s")


class _Timed:
    """Accumulates the wall time of calls to one bound method (installed on the instance)."""

    def __init__(self, owner: Any, name: str,
                 observe: Callable[..., None] | None = None) -> None:
        self.seconds = 0.0
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if observe is not None:
                observe(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(owner, name, timed)

    def take(self) -> float:
        """The seconds accumulated since the last take."""
        out, self.seconds = self.seconds, 0.0
        return out


class RealStep:
    """One run of the real loop in ``folder`` (module doc)."""

    def __init__(self, cfg: RunConfig, folder: Path, *, warm: bool = False,
                 after_open: Callable[[Run], None] | None = None) -> None:
        t0 = time.perf_counter()
        self.run = open_run(cfg, folder)
        self._frozen = ExitStack()
        try:
            if warm:
                warm_start(self.run)
            if after_open is not None:
                after_open(self.run)
            attach_roles(self.run)
            self._frozen.enter_context(frozen_objects())  # as closedloop train does
            if not resume(self.run):
                publish(self.run, version_name(0))
        except BaseException:
            self.close()
            raise
        trainer, worker, publisher = self.run.roles()
        self.trained: list[int] = []  # action tokens of each episode the update trained on

        def observe(episodes: Any, *_: Any, **__: Any) -> None:
            self.trained.extend(sum(len(t.action_token_ids) for t in e.turns)
                                for e in episodes)

        self.timers = {"update": _Timed(trainer.trainer, "step"),
                       "batch": _Timed(trainer, "update", observe),
                       "checkpoint": _Timed(trainer, "checkpoint"),
                       "stage": _Timed(publisher, "stage"),
                       "prove": _Timed(worker, "prove"),
                       "acknowledge": _Timed(publisher, "acknowledge"),
                       # parts of the proof (inside "prove"/"acknowledge", not added again)
                       "decode sync": _Timed(worker.generator, "refresh_weights"),
                       "probe score": _Timed(worker.generator, "score")}
        if publisher.reference is not None:
            self.timers["probe reference"] = _Timed(publisher.reference, "logprobs")
            self.timers["probe reference (primed)"] = _Timed(publisher.reference, "prime")
        self.setup_s = time.perf_counter() - t0
        self.next_step = 0

    def step(self, order: WorkOrder | None = None) -> dict[str, Any]:
        """Run the next ``rl_step`` (on ``order`` if given) and return its breakdown."""
        run, k = self.run, self.next_step
        if order is not None:
            run.state.orders[k] = order
        for t in self.timers.values():
            t.take()
        self.trained = []
        t0 = time.perf_counter()
        report = rl_step(run, k)
        wall = time.perf_counter() - t0
        self.next_step += 1
        _, episodes = load_episodes(run.dir / "traces" / f"step-{k:04d}.jsonl")
        trace = {key: sum(e.trajectory.timings.get(key, 0.0) for e in episodes)
                 for key in TRACE_KEYS}
        secs = report.seconds
        timers = {name: t.take() for name, t in self.timers.items()}
        update = timers["update"]
        generation = trace["decode_s"]
        environment = trace["env_s"] + trace["reset_s"]
        collect_rest = secs.get("collect_s", 0.0) - generation - environment - sum(
            trace[key] for key in ("render_s", "bookkeeping_s", "verify_s"))
        items = {
            "render observation deltas": trace["render_s"],
            "turn records (trace)": trace["bookkeeping_s"],
            "clean-room verifier step": trace["verify_s"],
            "leases, snapshots, trace commit": collect_rest,
            "admission + ledger": secs.get("admit_s", 0.0),
            "credit, ledger check, padded batch": secs.get("update_s", 0.0) - update,
            "checkpoint": timers["checkpoint"],
            "publication: stage": timers["stage"],
            "publication: replica proof (worker load, probe score, trainer's reference, ack)":
            timers["prove"] + timers["acknowledge"] + timers.get("probe reference (primed)", 0.0),
            "sampler, ledger marks, adapter copy and checksum": secs.get("publish_s", 0.0)
            - timers["checkpoint"] - timers["stage"] - timers["prove"] - timers["acknowledge"]
            - timers.get("probe reference (primed)", 0.0),
        }
        proof_parts = {"decode copy re-merge": timers["decode sync"],
                       "probe score": timers["probe score"],
                       "trainer's reference": timers.get("probe reference", 0.0)
                       + timers.get("probe reference (primed)", 0.0),
                       "worker's read, copy and hashes":
                       timers["prove"] - timers["decode sync"] - timers["probe score"],
                       "check, ACK and activation":
                       timers["acknowledge"] - timers.get("probe reference", 0.0)}
        bookkeeping = wall - generation - environment - update
        action_tokens = sum(len(t.action_token_ids) for e in episodes for t in e.turns)
        observation_tokens = sum(len(t.prompt_token_ids) for e in episodes for t in e.turns
                                 if t.turn > 0)
        return {"wall": wall, "generation": generation, "environment": environment,
                "update": update, "bookkeeping": bookkeeping, "items": items,
                "proof_parts": proof_parts,
                "episodes": len(episodes), "turns": sum(len(e.turns) for e in episodes),
                "action_tokens": action_tokens, "observation_tokens": observation_tokens,
                "trained_episodes": len(self.trained), "trained_tokens": sum(self.trained),
                "admitted": report.admitted, "groups": report.groups,
                "updated": bool(report.metrics),
                "success": report.mean_success,
                "completion_lengths": [sum(len(t.action_token_ids) for t in e.turns)
                                       for e in episodes],
                "censored": sum(1 for e in episodes if e.trajectory.termination.is_censored)}

    def close(self) -> None:
        """Close the run (its directory stays where the caller put it)."""
        try:
            self._frozen.close()
        finally:
            self.run.close()


def share_line(parts: dict[str, Any]) -> str:
    """``generation 1.2s (40%), environment ..., update ..., bookkeeping ...``."""
    wall = parts["wall"]
    return ", ".join(f"{k} {parts[k]:.2f}s ({100 * parts[k] / wall:.1f}%)"
                     for k in ("generation", "environment", "update", "bookkeeping"))


def items_line(parts: dict[str, Any]) -> str:
    """The bookkeeping items, largest first, with their share of the wall time; then the
    replica proof's parts (the generator's decode-copy re-merge, the probe it scores, the
    trainer's reference, the worker's read of the version with its hashes, and the
    publisher's check, ACK and activation), which add up to the proof's item."""
    wall = parts["wall"]
    line = "; ".join(f"{k} {v:.3f}s ({100 * v / wall:.1f}%)" for k, v in
                     sorted(parts["items"].items(), key=lambda kv: -kv[1]))
    return line + " [the proof's parts: " + ", ".join(
        f"{k} {v:.3f}s" for k, v in parts["proof_parts"].items()) + "]"
