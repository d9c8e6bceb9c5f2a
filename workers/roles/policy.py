"""`PolicyWorker`: log-probabilities, PPO training, LM training, DPO and weight export for the rollout.

Batch fields (see workers/batch.py conventions): `input_ids` [B, P+R], `attention_mask` [B, P+R],
`responses` [B, R], `response_mask` [B, R]; training adds `advantages`, `old_logprobs` and optionally
`ref_logprobs` [B, R].
"""

from __future__ import annotations

import time
from typing import Any

import torch

from algorithms.distill import top1_agreement
from algorithms.objectives import BEHAVIOUR_MAX_METRICS, ObjectiveInputs, behaviour_mask, objective_loss
from workers.batch import Batch
from workers.config import build
from workers.dispatch import DP_COMPUTE, ONE_TO_ALL, register, split_by_minibatch
from workers.megatron.engine import Micro
from workers.roles.base import MegatronWorker
from workers.roles.dpo_step import PreferenceMixin
from workers.roles.lm import LMMixin
from workers.roles.logits import vocab_parallel_argmax, vocab_parallel_logprobs
from workers.roles.loss_config import PPOLossConfig
from workers.roles.micro import forward_responses
from workers.roles.optimize import Metrics, optimize_responses
from workers.roles.routes import ROUTES_KEY
from workers.roles.weights import put_buckets
from workers.rollout.policy_mixin import RolloutSyncMixin


class LogprobMixin:
    """`compute_logprobs` for the policy and the reference."""

    def _logprob_pass(self, batch: Batch, with_entropy: bool, key: str, micro_batch_size: int | None,
                      temperature: float = 1.0, top1_key: str | None = None) -> Batch:
        """`key` [B, R] (and `entropy`; with `top1_key`, each position's greedy token id there, as float)."""
        def outputs(sl: torch.Tensor, mb: Micro) -> dict[str, torch.Tensor]:
            labels = mb.fields["responses"][:, : sl.shape[1]]
            logp, ent = vocab_parallel_logprobs(scale_logits(sl, temperature), labels, self.engine.vocab_size,
                                                with_entropy)
            out = {key: logp, "entropy": ent} if with_entropy else {key: logp}
            if top1_key:
                out[top1_key] = vocab_parallel_argmax(sl, self.engine.vocab_size)
            return out

        return forward_responses(self, batch, micro_batch_size, outputs)


