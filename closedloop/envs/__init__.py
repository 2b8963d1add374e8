"""Environments: the framework every environment package plugs into — discovery of packages
(``closedloop.envs.discovery``), ``check_env`` and the verifier FP/FN audit, snapshot
bookkeeping, the Gymnasium bridges — and one subpackage per environment (``terminal``,
``keydoor``, ``shopping``, ``searchqa``). ``AgentEnv`` and ``SealingEnv``
(the transition contract, ``closedloop.contracts.transition``) are re-exported here for
environment authors.

Importing this package imports no environment.
"""

from closedloop.contracts.package import EnvPackage, EnvTaskSets, TaskInfo, TaskSetRequest
from closedloop.contracts.transition import AgentEnv, SealingEnv
from closedloop.envs.check import (
    EnvCheckReport,
    check_env,
    check_fork_isolation,
    check_invalid_actions,
    check_package,
    check_reset,
    check_steps,
    random_actions,
    replay_property,
)
from closedloop.envs.discovery import resolve_package
from closedloop.envs.task_records import HiddenGrader, TaskBundle, TaskSpec
from closedloop.envs.verifier_audit import FamilyCounts, VerifierAudit, audit_verifier
from closedloop.errors import (
    CheckOptionError,
    EnvCheckError,
    EnvError,
    EnvNotResetError,
    EnvPackageError,
    EnvRaisedError,
    EnvVersionMismatchError,
    EpisodeDoneError,
    EpisodeNotDoneError,
    ForkIsolationError,
    InvalidActionEffectError,
    ProbeNoEffectError,
    ReplayMismatchError,
    ResetNondeterminismError,
    RestoreMismatchError,
    SandboxCommandError,
    SandboxInfraError,
    SealedSnapshotError,
    StateDecodeError,
    StepNondeterminismError,
    TaskError,
    UnknownEnvironmentError,
    UnknownSnapshotError,
    VerifierCheckError,
    WorkspaceLimitError,
    WorkspacePathError,
)

# contract and tasks
__all__ = ["AgentEnv", "HiddenGrader", "SealingEnv", "TaskBundle", "TaskSpec"]
# the plug-in contract
__all__ += ["EnvPackage", "EnvPackageError", "EnvTaskSets", "TaskInfo", "TaskSetRequest",
            "UnknownEnvironmentError", "resolve_package"]
# the verifier FP/FN audit on adjudicated fixtures
__all__ += ["FamilyCounts", "VerifierAudit", "audit_verifier"]
# checker
__all__ += ["CheckOptionError", "EnvCheckReport", "check_env", "check_fork_isolation",
            "check_invalid_actions", "check_package", "check_reset", "check_steps",
            "random_actions", "replay_property"]
# errors
__all__ += ["EnvCheckError", "EnvError", "EnvNotResetError", "EnvRaisedError",
            "EnvVersionMismatchError", "EpisodeDoneError", "EpisodeNotDoneError",
            "ForkIsolationError", "InvalidActionEffectError", "ProbeNoEffectError",
            "ReplayMismatchError", "ResetNondeterminismError", "RestoreMismatchError",
            "SandboxCommandError", "SandboxInfraError", "SealedSnapshotError", "StateDecodeError",
            "StepNondeterminismError", "TaskError", "UnknownSnapshotError", "VerifierCheckError",
            "WorkspaceLimitError", "WorkspacePathError"]
