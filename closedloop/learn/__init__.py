"""Update math: credit estimators, loss reducers, KL estimators and objectives.

Pure functions over tensors with named outputs; see each module's docstring for formulas and
shapes (B episodes, G group members, T token positions, K turns, V vocabulary). The records and
protocols the objectives and the trainer satisfy are the update contract,
``closedloop.contracts.update``.
"""

from closedloop.contracts.batch import KLSpec
from closedloop.errors import (
    GroupTooSmallError,
    InvalidObjectiveError,
    KLPlacementError,
    LearnError,
    MaskError,
    NonFiniteLogprobError,
    NonFiniteRewardError,
    UnknownNameError,
    UnknownObjectiveError,
)
from closedloop.learn.credit import (
    CENSOR_RULES,
    ESTIMATORS,
    CreditSummary,
    GroupCredit,
    dr_grpo,
    get_estimator,
    group_advantages,
    grpo,
    p_informative,
    p_zero_variance,
    returns_to_go,
    rloo,
    summarize_credit,
)
from closedloop.learn.kl import (
    KL_ESTIMATORS,
    exact_kl,
    get_kl_estimator,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_reward_penalty,
    validate_kl_placement,
)
from closedloop.learn.objectives import (
    OBJECTIVES,
    BoundObjective,
    ClipRange,
    get_objective,
    normalized_ratio_clip,
    ppo_clip,
    register_objective,
    reinforce_with_kl,
    token_entropy,
)
from closedloop.learn.reducers import (
    GROUP_REWARD_SCALES,
    REDUCERS,
    ReducedLoss,
    apply_group_reward_scale,
    get_reducer,
    reduce_loss,
    reducer_weights,
)

__all__ = [  # noqa: RUF022 -- grouped by module, sorted within each group
    # credit estimators (closedloop.learn.credit)
    "CENSOR_RULES",
    "ESTIMATORS",
    "CreditSummary",
    "GroupCredit",
    "dr_grpo",
    "get_estimator",
    "group_advantages",
    "grpo",
    "p_informative",
    "p_zero_variance",
    "returns_to_go",
    "rloo",
    "summarize_credit",
    # loss reducers (closedloop.learn.reducers)
    "GROUP_REWARD_SCALES",
    "REDUCERS",
    "ReducedLoss",
    "apply_group_reward_scale",
    "get_reducer",
    "reduce_loss",
    "reducer_weights",
    # KL estimators (closedloop.learn.kl)
    "KL_ESTIMATORS",
    "KLSpec",
    "exact_kl",
    "get_kl_estimator",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_reward_penalty",
    "validate_kl_placement",
    # objectives (closedloop.learn.objectives)
    "OBJECTIVES",
    "BoundObjective",
    "ClipRange",
    "get_objective",
    "normalized_ratio_clip",
    "ppo_clip",
    "register_objective",
    "reinforce_with_kl",
    "token_entropy",
    # errors
    "GroupTooSmallError",
    "InvalidObjectiveError",
    "KLPlacementError",
    "LearnError",
    "MaskError",
    "NonFiniteLogprobError",
    "NonFiniteRewardError",
    "UnknownObjectiveError",
    "UnknownNameError",
]
