"""Contracts: immutable typed records with canonical serialization and content hashes.

This layer imports no torch. See design.md §1-3.
"""

from closedloop.contracts.action import (
    PARSER_VERSION,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Action,
    parse_action,
)
from closedloop.contracts.errors import (
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
from closedloop.contracts.hashing import canonical_json, content_hash, sha256_hex
from closedloop.contracts.manifest import PolicyManifest, SamplerConfig
from closedloop.contracts.records import GroupLease, TrajectoryRecord, TurnRecord
from closedloop.contracts.snapshot import SnapshotRef, Transition
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

__all__ = [
    # termination
    "CENSORED_CODES",
    # actions
    "PARSER_VERSION",
    "TERMINAL_CODES",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "Action",
    # errors
    "ActionParseError",
    "ClosedloopError",
    "ConfigError",
    "ContractError",
    # trace records and I/O
    "Episode",
    "GroupLease",
    "InfrastructureError",
    "MixedPolicyGroupError",
    # policy boundary
    "PolicyManifest",
    "SamplerConfig",
    "SnapshotMismatchError",
    # environment state
    "SnapshotRef",
    "StalePolicyError",
    "TamperDetected",
    "Termination",
    "TraceFormatError",
    "TraceWriter",
    "TrajectoryRecord",
    "Transition",
    "TurnRecord",
    "assemble_episodes",
    # hashing
    "canonical_json",
    "content_hash",
    "load_episodes",
    "parse_action",
    "read_trace",
    "record_from_line",
    "record_to_line",
    "sha256_hex",
]
