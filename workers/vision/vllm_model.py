"""vLLM's Qwen2-VL model class, imported after the torchvision-free compat layer.

vLLM inspects model classes in a subprocess that imports the module named in the registry; registering
this module under Qwen2-VL's architecture name makes that subprocess, and the engine, install the compat
layer (workers/vision/hf_compat.py) before vLLM's own Qwen2-VL file imports transformers' image module.
"""

from __future__ import annotations

from workers.vision import hf_compat

hf_compat.install()

from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration  # noqa: E402

ARCHITECTURE = "Qwen2VLForConditionalGeneration"

__all__ = ["ARCHITECTURE", "Qwen2VLForConditionalGeneration", "register"]


def register() -> None:
    """Point vLLM's registry at this module for Qwen2-VL (no-op with torchvision installed)."""
    if not hf_compat.torchvision_missing():
        return
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, f"{__name__}:{ARCHITECTURE}")
