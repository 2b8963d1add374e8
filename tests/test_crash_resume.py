"""Crash test (issue 4): SIGKILL ``closedloop train`` at random points, resume, compare.

A short run (``tests.conftest.short_run_config``, ``KILL_RL_STEPS`` steps) is played twice from
the same config, each in its own run directory and its own ``closedloop train CONFIG --run-dir
DIR`` processes (the real trainer, collector, environment, verifier, ledger, registry and
checkpoints; nothing is mocked), each forked from one interpreter that imported closedloop once
(``tests.forked_launch``):

- the *reference*, uninterrupted (``tests.conftest.kill_bed``: one per session, shared with
  ``tests.test_chaos``);
- the *crashed* run, SIGKILLed several times and restarted with the same command until it
  completes. A seeded plan picks one RL step for each phase (collection; the admission,
  credit and update between a complete trace and its checkpoint; the checkpoint write; right
  after the checkpoint's commit, before the ledger marks its groups consumed) and a random
  delay after the phase's first file appears in the run directory; each launch watches the
  directory and kills the whole process group when its trigger fires. Where each kill landed
  is read back from the run directory and printed (``pytest -s``).

Then: the ledger shows every step group consumed exactly once (one consuming event per group,
no refused duplicate, nothing lost, pending or unexpected) and agrees with the checkpoint's
consumed ids and with the reference's ledger; every step sampled the same actions as the
reference; the final adapter weights and optimizer state are *bit-identical* to the reference's
(``torch.equal``: both runs are fp32 on CPU with one thread, the same seeds and the same batch
composition, so any difference is a resume bug, not rounding); the held-out evaluation agrees.

The policy is ``tests.tiny_agent``: a tiny Llama taught to solve the two train tasks about half
the time, so groups hold successes and failures and the update is not vacuous (the test fails
if no step had a non-zero advantage or the adapter never moved), and to give up on the
held-out tasks, so their episodes are scored rather than censored.

Environment knobs: ``CLOSEDLOOP_CRASH_SEED`` overrides the kill plan's seed;
``CLOSEDLOOP_CRASH_EVAL_KILL=1`` adds a kill in the start or final held-out evaluation.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from closedloop.learn.checkpoint import Checkpoint, load_latest
from closedloop.policy.registry import PolicyRegistry, version_name
from closedloop.rollout.ledger import Ledger
from tests import conftest
from tests.forked_launch import KillBed, child_env

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("kill-bed")]

REPO = Path(__file__).resolve().parent.parent
RL_STEPS = conftest.KILL_RL_STEPS
GROUPS_PER_STEP = 2
KILL_SEED = int(os.environ.get("CLOSEDLOOP_CRASH_SEED", "4"))
EVAL_KILL = os.environ.get("CLOSEDLOOP_CRASH_EVAL_KILL", "") == "1"
"""One more kill in a held-out evaluation (about 15 s more on 2 busy cores); off by default."""
DEADLINE_S = 600.0
PHASES = ("collect", "update", "checkpoint", "commit")
"""Kill phases in the order they happen within one RL step."""
EVAL_PHASES = ("eval-start", "eval-final")
"""Kill phases outside the RL steps: the held-out evaluations of the start and final policy."""


# ----------------------------------------------------------------------------- processes
def launch(config: Path, run_dir: Path, log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start ``closedloop train`` in its own process group (so a kill takes its children)."""
    with open(log, "ab") as fh:
        fh.write(f"\n=== launch at {time.time():.3f}\n".encode())
        return subprocess.Popen(
            [sys.executable, "-m", "closedloop.cli", "train", str(config), "--run-dir",
             str(run_dir)], cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT,
            start_new_session=True)


def tail(log: Path, n: int = 40) -> str:
    """The last lines of a launch log."""
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


