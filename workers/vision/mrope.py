"""Qwen2-VL's multimodal RoPE positions: three position ids (time, row, column) per token.

Text tokens keep their ordinary position in all three. The tokens of one image (its merged patches, in
row-major order over t x h' x w' windows) sit at `p + (frame, row, column)`, p being the position the first
image token would have as text; the text after the image resumes at `p + max(h', w')` instead of
`p + t * h' * w'` (t = 1 for images), so each image shifts the later text of its sequence by
`max(h', w') - h' * w'`.

Starting from the engine's ordinary positions makes padding and packing work as they do for text: a row's
positions restarting (a packed row's next sequence) resets the shift.
"""

from __future__ import annotations

import torch


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of True in a 1-D bool tensor."""
    edges = torch.diff(mask.int(), prepend=mask.new_zeros(1).int(), append=mask.new_zeros(1).int())
    starts = (edges == 1).nonzero().flatten().tolist()
    ends = (edges == -1).nonzero().flatten().tolist()
    return list(zip(starts, ends))


def image_runs(input_ids: torch.Tensor, image_grid_thw: torch.Tensor, image_token_id: int,
               ) -> list[list[tuple[tuple[int, int], list[int]]]]:
    """Per row, each image's token run [start, end) with its grid, in order. A row may hold more runs than
    images: image tokens the model generated in its response are text (as in the engine), not images. A
    row with fewer runs than grids is refused."""
    out = []
    for r in range(input_ids.shape[0]):
        grids = [g for g in image_grid_thw[r].tolist() if g[0] > 0]
        runs = _runs(input_ids[r] == image_token_id)
        if len(runs) < len(grids):
            raise ValueError(f"row {r}: {len(runs)} image token runs but {len(grids)} image grids")
        out.append(list(zip(runs, grids)))
    return out


def image_mask(input_ids: torch.Tensor, image_grid_thw: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """[b, s] True on the tokens that take image features (the images' runs, not generated image tokens)."""
    mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for r, row in enumerate(image_runs(input_ids, image_grid_thw, image_token_id)):
        for (a, e), _ in row:
            mask[r, a:e] = True
    return mask


def mrope_positions(input_ids: torch.Tensor, positions: torch.Tensor, image_grid_thw: torch.Tensor,
                    image_token_id: int, merge: int) -> torch.Tensor:
    """[3, b, s] positions from `input_ids` [b, s], the ordinary `positions` [b, s] and `image_grid_thw`
    [b, images, 3] (each row's images in order; all-zero rows are padding). ValueError when a row's image
    token runs do not match its grids (`image_runs`)."""
    b, s = input_ids.shape
    out = positions.unsqueeze(0).expand(3, b, s).clone()
    for r, row in enumerate(image_runs(input_ids, image_grid_thw, image_token_id)):
        restart = (torch.diff(positions[r]) <= 0).nonzero().flatten().add(1).tolist() + [s]
        for (a, e), (t, h, w) in row:
            hh, ww = h // merge, w // merge
            if e - a != t * hh * ww:
                raise ValueError(f"row {r}: an image run of {e - a} tokens for a grid {t}x{h}x{w} "
                                 f"({t * hh * ww} merged patches)")
            base = out[0, r, a].clone()
            out[0, r, a:e] = base + torch.arange(t).repeat_interleave(hh * ww)
            out[1, r, a:e] = base + torch.arange(hh).repeat_interleave(ww).repeat(t)
            out[2, r, a:e] = base + torch.arange(ww).repeat(t * hh)
            end = next(x for x in restart if x >= e)  # the end of this image's sequence in the row
            out[:, r, e:end] += max(hh, ww) - (e - a)
    return out
