"""What every rank of `run_distributed` imports, imported once in its fork server (workers/megatron/launch.py):
torch, megatron-core's parallel state, models and checkpointing, transformers' config machinery and its causal-LM
classes (the ranks that check a conversion build the HF model beside the Megatron one). Forked from the server,
a rank starts with these in memory instead of importing them again (about 8 s of CPU per rank on 2 cores)."""

from __future__ import annotations

import megatron.core.dist_checkpointing
import megatron.core.models.gpt  # noqa: F401
import torch  # noqa: F401
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel  # noqa: F401

AutoConfig.for_model("qwen2")  # the lazy config classes, imported by any config's first load
