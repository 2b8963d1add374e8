"""Rollout: version-pinned group collection, training tensors, replay, ledger and admission."""

from closedloop.contracts.batch import TrainingBatch
from closedloop.errors import (
    DuplicateConsumptionError,
    DuplicateGroupError,
    IllegalTransitionError,
    LedgerError,
    LedgerInconsistencyError,
    UnknownGroupError,
)
from closedloop.rollout.admission import (
    AdmissionController,
    AdmissionDecision,
    AdmissionStats,
    apply_decision,
)
from closedloop.rollout.collector import CollectedGroup, Collector, CollectorConfig
from closedloop.rollout.ledger import (
    ExactlyOnceReport,
    GroupSummary,
    Ledger,
    LedgerCounts,
    ReconcileReport,
)
from closedloop.rollout.replay import ReplayReport, replay_trace
from closedloop.rollout.source import ActionSample, GeneratorSource, ScriptedSource
from closedloop.rollout.tensors import ShiftedTargets, build_training_batch, shift_targets

__all__ = [  # noqa: RUF022 -- grouped by topic
    # collection
    "ActionSample", "CollectedGroup", "Collector", "CollectorConfig", "GeneratorSource",
    "ScriptedSource",
    # training tensors
    "ShiftedTargets", "TrainingBatch", "build_training_batch", "shift_targets",
    # replay
    "ReplayReport", "replay_trace",
    # admission and the exactly-once ledger
    "AdmissionController", "AdmissionDecision", "AdmissionStats", "apply_decision",
    "ExactlyOnceReport", "GroupSummary", "Ledger", "LedgerCounts", "ReconcileReport",
    "DuplicateConsumptionError", "DuplicateGroupError", "IllegalTransitionError",
    "LedgerError", "LedgerInconsistencyError", "UnknownGroupError",
]
