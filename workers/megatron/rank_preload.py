"""What every rank of `run_distributed` imports, imported once in its fork server (workers/megatron/launch.py):
torch, megatron-core's parallel state, models and checkpointing, and transformers' config machinery, whose
first `AutoConfig` use imports the auto model classes. Forked from the server, a rank starts with these in
memory instead of importing them again (about 8 s of CPU per rank on 2 cores)."""

from __future__ import annotations

import megatron.core.dist_checkpointing
import megatron.core.models.gpt  # noqa: F401
import torch  # noqa: F401
from transformers import AutoConfig

AutoConfig.for_model("qwen2")  # the lazy auto classes, imported by any config's first load
