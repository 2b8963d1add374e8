"""Generator replicas in their own processes, proving every publication
(``weight_sync.replicas``; atomic weight publication, docs/concepts.md).

Each replica is a spawned process that rebuilds the run's policy from its recipe (the model, the
warm-start adapter merged as the run merged it, the RL adapter's shape), so its base is its own
copy (its hash must still be the manifest's), and holds two slots, each a ``RolloutWorker``
over that base: *live* (what it serves) and *shadow*. At start it loads the registry's active
version into live (a restarted replica serves the active version, never a partial one).

    stage(v)     the shadow loads v from the registry (verified on read), hashes what it
                 holds, serves the fixed probe: the replica's ``Proof``
    activate(v)  shadow and live swap (the declared boundary: after every worker proved v)
    status()     the live version and the checksum of what live holds

Every call has a deadline (``ReplicaError`` naming the replica when it passes, when the process
died, or when the replica failed); a replica never hangs its caller.

``fault`` (tests): ``"stale"``: after its first version the replica loads nothing more, as a
generator whose updates never arrive; it proves the weights it actually holds, and is caught.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from closedloop.errors import ReplicaError
from closedloop.training.weight_sync import Probe, Proof, score_probe

__all__ = ["PolicyRecipe", "Replica", "ReplicaPool"]


@dataclass(frozen=True)
class PolicyRecipe:
    """How a replica rebuilds the run's policy: the model (``embedded`` or a local folder),
    its dtype and matmul precision, the warm-start adapter (``None`` without one) and the LoRA
    shapes (rank, alpha, target modules, seed) of the warm start and of the RL adapter, the
    environment section (for the scaffold), the run's registry, and the probe."""

    model: str
    dtype: str
    precision: str
    sft_adapter: str | None
    sft_lora: tuple[int, int, tuple[str, ...], int]
    rl_lora: tuple[int, int, tuple[str, ...], int]
    environment: dict[str, Any]
    registry_root: str
    run_id: str
    probe: Probe | None  # None: the run's publication gates no probe (bf16)
    threads: int = 1


def _build(recipe: PolicyRecipe, worker_id: str) -> tuple[Any, Any]:
    """The replica's live and shadow slots (``RolloutWorker``s over one rebuilt base)."""
    import torch

    from closedloop.engine import drop_bf16_copies
    from closedloop.envs.discovery import resolve_section
    from closedloop.policy import attach_lora
    from closedloop.policy.registry import PolicyRegistry
    from closedloop.training.rollout_worker import RolloutWorker, WorkerParts
    from closedloop.training.run import load_policy

    torch.set_num_threads(recipe.threads)
    package = resolve_section(recipe.environment)
    policy = load_policy(recipe.model, recipe.dtype, package)
    model = policy.model
    if recipe.sft_adapter is not None:
        r, alpha, targets, seed = recipe.sft_lora
        model = attach_lora(model, r=r, alpha=alpha, seed=seed, target_modules=targets)
        state = torch.load(recipe.sft_adapter, weights_only=True)
        model.load_state_dict(state, strict=False)
        model = model.merge_and_unload()
        drop_bf16_copies(model)
    r, alpha, targets, seed = recipe.rl_lora
    model = attach_lora(model, r=r, alpha=alpha, seed=seed, target_modules=targets)
    registry = PolicyRegistry(recipe.registry_root)
    parts = WorkerParts(recipe.run_id, policy.renderer, package, 1, None)
    live, shadow = (RolloutWorker(model, policy.tokenizer, registry, parts, worker_id=worker_id,
                                  precision=recipe.precision) for _ in range(2))
    return live, shadow


