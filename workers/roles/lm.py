"""The LM loss on token batches: pretraining and SFT steps of the policy worker (`LMMixin`).

Batch layout of `train_lm_step` / `eval_lm` (what `rlhf.data.pretrain` and `rlhf.data.sft.collate_sft`
produce), all [B, S]:
- `tokens` int64 inputs, `labels` int64 next-token targets (labels[t] is predicted from tokens[..t]);
- `loss_mask` float32, 1 where labels[t] is trained (0 on padding / prompts / masked eod);
- `position_ids` int64; a row holds packed samples when its positions restart at 0. The attention
  mask is rebuilt here from the positions: causal within each segment (block-diagonal when packed).
`lm_batch_from_rl` puts a batch in the RL layout (`input_ids`, `attention_mask`, `loss_mask`) in this one.

Loss: token-mean cross-entropy over the whole global batch: every micro-batch divides its summed NLL by
the number of loss tokens in the global batch (all-reduced over DP), so the loss and the gradients do
not depend on the micro-batch count, the DP size or how rows are split.
"""

from __future__ import annotations

import time

import torch

from algorithms import agg_loss, global_normalizer
from workers.batch import LM_KEYS, Batch
from workers.dispatch import DP_COMPUTE, register
from workers.megatron.engine import Micro
from workers.megatron.masks import causal_mask
from workers.roles.base import MegatronWorker
from workers.roles.logits import vocab_parallel_logprobs
from workers.roles.optimize import Metrics, MicroLoss, run_loss


def lm_attention_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """Bool mask, True = masked: [1, 1, S, S] causal when no row restarts its positions, else
    [B, 1, S, S] causal within the segments that start where position_ids == 0."""
    s = position_ids.shape[1]
    causal = causal_mask(s, device=position_ids.device)
    seg = (position_ids == 0).long().cumsum(-1)
    if bool((seg == seg[:, :1]).all()):
        return causal[None, None]
    same = seg[:, :, None] == seg[:, None, :]
    return (~same | causal[None]).unsqueeze(1)


def lm_micros(batch: Batch, micro_batch_size: int, device: torch.device) -> list[Micro]:
    """Micro-batches of an LM batch. Columns after the last loss token of a micro-batch are dropped:
    with causal attention they cannot change any trained prediction."""
    out = []
    for chunk in batch.chunks(max(1, micro_batch_size)):
        mask = chunk["loss_mask"].to(torch.float32)
        used = (mask != 0).any(0).nonzero().flatten()
        hi = int(used.max()) + 1 if used.numel() else 1
        tokens, pos = chunk["tokens"][:, :hi].to(device), chunk["position_ids"][:, :hi].to(device)
        fields = {"labels": chunk["labels"][:, :hi].to(device), "loss_mask": mask[:, :hi].to(device)}
        out.append(Micro(tokens, pos, lm_attention_mask(pos), fields))
    return out


def lm_batch_from_rl(batch: Batch) -> Batch:
    """The LM layout of an RL-layout batch: `input_ids` [B, S] with optional `attention_mask` (1 on real
    tokens; left or right padding) and `loss_mask` (1 where the token at t is a target, e.g. the
    assistant tokens in SFT; default: every real token). A row's first real token is never a target
    (nothing predicts it)."""
    ids = batch["input_ids"]
    attn = batch["attention_mask"] if "attention_mask" in batch else torch.ones_like(ids)
    positions = (attn.long().cumsum(-1) - 1).clamp_min(0)  # each left-pad token is a segment of its own
    target = (batch["loss_mask"] if "loss_mask" in batch else attn).to(torch.float32)  # noqa: SIM401 - no .get
    target = target * attn * (positions > 0)
    loss_mask = torch.zeros_like(target)
    loss_mask[:, :-1] = target[:, 1:]  # labels[t] = input_ids[t + 1]
    return Batch({"tokens": ids, "labels": torch.roll(ids, -1, 1), "loss_mask": loss_mask,
                  "position_ids": positions})


def masked_token_nll(logp: torch.Tensor, mask: torch.Tensor, normalizer: torch.Tensor | None = None) -> torch.Tensor:
    """The LM loss from the targets' log-probabilities: their negative sum over `mask` divided by
    `normalizer` (the global batch's target count; default: this batch's). The Megatron LM step and the
    HF warm start (rlhf.driver.warmstart.hf_sft) both train on it."""
    return agg_loss(-logp, mask, "token-mean", normalizer=normalizer)


def lm_loss(vocab_size: int, normalizer: torch.Tensor) -> MicroLoss:
    """Masked next-token cross-entropy of a micro-batch, divided by the global batch's loss tokens
    (`normalizer`); records `loss` and `tokens`."""

    def loss_fn(mb: Micro, logits: torch.Tensor, acc: Metrics) -> torch.Tensor:
        mask = mb.fields["loss_mask"]
        logp, _ = vocab_parallel_logprobs(logits, mb.fields["labels"], vocab_size)
        loss = masked_token_nll(logp, mask, normalizer)
        acc.add_sum({"loss": loss.detach(), "tokens": float(mask.sum())})
        return loss

    return loss_fn


class LMMixin(MegatronWorker):
    """Pretraining / SFT steps on LM-layout batches (see module docstring) for the policy worker."""

    @register(DP_COMPUTE, pad=False)
    def train_lm_step(self, batch: Batch, micro_batch_size: int | None = None) -> dict[str, float]:
        """One optimizer step over the batch (gradient accumulation over its micro-batches).

        Returns loss (global token-mean), tokens (loss tokens in the global batch), grad_norm (before
        clipping), lr (of this step), skipped (1.0 when the grad norm was NaN/Inf and the step skipped)."""
        t0 = time.monotonic()
        out = self._lm_pass(batch, micro_batch_size, train=True)
        out["time_s"] = time.monotonic() - t0
        return out

    @register(DP_COMPUTE, pad=False)
    def eval_lm(self, batch: Batch, micro_batch_size: int | None = None) -> dict[str, float]:
        """Forward-only token-mean loss over the batch (all DP shards together) and its token count."""
        return self._lm_pass(batch, micro_batch_size, train=False)

    def _lm_pass(self, batch: Batch, micro_batch_size: int | None, train: bool) -> dict[str, float]:
        missing = [k for k in LM_KEYS if k not in batch]
        if missing:
            raise ValueError(f"LM batch lacks {missing}; it has {batch.keys()} (lm_batch_from_rl converts "
                             f"the RL layout)")
        norm = self.dp_all_reduce(global_normalizer(batch["loss_mask"].to(torch.float32), "token-mean"))
        micros = lm_micros(batch, micro_batch_size or self.micro_batch_size, self.engine.device)
        return run_loss(self, micros, lm_loss(self.engine.vocab_size, norm.clamp(min=1.0)), train=train)
