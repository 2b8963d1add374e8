"""Every error class closedloop defines, under one root, grouped by the layer that raises it.

A violated contract raises one of these (never ``assert``), so a caller can quarantine the
sample with the error's name as the reason. The rules that span classes:

- Errors an *agent* can cause (a bad path, a disallowed command, unparsable text) are not
  raised to callers: the tools turn them into structured error observations (``ToolFailure``
  carries one inside the envs layer).
- ``InfrastructureError`` (and the built-in ``TimeoutError``) is what the collector turns into
  the ``infra_abort`` termination, unscored; any other exception is a programming error and
  stops the run with its traceback.
- Classes that also derive from a builtin (``ValueError``, ``KeyError``, ``RuntimeError``,
  ``NotImplementedError``) do so because callers catch that builtin.

This module imports nothing from closedloop, so every layer can import it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


class ClosedloopError(Exception):
    """Base class of every error closedloop raises on purpose."""


# --------------------------------------------------------------------------- contracts


class ContractError(ClosedloopError):
    """A record or value breaks its contract (wrong type, missing field, inconsistent lengths)."""


class ActionParseError(ContractError):
    """Model text does not hold exactly one well-formed action; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class FieldError(ContractError):
    """One field of a record is wrong; carries ``field`` and ``reason``."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class TraceFormatError(ContractError):
    """A trace line is corrupt; carries ``path`` (or None), ``line`` (0: whole trace), ``field``,
    ``reason``."""

    def __init__(self, line: int, field: str, reason: str, path: str | None = None) -> None:
        where = f"{path}: " if path else ""
        super().__init__(f"{where}trace line {line}: field {field!r}: {reason}")
        self.line = line
        self.field = field
        self.reason = reason
        self.path = path

    def in_file(self, path: object) -> TraceFormatError:
        """The same error, naming ``path``."""
        return TraceFormatError(self.line, self.field, self.reason, str(path))


class MetricsFormatError(ContractError):
    """A metrics line is corrupt or repeats a key; carries ``path``, ``line`` (0: whole file),
    ``field``, ``reason``."""

    def __init__(self, path: str | Path, line: int, field: str, reason: str) -> None:
        super().__init__(f"{path}: metrics line {line}: field {field!r}: {reason}")
        self.path = str(path)
        self.line = line
        self.field = field
        self.reason = reason


class InfrastructureError(ClosedloopError):
    """The machinery under an episode failed (sandbox, worker, deadline): ``infra_abort``."""


class SnapshotMismatchError(ClosedloopError):
    """A restored or replayed state does not have the hash its snapshot or trace promised."""


class StalePolicyError(ClosedloopError):
    """A sample's behaviour version lags the trainer by more than ``max_version_lag``."""


class MixedPolicyGroupError(ClosedloopError):
    """An episode, a group or an evaluation holds actions of more than one policy version."""


class TamperDetected(ClosedloopError):
    """The verifier found evidence the agent tampered with grading; quarantine the episode."""


class VerifierFailure(ClosedloopError):
    """A verifier declares it cannot decide this state (its own timeout, a resource or sandbox
    limit it enforces): the episode is left unscored (``verifier_failure: ...``). Any exception a
    verifier raises that is not a declared failure is a programming error and stops the run."""


class ConfigError(ClosedloopError):
    """A run config is invalid; carries ``key`` (the dotted path) and ``reason``."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"config key {key!r}: {reason}")
        self.key = key
        self.reason = reason


# --------------------------------------------------------------------------- envs


class EnvError(ClosedloopError):
    """Base class of the environment layer's errors."""


class TaskError(EnvError):
    """A task cannot be loaded: unknown id, wrong env version, invalid files or commands."""


class WorkspacePathError(EnvError):
    """A workspace path is malformed or escapes the workspace; carries ``code``, ``reason``,
    ``violation``.

    ``code`` is the observation error code the tools report: ``path_denied`` for paths that try
    to leave the workspace or touch a reserved prefix, ``bad_arguments`` for malformed ones.
    ``violation`` is the policy-violation code a denied path counts as (``path_escape`` or
    ``reserved_path``), ``None`` for a merely malformed path.
    """

    def __init__(self, code: str, reason: str, violation: str | None = None) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.violation = violation


