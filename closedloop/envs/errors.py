"""Named errors of the environment layer.

Every failure raises one of these (never ``assert``). Errors an *agent* can cause (a bad path, a
disallowed command) are not exceptions: the tools turn them into structured error observations.
The classes here are for callers: the collector, the verifier, task authors and ``check_env``.
"""

from __future__ import annotations

from closedloop.contracts import (
    ClosedloopError,
    ContractError,
    InfrastructureError,
    SnapshotMismatchError,
)


class EnvError(ClosedloopError):
    """Base class of the environment layer's errors."""


class TaskError(EnvError):
    """A task cannot be loaded: unknown id, wrong env version, invalid files or commands."""


class WorkspacePathError(EnvError):
    """A workspace path is malformed or escapes the workspace.

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


class SandboxInfraError(EnvError, InfrastructureError):
    """The sandbox itself failed (could not create the directory or start the process).

    This is an infrastructure event, never an observation the agent is trained on: the step is
    not consumed and the state is unchanged, so the collector can abort (``infra_abort``).
    """


class SandboxCommandError(TaskError):
    """A command's argv cannot run in the sandbox (only ``python3 <script>``/``-m`` forms)."""


class EnvCheckError(EnvError):
    """``check_env`` found a contract violation; the message names task, seed and step."""


class ResetNondeterminismError(EnvCheckError):
    """Two resets with the same task and seed gave different observations or state hashes."""


class StepNondeterminismError(EnvCheckError):
    """The same actions from the same reset gave different transitions or states."""


class ReplayMismatchError(EnvCheckError):
    """Restoring a snapshot and replaying the recorded suffix did not reproduce the episode."""


class ForkIsolationError(EnvCheckError):
    """A write in one fork reached a sibling fork, the parent, or the snapshot."""


class RestoreMismatchError(ReplayMismatchError):
    """``restore`` (or ``fork``) left the env at a state hash other than the snapshot's."""


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
