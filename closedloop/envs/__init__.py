"""Environments: the terminal-repair environment, its sandbox and tools, exported-state decoding
for the verifier, the environment packages, and ``check_env``. ``AgentEnv`` and ``SealingEnv``
(the transition contract, ``closedloop.contracts.transition``) are re-exported here for
environment authors.

Importing this package has no side effects (the sandbox probes ``unshare`` on first use only).
"""

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
from closedloop.envs.plugin import (
    EnvPackage,
    EnvTaskSets,
    TaskInfo,
    TaskSetRequest,
    resolve_package,
)
from closedloop.envs.sandbox import (
    CommandResult,
    SandboxConfig,
    network_namespace_available,
    run_command,
)
from closedloop.envs.task import HiddenGrader, TaskBundle, TaskSpec
from closedloop.envs.terminal import (
    ENV_VERSION,
    EnvConfig,
    TerminalRepairEnv,
    decode_sealed,
    validate_spec,
)
from closedloop.envs.tools import TOOLS, tool_schemas
from closedloop.envs.workspace import (
    RESERVED_PREFIXES,
    ExportedState,
    WorkspaceLimits,
    WorkspaceState,
    decode_state,
    normalize_path,
)
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
# the terminal-repair environment
__all__ += ["ENV_VERSION", "EnvConfig", "TerminalRepairEnv", "validate_spec"]
# state export (what the verifier reads)
__all__ += ["ExportedState", "WorkspaceState", "decode_sealed", "decode_state"]
# workspace, tools and sandbox
__all__ += ["RESERVED_PREFIXES", "TOOLS", "CommandResult", "SandboxConfig", "WorkspaceLimits",
            "network_namespace_available", "normalize_path", "run_command", "tool_schemas"]
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
