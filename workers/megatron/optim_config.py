"""The optimizer and LR schedule settings of a trainable role (the schema's `<role>.optim` section)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OptimConfig:
    """Adam with decoupled weight decay, global-norm clipping and a warmup-then-decay LR schedule."""

    lr: float = 1e-5
    min_lr: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 1.0  # 0: no clipping
    warmup_steps: int = 0
    lr_decay_style: str = "constant"  # constant | cosine | linear
    use_distributed_optimizer: bool = False
    # the data-parallel gradient reduce runs bucket by bucket during the last micro-batch's backward instead
    # of after it (exact: the same sums); a time lever at dp > 1
    overlap_grad_reduce: bool = False
    max_consecutive_nonfinite: int = 3  # stop after this many skipped (NaN/Inf) steps in a row


@dataclass
class OptimSettings(OptimConfig):
    """What the engine builds its optimizer from: the role's settings and the schedule's length, which the
    driver derives from the run (RL steps x PPO epochs x mini-batches, or the LM run's steps)."""

    total_steps: int = 1000
