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
    # with the distributed optimizer: each updated shard's all-gather waits until the next forward needs its
    # bucket instead of running after the step (exact; the engine finishes it before the weights are read)
    overlap_param_gather: bool = False
    # GPU only: Adam's state and fp32 master weights of this fraction of the parameters live and update on the
    # CPU (megatron-core's HybridDeviceOptimizer; needs the distributed optimizer). On a CPU run they are in host
    # memory already, so it is refused there.
    cpu_offload: bool = False
    cpu_offload_fraction: float = 1.0
    max_consecutive_nonfinite: int = 3  # stop after this many skipped (NaN/Inf) steps in a row


@dataclass
class OptimSettings(OptimConfig):
    """What the engine builds its optimizer from: the role's settings and the schedule's length, which the
    driver derives from the run (RL steps x PPO epochs x mini-batches, or the LM run's steps)."""

    total_steps: int = 1000
