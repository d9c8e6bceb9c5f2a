"""The DPO step of the policy worker (`PreferenceMixin`): preference losses on chosen / rejected pairs.

Batch layout (one row per pair, what `rlhf.data.preference_pairs.collate_pairs` produces): `chosen_<k>` and
`rejected_<k>` for k in tokens, labels, loss_mask, position_ids, [B, S] each (the LM layout of
`workers.roles.lm`, loss_mask on the answer tokens); with a reference, `ref_chosen_logps` and
`ref_rejected_logps` [B] (summed over the answer tokens). KTO (`loss: kto`) adds `kl_<k>` rows (each prompt
with another pair's answer, `rlhf.data.kto_examples`) and their `ref_kl_logps` [B]: before its update the step
takes the KL baseline z0 from them (`kl_baseline`, a forward-only pass), the same for every micro-batch.

A micro-batch of m pairs is one forward over 2m rows, the chosen then the rejected answers. Each row's
log-prob is summed over its answer tokens; the loss of a micro-batch is its pairs' summed preference loss
divided by the global batch's pair count, so the update does not depend on the micro-batch count or DP size.

`greedy_accuracy`: the fraction of pairs whose chosen answer (with its end of turn) is exactly what greedy
decoding from the prompt would produce, checked teacher-forced in the same forward (every answer token has
the largest logit given the tokens before it), so it needs no generation.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from algorithms import kto_kl_baseline, preference_loss
from workers.batch import LM_KEYS, Batch
from workers.config import build
from workers.dispatch import DP_COMPUTE, register
from workers.megatron.engine import Micro
from workers.roles.base import MegatronWorker
from workers.roles.lm import lm_micros
from workers.roles.logits import vocab_parallel_greedy_hits, vocab_parallel_logprobs
from workers.roles.loss_config import PreferenceLossConfig
from workers.roles.optimize import Metrics, run_loss

SIDES = ("chosen", "rejected")
KL_SIDE = "kl"  # KTO's mismatched prompt / answer rows (rlhf.data.kto_examples.KL_SIDE)


def pair_micros(batch: Batch, pairs_per_micro: int, device: torch.device,
                sides: tuple[str, ...] = SIDES) -> list[Micro]:
    """Micro-batches of `pairs_per_micro` pairs, each len(sides) x m rows (chosen, then rejected, by
    default); the reference log-probs (`ref_<side>_logps`), when present, ride along as the field `ref_logps`."""
    missing = [f"{s}_{k}" for s in sides for k in LM_KEYS if f"{s}_{k}" not in batch]
    if missing:
        raise ValueError(f"preference batch lacks {missing}; it has {batch.keys()}")
    ref_keys = [f"ref_{s}_logps" for s in sides]
    out = []
    for chunk in batch.chunks(max(1, pairs_per_micro)):
        rows = Batch({k: torch.cat([chunk[f"{s}_{k}"] for s in sides]) for k in LM_KEYS})
        (mb,) = lm_micros(rows, len(rows), device)
        if all(k in chunk for k in ref_keys):
            mb.fields["ref_logps"] = torch.cat([chunk[k] for k in ref_keys]).to(device, torch.float32)
        out.append(mb)
    return out


def sequence_logps(mb: Micro, logits: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob of each row's answer tokens [2m], answer token counts [2m])."""
    mask = mb.fields["loss_mask"]
    logp, _ = vocab_parallel_logprobs(logits, mb.fields["labels"], vocab_size)
    return (logp * mask).sum(-1), mask.sum(-1)


