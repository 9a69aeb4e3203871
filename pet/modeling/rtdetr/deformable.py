"""Multi-scale deformable attention (Deformable DETR) in plain PyTorch: bilinear sampling with ``grid_sample``.

No compiled kernel: ``grid_sample`` runs on every device, differentiates, and exports to ONNX (opset 16+).
Each query attends to ``num_points`` locations per head and level, placed around its reference box
(offsets scaled by the box's size, as RT-DETR's decoder does), weighted by a softmax over all of them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MSDeformableAttention", "deformable_sample"]


def deformable_sample(value: torch.Tensor, shapes: list[tuple[int, int]], locations: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
    """Sum over levels and points of bilinear samples of ``value`` times ``weights``.

    ``value`` [B, S, H, D] (S = sum of h * w over ``shapes``, rows of each level row-major), ``locations``
    [B, Q, H, L, P, 2] as (x, y) in [0, 1] of each level (0 and 1 the outer edges of its border pixels, zero
    outside), ``weights`` [B, Q, H, L, P]. Returns [B, Q, H * D].
    """
    b, _, heads, d = value.shape
    _, q, _, levels, points, _ = locations.shape
    grids = 2 * locations - 1
    sampled = []
    for level, (v, (h, w)) in enumerate(zip(value.split([h * w for h, w in shapes], dim=1), shapes)):
        v = v.flatten(2).transpose(1, 2).reshape(b * heads, d, h, w)
        grid = grids[:, :, :, level].transpose(1, 2).flatten(0, 1)  # [B * H, Q, P, 2]
        sampled.append(F.grid_sample(v, grid, mode="bilinear", padding_mode="zeros", align_corners=False))
    weights = weights.transpose(1, 2).reshape(b * heads, 1, q, levels * points)
    out = (torch.stack(sampled, dim=-2).flatten(-2) * weights).sum(-1)  # [B * H, D, Q]
    return out.view(b, heads * d, q).transpose(1, 2)


class MSDeformableAttention(nn.Module):
    """Queries ``[B, Q, C]`` with reference boxes ``[B, Q, 1, 4]`` (cx, cy, w, h in [0, 1]) attend to the
    flattened multi-scale ``memory`` ``[B, S, C]``."""

    def __init__(self, dim: int, num_heads: int, num_levels: int, num_points: int) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"the decoder's dimension {dim} must be a multiple of its {num_heads} heads")
        self.num_heads, self.num_levels, self.num_points = num_heads, num_levels, num_points
        self.sampling_offsets = nn.Linear(dim, num_heads * num_levels * num_points * 2)
        self.attention_weights = nn.Linear(dim, num_heads * num_levels * num_points)
        self.value_proj = nn.Linear(dim, dim)
        self.output_proj = nn.Linear(dim, dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Deformable DETR's initialisation: no learnt offsets yet, the points of head k spread along direction
        2 pi k / H at distances 1..P, uniform attention weights."""
        nn.init.zeros_(self.sampling_offsets.weight)
        angles = torch.arange(self.num_heads, dtype=torch.float32) * (2 * torch.pi / self.num_heads)
        grid = torch.stack([angles.cos(), angles.sin()], -1)
        grid = (grid / grid.abs().max(-1, keepdim=True).values).view(self.num_heads, 1, 1, 2)
        grid = grid.repeat(1, self.num_levels, self.num_points, 1)
        grid *= torch.arange(1, self.num_points + 1, dtype=torch.float32).view(1, 1, -1, 1)
        with torch.no_grad():
            self.sampling_offsets.bias.copy_(grid.flatten())
        nn.init.zeros_(self.attention_weights.weight)
        nn.init.zeros_(self.attention_weights.bias)
        for layer in (self.value_proj, self.output_proj):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, query: torch.Tensor, reference: torch.Tensor, memory: torch.Tensor,
                shapes: list[tuple[int, int]]) -> torch.Tensor:
        b, q, _ = query.shape
        h, lv, p = self.num_heads, self.num_levels, self.num_points
        value = self.value_proj(memory).view(b, memory.shape[1], h, -1)
        offsets = self.sampling_offsets(query).view(b, q, h, lv, p, 2)
        weights = self.attention_weights(query).view(b, q, h, lv * p).softmax(-1).view(b, q, h, lv, p)
        # Offsets are in units of half the box size divided by the number of points (RT-DETR's decoder).
        centre, size = reference[:, :, None, :, None, :2], reference[:, :, None, :, None, 2:]
        locations = centre + offsets / p * size * 0.5
        return self.output_proj(deformable_sample(value, shapes, locations, weights))
