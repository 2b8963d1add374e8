"""Named errors shared across layers.

Every contract violation raises one of these (never ``assert``), so a caller can quarantine the
sample with the error's name as the reason.
"""

from __future__ import annotations


class ClosedloopError(Exception):
    """Base class of every error closedloop raises on purpose."""


class ContractError(ClosedloopError):
    """A record or value breaks its contract (wrong type, missing field, inconsistent lengths)."""


class ActionParseError(ContractError):
    """Model text does not hold exactly one well-formed action; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class TraceFormatError(ContractError):
    """A trace line is corrupt. Names the file (when read from one), the line (1-based; 0 for
    a whole-trace check), the field and the reason."""

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


class InfrastructureError(ClosedloopError):
    """The machinery under an episode failed (a sandbox that could not start, a worker that
    died, a deadline), not the agent and not the code.

    The collector turns exactly these (and the built-in ``TimeoutError``) into the
    ``infra_abort`` termination, unscored; any other exception is a programming error and
    stops the run with its traceback.
    """


class SnapshotMismatchError(ClosedloopError):
    """A restored or replayed state does not have the hash its snapshot or trace promised."""


class StalePolicyError(ClosedloopError):
    """A sample's behaviour version lags the trainer by more than ``max_version_lag``."""


class MixedPolicyGroupError(ClosedloopError):
    """An episode or a group holds actions from more than one behaviour version."""


class TamperDetected(ClosedloopError):
    """The verifier found evidence the agent tampered with grading; quarantine the episode."""


class ConfigError(ClosedloopError):
    """A run config is invalid. Names the key (dotted path) and the reason."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"config key {key!r}: {reason}")
        self.key = key
        self.reason = reason
