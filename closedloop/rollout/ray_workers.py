"""Environment workers and generator workers as Ray actors (``rollout.workers: ray``).

The synchronous collection of a step, spread over processes:

- **environment workers** (``EnvWorker``, a fractional CPU each): each holds many environment
  instances (one per sibling episode, never shared) and executes their calls. The collector
  reaches them through ``RemoteEnv``, an ``AgentEnv`` whose every method is one remote call
  with a timeout.
- **generator workers** (``RolloutWorker``, whole CPUs): each holds its own copy of the policy
  (``PolicySpec.build``: base weights from a model folder, the LoRA adapter of the version it
  loaded and hashed) and rolls out its share of the step's groups with the ordinary
  ``Collector``, environments on the environment workers. Complete, unscored groups go to the
  driver through a bounded queue (``queue_capacity`` groups): a worker blocks on a full queue
  (backpressure) rather than pile groups up in the object store. The driver's verifier step
  scores them (clean-room scoring stays with the run, never on a worker).

Every remote call has a timeout (``call_timeout_s``). A worker that died or was killed raises
``WorkerError`` and one that does not answer in time raises ``WorkerTimeoutError`` (and is
killed): both are ``InfrastructureError``, so an episode whose environment worker died ends
``infra_abort``, unscored; its group is then discarded (or loses that member) by the censoring
rule and counted in the ledger like any other, and the pool starts a replacement worker before
the next collection (``EnvWorkerPool.heal``). A generator worker that dies loses no episode
record (the driver writes traces only from returned groups): its groups are collected again
from their leases on a fresh worker, once; a second failure raises.

With one generator worker the collector sees the same batches as the in-process run, and with
per-episode sampling streams (``CollectorConfig.sampling_salt``) the same seeds give the same
trajectories, timing fields aside. The code is the same on a multi-node cluster
(``address``): the run directory (the registry the workers read) must then be on a shared
filesystem.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from closedloop.contracts import (
    Action,
    AgentEnv,
    GroupLease,
    PolicyManifest,
    SnapshotRef,
    Transition,
)
from closedloop.errors import (
    SnapshotUnsupportedError,
    WorkerError,
    WorkersUnavailableError,
    WorkerTimeoutError,
)
from closedloop.rollout.collector import Collector, CollectorConfig, Renderer
from closedloop.rollout.verifier_step import RolloutGroup

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Set before ``ray.init``: no usage reporting, no token prompt, and a local cluster on
127.0.0.1 (without the last, Ray advertises the host's external address)."""


@dataclass(frozen=True)
class RayWorkersConfig:
    """The worker layout of a Ray collection (config ``rollout.ray``)."""

    env_workers: int = 2
    env_worker_cpus: float = 0.25
    generator_workers: int = 1
    generator_worker_cpus: float = 1.0
    queue_capacity: int = 4
    call_timeout_s: float = 600.0
    address: str | None = None  # None: start a local cluster with num_cpus
    num_cpus: int | None = None  # None: the machine's CPUs
    object_store_mb: int = 256


def ray_unavailable_reason() -> str | None:
    """Why Ray workers cannot run here (``ray`` not importable), or None."""
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        return f"ray is not installed ({exc}); pip install 'ray==2.60.0'"
    return None


@contextmanager
def ray_cluster(cfg: RayWorkersConfig) -> Iterator[dict[str, float]]:
    """Start (or join, with ``address``) a cluster for the block; yield its resources.

    A local cluster gets ``num_cpus`` (default the machine's), an object store of
    ``object_store_mb`` and no dashboard; it is shut down on exit.
    """
    reason = ray_unavailable_reason()
    if reason is not None:
        raise WorkersUnavailableError(reason)
    import ray

    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    if ray.is_initialized():
        yield dict(ray.cluster_resources())
        return
    kwargs: dict[str, Any] = dict(include_dashboard=False, logging_level="WARNING",
                                  log_to_driver=False)
    if cfg.address is None:
        kwargs.update(num_cpus=cfg.num_cpus or os.cpu_count() or 1,
                      object_store_memory=cfg.object_store_mb * 1024 * 1024)
    try:
        ray.init(address=cfg.address, **kwargs)
    except Exception as exc:  # ray raises several types for a cluster it cannot start
        raise WorkersUnavailableError(f"ray.init failed: {exc!r}") from exc
    try:
        yield dict(ray.cluster_resources())
    finally:
        ray.shutdown()


