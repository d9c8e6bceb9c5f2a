"""Qwen2-VL's processor without torchvision (the CPU stack has none).

transformers 5.19 builds a `Qwen2VLProcessor` from three parts: tokenizer, image processor and video
processor. The video processor, and the torchvision image processor, need torchvision, whose PyPI wheels
are CUDA builds that cannot load beside the CPU torch. Images alone need neither: transformers ships a PIL
image processor (`Qwen2VLImageProcessorPil`) computing the same pixel patches. `install()` makes the
processor loadable with it:
- the video slot takes `NoVideoProcessor`, which refuses any video;
- `transformers.models.qwen2_vl.image_processing_qwen2_vl` (imported by vLLM's Qwen2-VL model file for
  `smart_resize`) resolves to the PIL module, whose `smart_resize` is the same function.

With torchvision installed (GPU machines) `install()` does nothing.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

_TORCHVISION_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


def torchvision_missing() -> bool:
    return importlib.util.find_spec("torchvision") is None


def _no_video_class() -> type:
    from transformers.processing_utils import VideosKwargs
    from transformers.utils import PushToHubMixin

    class NoVideoProcessor(PushToHubMixin):
        """The processor's video slot where torchvision is missing: images only."""

        valid_kwargs = VideosKwargs
        merge_size = 2

        @classmethod
        def from_pretrained(cls, *args: Any, **kwargs: Any) -> NoVideoProcessor:
            return cls()

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError("videos need torchvision, which this machine does not have (images only)")

        def to_dict(self) -> dict[str, Any]:
            return {}

    return NoVideoProcessor


NO_VIDEO_NAME = "NoVideoProcessor"


def install() -> None:
    """Make Qwen2-VL's processor and vLLM's Qwen2-VL model importable without torchvision (idempotent)."""
    if not torchvision_missing():
        return
    import transformers.processing_utils as pu

    if getattr(pu.transformers_module, NO_VIDEO_NAME, None) is None:
        setattr(pu.transformers_module, NO_VIDEO_NAME, _no_video_class())
        this_module = sys.modules[__name__]
        setattr(this_module, NO_VIDEO_NAME, getattr(pu.transformers_module, NO_VIDEO_NAME))
        pu.MODALITY_TO_BASE_CLASS_MAPPING["video_processor"] = NO_VIDEO_NAME
        mapping = pu.MODALITY_TO_AUTOPROCESSOR_MAPPING
        mapping._MAPPING_NAMES = {**mapping._MAPPING_NAMES, "video_processor": (__name__, NO_VIDEO_NAME)}
    if _TORCHVISION_IMAGE_MODULE not in sys.modules or not hasattr(sys.modules[_TORCHVISION_IMAGE_MODULE],
                                                                   "smart_resize"):
        import transformers.models.qwen2_vl as qwen2_vl
        from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

        alias = types.ModuleType(_TORCHVISION_IMAGE_MODULE, "Qwen2-VL's PIL image processor, under the torchvision "
                                                            "module's name (workers/vision/hf_compat.py)")
        alias.smart_resize = pil.smart_resize  # type: ignore[attr-defined]
        alias.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # type: ignore[attr-defined]
        alias.Qwen2VLImageProcessorKwargs = pil.Qwen2VLImageProcessorKwargs  # type: ignore[attr-defined]
        sys.modules[_TORCHVISION_IMAGE_MODULE] = alias
        qwen2_vl.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil


def load_processor(path: str) -> Any:
    """The HF processor of the model folder `path` (tokenizer + image processor)."""
    install()
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)