class PolicyWorker(RolloutSyncMixin, LogprobMixin, LMMixin, PreferenceMixin, MegatronWorker):
    """The trainable policy (see module docstring)."""

    @register(DP_COMPUTE)
    def compute_logprobs(self, batch: Batch, with_entropy: bool = False, key: str = "logprobs",
                         micro_batch_size: int | None = None, temperature: float = 1.0,
                         top1_key: str | None = None) -> Batch:
        """Per-token log-probs [B, R] of the responses under `key` (and `entropy` [B, R] when asked) of
        the logits divided by `temperature` (the sampling distribution); 0 at padding positions. With
        `top1_key`, the greedy token id at each response position under it."""
        return self._logprob_pass(batch, with_entropy, key, micro_batch_size, temperature, top1_key)

    @register(DP_COMPUTE, pad=False, split=split_by_minibatch())
    def train_step(self, batch: Batch, loss_config: dict[str, Any] | PPOLossConfig | None = None,
                   micro_batch_size: int | None = None, temperature: float = 1.0) -> dict[str, float]:
        """PPO-style update: `ppo_epochs` x `mini_batches` optimizer steps on `algorithms.objective_loss` of
        `policy_objective`, log-probs taken at the rollout's `temperature`; returns metrics averaged over the
        steps (policy loss, clipfrac, approx_kl, entropy, kl, grad_norm, lr, skipped_steps, ...). MoE models
        with `moe.routing_replay`: every token uses the experts of the batch's `routed_experts` (the rollout's)
        where it has them."""
        cfg = build(PPOLossConfig, loss_config)
        agg, vocab = cfg.loss_agg_mode, self.engine.vocab_size
        use_kl = cfg.kl_coef > 0 and "ref_logprobs" in batch
        need_entropy = cfg.entropy_coef != 0
        options = vars(cfg)  # the objective takes the settings it names
        c0 = time.process_time()

        def loss_fn(sl: torch.Tensor, f: dict[str, torch.Tensor], mask: torch.Tensor, norm: torch.Tensor,
                    acc: Metrics) -> torch.Tensor:
            logp, ent = vocab_parallel_logprobs(scale_logits(sl, temperature), f["responses"], vocab, need_entropy)
            # in_update: the policy before this, the only step, is the one computing logp
            old = f["old_logprobs"].float() if "old_logprobs" in f else logp.detach().float()
            x = ObjectiveInputs(logp, old, f["advantages"].float(), mask, f.get("rollout_logprobs"), agg,
                                normalizer=norm)
            ref = f["ref_logprobs"].float() if use_kl else None
            loss, parts, m = objective_loss(cfg.policy_objective, x, options, entropy=ent,
                                            entropy_coef=cfg.entropy_coef, ref_logp=ref, kl_coef=cfg.kl_coef,
                                            kl_kind=cfg.kl_kind)
            record_metrics(acc, parts, m, float(mask.sum()))
            if "teacher_top1" in f:  # on-policy distillation: how often the student's greedy pick is the teacher's
                agree = top1_agreement(vocab_parallel_argmax(sl, vocab), f["teacher_top1"].long(), mask)
                acc.add_mean({"distill/top1_agreement": agree}, weight=float(mask.sum()))
            return loss

        keys = ["advantages", "ref_logprobs", "teacher_top1"]
        if cfg.old_logprobs != "in_update":
            keys.append("old_logprobs")
        if cfg.old_logprobs != "rollout":  # there the engine's log-probs are the old ones: nothing to compare
            keys.append("rollout_logprobs")
        if self.engine.moe is not None and self.engine.moe.routing_replay:
            keys.append(ROUTES_KEY)  # R3: the update routes each token to the rollout's experts
        norm_mask = None
        if cfg.old_logprobs == "recompute":  # MIS narrows the mask the normaliser counts
            def norm_mask(mini: Batch) -> torch.Tensor:
                rollout = mini["rollout_logprobs"] if "rollout_logprobs" in mini else None  # noqa: SIM401
                return behaviour_mask(mini["old_logprobs"], rollout, mini["response_mask"], options)
        out = optimize_responses(self, batch, cfg, keys, loss_fn, micro_batch_size, norm_mask=norm_mask)
        out["cpu_s"] = time.process_time() - c0  # this rank's CPU time (all its threads)
        return out

    # ---- weights for the rollout engine -------------------------------------------------------
    @register(ONE_TO_ALL, collect="flatten")
    def state_dict_for_rollout(self, bucket_mb: float = 64.0) -> list[Any]:
        """Full HF-named weights (gathered over TP, one share per PP stage) as buckets in the Ray object
        store. The group returns the list of bucket ObjectRefs (each a dict name -> CPU tensor of about
        `bucket_mb`); pass them to the rollout worker, which `ray.get`s them one at a time (the data
        never goes through the driver). `workers.roles.weights.fetch_state_dict(refs)` merges them."""
        return put_buckets(self.engine, bucket_mb)

    @register(ONE_TO_ALL, collect="rank0")
    def lora_adapter(self) -> dict[str, Any]:
        """The LoRA adapters in PEFT's names and config (`gather_peft_adapter`), for the rollout's adapter sync;
        collective."""
        from workers.megatron.lora_peft import gather_peft_adapter

        with self.onloaded():
            return gather_peft_adapter(self.engine) or {}

    @register(ONE_TO_ALL, collect="rank0")
    def save_lora_adapter(self, out_dir: str) -> dict[str, float]:
        """Write the LoRA adapters alone as a PEFT folder (workers.megatron.lora_peft) into `out_dir`;
        collective. Returns its `bytes` and the `time_s` it took."""
        from workers.megatron.lora_peft import WEIGHTS_FILE, write_peft_adapter

        t0 = time.perf_counter()
        out = write_peft_adapter(self.engine, out_dir)
        size = (out / WEIGHTS_FILE).stat().st_size if torch.distributed.get_rank() == 0 else 0
        return {"bytes": float(size), "time_s": time.perf_counter() - t0}


def record_metrics(acc: Metrics, parts: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor],
                   seen: float) -> None:
    """One micro-batch's loss parts (summed) and metrics: the behaviour's (`mismatch/*`, `off_policy/*`) as
    token means over the `seen` response tokens, or maxima (`algorithms.BEHAVIOUR_MAX_METRICS`); the
    objective's as means over the tokens it trained on (`parts["tokens"]`, fewer than `seen` under MIS)."""
    trained = float(parts.pop("tokens", seen))
    acc.add_sum({**parts, "tokens": trained})  # loss parts carry the global normaliser
    if seen > 0:
        acc.add_max({k: metrics.pop(k) for k in BEHAVIOUR_MAX_METRICS if k in metrics})
    else:
        metrics = {k: v for k, v in metrics.items() if k not in BEHAVIOUR_MAX_METRICS}
    behaviour = {k: metrics.pop(k) for k in list(metrics) if k.startswith(("mismatch/", "off_policy/"))}
    acc.add_mean(behaviour, weight=seen)
    acc.add_mean(metrics, weight=trained)


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits of the sampling distribution at `temperature` (the rollout's): logits / temperature."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probabilities, got {temperature}")
    return logits if temperature == 1.0 else logits / temperature
