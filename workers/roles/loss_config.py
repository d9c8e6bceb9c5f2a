"""The update settings of the policy and the critic (the schema's `algorithm` section is built on them), and
the DPO loss (`algorithm.dpo`).

`train_step(batch, loss_config)` takes a `PPOLossConfig` / `ValueLossConfig` or a dict of its fields; the
per-call values (the micro-batch size, the sampling temperature) are `train_step` arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

# where the PPO ratio's old log-probs come from (`PPOLossConfig.old_logprobs`)
OLD_LOGPROBS_SOURCES = ("recompute", "rollout", "in_update")


@dataclass
class UpdateConfig:
    """How many optimizer steps an update takes, and how its token losses are aggregated."""

    ppo_epochs: int = 1  # passes over the rollout batch
    mini_batches: int = 1  # optimizer steps per pass
    # algorithms.AGG_MODES, verl's loss_agg_mode names with verl's meaning
    loss_agg_mode: str = "token-mean"


@dataclass
class ValueLossConfig(UpdateConfig):
    """The critic's clipped value loss."""

    value_clip: float | None = 0.2  # null: no clipping


@dataclass
class PPOLossConfig(UpdateConfig):
    """The policy's objective (PPO's clipped surrogate by default), with entropy bonus and KL to the reference as
    loss terms (`algorithms.objective_loss`)."""

    # algorithms.list_objectives(): ppo_clip | gspo | gmpo | cispo | sapo, or one added with register_objective;
    # each takes the settings below that its function names (algorithms/objectives/<name>.py)
    policy_objective: str = "ppo_clip"
    # the clip range of ppo_clip, gspo (sequence ratio; its paper: 3e-4 / 4e-4), cispo (the IS weight) and gmpo
    # (there the log-ratio's bounds; its paper: 0.4 / 0.4)
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_c: float | None = None  # ppo_clip's dual clip constant (> 1); null: off (verl's default is 3)
    # sapo: the soft gate's temperatures for positive / negative advantages
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    entropy_coef: float = 0.0
    kl_coef: float = 0.0  # > 0 with `ref_logprobs` in the batch: KL as a loss term
    kl_kind: str = "k3"  # algorithms.KL_KINDS or an alias in algorithms.KL_ALIASES
    # The behaviour policy's log-probs (the PPO ratio's denominator): "recompute": a forward pass of the policy
    # after the rollout (exact); "rollout": the engine's sampled-token log-probs (saves that pass; fp32 engines
    # match within 1e-3); "in_update": the update's own forward, detached before its only optimizer step
    # (exact like recompute, without its pass; needs ppo_epochs = mini_batches = 1, as verl's on-policy update)
    old_logprobs: str = "recompute"
    # Samples older than the trained policy (rollout.mode=one_step_off): weight or mask response tokens by
    # rho = exp(old_logprobs - rollout_logprobs) (algorithms.IS_CORRECTIONS: none | tis, weight min(rho,
    # is_cap) | mis_token, drop tokens with rho outside [is_low, is_high] | mis_sequence, drop whole sequences
    # by their geometric-mean rho); needs old_logprobs=recompute, or in_update with none | tis
    off_policy_correction: str = "none"
    is_cap: float = 2.0
    is_low: float = 0.5
    is_high: float = 2.0


@dataclass
class PreferenceLossConfig:
    """The offline preference loss of the DPO step (`algorithms.preference_loss`)."""

    # algorithms.PREFERENCE_LOSSES: sigmoid | ipo | simpo, orpo (these two reference-free) | kto (each pair split
    # into a desirable and an undesirable example, against the reference's KL baseline)
    loss: str = "sigmoid"
    # sigmoid: the KL strength; ipo: its tau; simpo: the reward scale (2.0-2.5 in the paper); kto: its beta
    beta: float = 0.1
    label_smoothing: float = 0.0  # sigmoid / simpo: probability that a pair's label is flipped (conservative DPO)
    simpo_gamma: float = 0.5  # simpo: the target reward margin
    # > 0: each pair's loss also gets nll_coef x the chosen answer's mean token NLL (RPO; OpenRLHF's
    # nll_loss_coef, TRL's rpo_alpha), which keeps the chosen answer likely while the margin grows
    nll_coef: float = 0.0
    # orpo: the weight of the odds-ratio term next to the chosen answer's mean token NLL (the paper's lambda;
    # 0.1 there and TRL's default, which calls it beta)
    orpo_lambda: float = 0.1
    # kto: the weights of desirable and undesirable examples (the paper's lambda_D, lambda_U; it keeps
    # lambda_D n_D / (lambda_U n_U) in [1, 4/3], and split pairs give n_D = n_U)
    kto_desirable_weight: float = 1.0
    kto_undesirable_weight: float = 1.0  # kto: lambda_U (see kto_desirable_weight)
