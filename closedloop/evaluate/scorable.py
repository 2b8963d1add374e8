"""A run that cannot produce a scored episode stops, naming the config keys that decide it.

An RL step trains on scored episodes only: censored ones (truncated at the turn or action-token
limit, timed out, aborted, cancelled) and quarantined ones carry no reward, and a group without
two scored members (``drop_censored``) or with any censored member (``discard_group``) is
discarded. When *no* episode of a step was scored, every group is discarded whatever the
policy's luck, nothing trains, and the next step samples the same policy: the run stops with
:class:`UnscorableRunError` instead of ending well having trained nothing. The keys it names
follow the termination codes: ``max_step_truncation`` → ``environment.max_turns`` (below the
package's step budget, an agent that never finishes is cut, never scored as a failure),
``max_token_truncation`` → ``rollout.max_action_tokens``, ``scheduler_cancel`` →
``rollout.episode_deadline_s``; with ``credit.censor_rule: discard_group`` that key too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from closedloop.contracts import TrajectoryRecord
from closedloop.errors import UnscorableRunError

__all__ = ["KEYS_BY_TERMINATION", "REMEDIES", "require_scored"]

KEYS_BY_TERMINATION: Mapping[str, str] = {
    "max_step_truncation": "environment.max_turns",
    "max_token_truncation": "rollout.max_action_tokens",
    "scheduler_cancel": "rollout.episode_deadline_s",
}
"""The config key that decides each censoring termination code."""
REMEDIES: Mapping[str, str] = {
    "environment.max_turns": "raise it to at least the package's step budget, so an episode "
                             "that runs out of steps is scored as a failure, not censored",
    "rollout.max_action_tokens": "raise it (an action cut at the limit censors its episode), "
                                 "or warm-start the policy on the environment's action format",
    "rollout.episode_deadline_s": "raise it or set it to null",
    "credit.censor_rule": "drop_censored keeps a group's scored members when two remain",
}
"""What to change for each key an unscorable step names."""


def require_scored(trajectories: Iterable[TrajectoryRecord], where: str,
                   censor_rule: str, budgets: Mapping[str, object]) -> None:
    """Raise ``UnscorableRunError`` when none of ``trajectories`` was scored (and there was at
    least one); ``budgets`` maps the named keys to their values, quoted in the advice."""
    trajs = list(trajectories)
    if not trajs or any(t.reward is not None for t in trajs):
        return
    codes = Counter(t.termination.value for t in trajs)
    quarantined = sum(t.quarantine_reason is not None for t in trajs)
    if quarantined:
        codes["quarantined"] = quarantined
    keys = [KEYS_BY_TERMINATION[c] for c, _ in codes.most_common() if c in KEYS_BY_TERMINATION]
    if censor_rule == "discard_group":
        keys.append("credit.censor_rule")
    advice = " ".join(f"{k} = {budgets.get(k)}: {REMEDIES[k]}." for k in keys) if keys else (
        "Every episode was aborted or quarantined: check the environment and the verifier "
        "(closedloop check).")
    raise UnscorableRunError(where, keys or ["(none: infrastructure or verifier)"],
                             dict(codes), advice)