def remote_get(ref: Any, timeout_s: float, worker: str, actor: Any = None) -> Any:
    """``ray.get(ref)`` within ``timeout_s``: ``WorkerTimeoutError`` (the actor is killed)
    past it, ``WorkerError`` if the actor died; an exception raised inside the call is
    re-raised as itself."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        if actor is not None:
            ray.kill(actor)
        raise WorkerTimeoutError(worker, f"no answer within {timeout_s:g} s; killed") from None
    except RayActorError as exc:
        raise WorkerError(worker, f"died: {str(exc).splitlines()[0]}") from None
    except RayTaskError as exc:
        cause = exc.as_instanceof_cause()
        raise cause.cause if getattr(cause, "cause", None) is not None else cause from None


# ----------------------------------------------------------------------------- environments
class EnvWorker:
    """Holds environment instances by key and executes their calls (a Ray actor's class)."""

    def __init__(self, make_env: Callable[[], AgentEnv]) -> None:
        self.make_env = make_env
        self.envs: dict[str, AgentEnv] = {}
        self.calls = 0
        self.exit_at: int | None = None

    def open(self, key: str) -> str:
        """Create the environment ``key``; return its version."""
        env = self.make_env()
        self.envs[key] = env
        return env.env_version

    def call(self, key: str, method: str, *args: Any) -> Any:
        """Call ``method`` of environment ``key``."""
        self.calls += 1
        if self.exit_at is not None and self.calls >= self.exit_at:
            os._exit(1)  # a fault injected on purpose: the process dies mid-episode
        return getattr(self.envs[key], method)(*args)

    def close(self, key: str) -> None:
        """Forget environment ``key``."""
        self.envs.pop(key, None)

    def exit_after(self, calls: int) -> int:
        """Fault injection: the process exits at its ``calls``-th environment call from now.
        Returns the pid."""
        self.exit_at = self.calls + calls
        return os.getpid()

    def ping(self) -> int:
        """The pid (a liveness probe)."""
        return os.getpid()


class RemoteEnv:
    """An ``AgentEnv`` living in an ``EnvWorker``: each method is one remote call. The remote
    instance is created at the first call (inside the collector's ``reset``, where a dead
    worker becomes ``infra_abort``); ``env_version`` is the pool's."""

    def __init__(self, actor: Any, key: str, worker: str, timeout_s: float,
                 env_version: str) -> None:
        self.actor, self.key, self.worker, self.timeout_s = actor, key, worker, timeout_s
        self.env_version = env_version
        self._opened = False

    def _call(self, method: str, *args: Any) -> Any:
        if not self._opened:
            remote_get(self.actor.open.remote(self.key), self.timeout_s, self.worker,
                       self.actor)
            self._opened = True
        return remote_get(self.actor.call.remote(self.key, method, *args), self.timeout_s,
                          self.worker, self.actor)

    def reset(self, task_id: str, seed: int) -> str:
        """Remote ``reset``."""
        out: str = self._call("reset", task_id, seed)
        return out

    def step(self, action: Action | str) -> Transition:
        """Remote ``step``."""
        out: Transition = self._call("step", action)
        return out

    def export_state(self) -> bytes:
        """Remote ``export_state``."""
        out: bytes = self._call("export_state")
        return out

    def state_hash(self) -> str:
        """Remote ``state_hash``."""
        out: str = self._call("state_hash")
        return out

    def snapshot(self, label: str) -> SnapshotRef:
        """Remote ``snapshot``."""
        out: SnapshotRef = self._call("snapshot", label)
        return out

    def restore(self, snapshot: SnapshotRef) -> None:
        """Remote ``restore``."""
        self._call("restore", snapshot)

    def fork(self, snapshot: SnapshotRef, branch_id: str) -> AgentEnv:
        """Not offered remotely (runs do not branch)."""
        raise SnapshotUnsupportedError("a remote environment does not fork")

    def __del__(self) -> None:
        if self._opened:
            with contextlib.suppress(Exception):  # the worker may be gone: nothing to free
                self.actor.close.remote(self.key)


class RemoteSealingEnv(RemoteEnv):
    """A ``RemoteEnv`` over an environment that seals its terminal states."""

    def sealed_terminal(self) -> SnapshotRef:
        """Remote ``sealed_terminal``."""
        out: SnapshotRef = self._call("sealed_terminal")
        return out

    def export_sealed(self, ref: SnapshotRef) -> bytes:
        """Remote ``export_sealed``."""
        out: bytes = self._call("export_sealed", ref)
        return out




class EnvWorkerPool:
    """``n`` environment workers (``cpus`` each); environments are placed round-robin."""

    def __init__(self, make_env: Callable[[], AgentEnv], n: int, cpus: float,
                 timeout_s: float) -> None:
        import ray

        self._cls = ray.remote(EnvWorker)
        self.make_env, self.cpus, self.timeout_s = make_env, cpus, timeout_s
        sample = make_env()  # what every instance is: its version, whether it seals
        self.env_version = sample.env_version
        self.proxy = RemoteSealingEnv if hasattr(sample, "sealed_terminal") else RemoteEnv
        self.actors = [self._spawn() for _ in range(n)]
        self.names = [f"env-worker-{i}" for i in range(n)]
        self.replaced = 0

    def _spawn(self) -> Any:
        return self._cls.options(num_cpus=self.cpus).remote(self.make_env)

    def heal(self) -> int:
        """Replace every worker that does not answer a ping; return how many were."""
        fixed = 0
        for i, actor in enumerate(self.actors):
            try:
                remote_get(actor.ping.remote(), self.timeout_s, self.names[i], actor)
            except WorkerError:
                self.actors[i] = self._spawn()
                self.names[i] = f"env-worker-{i}.{self.replaced + fixed + 1}"
                fixed += 1
        self.replaced += fixed
        return fixed

    def factory(self, prefix: str) -> Callable[[], AgentEnv]:
        """An ``env_factory`` placing each new environment on the next worker."""
        counter = iter(range(10**12))
        actors, names, timeout = list(self.actors), list(self.names), self.timeout_s
        proxy, version = self.proxy, self.env_version

        def make() -> AgentEnv:
            i = next(counter)
            w = i % len(actors)
            return proxy(actors[w], f"{prefix}/{i}", names[w], timeout, version)

        return make


# ----------------------------------------------------------------------------- generators
@dataclass(frozen=True)
class PolicySpec:
    """How a generator worker builds its own policy and collector (picklable).

    ``build()`` returns ``(generator, load)``: a batched generator (the collector's session
    API) over the worker's own weights, and ``load(adapter_state, expected_checksum) ->
    PolicyChecksum``, which copies a version's adapter into those weights, hashes what the
    worker then holds (base, adapter, combined) and raises ``ChecksumMismatchError`` unless
    the combined checksum is ``expected_checksum``.
    """

    build: Callable[[], tuple[Any, Callable[[dict[str, Any], str], Any]]]
    renderer: Renderer
    decode: Callable[[list[int]], str]
    task_info: Callable[[str], tuple[str, str]]
    run_id: str
    collector: CollectorConfig
    threads: int = 1


@dataclass(frozen=True)
class HFPolicyBuilder:
    """``PolicySpec.build`` for an ``HFGenerator`` over a model folder (the run's base), with
    a LoRA adapter of the given layout when ``lora_rank`` is set (its initial values do not
    matter: every version's adapter is loaded over them)."""

    model: str
    lora_rank: int | None = None
    lora_alpha: int = 16
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    seed: int = 0
    precision: str = "float32"

    def __call__(self) -> tuple[Any, Callable[[dict[str, Any], str], Any]]:
        """Build the worker's policy, generator and ``load`` (``PolicySpec``)."""
        import torch

        from closedloop.engine import HFGenerator
        from closedloop.errors import ChecksumMismatchError, RegistryError
        from closedloop.policy import attach_lora
        from closedloop.policy.lora import policy_weight_checksum, split_state_dict
        from closedloop.policy.model_loader import load_model
        from closedloop.policy.weights import tensor_digests

        loaded = load_model(self.model)
        model = loaded.model
        if self.lora_rank is not None:
            model = attach_lora(model, r=self.lora_rank, alpha=self.lora_alpha,
                                target_modules=self.lora_targets)
        model.requires_grad_(False)
        generator = HFGenerator(model, loaded.tokenizer, seed=self.seed,
                                precision=self.precision)

        def load(state: dict[str, Any], expected: str) -> Any:
            own = split_state_dict(model)[1]
            if set(state) != set(own):
                raise RegistryError("the version's adapter tensors are not this worker's")
            with torch.no_grad():
                for name, tensor in state.items():
                    own[name].copy_(tensor)
            held = policy_weight_checksum(model)
            generator.refresh_weights(held.combined)
            if held.combined != expected:
                raise ChecksumMismatchError(f"the worker holds {held.combined}, not "
                                            f"{expected}")
            return held, tensor_digests(own)

        return generator, load


class RolloutWorker:
    """A generator worker (a Ray actor's class): its own policy copy and a collector."""

    def __init__(self, spec: PolicySpec) -> None:
        import torch

        torch.set_num_threads(spec.threads)
        self.spec = spec
        self.generator, self._load = spec.build()
        self.checksum: str | None = None

    def load(self, adapter_state: dict[str, Any], expected_checksum: str,
             probe: Any = None) -> Any:
        """Hold a version's adapter; return the ``PolicyChecksum`` of what this worker now
        holds, its per-tensor digests of the adapter and, given the run's ``probe``
        (``closedloop.training.weight_sync.Probe``), the probe's log-probs scored by its own
        generator (``()`` without one). A failed load leaves it holding no version: it
        collects nothing until the next."""
        self.checksum = None
        held, digests = self._load(adapter_state, expected_checksum)
        scored = () if probe is None else tuple(self.generator.score(probe.ids, probe.sampler))
        self.checksum = held.combined
        return held, digests, scored

    def collect(self, manifest: PolicyManifest, leases: Sequence[GroupLease],
                env_factory: Callable[[], AgentEnv], queue: Any) -> int:
        """Roll out ``leases`` under ``manifest``; put each complete, unscored group on
        ``queue``."""
        from closedloop.errors import RegistryError
        from closedloop.rollout.source import GeneratorSource

        if self.checksum != manifest.weight_checksum:
            raise RegistryError(f"this worker holds {self.checksum}, not "
                                f"{manifest.policy_version}'s {manifest.weight_checksum}")
        spec = self.spec
        source = GeneratorSource(self.generator, spec.decode, manifest.sampler,
                                 manifest.max_action_tokens, manifest.generator_build)
        collector = Collector(source, spec.renderer, env_factory, None, spec.task_info,
                              manifest, spec.run_id, None, spec.collector)
        groups = collector.rollout(list(leases))
        for group in groups:
            queue.put(group, block=True)
        return len(groups)

    def ping(self) -> int:
        """The pid (a liveness probe)."""
        return os.getpid()


class RayCollection:
    """Generator workers over an environment worker pool (module doc)."""

    def __init__(self, spec: PolicySpec, make_env: Callable[[], AgentEnv],
                 cfg: RayWorkersConfig) -> None:
        import ray
        from ray.util.queue import Queue

        self.cfg, self.spec = cfg, spec
        self.envs = EnvWorkerPool(make_env, cfg.env_workers, cfg.env_worker_cpus,
                                  cfg.call_timeout_s)
        self._cls = ray.remote(RolloutWorker)
        self.workers = [self._spawn() for _ in range(cfg.generator_workers)]
        self.queue = Queue(maxsize=cfg.queue_capacity, actor_options={"num_cpus": 0})
        self.held: tuple[dict[str, Any], str] | None = None
        self.collections = 0

    def _spawn(self) -> Any:
        return self._cls.options(num_cpus=self.cfg.generator_worker_cpus).remote(self.spec)

    def load(self, adapter_state: dict[str, Any], expected_checksum: str,
             probe: Any = None) -> dict[str, Any]:
        """Every generator worker holds the version; returns ``{worker: (PolicyChecksum,
        per-tensor digests, probe log-probs)}``, each computed by the worker itself from what
        it holds (a checksum mismatch raises ``ChecksumMismatchError``; ``RolloutWorker.load``
        for the probe)."""
        import ray

        ref = ray.put(adapter_state)
        refs = [w.load.remote(ref, expected_checksum, probe) for w in self.workers]
        self.held = (adapter_state, expected_checksum)
        return {self.name(i): remote_get(r, self.cfg.call_timeout_s, self.name(i), w)
                for i, (r, w) in enumerate(zip(refs, self.workers, strict=True))}

    def name(self, i: int) -> str:
        """The registry worker id of generator worker ``i``."""
        return f"ray-generator-{i}"

    def collect(self, manifest: PolicyManifest, leases: Sequence[GroupLease]
                ) -> list[RolloutGroup]:
        """Roll out ``leases`` over the workers: complete, unscored groups in lease order."""
        self.envs.heal()
        shares = [list(leases[i::len(self.workers)]) for i in range(len(self.workers))]
        got: dict[str, RolloutGroup] = {}
        for attempt in range(2):
            pending = self._dispatch(manifest, shares, attempt)
            failed = self._drain(pending, got)
            if not failed:
                break
            if attempt == 1:
                raise WorkerError(failed[0], "died twice while collecting its groups")
            shares = [[lz for lz in share if lz.group_id not in got]
                      if self.name(i) in failed else [] for i, share in enumerate(shares)]
        self.collections += 1
        return [got[lz.group_id] for lz in leases]

    def _dispatch(self, manifest: PolicyManifest, shares: list[list[GroupLease]],
                  attempt: int) -> dict[Any, int]:
        pending = {}
        for i, share in enumerate(shares):
            if not share:
                continue
            prefix = f"c{self.collections}.{attempt}.w{i}"
            pending[self.workers[i].collect.remote(manifest, share, self.envs.factory(prefix),
                                                   self.queue)] = i
        return pending

    def _drain(self, pending: dict[Any, int], got: dict[str, RolloutGroup]) -> list[str]:
        """Take groups off the queue until every dispatched collection has returned; restart
        (and reload) the workers that died. Returns their names."""
        import ray

        failed: list[str] = []
        deadline = time.monotonic() + self.cfg.call_timeout_s
        while pending or not self.queue.empty():
            while not self.queue.empty():
                group = self.queue.get(timeout=self.cfg.call_timeout_s)
                got[group.lease.group_id] = group
            if not pending:
                break
            done, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            for ref in done:
                i = pending.pop(ref)
                try:
                    remote_get(ref, self.cfg.call_timeout_s, self.name(i), self.workers[i])
                except WorkerError:
                    failed.append(self.name(i))
                    self._restart(i)
            if time.monotonic() > deadline:
                late = sorted(pending.values())
                for i in late:
                    ray.kill(self.workers[i])
                raise WorkerTimeoutError(self.name(late[0]), "its collection passed "
                                         f"{self.cfg.call_timeout_s:g} s; killed")
        return failed

    def shutdown(self) -> None:
        """Kill this collection's actors (generator and environment workers, the queue),
        freeing their CPUs on a cluster that outlives it."""
        import ray

        for actor in [*self.workers, *self.envs.actors, self.queue.actor]:
            with contextlib.suppress(Exception):
                ray.kill(actor)

    def _restart(self, i: int) -> None:
        self.workers[i] = self._spawn()
        if self.held is not None:
            state, checksum = self.held
            remote_get(self.workers[i].load.remote(state, checksum), self.cfg.call_timeout_s,
                       self.name(i), self.workers[i])
