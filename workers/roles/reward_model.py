"""`RewardModelWorker`: a Megatron GPT with a value head scoring whole sequences, and its
Bradley-Terry training on preference pairs.

`compute_scores(batch)`: `input_ids` / `attention_mask` [B, S] (any padding side) -> `scores` [B], the
value at each row's last real token. `train_step(batch)`: pairs with `chosen_input_ids`,
`chosen_attention_mask`, `rejected_input_ids`, `rejected_attention_mask`; loss
`-log sigmoid(s_chosen - s_rejected)` averaged over all pairs (split-invariant). `evaluate_pairs`
returns both scores for accuracy checks.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from workers.batch import Batch
from workers.dispatch import DP_COMPUTE, register
from workers.megatron.engine import Micro
from workers.roles.base import MegatronWorker
from workers.roles.micro import make_micro
from workers.roles.optimize import Metrics, run_loss


def last_token_index(attn: torch.Tensor) -> torch.Tensor:
    """Column of each row's last 1 in a [b, s] mask (0 for an empty row)."""
    s = attn.shape[1]
    return (s - 1 - attn.flip(1).to(torch.long).argmax(1)).clamp_min(0)


def _stack_pairs(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """[chosen; rejected] ids and masks, right-padded to a common width: [2B, S]."""
    ids, masks = [batch["chosen_input_ids"], batch["rejected_input_ids"]], \
        [batch["chosen_attention_mask"], batch["rejected_attention_mask"]]
    width = max(t.shape[1] for t in ids)
    ids = [F.pad(t, (0, width - t.shape[1])) for t in ids]
    masks = [F.pad(t, (0, width - t.shape[1])) for t in masks]
    return torch.cat(ids), torch.cat(masks)


class RewardModelWorker(MegatronWorker):
    value_head = True

    def _score_micros(self, ids: torch.Tensor, attn: torch.Tensor, mbs: int, extra: dict | None = None) -> list[Micro]:
        micros = []
        for i in range(0, ids.shape[0], mbs):
            sl = slice(i, i + mbs)
            fields = {"last": last_token_index(attn[sl])} | {k: v[sl] for k, v in (extra or {}).items()}
            micros.append(make_micro(ids[sl], attn[sl], fields, self.engine.device))
        return micros

    @staticmethod
    def _scores(mb: Micro, out: torch.Tensor) -> torch.Tensor:
        idx = (mb.fields["last"] - mb.offset).clamp(0, out.shape[1] - 1)
        return out[torch.arange(out.shape[0], device=out.device), idx, 0].float()

    @register(DP_COMPUTE)
    def compute_scores(self, batch: Batch, micro_batch_size: int | None = None) -> Batch:
        """`scores` [B]: the value head at each sequence's last real token."""
        attn = batch["attention_mask"] if "attention_mask" in batch else torch.ones_like(batch["input_ids"])
        scores = self._run_scores(batch["input_ids"], attn, micro_batch_size)
        return Batch({"scores": scores}) if scores is not None else Batch()

    @register(DP_COMPUTE)
    def evaluate_pairs(self, batch: Batch, micro_batch_size: int | None = None) -> Batch:
        """`chosen_scores`, `rejected_scores` [B] for preference pairs."""
        ids, attn = _stack_pairs(batch)
        out = self._run_scores(ids, attn, micro_batch_size)
        if out is None:
            return Batch()
        n = len(batch)
        return Batch({"chosen_scores": out[:n], "rejected_scores": out[n:]})

    def _run_scores(self, ids: torch.Tensor, attn: torch.Tensor, mbs: int | None) -> torch.Tensor | None:
        micros = self._score_micros(ids, attn, mbs or self.micro_batch_size)
        with self.onloaded():
            outs = self.engine.forward_backward(
                micros, lambda mb, out: (torch.zeros((), device=out.device), self._scores(mb, out).cpu()),
                forward_only=True)
        return torch.cat(outs) if outs else None

    @register(DP_COMPUTE, pad=False)
    def train_step(self, batch: Batch, micro_batch_size: int | None = None) -> dict[str, float]:
        """One optimizer step of Bradley-Terry loss on the pairs; returns bt_loss, accuracy, margin,
        grad_norm, lr, skipped. Chosen and rejected of a pair always share a micro-batch."""
        t0 = time.monotonic()
        n = len(batch)
        total = self.dp_all_reduce(torch.tensor(float(n)))
        pairs_per_micro = max(1, (micro_batch_size or self.micro_batch_size) // 2)
        micros = []
        for i in range(0, n, pairs_per_micro):
            part = batch.index(slice(i, i + pairs_per_micro))
            ids, attn = _stack_pairs(part)
            micros += self._score_micros(ids, attn, ids.shape[0])

        def loss_fn(mb: Micro, out: torch.Tensor, acc: Metrics) -> torch.Tensor:
            s = self._scores(mb, out)
            k = s.shape[0] // 2
            diff = s[:k] - s[k:]
            loss = -F.logsigmoid(diff).sum() / total
            acc.add_sum({"bt_loss": loss.detach()})
            acc.add_mean({"accuracy": (diff > 0).float().mean(), "margin": diff.detach().mean()}, weight=k)
            return loss

        out = run_loss(self, micros, loss_fn)
        out["time_s"] = time.monotonic() - t0
        return out
