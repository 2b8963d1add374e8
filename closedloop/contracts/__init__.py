"""Contracts: the three contracts, and immutable typed records with canonical serialization and
content hashes.

- transition (``closedloop.contracts.transition``): ``AgentEnv``, ``SealingEnv``,
  ``SnapshotRef``, ``Transition`` (with ``Action`` and ``Termination``);
- verification (``closedloop.contracts.verification``): ``TaskVerifier``, ``ScoreResult``,
  ``GuardedVerifier``;
- update (``closedloop.contracts.update``): ``Objective``, ``ObjectiveInputs``,
  ``ObjectiveOutput``, ``PolicyUpdater``, ``StepResult``.

This layer imports no torch.
"""

from closedloop.contracts.action import (
    PARSER_VERSION,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Action,
    parse_action,
)
from closedloop.contracts.hashing import canonical_json, content_hash, sha256_hex
from closedloop.contracts.manifest import PolicyManifest, SamplerConfig
from closedloop.contracts.records import GroupLease, TrajectoryRecord, TurnRecord
from closedloop.contracts.termination import CENSORED_CODES, TERMINAL_CODES, Termination
from closedloop.contracts.trace import (
    Episode,
    TraceWriter,
    assemble_episodes,
    load_episodes,
    read_trace,
    record_from_line,
    record_to_line,
)
from closedloop.contracts.transition import AgentEnv, SealingEnv, SnapshotRef, Transition
from closedloop.contracts.update import (
    Metrics,
    Objective,
    ObjectiveInputs,
    ObjectiveOutput,
    PolicyUpdater,
    StepResult,
)
from closedloop.contracts.verification import (
    SUCCESS_KEY,
    GuardedVerifier,
    ScoreResult,
    TaskVerifier,
    guarded,
)
from closedloop.errors import (
    ActionParseError,
    ClosedloopError,
    ConfigError,
    ContractError,
    InfrastructureError,
    MixedPolicyGroupError,
    SnapshotMismatchError,
    StalePolicyError,
    TamperDetected,
    TraceFormatError,
)

__all__ = [  # noqa: RUF022 -- grouped by contract and record kind, sorted within each group
    # the transition contract (closedloop.contracts.transition)
    "AgentEnv",
    "SealingEnv",
    "SnapshotRef",
    "Transition",
    # the verification contract (closedloop.contracts.verification)
    "SUCCESS_KEY",
    "GuardedVerifier",
    "ScoreResult",
    "TaskVerifier",
    "guarded",
    # the update contract (closedloop.contracts.update)
    "Metrics",
    "Objective",
    "ObjectiveInputs",
    "ObjectiveOutput",
    "PolicyUpdater",
    "StepResult",
    # actions
    "PARSER_VERSION",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "Action",
    "parse_action",
    # termination
    "CENSORED_CODES",
    "TERMINAL_CODES",
    "Termination",
    # policy boundary
    "PolicyManifest",
    "SamplerConfig",
    # trace records and I/O
    "Episode",
    "GroupLease",
    "TraceWriter",
    "TrajectoryRecord",
    "TurnRecord",
    "assemble_episodes",
    "load_episodes",
    "read_trace",
    "record_from_line",
    "record_to_line",
    # hashing
    "canonical_json",
    "content_hash",
    "sha256_hex",
    # errors
    "ActionParseError",
    "ClosedloopError",
    "ConfigError",
    "ContractError",
    "InfrastructureError",
    "MixedPolicyGroupError",
    "SnapshotMismatchError",
    "StalePolicyError",
    "TamperDetected",
    "TraceFormatError",
]
