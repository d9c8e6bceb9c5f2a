"""Image inputs per batch row: the layout the vision model and the Batch carry.

The HF processor returns one flat `pixel_values` [all patches, patch_dim] and `image_grid_thw` [all images,
3] for a whole batch. Batch rows travel separately (micro-batches, data-parallel shards), so each row keeps
its own: `pixel_values` [b, P, patch_dim] (zero-padded to the batch's largest P) and `image_grid_thw`
[b, I, 3] (all-zero rows pad to the batch's largest image count).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

IMAGE_KEYS = ("pixel_values", "image_grid_thw")  # the Batch tensors a vision-language model takes


def split_rows(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
               images_per_row: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-row layout from the processor's flat tensors, given how many images each row has."""
    b, most = len(images_per_row), max(images_per_row, default=0)
    patches = image_grid_thw.prod(-1)
    rows_px, grid = [], image_grid_thw.new_zeros((b, max(most, 1), 3))
    i = p = 0
    for r, n in enumerate(images_per_row):
        count = int(patches[i:i + n].sum())
        rows_px.append(pixel_values[p:p + count])
        grid[r, :n] = image_grid_thw[i:i + n]
        i, p = i + n, p + count
    if i != image_grid_thw.shape[0] or p != pixel_values.shape[0]:
        raise ValueError(f"{image_grid_thw.shape[0]} images / {pixel_values.shape[0]} patches, but the rows "
                         f"account for {i} / {p}")
    width = max((x.shape[0] for x in rows_px), default=0)
    px = pixel_values.new_zeros((b, max(width, 1), pixel_values.shape[-1]))
    for r, x in enumerate(rows_px):
        px[r, : x.shape[0]] = x
    return px, grid


def encode_images(image_processor: Any, images: Sequence[Sequence[Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row `pixel_values` and `image_grid_thw` of each row's images (RGB PIL images; [] for none)."""
    flat = [im for row in images for im in row]
    if not flat:
        return torch.zeros((len(images), 1, 1)), torch.zeros((len(images), 1, 3), dtype=torch.long)
    enc = image_processor(images=flat, return_tensors="pt")
    return split_rows(enc["pixel_values"], enc["image_grid_thw"], [len(row) for row in images])