# ----------------------------------------------------------------------------- kill plan
@dataclass(frozen=True)
class Kill:
    """Kill when ``phase`` of RL step ``step`` has begun, ``delay_s`` after its first file."""

    phase: str
    step: int
    delay_s: float

    @property
    def order(self) -> tuple[int, int]:
        """Position in the run's timeline."""
        if self.phase == "eval-start":
            return (-1, 0)
        if self.phase == "eval-final":
            return (RL_STEPS, 0)
        return (self.step, PHASES.index(self.phase))


def kill_plan(seed: int, eval_kill: bool = False) -> list[Kill]:
    """One kill per RL-step phase, each at a random step (and with ``eval_kill`` one more in
    a random evaluation), each after a random delay; in timeline order."""
    rng = random.Random(seed)
    delays = {"collect": (0.2, 2.5), "update": (0.0, 0.4), "checkpoint": (0.0, 0.5),
              "commit": (0.0, 0.0), "eval-start": (0.0, 0.1), "eval-final": (0.0, 0.1)}
    kills = [Kill(phase, rng.randrange(RL_STEPS), round(rng.uniform(*delays[phase]), 3))
             for phase in PHASES]
    if eval_kill:
        phase = rng.choice(EVAL_PHASES)
        kills.append(Kill(phase, -1 if phase == "eval-start" else RL_STEPS,
                          round(rng.uniform(*delays[phase]), 3)))
    return sorted(kills, key=lambda k: k.order)


def _new(path: Path, since: float) -> bool:
    try:
        return path.stat().st_mtime >= since
    except FileNotFoundError:
        return False


def trigger(run_dir: Path, kill: Kill) -> Callable[[float], bool]:
    """Whether the phase's first file appeared in this launch (modified after ``since``)."""
    traces, ckpts = run_dir / "traces", run_dir / "checkpoints"
    if kill.phase in EVAL_PHASES:
        return lambda since: _new(traces / f"{kill.phase}.partial", since)
    if kill.phase == "collect":
        return lambda since: _new(traces / f"step-{kill.step:04d}.partial", since)
    if kill.phase == "update":
        return lambda since: _new(traces / f"step-{kill.step:04d}.jsonl", since)
    if kill.phase == "checkpoint":
        prefix = f".tmp-step-{kill.step + 1:06d}-"

        def writing(since: float) -> bool:
            try:
                names = os.listdir(ckpts)
            except FileNotFoundError:
                return False
            return any(n.startswith(prefix) and _new(ckpts / n, since) for n in names)

        return writing
    return lambda since: _new(ckpts / f"step-{kill.step + 1:06d}", since)


def describe(run_dir: Path) -> dict[str, Any]:
    """Where a killed run stopped: checkpoint, traces, ledger states, active version."""
    ckpt = load_latest(run_dir / "checkpoints") if (run_dir / "checkpoints").is_dir() else None
    traces = sorted(p.name for p in (run_dir / "traces").glob("*")) \
        if (run_dir / "traces").is_dir() else []
    states: dict[str, str] = {}
    if (run_dir / "ledger.sqlite").is_file():
        with Ledger(run_dir / "ledger.sqlite") as ledger:
            states = {g: ledger.get(g).state for g in ledger.group_ids()}
    active = None
    if (run_dir / "registry" / "ACTIVE").is_file():
        active = json.loads((run_dir / "registry" / "ACTIVE").read_text())["version"]
    leftovers = sorted(p.name for p in (run_dir / "checkpoints").glob(".tmp-*")) \
        if (run_dir / "checkpoints").is_dir() else []
    return {"checkpoint_step": ckpt.step if ckpt else None, "active": active,
            "traces": traces, "ledger": states, "checkpoint_tmp": leftovers}


