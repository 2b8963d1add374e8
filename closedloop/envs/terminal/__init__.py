"""The terminal-repair environment package (``terminal-repair-v1``): one package, self-contained.

- ``env``: ``TerminalRepairEnv`` (the ``AgentEnv``), its config and sealed-state decoding;
- ``tools``, ``workspace``, ``sandbox`` (+ ``sandbox_child``, the bootstrap of a sandboxed
  command): what the agent's actions do, the workspace it edits and how commands run;
- ``families``: the versioned task families, their hint levels, the retain suites and the
  held-out overlap audit;
- ``verifier`` and ``graders``: the clean-room verifier (reward vector, tamper detection,
  validation) that scores exported state bytes against the hidden grader;
- ``fixtures``: adjudicated exported states for the verifier FP/FN gate;
- ``task_sets``: solvability-filtered train / held-out / family-disjoint sets;
- ``package``: the ``EnvPackage`` that wires them (``terminal_package``).

Generic layers never import this package; they reach it through ``closedloop.envs.discovery``.
"""

from closedloop.envs.terminal.env import (
    ENV_VERSION,
    EnvConfig,
    TerminalRepairEnv,
    decode_sealed,
    validate_spec,
)
from closedloop.envs.terminal.fixtures import build_fixtures, independent_label
from closedloop.envs.terminal.graders import GradeResult, grade
from closedloop.envs.terminal.sandbox import (
    CommandResult,
    SandboxConfig,
    network_namespace_available,
    run_command,
)
from closedloop.envs.terminal.tools import TOOLS, tool_schemas
from closedloop.envs.terminal.verifier import (
    REWARD_KEYS,
    VERIFIER_VERSION,
    TaskValidation,
    ValidationReport,
    Verifier,
    check_solvable,
    detect_tamper,
    replay_actions,
)
from closedloop.envs.terminal.workspace import (
    RESERVED_PREFIXES,
    ExportedState,
    WorkspaceLimits,
    WorkspaceState,
    decode_state,
    normalize_path,
)

# the environment
__all__ = ["ENV_VERSION", "EnvConfig", "TerminalRepairEnv", "decode_sealed", "validate_spec"]
# state export (what the verifier reads)
__all__ += ["ExportedState", "WorkspaceState", "decode_state"]
# workspace, tools and sandbox
__all__ += ["RESERVED_PREFIXES", "TOOLS", "CommandResult", "SandboxConfig", "WorkspaceLimits",
            "network_namespace_available", "normalize_path", "run_command", "tool_schemas"]
# the clean-room verifier
__all__ += ["REWARD_KEYS", "VERIFIER_VERSION", "GradeResult", "TaskValidation",
            "ValidationReport", "Verifier", "build_fixtures", "check_solvable", "detect_tamper",
            "grade", "independent_label", "replay_actions"]