class PairLogpsMixin(MegatronWorker):
    """The answers' summed log-probs of preference batches: the policy's reference pass (`reference:
    precompute`) and the frozen reference group's (`reference: group`)."""

    @register(DP_COMPUTE)
    def compute_pair_logps(self, batch: Batch, micro_batch_size: int | None = None) -> Batch:
        """`chosen_logps` and `rejected_logps` [B]: each answer's summed log-prob under this model (the
        reference values when run before training); with KTO's `kl_<k>` rows also `kl_logps`."""
        eng = self.engine
        sides = SIDES + ((KL_SIDE,) if f"{KL_SIDE}_tokens" in batch else ())
        keys = [f"{s}_logps" for s in sides]

        def loss_fn(mb: Micro, out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            seq, _ = sequence_logps(mb, out, eng.vocab_size)
            return torch.zeros((), device=out.device), dict(zip(keys, seq.float().cpu().chunk(len(sides)), strict=True))

        micros = pair_micros(batch, micro_batch_size or self.micro_batch_size, eng.device, sides)
        with self.onloaded():
            outs = eng.forward_backward(micros, loss_fn, forward_only=True)
        if not outs:
            return Batch()
        return Batch({k: torch.cat([o[k] for o in outs]) for k in keys})

    def kl_baseline(self, batch: Batch, micro_batch_size: int) -> torch.Tensor:
        """KTO's z0 over the whole batch (all DP ranks): the mean of this model's minus the reference's summed
        log-probs of the `kl_<k>` rows, clamped at 0 (`algorithms.kto_kl_baseline`); a collective. On the
        last pipeline stage, where the loss is; 0 elsewhere."""
        eng = self.engine

        def loss_fn(mb: Micro, out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            seq, _ = sequence_logps(mb, out, eng.vocab_size)
            return torch.zeros((), device=out.device), {"diff": (seq.float() - mb.fields["ref_logps"]).cpu()}

        if f"ref_{KL_SIDE}_logps" not in batch:
            raise ValueError("kto needs the reference's log-probs of the mismatched rows (ref_kl_logps)")
        with self.onloaded():
            outs = eng.forward_backward(pair_micros(batch, micro_batch_size, eng.device, (KL_SIDE,)), loss_fn,
                                        forward_only=True)
        diffs = torch.cat([o["diff"] for o in outs]) if outs else torch.zeros(0)
        total = self.dp_all_reduce(torch.tensor([float(diffs.sum()), float(diffs.numel())], dtype=torch.float64))
        if total[1] == 0:
            return torch.zeros((), device=eng.device)
        # the mean over every rank's rows, then the clamp: kto_kl_baseline of the whole batch
        mean = torch.full((1,), float(total[0] / total[1]), dtype=torch.float64)
        return kto_kl_baseline(mean, torch.zeros_like(mean)).to(eng.device, torch.float32)


class PreferenceMixin(PairLogpsMixin):
    """DPO / IPO / SimPO / ORPO steps on preference batches (the policy)."""

    @register(DP_COMPUTE, pad=False)
    def train_preference_step(self, batch: Batch, loss_config: dict[str, Any] | PreferenceLossConfig | None = None,
                              micro_batch_size: int | None = None) -> dict[str, float]:
        """One optimizer step over the pairs; returns the loss and the pair means of rewards/chosen,
        rewards/rejected, rewards/margin, rewards/accuracy, logps/chosen, logps/rejected and
        greedy_accuracy (module docstring), with pairs, grad_norm, lr, skipped and time_s."""
        t0 = time.monotonic()
        out = self._preference_pass(batch, loss_config, micro_batch_size, train=True)
        out["time_s"] = time.monotonic() - t0
        return out

    @register(DP_COMPUTE, pad=False)
    def eval_preference(self, batch: Batch, loss_config: dict[str, Any] | PreferenceLossConfig | None = None,
                        micro_batch_size: int | None = None) -> dict[str, float]:
        """The metrics of `train_preference_step` without an update."""
        return self._preference_pass(batch, loss_config, micro_batch_size, train=False)

    def _preference_pass(self, batch: Batch, loss_config: Any, micro_batch_size: int | None,
                         train: bool) -> dict[str, float]:
        cfg = build(PreferenceLossConfig, loss_config)
        n_pairs = self.dp_all_reduce(torch.tensor(float(len(batch)))).clamp(min=1.0)
        micro = micro_batch_size or self.micro_batch_size
        z0 = self.kl_baseline(batch, micro) if cfg.loss == "kto" else None  # before the update, for every micro
        micros = pair_micros(batch, micro, self.engine.device)
        vocab = self.engine.vocab_size

        def loss_fn(mb: Micro, logits: torch.Tensor, acc: Metrics) -> torch.Tensor:
            seq, lengths = sequence_logps(mb, logits, vocab)
            hits = vocab_parallel_greedy_hits(logits, mb.fields["labels"], vocab) | (mb.fields["loss_mask"] == 0)
            greedy = hits.all(-1).chunk(2)[0].to(torch.float32)
            c, r = seq.chunk(2)
            n_c, n_r = lengths.chunk(2)
            ref_c, ref_r = mb.fields["ref_logps"].chunk(2) if "ref_logps" in mb.fields else (None, None)
            losses, metrics = preference_loss(c, r, ref_c, ref_r, n_c, n_r, loss=cfg.loss, beta=cfg.beta,
                                              label_smoothing=cfg.label_smoothing, simpo_gamma=cfg.simpo_gamma,
                                              nll_coef=cfg.nll_coef, orpo_lambda=cfg.orpo_lambda, kl_baseline=z0,
                                              kto_desirable_weight=cfg.kto_desirable_weight,
                                              kto_undesirable_weight=cfg.kto_undesirable_weight)
            n = n_pairs.to(losses.device)
            loss = losses.sum() / n
            acc.add_sum({"loss": loss.detach(), "pairs": float(losses.numel()), "greedy_accuracy": greedy.sum() / n,
                         **{k: v.sum() / n for k, v in metrics.items()}})
            return loss

        return run_loss(self, micros, loss_fn, train=train)
