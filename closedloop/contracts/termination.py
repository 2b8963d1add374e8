"""The nine termination codes (docs/concepts.md, termination taxonomy).

The first four are terminal: the policy or the task contract ended the episode and the verifier
decides success. The other five are censored or system events: they are excluded from group
advantages by a declared rule and are never scored as reward 0.
"""

from __future__ import annotations

from enum import StrEnum


class Termination(StrEnum):
    """Why an episode ended."""

    AGENT_FINISH = "agent_finish"
    ENV_TERMINAL_SUCCESS = "env_terminal_success"
    ENV_TERMINAL_FAILURE = "env_terminal_failure"
    TASK_BUDGET_EXHAUSTED_TERMINAL = "task_budget_exhausted_terminal"
    MAX_STEP_TRUNCATION = "max_step_truncation"
    MAX_TOKEN_TRUNCATION = "max_token_truncation"
    TOOL_TIMEOUT = "tool_timeout"
    INFRA_ABORT = "infra_abort"
    SCHEDULER_CANCEL = "scheduler_cancel"

    @property
    def is_terminal(self) -> bool:
        """True for the four codes whose episode the verifier scores."""
        return self in TERMINAL_CODES

    @property
    def is_censored(self) -> bool:
        """True for truncation, timeout, infra abort and cancellation: never scored 0."""
        return not self.is_terminal


TERMINAL_CODES = frozenset({
    Termination.AGENT_FINISH,
    Termination.ENV_TERMINAL_SUCCESS,
    Termination.ENV_TERMINAL_FAILURE,
    Termination.TASK_BUDGET_EXHAUSTED_TERMINAL,
})
CENSORED_CODES = frozenset(set(Termination) - TERMINAL_CODES)
