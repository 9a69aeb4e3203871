"""Multi-scale deformable attention (Deformable DETR) in plain PyTorch: bilinear sampling with ``grid_sample``.

No compiled kernel: ``grid_sample`` runs on every device, differentiates, and exports to ONNX (opset 16+).
Each query attends to a few locations per head and level, placed around its reference box (offsets scaled by
the box's size, as RT-DETR's decoder does), weighted by a softmax over all of them. RT-DETR samples the same
number of points on every level and projects the values and the output; D-FINE gives each level its own
number of points and does without both projections (``projections=False``).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MSDeformableAttention", "deformable_sample"]


def deformable_sample(value: torch.Tensor, shapes: list[tuple[int, int]], locations: torch.Tensor,
                      weights: torch.Tensor, points: Sequence[int]) -> torch.Tensor:
    """Sum over levels and points of bilinear samples of ``value`` times ``weights``.

    ``value`` [B, S, H, D] (S = sum of h * w over ``shapes``, rows of each level row-major), ``locations``
    [B, Q, H, P, 2] as (x, y) in [0, 1] of each level (0 and 1 the outer edges of its border pixels, zero
    outside), ``weights`` [B, Q, H, P]; the P points are ``points[0]`` on the first level, then ``points[1]`` on
    the second and so on. Returns [B, Q, H * D].
    """
    b, _, heads, d = value.shape
    q, total = locations.shape[1], locations.shape[3]
    grids = (2 * locations - 1).transpose(1, 2).flatten(0, 1).split(list(points), dim=-2)  # [B * H, Q, P_l, 2]
    sampled = []
    for v, grid, (h, w) in zip(value.split([h * w for h, w in shapes], dim=1), grids, shapes):
        v = v.flatten(2).transpose(1, 2).reshape(b * heads, d, h, w)
        sampled.append(F.grid_sample(v, grid, mode="bilinear", padding_mode="zeros", align_corners=False))
    weights = weights.transpose(1, 2).reshape(b * heads, 1, q, total)
    out = (torch.cat(sampled, dim=-1) * weights).sum(-1)  # [B * H, D, Q]
    return out.view(b, heads * d, q).transpose(1, 2)


class MSDeformableAttention(nn.Module):
    """Queries ``[B, Q, C]`` with reference boxes ``[B, Q, 1, 4]`` (cx, cy, w, h in [0, 1]) attend to the
    flattened multi-scale ``memory`` ``[B, S, C]``.

    ``num_points``: sampling points per head on each level (one number for all levels, or one per level). An
    offset of 1 moves a point by ``offset_scale`` times the box size over its level's number of points.
    """

    def __init__(self, dim: int, num_heads: int, num_levels: int, num_points: int | Sequence[int], *,
                 offset_scale: float = 0.5, projections: bool = True) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"the decoder's dimension {dim} must be a multiple of its {num_heads} heads")
        points = [num_points] * num_levels if isinstance(num_points, int) else list(num_points)
        if len(points) != num_levels:
            raise ValueError(f"{len(points)} numbers of sampling points ({points}) for {num_levels} levels")
        if projections and len(set(points)) > 1:
            raise ValueError(f"RT-DETR's deformable attention samples as many points on every level, got {points}")
        self.num_heads, self.points, self.offset_scale = num_heads, points, offset_scale
        total = num_heads * sum(points)
        self.sampling_offsets = nn.Linear(dim, total * 2)
        self.attention_weights = nn.Linear(dim, total)
        self.value_proj = nn.Linear(dim, dim) if projections else None
        self.output_proj = nn.Linear(dim, dim) if projections else None
        if not projections:
            # 1 / points of each point's level (D-FINE keeps it in its checkpoints, so it is a persistent buffer).
            self.register_buffer("num_points_scale", torch.tensor([1 / p for p in points for _ in range(p)]))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Deformable DETR's initialisation: no learnt offsets yet, the points of head k spread along direction
        2 pi k / H at distances 1..P_l on each level, uniform attention weights."""
        nn.init.zeros_(self.sampling_offsets.weight)
        angles = torch.arange(self.num_heads, dtype=torch.float32) * (2 * torch.pi / self.num_heads)
        grid = torch.stack([angles.cos(), angles.sin()], -1)
        grid = (grid / grid.abs().max(-1, keepdim=True).values).view(self.num_heads, 1, 2)
        distances = torch.cat([torch.arange(1, p + 1, dtype=torch.float32) for p in self.points])
        with torch.no_grad():
            self.sampling_offsets.bias.copy_((grid * distances.view(1, -1, 1)).flatten())
        nn.init.zeros_(self.attention_weights.weight)
        nn.init.zeros_(self.attention_weights.bias)
        for layer in (self.value_proj, self.output_proj):
            if layer is not None:
                nn.init.xavier_uniform_(layer.weight)
                nn.init.zeros_(layer.bias)

    def forward(self, query: torch.Tensor, reference: torch.Tensor, memory: torch.Tensor,
                shapes: list[tuple[int, int]]) -> torch.Tensor:
        b, q, _ = query.shape
        h, total = self.num_heads, sum(self.points)
        value = memory if self.value_proj is None else self.value_proj(memory)
        value = value.view(b, memory.shape[1], h, -1)
        offsets = self.sampling_offsets(query).view(b, q, h, total, 2)
        weights = self.attention_weights(query).view(b, q, h, total).softmax(-1)
        centre, size = reference[:, :, None, :, :2], reference[:, :, None, :, 2:]  # [B, Q, 1, 1, 2]
        if self.value_proj is None:
            # D-FINE's order of operations (offset * 1/P * size * scale), so the two agree to the bit.
            scale = self.num_points_scale.to(query.dtype).unsqueeze(-1)
            locations = centre + offsets * scale * size * self.offset_scale
        else:
            locations = centre + offsets / self.points[0] * size * self.offset_scale
        out = deformable_sample(value, shapes, locations, weights, self.points)
        return out if self.output_proj is None else self.output_proj(out)
