"""Qwen2-VL on megatron-core: `GPTModel` (M-RoPE) with the vision tower's features in place of the image
tokens' embeddings.

megatron-core parts used: `GPTModel` with `position_embedding_type="mrope"` (its MultimodalRotaryEmbedding
takes [3, b, s] positions and `mrope_section`) and its `decoder_input` entry, which takes the merged
embeddings. megatron-core's `LLaVAModel` does not fit: its vision towers are CLIP / SigLIP / InternViT /
RADIO and its image-token convention (one index expanded inside the model) differs from Qwen2-VL's
processor-expanded tokens. The vision tower (workers/vision/tower.py) is a plain module on the first
pipeline stage, replicated over TP; `vision.freeze` keeps it fixed while the language model trains.

Forward inputs beyond GPTModel's: `pixel_values` [b, P, patch_dim] (each row's image patches, zero-padded
to the batch's P) and `image_grid_thw` [b, I, 3] (each row's image grids, all-zero rows = no image). Rows
without images pass zero grids; a batch without any image runs the language model alone.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt import GPTModel

from workers.vision.mrope import image_mask, mrope_positions
from workers.vision.tower import VisionTower


class Qwen2VLGPTModel(GPTModel):
    """A GPTModel whose first stage also holds the vision tower (`self.vision`)."""

    def __init__(self, *args: Any, vision_config: Any, image_token_id: int, freeze_vision: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.image_token_id = int(image_token_id)
        self.merge = int(vision_config["spatial_merge_size"] if isinstance(vision_config, dict)
                         else vision_config.spatial_merge_size)
        self.vision: VisionTower | None = None
        if self.pre_process:
            self.vision = VisionTower(vision_config, dtype=self.config.params_dtype)
            for p in self.vision.parameters():
                p.requires_grad_(not freeze_vision)

    def image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """The merged features of every image in the batch, row by row, [image tokens, hidden]."""
        assert self.vision is not None
        grids = image_grid_thw.reshape(-1, 3)
        patches = [pixel_values[r, : int(g.prod(-1).sum())] for r, g in enumerate(image_grid_thw)]
        keep = grids[:, 0] > 0
        return self.vision(torch.cat(patches), grids[keep])

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                decoder_input: torch.Tensor | None = None, *args: Any, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        if image_grid_thw is None:
            image_grid_thw = input_ids.new_zeros((input_ids.shape[0], 0, 3))
        positions = mrope_positions(input_ids, position_ids, image_grid_thw, self.image_token_id, self.merge)
        if self.pre_process and decoder_input is None:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h]
            if pixel_values is not None and bool((image_grid_thw[..., 0] > 0).any()):
                features = self.image_features(pixel_values, image_grid_thw).to(decoder_input.dtype)
                where = image_mask(input_ids, image_grid_thw, self.image_token_id)  # [b, s]
                if int(where.sum()) != features.shape[0]:
                    raise ValueError(f"{int(where.sum())} image tokens but {features.shape[0]} image features")
                # Image features in row order: the scatter runs in [b, s] order, the embedding is [s, b].
                flat = decoder_input.transpose(0, 1).clone()
                flat[where] = features
                decoder_input = flat.transpose(0, 1).contiguous()
        return super().forward(input_ids, positions, attention_mask, decoder_input, *args, **kwargs)