def landing(state: dict[str, Any]) -> str:
    """Name the point of the run a kill interrupted, from ``describe``'s view of the dir."""
    partial = [t.removesuffix(".partial") for t in state["traces"] if t.endswith(".partial")]
    if partial:
        return f"collecting {partial[0]}"
    ckpt = state["checkpoint_step"] or 0
    if state["checkpoint_tmp"]:
        return f"writing checkpoint {ckpt + 1}"
    open_groups = sorted(g for g, s in state["ledger"].items() if s in ("collected", "admitted"))
    if open_groups:
        step = int(open_groups[0][1:5])
        if step < ckpt:
            return (f"step {step}: checkpoint {ckpt} committed, ledger not yet marked "
                    f"({len(open_groups)} groups admitted)")
        return f"step {step}: admission/credit/update, trace complete, no checkpoint yet"
    if state["active"] != version_name(ckpt):
        return f"step {ckpt - 1}: publishing {version_name(ckpt)}"
    return f"after step {ckpt - 1}, between phases"


@dataclass
class CrashLog:
    """What the crashing run went through."""

    launches: int = 0
    kills: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[Kill] = field(default_factory=list)
    seconds: float = 0.0


def run_with_kills(config: Path, run_dir: Path, log: Path, plan: list[Kill],
                   deadline: float, launcher: Callable[..., Any] | None = None) -> CrashLog:
    """Launch until the run completes, SIGKILLing the process group at each planned point.

    Each launch watches every pending kill's trigger; the first that fires is carried out
    (kills planned before it, whose moment this launch has already passed, are skipped).
    ``launcher(config, run_dir, log, env)`` starts one launch (default :func:`launch`) and
    returns a handle with ``pid`` (its process group), ``poll``, ``wait`` and ``returncode``.
    """
    out = CrashLog()
    pending = list(plan)
    start = time.monotonic()
    env = child_env(checkpoint_pause_s=0.15)
    while True:
        since = time.time() - 0.001
        proc = (launcher or launch)(config, run_dir, log, env)
        out.launches += 1
        triggers = [(k, trigger(run_dir, k)) for k in pending]
        armed: tuple[Kill, float] | None = None
        while proc.poll() is None:
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                pytest.fail(f"crashed run past its deadline; log tail:\n{tail(log)}")
            if armed is None:
                for i, (kill, fired) in enumerate(triggers):
                    if fired(since):
                        out.skipped += pending[:i]
                        armed = (kill, time.monotonic())
                        break
            if armed is not None and time.monotonic() - armed[1] >= armed[0].delay_s:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                kill = armed[0]
                state = describe(run_dir)
                out.kills.append({"planned": kill, "at_s": round(time.monotonic() - start, 2),
                                  "exit": proc.returncode, "landed": landing(state),
                                  "state": state})
                pending = pending[pending.index(kill) + 1:]
                break
            time.sleep(0.004)
        else:
            assert proc.returncode == 0, f"launch {out.launches} failed:\n{tail(log)}"
            out.skipped += pending
            out.seconds = time.monotonic() - start
            return out


# ----------------------------------------------------------------------------- reading runs
def group_events(ledger: Ledger) -> dict[str, Counter[str]]:
    """Per group, the count of each (kind, to_state) event."""
    out: dict[str, Counter[str]] = {}
    for ev in ledger.events():
        out.setdefault(ev.group_id, Counter())[f"{ev.kind}:{ev.to_state}"] += 1
    return out


def step_actions(run_dir: Path) -> dict[str, list[list[int]]]:
    """Per episode of every RL step trace (keyed by group and sibling), its action token ids."""
    from closedloop.contracts import load_episodes

    out: dict[str, list[list[int]]] = {}
    for step in range(RL_STEPS):
        _, episodes = load_episodes(run_dir / "traces" / f"step-{step:04d}.jsonl")
        for ep in episodes:
            key = f"{ep.trajectory.group_id}/{ep.trajectory.sample_index}"
            out[key] = [list(t.action_token_ids) for t in ep.turns]
    return out


def eval_actions(run_dir: Path, label: str) -> list[list[list[int]]]:
    """The action token ids of every episode of held-out evaluation ``label``."""
    from closedloop.contracts import load_episodes

    _, episodes = load_episodes(run_dir / "traces" / f"eval-{label}.jsonl")
    return [[list(t.action_token_ids) for t in ep.turns]
            for ep in sorted(episodes, key=lambda e: e.trajectory.group_id)]


