"""`RewardModelWorker`: a Megatron GPT with a value head scoring whole sequences, and its
Bradley-Terry training on preference pairs.

`compute_scores(batch)`: `input_ids` / `attention_mask` [B, S] (any padding side) -> `scores` [B], the
value at each row's last real token (the token HF's `*ForSequenceClassification` pools when the pad id
marks the padding, see `workers.roles.hf_export`).

Pair batches (`train_step`, `eval_step`, `evaluate_pairs`): `chosen_input_ids`, `chosen_attention_mask`,
`rejected_input_ids`, `rejected_attention_mask` [B, S] (`rlhf.data.preference_pairs.scored_pairs` makes them from
the DPO pair layout). Their `micro_batch_size` counts pairs: a micro-batch of m pairs is one forward of 2m
rows, chosen then rejected. The loss is `algorithms.bradley_terry_loss` summed over the pairs and divided by
the global pair count (all DP ranks), so the update does not depend on the micro-batch count or DP size.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from algorithms import bradley_terry_loss
from workers.batch import Batch
from workers.dispatch import DP_COMPUTE, register
from workers.megatron.engine import Micro
from workers.roles.base import MegatronWorker
from workers.roles.micro import make_micro
from workers.roles.optimize import Metrics, run_loss

PAIR_KEYS = ("chosen_input_ids", "chosen_attention_mask", "rejected_input_ids", "rejected_attention_mask")


def last_token_index(attn: torch.Tensor) -> torch.Tensor:
    """Column of each row's last 1 in a [b, s] mask (0 for an empty row)."""
    s = attn.shape[1]
    return (s - 1 - attn.flip(1).to(torch.long).argmax(1)).clamp_min(0)


def _stack_pairs(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """[chosen; rejected] ids and masks, right-padded to a common width: [2B, S]."""
    missing = [k for k in PAIR_KEYS if k not in batch]
    if missing:
        raise ValueError(f"reward-model pair batch lacks {missing}; it has {batch.keys()}")
    ids, masks = [batch["chosen_input_ids"], batch["rejected_input_ids"]], \
        [batch["chosen_attention_mask"], batch["rejected_attention_mask"]]
    width = max(t.shape[1] for t in ids)
    ids = [F.pad(t, (0, width - t.shape[1])) for t in ids]
    masks = [F.pad(t, (0, width - t.shape[1])) for t in masks]
    return torch.cat(ids), torch.cat(masks)


class RewardModelWorker(MegatronWorker):
    value_head = True

    def _score_micros(self, ids: torch.Tensor, attn: torch.Tensor, mbs: int) -> list[Micro]:
        micros = []
        for i in range(0, ids.shape[0], mbs):
            sl = slice(i, i + mbs)
            micros.append(make_micro(ids[sl], attn[sl], {"last": last_token_index(attn[sl])}, self.engine.device))
        return micros

    def _pair_micros(self, batch: Batch, pairs_per_micro: int | None) -> list[Micro]:
        """Micro-batches of `pairs_per_micro` pairs (default: the role's micro_batch_size), 2m rows each."""
        m = max(1, pairs_per_micro or self.micro_batch_size)
        micros = []
        for i in range(0, len(batch), m):
            ids, attn = _stack_pairs(batch.index(slice(i, i + m)))
            micros += self._score_micros(ids, attn, ids.shape[0])
        return micros

    @staticmethod
    def _scores(mb: Micro, out: torch.Tensor) -> torch.Tensor:
        idx = (mb.fields["last"] - mb.offset).clamp(0, out.shape[1] - 1)
        return out[torch.arange(out.shape[0], device=out.device), idx, 0].float()

    @register(DP_COMPUTE)
    def compute_scores(self, batch: Batch, micro_batch_size: int | None = None) -> Batch:
        """`scores` [B]: the value head at each sequence's last real token (`micro_batch_size` rows)."""
        attn = batch["attention_mask"] if "attention_mask" in batch else torch.ones_like(batch["input_ids"])
        micros = self._score_micros(batch["input_ids"], attn, micro_batch_size or self.micro_batch_size)
        scores = self._forward_scores(micros)
        return Batch({"scores": scores}) if scores is not None else Batch()

    @register(DP_COMPUTE)
    def evaluate_pairs(self, batch: Batch, micro_batch_size: int | None = None) -> Batch:
        """`chosen_scores`, `rejected_scores` [B] for preference pairs."""
        outs = self._forward_scores(self._pair_micros(batch, micro_batch_size), per_micro=True)
        if outs is None:
            return Batch()
        halves = [o.chunk(2) for o in outs]
        return Batch({"chosen_scores": torch.cat([c for c, _ in halves]),
                      "rejected_scores": torch.cat([r for _, r in halves])})

    def _forward_scores(self, micros: list[Micro], per_micro: bool = False):
        with self.onloaded():
            outs = self.engine.forward_backward(
                micros, lambda mb, out: (torch.zeros((), device=out.device), self._scores(mb, out).cpu()),
                forward_only=True)
        if not outs:  # not the last pipeline stage
            return None
        return outs if per_micro else torch.cat(outs)

    @register(DP_COMPUTE, pad=False)
    def train_step(self, batch: Batch, micro_batch_size: int | None = None) -> dict[str, float]:
        """One optimizer step of Bradley-Terry loss on the pairs; returns loss, accuracy, margin,
        scores/chosen, scores/rejected (pair means), pairs, grad_norm, lr, skipped and time_s."""
        t0 = time.monotonic()
        out = self._bt_pass(batch, micro_batch_size, train=True)
        out["time_s"] = time.monotonic() - t0
        return out

    @register(DP_COMPUTE, pad=False)
    def eval_step(self, batch: Batch, micro_batch_size: int | None = None) -> dict[str, float]:
        """The metrics of `train_step` without an update (validation on held-out pairs)."""
        return self._bt_pass(batch, micro_batch_size, train=False)

    def _bt_pass(self, batch: Batch, micro_batch_size: int | None, train: bool) -> dict[str, float]:
        total = self.dp_all_reduce(torch.tensor(float(len(batch)))).clamp(min=1.0)
        micros = self._pair_micros(batch, micro_batch_size)

        def loss_fn(mb: Micro, out: torch.Tensor, acc: Metrics) -> torch.Tensor:
            losses, metrics = bradley_terry_loss(*self._scores(mb, out).chunk(2))
            n = total.to(losses.device)
            loss = losses.sum() / n
            acc.add_sum({"loss": loss.detach(), "pairs": float(losses.numel()),
                         **{k: v.sum() / n for k, v in metrics.items()}})
            return loss

        return run_loss(self, micros, loss_fn, train=train)
