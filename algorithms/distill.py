"""On-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models"; the form slime and
NeMo-RL ship): the student samples, a teacher scores the student's own tokens, and the per-token reverse KL to
the teacher becomes the advantage.

For a sampled response token ``y_t`` with student log-prob ``s_t`` (the behaviour policy's, detached) and
teacher log-prob ``q_t``::

    A_t = reward_weight * A_task_t + kl_coef * (q_t - s_t)

``s_t - q_t`` is the single-sample (k1) estimate of the reverse KL ``KL(student || teacher)`` at that
position, so a policy-gradient step on ``A`` lowers the reverse KL (mode-seeking: the student is pushed off
the tokens the teacher finds unlikely, on the prefixes the student itself reaches). ``reward_weight = 0`` is
pure distillation; a positive one mixes in the task reward's advantage (``A_task``, from any estimator).

``baseline``: the batch's mean of ``q - s`` over the response tokens is taken out of every token's term. That
mean is minus the batch's reverse-KL estimate, so without it nearly every sampled token is pushed down; with it
a token goes up when the teacher finds it likelier than the student does on average. The expected gradient is
unchanged (the expected score function at each position is 0); the estimate only has less variance.

``top1_agreement``: the fraction of response positions where the student's most likely token is the
teacher's.
"""

from __future__ import annotations

import torch

from .masked import masked_mean

__all__ = ["distill_advantages", "top1_agreement"]


def distill_advantages(task_advantages: torch.Tensor, student_logp: torch.Tensor, teacher_logp: torch.Tensor,
                       mask: torch.Tensor, kl_coef: float = 1.0, reward_weight: float = 0.0,
                       baseline: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """The advantages [B, R] of the module doc (0 where ``mask`` is 0; ``baseline``: centred, see there) and
    their metrics: ``distill/teacher_kl``
    (the masked mean of ``s - q``, the reverse-KL estimate), ``distill/teacher_logprob_mean`` and
    ``distill/advantage_mean``."""
    if kl_coef < 0 or reward_weight < 0:
        raise ValueError(f"distillation weights must be >= 0, got kl_coef={kl_coef}, reward_weight={reward_weight}")
    m = mask.to(torch.float32)
    s, q = student_logp.detach().to(torch.float32), teacher_logp.detach().to(torch.float32)
    gap = q - s
    if baseline:
        gap = gap - masked_mean(gap, m)
    adv = (reward_weight * task_advantages.to(torch.float32) + kl_coef * gap) * m
    return adv, {"distill/teacher_kl": float(masked_mean(s - q, m)),
                 "distill/teacher_logprob_mean": float(masked_mean(q, m)),
                 "distill/advantage_mean": float(masked_mean(adv, m))}


def top1_agreement(student_top1: torch.Tensor, teacher_top1: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The fraction (a 0-dim float32 tensor) of masked positions where the two top-1 token ids are equal."""
    return masked_mean((student_top1 == teacher_top1).to(torch.float32), mask.to(torch.float32))
