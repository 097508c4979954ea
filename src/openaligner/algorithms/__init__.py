"""RLHF math: masked statistics, KL estimators and controllers, reward shaping, GAE, the critic-free
estimators (RLOO, GRPO, REINFORCE++), losses, and the losses of the Tinker training API.

Pure tensor functions over the next-token-aligned layout (B batch, S-1 positions, mask 1 = valid).
This package imports only torch and the standard library: no models, configs, servers or
torch.distributed calls (cross-rank statistics take a ``reduce`` callable).
"""

from openaligner.algorithms.advantages import (
    decoupled_gae,
    gae,
    gae_per_row_lambda,
    gae_reference,
    length_adaptive_lambda,
    td_errors,
)
from openaligner.algorithms.critic_free import (
    broadcast_to_tokens,
    grpo_advantages,
    grpo_advantages_reference,
    reinforce_pp_advantages,
    returns_to_go,
    returns_to_go_reference,
    rloo_advantages,
    rloo_advantages_reference,
    sequence_kl,
)
from openaligner.algorithms.kl import KL_KINDS, AdaptiveKLController, FixedKLController, KLKind, kl_penalty
from openaligner.algorithms.logprobs import (
    chunked_token_stats,
    entropy_from_logits,
    logprob_mismatch,
    logprobs_from_logits,
    next_token_logprobs,
    truncated_is_weights,
)
from openaligner.algorithms.losses import (
    LOSS_AGGREGATIONS,
    LossAggregation,
    PolicyLossStats,
    ValueLossStats,
    aggregate,
    aggregation_units,
    explained_variance,
    ppo_policy_loss,
    value_loss,
)
from openaligner.algorithms.masked import (
    Reduce,
    masked_mean,
    masked_mean_var,
    masked_sum,
    masked_var,
    masked_whiten,
    select_valid,
    single_process,
)
from openaligner.algorithms.rewards import adjust_scores, response_mask, shape_rewards
from openaligner.algorithms.tinker_losses import (
    TINKER_LOSSES,
    TinkerLoss,
    TinkerLossInputError,
    tinker_loss,
)
from openaligner.algorithms.value_diagnostics import (
    POSITION_BANDS,
    position_bands,
    value_error_by_position,
    wrong_sign_fraction,
)

__all__ = [
    "KL_KINDS",
    "LOSS_AGGREGATIONS",
    "POSITION_BANDS",
    "TINKER_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "KLKind",
    "LossAggregation",
    "PolicyLossStats",
    "Reduce",
    "TinkerLoss",
    "TinkerLossInputError",
    "ValueLossStats",
    "adjust_scores",
    "aggregate",
    "aggregation_units",
    "broadcast_to_tokens",
    "chunked_token_stats",
    "decoupled_gae",
    "entropy_from_logits",
    "explained_variance",
    "gae",
    "gae_per_row_lambda",
    "gae_reference",
    "grpo_advantages",
    "grpo_advantages_reference",
    "kl_penalty",
    "length_adaptive_lambda",
    "logprob_mismatch",
    "logprobs_from_logits",
    "masked_mean",
    "masked_mean_var",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "next_token_logprobs",
    "position_bands",
    "ppo_policy_loss",
    "reinforce_pp_advantages",
    "response_mask",
    "returns_to_go",
    "returns_to_go_reference",
    "rloo_advantages",
    "rloo_advantages_reference",
    "select_valid",
    "sequence_kl",
    "shape_rewards",
    "single_process",
    "td_errors",
    "tinker_loss",
    "truncated_is_weights",
    "value_error_by_position",
    "value_loss",
    "wrong_sign_fraction",
]