def replica_main(conn: Connection, worker_id: str, recipe: PolicyRecipe,
                 fault: str | None) -> None:
    """The replica process's loop (module doc): one request, one answer, until ``stop``."""
    live, shadow = _build(recipe, worker_id)
    active = live.registry.active()
    if active is not None:
        live.load(active.version)
    conn.send(("ready", live.version))
    staged = False
    while True:
        try:
            command, arg = conn.recv()
        except EOFError:
            return
        try:
            if command == "stop":
                conn.send(("ok", None))
                return
            if command == "stage":
                if fault == "stale" and staged:
                    proof = _prove_held(shadow, arg, recipe.probe)  # the update never came
                else:
                    proof = shadow.prove(arg, recipe.probe)
                staged = True
                conn.send(("ok", proof.to_dict()))
            elif command == "activate":
                if shadow.version != arg:
                    raise ValueError(f"asked to activate {arg}, the shadow holds "
                                     f"{shadow.version}")
                live, shadow = shadow, live
                conn.send(("ok", live.version))
            elif command == "status":
                conn.send(("ok", {"version": live.version,
                                  "checksum": live.held_checksum().combined}))
            else:
                raise ValueError(f"unknown command {command!r}")
        except Exception as exc:  # reported to the caller, who quarantines the replica
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _prove_held(slot: Any, version: str, probe: Probe | None) -> Proof:
    """The proof of what ``slot`` holds, without loading ``version`` (the ``stale`` fault)."""
    from closedloop.policy.weights import tensor_digests

    ids, logprobs = score_probe(slot.generator, probe)
    return Proof(slot.worker_id, version, slot.held_checksum().combined,
                 tensor_digests(slot.adapter_tensors()), ids, logprobs, 0.0)


class Replica:
    """The trainer-side handle of one replica process (module doc)."""

    def __init__(self, worker_id: str, recipe: PolicyRecipe, *, timeout_s: float = 300.0,
                 fault: str | None = None) -> None:
        self.worker_id = worker_id
        self.recipe = recipe
        self.timeout_s = timeout_s
        self.fault = fault
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Connection | None = None
        self.started_version: str | None = None

    def start(self) -> None:
        """Spawn the process and wait until it serves (the active version, if any)."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=replica_main, name=f"closedloop-{self.worker_id}",
                                 args=(child, self.worker_id, self.recipe, self.fault),
                                 daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        self.started_version = self._receive("start")[1]

    def _receive(self, what: str) -> tuple[str, Any]:
        assert self._conn is not None
        deadline = time.monotonic() + self.timeout_s
        while not self._conn.poll(0.1):
            if not self.alive():
                raise ReplicaError(f"replica {self.worker_id} died during {what}")
            if time.monotonic() > deadline:
                raise ReplicaError(f"replica {self.worker_id} did not answer {what} within "
                                   f"{self.timeout_s:.0f}s")
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise ReplicaError(f"replica {self.worker_id} died during {what}") from exc
        if status == "error":
            raise ReplicaError(f"replica {self.worker_id} failed {what}: {value}")
        return status, value

    def _call(self, command: str, arg: Any = None) -> Any:
        with self._lock:
            if self._conn is None or not self.alive():
                raise ReplicaError(f"replica {self.worker_id} is not running")
            try:
                self._conn.send((command, arg))
            except (BrokenPipeError, OSError) as exc:
                raise ReplicaError(f"replica {self.worker_id} died before {command}") from exc
            return self._receive(command)[1]

    def stage(self, version: str) -> Proof:
        """The replica's proof that its shadow holds ``version``."""
        return Proof.from_dict(self._call("stage", version))

    def activate(self, version: str) -> None:
        """Swap the shadow (holding ``version``) into live."""
        self._call("activate", version)

    def status(self) -> dict[str, Any]:
        """The live version and the checksum of what live holds."""
        result: dict[str, Any] = self._call("status")
        return result

    def alive(self) -> bool:
        """Whether the process runs."""
        return self._proc is not None and self._proc.is_alive()

    def kill(self) -> None:
        """SIGKILL the process (a crash, for tests)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(10)

    def stop(self) -> None:
        """Ask the process to end, then make sure it did."""
        if self.alive():
            with contextlib.suppress(ReplicaError):
                self._call("stop")
        if self._proc is not None:
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class ReplicaPool:
    """The run's replicas: ``replica-0 .. replica-(n-1)``."""

    def __init__(self, n: int, recipe: PolicyRecipe, *, timeout_s: float = 300.0,
                 faults: dict[str, str] | None = None) -> None:
        self.replicas = [Replica(f"replica-{i}", recipe, timeout_s=timeout_s,
                                 fault=(faults or {}).get(f"replica-{i}")) for i in range(n)]

    @property
    def worker_ids(self) -> list[str]:
        """The replicas' worker ids."""
        return [r.worker_id for r in self.replicas]

    def start(self) -> None:
        """Start every replica (in turn: each rebuilds the policy)."""
        for r in self.replicas:
            r.start()

    def get(self, worker_id: str) -> Replica:
        """The replica named ``worker_id``."""
        return next(r for r in self.replicas if r.worker_id == worker_id)

    def stop(self) -> None:
        """Stop every replica."""
        for r in self.replicas:
            r.stop()
