"""The built-in PPO step (critic, GAE, KL in the reward), written with the workflow API."""

from __future__ import annotations

from rlhf.driver.rl.advantages import add_advantages
from rlhf.driver.rl.context import StepContext, rollout_metrics
from rlhf.driver.rl.grpo import add_logprobs, generate_and_score
from rlhf.workflow import Roles, loss_config, value_loss_config
from workers.rollout.syncer import SYNC_METRICS


def ppo_step(roles: Roles, ctx: StepContext) -> dict[str, float]:
    cfg = ctx.cfg
    batch = generate_and_score(roles, ctx)
    roles.rollout.sleep()  # colocated engines free their memory for the policy's turn; the sync wakes them
    batch = add_logprobs(roles, batch, ctx)
    with ctx.phase("critic"):
        batch = roles.critic.values(batch)
    with ctx.phase("advantages"):
        batch, adv_metrics = add_advantages(batch, cfg.algorithm, ctx.kl_ctrl.value, cfg.rollout.max_tokens)
    with ctx.phase("train"):
        critic_metrics = roles.critic.train(batch, value_loss_config(cfg))
        policy_metrics = roles.policy.train(batch, loss_config(cfg))
    with ctx.phase("sync"):
        synced = roles.rollout.sync_weights(roles.policy)
    ctx.kl_ctrl.update(adv_metrics.get("kl", 0.0), len(batch))
    critic_metrics = {f"critic/{k}": v for k, v in critic_metrics.items()}
    return {**rollout_metrics(batch), **adv_metrics, **policy_metrics, **critic_metrics,
            "policy_loss": policy_metrics.get("pg_loss", 0.0), "kl_coef": ctx.kl_ctrl.value,
            "sync/bytes": synced["sync/bytes"], **{k: synced[k] for k in SYNC_METRICS if k in synced}}
