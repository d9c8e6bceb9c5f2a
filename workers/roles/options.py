"""The settings a Megatron role's ranks are built from: `RoleOptions` (the run's role sections are built on
it) and `MegatronOptions`, the `init_kwargs` of a role's `WorkerGroup` (`MegatronWorker.setup` reads them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.megatron.lora_config import LoRAConfig
from workers.megatron.moe_config import MoEConfig
from workers.megatron.optim_config import OptimSettings


@dataclass
class RoleOptions:
    """The settings of a Megatron role a run sets (its `policy`, `reference`, `critic` or `reward_model`)."""

    moe: MoEConfig = field(default_factory=MoEConfig)  # MoE models: router losses, expert-bias rate, dispatcher
    # policy only: train LoRA adapters (rank, alpha, dropout, target_modules) on the frozen model instead of all
    # of it; null = full fine-tuning. `policy.lora.rank=16` turns it on with the other defaults.
    lora: LoRAConfig | None = None
    micro_batch_size: int = 8
    dtype: str = "float32"  # float32 | bfloat16
    offload: bool = False  # GPU only: keep parameters on CPU between uses
    # memory levers, each exact (workers/megatron/memory_levers.py): activation recompute none | selective
    # (core attention) | full (every layer keeps its input only; recomputed recompute_num_layers at a time),
    # and sequence parallelism of the norms' and dropouts' activations over the TP ranks (tp > 1)
    recompute: str = "none"
    recompute_num_layers: int = 1
    sequence_parallel: bool = False
    freeze_vision: bool = False  # vision-language models: keep the vision tower's weights fixed (train the rest)


@dataclass
class MegatronOptions(RoleOptions):
    """A role's `init_kwargs`: its `RoleOptions` plus what the driver derives (the HF folder, the optimizer
    with the schedule's length, the expert-parallel size) and the engine's switches that tests set.

    `pack_sequences` (RL batches): "prefix" (the samples of one prompt share one copy of it in a row), True
    (whole sequences packed into rows with block-diagonal attention) or False (padded rows); None picks
    "prefix" where the model's RoPE takes explicit positions, else True (workers/roles/micro.py)."""

    model_path: str = ""  # the HF folder the role loads
    optim: OptimSettings | dict[str, Any] | None = None
    ep: int = 1  # expert-parallel size (MoE models)
    load_weights: bool = True
    pack_sequences: bool | str | None = None