def final_checkpoint(run_dir: Path) -> Checkpoint:
    """The run's newest verified checkpoint (must be the last RL step's)."""
    ckpt = load_latest(run_dir / "checkpoints")
    assert ckpt is not None and ckpt.step == RL_STEPS
    return ckpt


def flat_tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Walk an optimizer state dict: (path, leaf) pairs."""
    if isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from flat_tensors(obj[k], f"{prefix}/{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from flat_tensors(v, f"{prefix}/{i}")
    else:
        yield prefix, obj


def leaves_equal(a: Any, b: Any) -> bool:
    """Bitwise equality of two leaves (tensors or plain values)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    return bool(a == b)


# ----------------------------------------------------------------------------- the test
def test_sigkill_and_resume_consumes_each_group_once_and_matches_uninterrupted(
        kill_bed: KillBed, tmp_path: Path) -> None:
    t0 = time.monotonic()
    ref_dir, crash_dir = kill_bed.reference_dir, tmp_path / "crashed"
    crash_log = tmp_path / "crashed.log"
    deadline = time.monotonic() + DEADLINE_S

    # the reference (shared with tests.test_chaos) runs alongside the crashed run's launches
    # (one thread each), every launch forked from one interpreter that imported closedloop once
    plan = kill_plan(KILL_SEED, EVAL_KILL)
    crashed = run_with_kills(kill_bed.config, crash_dir, crash_log, plan, deadline,
                             launcher=kill_bed.zygote.launch)
    rc = kill_bed.reference_rc(timeout=max(1.0, deadline - time.monotonic()))
    assert rc == 0, f"reference run failed:\n{tail(kill_bed.reference_log)}"
    report = {"kill_seed": KILL_SEED, "launches": crashed.launches,
              "kills": [{"planned": str(k["planned"]), "at_s": k["at_s"], "exit": k["exit"],
                         "landed": k["landed"]} for k in crashed.kills],
              "skipped": [str(k) for k in crashed.skipped],
              "crashed_run_s": round(crashed.seconds, 1)}
    print(json.dumps(report, indent=1))
    assert len(crashed.kills) >= 3, f"too few kills landed: {report}"

    # the update was not vacuous: some step had a group with both successes and failures
    ref_metrics = [json.loads(line) for line in (ref_dir / "metrics.jsonl").read_text()
                   .splitlines()]
    steps = [m for m in ref_metrics if m["kind"] == "rl_step"]
    assert len(steps) == RL_STEPS
    informative = [m["step"] for m in steps if m["admitted"] > 0 and m["metrics"]
                   and m["credit"]["n_scored_groups"] > m["zero_variance"]]
    assert informative, f"no step had a non-zero advantage: {steps}"

    # ledger: every step group consumed exactly once, in both runs, with the same fate
    expected = {f"s{s:04d}-g{j}" for s in range(RL_STEPS) for j in range(GROUPS_PER_STEP)}
    with Ledger(ref_dir / "ledger.sqlite") as ref_ledger, \
            Ledger(crash_dir / "ledger.sqlite") as crash_ledger:
        ref_states = {g: ref_ledger.get(g).state for g in ref_ledger.group_ids()}
        crash_states = {g: crash_ledger.get(g).state for g in crash_ledger.group_ids()}
        assert set(ref_states) == set(crash_states) == expected, (ref_states, crash_states)
        assert crash_states == ref_states, f"ledgers differ: {ref_states} vs {crash_states}"
        consumed = {g for g, s in crash_states.items() if s == "consumed"}
        assert consumed, "no group was consumed"
        once = crash_ledger.exactly_once_report(expected)
        ref_once = ref_ledger.exactly_once_report(expected)
        assert once.ok and ref_once.ok, (once.counts(), ref_once.counts())
        assert set(once.consumed_once) == set(ref_once.consumed_once) == consumed
        assert (once.discarded, once.quarantined) == (ref_once.discarded, ref_once.quarantined)
        assert once.duplicate_attempts == 0 and not once.duplicate, once.counts()
        assert not (once.lost or once.pending or once.unexpected or once.incomplete), \
            once.counts()
        at_step = {g: (ref_ledger.get(g).consumed_step, crash_ledger.get(g).consumed_step)
                   for g in consumed}
        assert all(a == b for a, b in at_step.values()), f"consumed at other steps: {at_step}"
        counts = crash_ledger.counts()
        assert counts.consumed == ref_ledger.counts().consumed == len(consumed)
        assert counts.duplicates_rejected == 0 and counts.illegal_transitions_rejected == 0
        # a kill after the ledger marked a step but before its metrics record sets that
        # step's checkpoint aside and runs the step again: its groups are reverted, once each
        reverted = 0
        for gid, events in group_events(crash_ledger).items():
            if gid not in consumed:
                continue
            applied = events["transition:consumed"] + events["reconciled:consumed"]
            assert applied - events["reconciled:admitted"] == 1, (gid, events)
            assert events["reconciled:admitted"] <= 1, (gid, events)
            reverted += events["reconciled:admitted"]
            assert not any(k.startswith("rejected") for k in events), (gid, events)
            assert events["transition:collected"] == 1, (gid, events)
        assert counts.reverted_by_reconcile == reverted

    # checkpoints: the same consumed ids, and bit-identical weights and optimizer state
    ref_ckpt, crash_ckpt = final_checkpoint(ref_dir), final_checkpoint(crash_dir)
    assert crash_ckpt.consumed_group_ids == ref_ckpt.consumed_group_ids == consumed
    assert crash_ckpt.output_policy_version == version_name(RL_STEPS)
    assert step_actions(crash_dir) == step_actions(ref_dir), "a resumed step sampled other actions"
    assert ref_ckpt.model_state.keys() == crash_ckpt.model_state.keys()
    differing = [k for k, v in ref_ckpt.model_state.items()
                 if not torch.equal(v, crash_ckpt.model_state[k])]
    assert not differing, f"final weights differ from the uninterrupted run's: {differing}"
    assert crash_ckpt.model_checksum == ref_ckpt.model_checksum
    ref_opt = dict(flat_tensors(ref_ckpt.optimizer_state))
    crash_opt = dict(flat_tensors(crash_ckpt.optimizer_state))
    assert ref_opt.keys() == crash_opt.keys()
    assert all(leaves_equal(ref_opt[k], crash_opt[k]) for k in ref_opt), "optimizer state differs"

    # the adapter moved (RL changed the weights), and the published versions agree
    start = PolicyRegistry(ref_dir / "registry").manifest(version_name(0))
    final = PolicyRegistry(ref_dir / "registry").manifest(version_name(RL_STEPS))
    assert start.weight_checksum != final.weight_checksum, "RL never changed the adapter"
    crash_registry = PolicyRegistry(crash_dir / "registry")
    active = crash_registry.active()
    assert active is not None and active.version == version_name(RL_STEPS)
    assert active.checksum == final.weight_checksum

    # held-out evaluation of the start and final policies: same episodes, same summary
    for label in ("start", "final"):
        assert eval_actions(crash_dir, label) == eval_actions(ref_dir, label), label
    ref_summary = json.loads((ref_dir / "summary.json").read_text())
    crash_summary = json.loads((crash_dir / "summary.json").read_text())
    assert ref_summary["heldout_success_final"] is not None, "held-out episodes all censored"
    for key in ("heldout_success_start", "heldout_success_final", "pass_hat_k_start",
                "pass_hat_k_final", "invalid_action_rate_start", "invalid_action_rate_final",
                "ledger", "train_success_by_step", "kl_by_step", "zero_variance_groups",
                "groups_collected", "zero_variance_rate"):
        assert crash_summary[key] == ref_summary[key], key
    print(f"crash test: {crashed.launches} launches, {len(crashed.kills)} kills, "
          f"{time.monotonic() - t0:.1f}s (plus the tiny agent fixture)")
