"""Pure-torch RL algorithms: advantage estimators, KL estimators and controllers, losses, loss
aggregation and rule-based rewards. Imports only torch and the standard library.
"""

from .advantages import (
    ADVANTAGE_KWARGS,
    compute_advantages,
    gae,
    get_advantage_estimator,
    grpo,
    list_advantage_estimators,
    register_advantage_estimator,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
)
from .aggregation import AGG_MODES, agg_loss, global_normalizer
from .kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_estimate,
    make_kl_controller,
)
from .losses import entropy_from_logits, lm_loss, logprobs_from_logits, policy_loss, value_loss
from .masked import masked_mean, masked_sum, masked_var, masked_whiten
from .rewards import (
    RewardFn,
    RewardResult,
    UnknownRewardError,
    combine_rewards,
    extract_answer,
    format_reward,
    get_reward_fn,
    list_rewards,
    math_exact_match,
    parse_number,
    register_reward,
    score_with_reason,
)

__all__ = [
    "ADVANTAGE_KWARGS",
    "AGG_MODES",
    "KL_KINDS",
    "AdaptiveKLController",
    "FixedKLController",
    "RewardFn",
    "RewardResult",
    "UnknownRewardError",
    "agg_loss",
    "apply_kl_penalty",
    "combine_rewards",
    "compute_advantages",
    "entropy_from_logits",
    "extract_answer",
    "format_reward",
    "gae",
    "get_advantage_estimator",
    "get_reward_fn",
    "global_normalizer",
    "grpo",
    "kl_estimate",
    "list_advantage_estimators",
    "list_rewards",
    "lm_loss",
    "logprobs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "math_exact_match",
    "parse_number",
    "policy_loss",
    "register_advantage_estimator",
    "register_reward",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "rloo",
    "score_with_reason",
    "value_loss",
]