class WorkspaceLimitError(EnvError):
    """A write would exceed the per-file, total-size or file-count cap of the workspace."""


class StateDecodeError(ContractError):
    """Exported state bytes are corrupt: not JSON, a field is missing or wrong, a hash differs."""


class EnvNotResetError(EnvError):
    """``step``/``snapshot``/``export_state`` was called before ``reset``."""


class EpisodeDoneError(EnvError):
    """The episode is over: no more steps or snapshots (its terminal state is sealed)."""


class EpisodeNotDoneError(EnvError):
    """A terminal snapshot was requested before the episode ended."""


class SealedSnapshotError(EnvError):
    """A sealed terminal snapshot was restored or forked into an agent-facing environment."""


class UnknownSnapshotError(SnapshotMismatchError):
    """The snapshot id is not in this environment's snapshot store."""


class SnapshotUnsupportedError(EnvError, NotImplementedError):
    """The environment cannot capture its state; the message says why (no snapshots, forks)."""


class SandboxInfraError(EnvError, InfrastructureError):
    """The sandbox failed to create its directory or start the process (step not consumed)."""


class SandboxCommandError(TaskError):
    """A command's argv cannot run in the sandbox (only ``python3 <script>``/``-m`` forms)."""


class ToolFailure(ClosedloopError):
    """Inside the envs layer: a tool call failed; carries ``code``, ``message``, ``violation``.

    The tools turn it into an error observation; it never reaches a caller.
    """

    def __init__(self, code: str, message: str, violation: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.violation = violation


class TaskGenerationError(ClosedloopError):
    """A template produced a draft that breaks the task contract; the message says which rule."""


class UnknownTaskError(ClosedloopError):
    """A task id, family, template or hint level is not known to the task registry."""


class EnvPackageError(EnvError):
    """An environment package is invalid, cannot be loaded, or is not what was asked for."""


class UnknownEnvironmentError(EnvPackageError):
    """No package is registered under the id (the message lists the known ids)."""


class GymAdapterError(EnvError):
    """A Gymnasium env cannot be wrapped (no ``Discrete`` action space, names do not match)."""


class EnvCheckError(EnvError):
    """``check_env`` found a contract violation; the message names task, seed and step."""


class CheckOptionError(EnvError):
    """A ``check_env`` option is invalid (unknown weight key, negative weight, no source)."""


class ResetNondeterminismError(EnvCheckError):
    """Two resets with the same task and seed gave different observations or state hashes."""


class StepNondeterminismError(EnvCheckError):
    """The same actions from the same reset gave different transitions or states."""


class ReplayMismatchError(EnvCheckError):
    """Restoring a snapshot and replaying the recorded suffix did not reproduce the episode."""


class RestoreMismatchError(ReplayMismatchError):
    """``restore`` (or ``fork``) left the env at a state hash other than the snapshot's."""


class ForkIsolationError(EnvCheckError):
    """A write in one fork reached a sibling fork, the parent, or the snapshot."""


class InvalidActionEffectError(EnvCheckError):
    """An unparsable text was not reported as an error, or its effect depended on the text."""


class ProbeNoEffectError(EnvCheckError):
    """The fork probe (a declared state-changing action) did not change the state."""


class EnvRaisedError(EnvCheckError):
    """The environment raised its own exception during a check (named in the message)."""


class EnvVersionMismatchError(EnvCheckError):
    """``make_env().env_version`` is not the package's ``env_version``."""


class VerifierCheckError(EnvCheckError):
    """The verifier rejected the scripted expert's final state or accepted the initial one."""


# --------------------------------------------------------------------------- verify


class UnknownGraderError(ClosedloopError):
    """``checks["kind"]`` names no grader (a task-definition bug, not an agent failure)."""


class DuplicateKeyError(ClosedloopError, ValueError):
    """A JSON object read by ``loads_strict`` repeats a key (ambiguous JSON is not accepted)."""


class FixtureError(ClosedloopError):
    """A fixture cannot be built, or its hand label and the independent checker disagree."""


# --------------------------------------------------------------------------- policy


class ChatTemplateError(ContractError):
    """The tokenizer does not fit the template (a special token is missing or splits)."""


class GenerationError(ContractError):
    """A generation request is invalid (unknown session, empty context, bad budget or ids)."""


class ContextOverflowError(GenerationError):
    """A context plus its budget exceeds the window; carries ``sessions``, ``max_context``.

    The collector ends the named sessions' episodes with ``max_token_truncation`` instead of
    letting the model see a silently cut context.
    """

    def __init__(self, sessions: Sequence[Any], max_context: int) -> None:
        super().__init__(f"sessions {list(sessions)} would exceed the {max_context}-token "
                         "context window")
        self.sessions = list(sessions)
        self.max_context = max_context


class AdapterError(ClosedloopError):
    """An adapter cannot be attached, saved or loaded; the message says why."""


class ModelLoadError(ClosedloopError):
    """The model could not be located, loaded or cached; the message says which and why."""


class RegistryError(ClosedloopError):
    """Base class of policy registry errors (bad version names, nothing published, ...)."""


class UnknownVersionError(RegistryError):
    """The version is not in the registry (never staged, or staged elsewhere)."""


class ChecksumMismatchError(RegistryError):
    """Stored or loaded weights do not have the checksum the registry recorded."""


class MissingAckError(RegistryError):
    """A worker has not acknowledged loading the version."""


class ReplicaError(RegistryError):
    """A generator replica process died, failed a request or did not answer within its
    deadline (it is quarantined; the active version stays)."""


class PublicationError(RegistryError):
    """A version could not be made active: a worker does not hold what the manifest says (it
    is quarantined) or did not acknowledge in time; the active version stays."""


# --------------------------------------------------------------------------- engine


class PrecisionError(ClosedloopError, ValueError):
    """An unknown matmul precision name (not one of ``engine.PRECISIONS``)."""


class NativeBuildError(ClosedloopError, RuntimeError):
    """A C source could not be built for this host (no compiler, or the compiler failed); caught
    by ``closedloop.engine.native_build``, whose callers then keep their torch path."""


class EmulatedBf16Warning(ClosedloopError, UserWarning):
    """Warned (never raised) when bfloat16 matmuls are forced on a host that emulates them, many
    times slower than float32 (``closedloop.engine.host_precision``)."""


class LogprobInputError(ContractError):
    """Ids and masks disagree in shape, or a row's real tokens are not contiguous."""


class EngineUnavailableError(ClosedloopError):
    """An external inference engine cannot run here (its environment is absent or broken);
    carries ``reason``, the exact cause (``scripts/setup-vllm`` writes it)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EngineProcessError(InfrastructureError):
    """An engine process died or stopped answering: the episodes it served end ``infra_abort``;
    the message carries the tail of its log."""


class EngineTimeoutError(EngineProcessError, TimeoutError):
    """An engine process gave no answer within the call's timeout (it is then killed)."""


class EngineRequestError(GenerationError):
    """An engine process refused a request (its reply names the error and its traceback)."""


class ReplicaProofError(RegistryError):
    """A generator replica could not prove it serves a version: the weights it hashed are not
    the manifest's, or its probe log-probs differ from the trainer's beyond the audit
    tolerance. The replica is not acknowledged; carries ``proof`` (a ``ReplicaProof``)."""

    def __init__(self, message: str, proof: Any = None) -> None:
        super().__init__(message)
        self.proof = proof


# --------------------------------------------------------------------------- rollout


class ContextBudgetExceeded(ClosedloopError):
    """Some contexts cannot take another action within the window; carries ``keys``.

    The collector ends those episodes with ``max_token_truncation`` (censored) rather than let
    the model see a silently cut context (docs/concepts.md, termination taxonomy).
    """

    def __init__(self, keys: Sequence[str]) -> None:
        super().__init__(f"context window exceeded for {list(keys)}")
        self.keys = list(keys)


class PrefixRestoreError(SnapshotMismatchError):
    """A recorded episode's prefix did not reproduce its recorded state hashes on replay, so no
    snapshot of the replayed env can stand for the recorded decision state (branching, shaping
    and the causal audit refuse it)."""


class BranchError(ClosedloopError):
    """A branch request breaks the branching contract (a branch point outside the episode's
    executed turns, fewer than two continuations, a parent without a recorded prompt)."""


class WorkerError(InfrastructureError):
    """A remote worker (a Ray actor) died, was killed, or did not answer within the call's
    timeout; the episodes it held end ``infra_abort``. Carries ``worker``."""

    def __init__(self, worker: str, reason: str) -> None:
        super().__init__(f"worker {worker}: {reason}")
        self.worker = worker
        self.reason = reason


class WorkerTimeoutError(WorkerError, TimeoutError):
    """A remote call to a worker passed its timeout: the worker is treated as dead."""


class WorkersUnavailableError(ClosedloopError):
    """The worker backend asked for (``ray``) is not installed or cannot start a cluster."""


class LedgerError(ClosedloopError):
    """Base class of every group ledger error."""


class LedgerCorruptError(LedgerError):
    """The ledger file is unreadable, fails its integrity check, or disagrees with its events or
    a checkpoint's digest; the message names the file and what was found."""


class LedgerSchemaError(LedgerError):
    """The database file was written with another ledger schema version."""


class UnknownGroupError(LedgerError):
    """A transition names a group id the ledger never recorded."""


class DuplicateGroupError(LedgerError):
    """``record_collected`` was called twice for one group id (the group ids are immutable)."""


class IllegalTransitionError(LedgerError):
    """A transition is not allowed from the group's state; carries ``group_id``,
    ``from_state``, ``to_state``."""

    def __init__(self, group_id: str, from_state: str, to_state: str) -> None:
        super().__init__(f"group {group_id!r}: illegal transition {from_state} -> {to_state}")
        self.group_id = group_id
        self.from_state = from_state
        self.to_state = to_state


class DuplicateConsumptionError(IllegalTransitionError):
    """A group that is already ``consumed`` was offered for consumption again."""


class LedgerInconsistencyError(LedgerError):
    """The ledger and a trainer checkpoint disagree in a way the protocol cannot produce."""


class QueueCapacityError(ClosedloopError):
    """A generator round would break the admission queue's capacity rule (accepted + running +
    B > (max_version_lag + v + 1) * B), or was started or handed over twice."""


class QueueTimeoutError(ClosedloopError, TimeoutError):
    """The generator or the trainer waited past its deadline on the admission queue (the other
    side stopped or hangs): raised, never waited on forever."""


class StaleTokenError(ClosedloopError):
    """A batch about to be trained holds an action token sampled more than ``max_version_lag``
    versions before the trainer's version: the hard staleness bound was broken upstream."""


class TaskSamplerError(ClosedloopError):
    """The task sampler was configured or updated inconsistently; the message says how."""


class UnknownSamplerTaskError(TaskSamplerError, KeyError):
    """A task id the sampler does not hold."""


class NoCandidateTasksError(TaskSamplerError):
    """Every task is quarantined (or every non-empty stream has weight 0): nothing to draw."""


# --------------------------------------------------------------------------- learn


class LearnError(ContractError, ValueError):
    """A value handed to a ``closedloop.learn`` function (or the trainer) breaks its contract."""


class UnknownNameError(ClosedloopError, ValueError):
    """A lookup by name failed; carries ``registry``, ``name`` and the ``known`` names."""

    def __init__(self, registry: str, name: str, known: Iterable[str]) -> None:
        self.registry = registry
        self.name = name
        self.known = tuple(sorted(known))
        super().__init__(f"unknown {registry} {name!r}; known: {', '.join(self.known)}")


class GroupTooSmallError(LearnError):
    """A group-relative estimator got fewer than two members with a reward."""


class NonFiniteRewardError(LearnError):
    """An uncensored member's reward is missing (None) or not finite."""


class KLPlacementError(LearnError):
    """KL would enter both the reward and the loss, or a placement/spec field is invalid."""


class MaskError(LearnError):
    """A mask, turn-id or loss tensor has the wrong shape or values."""


class NonFiniteLogprobError(LearnError):
    """A log-prob or advantage on an action token is missing or not finite."""


class UnknownObjectiveError(LearnError):
    """An objective name that is not registered, or a dotted path that does not import."""


class InvalidObjectiveError(LearnError):
    """An objective factory that is not callable, raised, or made something that does not
    satisfy the ``Objective`` protocol; or a registration under an unusable or taken name."""


class BatchReuseError(LearnError):
    """Several optimizer steps on one batch asked of an objective without ratios."""


class CheckpointError(ClosedloopError):
    """A checkpoint cannot be written or read (or does not fit the model it is loaded into)."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint directory is incomplete or its content does not match its hashes."""


class CheckpointExistsError(CheckpointError):
    """A valid checkpoint at this step (or a later one) already exists."""


# --------------------------------------------------------------------------- evaluate


class StatsInputError(ContractError, ValueError):
    """Counts or samples handed to a statistics function are inconsistent."""


class EmptySampleError(StatsInputError):
    """An interval or a summary was asked for with no observations (n = 0, an empty sample)."""


class RetainSuiteMismatchError(StatsInputError):
    """The two evaluations to compare do not cover the same retain suites."""


class CausalAuditError(ContractError, ValueError):
    """A causal audit was handed an episode it cannot intervene on (not scored, not terminal) or
    credits that do not cover an episode's executed turns, or an intervention without its
    replacement."""


class RunDirError(ClosedloopError):
    """The path is not a readable run (or experiment) directory."""


class UnknownGateError(ClosedloopError, KeyError):
    """``evaluate_gates`` was asked for gate names it does not have (the message lists them)."""


class PackageCheckError(ClosedloopError):
    """An environment package failed its check (the environment contract checker or the
    verifier FP/FN audit) before training; carries ``env_id`` and ``problems``."""

    def __init__(self, env_id: str, problems: Sequence[str]) -> None:
        super().__init__(f"environment package {env_id!r} failed its check: "
                         + "; ".join(problems) + " (run `closedloop check` on it for the "
                         "report; training.package_check names the mode)")
        self.env_id = env_id
        self.problems = list(problems)


# --------------------------------------------------------------------------- runs


class RunDirectoryError(ClosedloopError):
    """A run directory's file disagrees with the rest of the run; carries ``path``, ``problem``,
    ``recovery``."""

    def __init__(self, path: str | Path, problem: str, recovery: str) -> None:
        super().__init__(f"{path}: {problem}. To recover: {recovery}")
        self.path = str(path)
        self.problem = problem
        self.recovery = recovery


class ConfigDriftError(RunDirectoryError):
    """The resolved config differs from the one the run directory recorded."""


class RunStateError(RunDirectoryError):
    """Checkpoints, ledger, registry, metrics and traces cannot be reconciled."""


class RunLockedError(RunDirectoryError):
    """Another process holds the run directory."""


class UnscorableRunError(ClosedloopError):
    """A run cannot produce a scored episode (every episode of an RL step censored or
    quarantined), so it cannot train; carries ``keys`` (the config keys that decide the
    censoring) and ``terminations`` (the counts by code)."""

    def __init__(self, where: str, keys: Sequence[str], terminations: dict[str, int],
                 advice: str) -> None:
        shown = ", ".join(f"{k} {n}" for k, n in sorted(terminations.items()))
        super().__init__(f"{where}: no episode was scored ({shown}), so nothing can train; "
                         f"the keys that decide it: {', '.join(keys)}. {advice}")
        self.keys = list(keys)
        self.terminations = dict(terminations)


class RunNotReadyError(ClosedloopError, RuntimeError):
    """A training-run function was called before the set-up it needs (``attach_roles``)."""


class ConsistencyGateError(ClosedloopError):
    """Generator and trainer disagree on log-probs at one version beyond the tolerance."""


class ExportError(ClosedloopError):
    """A run cannot be exported (no traces, a bad format, an existing output)."""


class ExportDependencyError(ExportError):
    """pyarrow or datasets is missing: install the extra ``closedloop[export]``."""


class ExportMismatchError(ExportError):
    """A record read back from the export differs from its JSONL record (names which)."""
