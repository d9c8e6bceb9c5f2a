"""Qwen2-VL's vision tower, top to bottom: patches -> ViT blocks with 2D RoPE -> 2 x 2 patch merger.

Parameter names follow the HF checkpoint below `visual.` (patch_embed.proj, blocks.{i}.norm1/attn.qkv/
attn.proj/norm2/mlp.fc1/mlp.fc2, merger.ln_q/mlp.0/mlp.2), so the weight map is a prefix swap. The tower is
replicated over tensor-parallel ranks (it is small next to the language model; every rank computes the
same features) and lives on the first pipeline stage.

Inputs are the processor's: `pixel_values` [patches, 3 * 2 * 14 * 14] (each row one 14 x 14 patch of two
identical frames), `grid_thw` [images, 3] (frames t, patch rows h, patch columns w). Patches come in 2 x 2
merge-window order, so the merger's view(-1, 4 * width) joins each window's four patches. Attention is
full (not causal) within each frame of each image, never across images.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _field(cfg: Any, name: str, default: Any = None) -> Any:
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class PatchEmbed(nn.Module):
    """A Conv3d with stride = kernel over (frames, rows, cols): one linear map per patch."""

    def __init__(self, in_channels: int, temporal: int, patch: int, width: int) -> None:
        super().__init__()
        self.proj = nn.Conv3d(in_channels, width, kernel_size=(temporal, patch, patch),
                              stride=(temporal, patch, patch), bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1))


class VisionAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, -1).unbind(1)  # [n, heads, head_dim] each
        q, k = ((t.float() * cos + rotate_half(t.float()) * sin).to(v.dtype) for t in (q, k))
        out = []
        for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths)):  # one frame at a time
            out.append(F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1),
                                                      vi.transpose(0, 1)).transpose(0, 1))
        return self.proj(torch.cat(out).reshape(n, -1))


class VisionMlp(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(quick_gelu(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, width: int, heads: int, mlp_hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width, eps=1e-6)
        self.attn = VisionAttention(width, heads)
        self.norm2 = nn.LayerNorm(width, eps=1e-6)
        self.mlp = VisionMlp(width, mlp_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm each patch, join each 2 x 2 window's four patches, project to the language model's width."""

    def __init__(self, width: int, out: int, merge: int) -> None:
        super().__init__()
        self.joined = width * merge * merge
        self.ln_q = nn.LayerNorm(width, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.joined, self.joined), nn.GELU(), nn.Linear(self.joined, out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.joined))


class VisionTower(nn.Module):
    """Image patches -> one feature per merged 2 x 2 window, in the language model's width."""

    def __init__(self, vision_config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        width, heads = int(_field(vision_config, "embed_dim")), int(_field(vision_config, "num_heads"))
        act = _field(vision_config, "hidden_act", "quick_gelu")
        if act != "quick_gelu":
            raise ValueError(f"vision_config.hidden_act={act!r} is not supported (quick_gelu)")
        self.merge = int(_field(vision_config, "spatial_merge_size", 2))
        self.patch_embed = PatchEmbed(int(_field(vision_config, "in_channels", 3)),
                                      int(_field(vision_config, "temporal_patch_size", 2)),
                                      int(_field(vision_config, "patch_size", 14)), width)
        hidden = int(width * float(_field(vision_config, "mlp_ratio", 4)))
        self.blocks = nn.ModuleList(VisionBlock(width, heads, hidden) for _ in range(int(_field(vision_config,
                                                                                            "depth"))))
        self.merger = PatchMerger(width, int(_field(vision_config, "hidden_size")), self.merge)
        theta = float((_field(vision_config, "rope_parameters") or {}).get("rope_theta", 10000.0))
        quarter = width // heads // 2  # h and w each rotate a quarter of the head, written twice (rotate_half)
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter),
                             persistent=False)
        self.to(dtype)
        self.inv_freq = self.inv_freq.float()

    def _rope(self, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [patches, 1, head_dim] of each patch's (row, column), in merge-window order."""
        pos = []
        m = self.merge
        for t, h, w in grid_thw.tolist():
            rows = torch.arange(h)[:, None].expand(h, w).reshape(h // m, m, w // m, m).transpose(1, 2).flatten()
            cols = torch.arange(w)[None, :].expand(h, w).reshape(h // m, m, w // m, m).transpose(1, 2).flatten()
            pos.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
        p = torch.cat(pos).to(self.inv_freq.device).float()
        freqs = torch.cat([p[:, :1] * self.inv_freq, p[:, 1:] * self.inv_freq], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        return emb.cos(), emb.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        cos, sin = self._rope(grid_thw)
        lengths = [int(h * w) for t, h, w in grid_thw.tolist() for _ in range(int(t))]
        x = self.patch_embed(pixel_values)
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)


def hf_shapes(vision_config: Any) -> dict[str, tuple[int, ...]]:
    """Every `visual.*` tensor of the HF checkpoint with its shape (built on the meta device)."""
    with torch.device("meta"):
        tower = VisionTower(vision_config)
    return {f"visual.{n}": tuple(p.shape) for n, p in tower.named_parameters()}
