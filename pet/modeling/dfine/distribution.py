"""D-FINE's box representation: each edge of a box as a probability distribution over fixed offsets.

Fine-grained distribution refinement (FDR, Peng et al., "D-FINE", ICLR 2025): a decoder layer predicts, for each of
a query's four edges (left, top, right, bottom), logits over ``num_bins + 1`` bins; the edge's distance from its
anchor is the expectation of the non-uniform weighting function W(n) under their softmax, in units of the anchor's
size / ``reg_scale`` (:func:`distances_to_boxes`). W is dense near 0 (fine corrections) and sparse at its ends
(coarse ones). Later layers add to the earlier layers' logits, so each refines the distributions, not the boxes.
The location quality estimate (:class:`LocationQuality`) reads how peaked those distributions are.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import box_convert

from pet.modeling.rtdetr.layers import MLP

__all__ = ["weighting_function", "expected_distances", "distances_to_boxes", "LocationQuality"]


def weighting_function(num_bins: int, up: torch.Tensor, reg_scale: torch.Tensor) -> torch.Tensor:
    """W(n) for n = 0..num_bins ``[num_bins + 1]``: 0 in the middle, ``+-(s^k - 1)`` for k = 1..num_bins/2 - 1 with
    ``s = (|up * reg_scale| + 1) ** (2 / (num_bins - 2))`` on either side (reaching ``+-|up * reg_scale|``), and
    ``+-2 |up * reg_scale|`` at the two ends. ``up`` and ``reg_scale`` are one-element tensors (the model's buffers),
    so the values follow a checkpoint's."""
    bound = up[0].abs() * reg_scale.abs()
    step = (bound + 1) ** (2 / (num_bins - 2))
    left = [-(step**i) + 1 for i in range(num_bins // 2 - 1, 0, -1)]
    right = [step**i - 1 for i in range(1, num_bins // 2)]
    return torch.cat([-bound * 2, *left, torch.zeros_like(up[0][None]), *right, bound * 2], 0)


def expected_distances(corners: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Edge logits ``[B, Q, 4 * (num_bins + 1)]`` -> expected distances ``[B, Q, 4]`` under W (``weights``)."""
    b, q, _ = corners.shape
    probabilities = F.softmax(corners.reshape(-1, weights.shape[0]), dim=1)
    return F.linear(probabilities, weights).reshape(b, q, 4)


def distances_to_boxes(anchors: torch.Tensor, distances: torch.Tensor, reg_scale: torch.Tensor) -> torch.Tensor:
    """Boxes (cx, cy, w, h) from ``anchors`` (cx, cy, w, h) and edge ``distances`` (left, top, right, bottom):
    an edge lies ``reg_scale / 2 + distance`` units of ``anchor size / reg_scale`` from the anchor's centre, so
    distance 0 gives the anchor back."""
    scale = reg_scale.abs()
    cx, cy, w, h = anchors.unbind(-1)
    x0 = cx - (0.5 * scale + distances[..., 0]) * (w / scale)
    y0 = cy - (0.5 * scale + distances[..., 1]) * (h / scale)
    x1 = cx + (0.5 * scale + distances[..., 2]) * (w / scale)
    y1 = cy + (0.5 * scale + distances[..., 3]) * (h / scale)
    return box_convert(torch.stack([x0, y0, x1, y1], -1), "xyxy", "cxcywh")


class LocationQuality(nn.Module):
    """D-FINE's LQE: the ``topk`` largest bin probabilities of each edge and their mean, through an MLP, give one
    quality logit per query, added to all its class logits (a confident box raises its score)."""

    def __init__(self, num_bins: int, topk: int, hidden_dim: int, num_layers: int) -> None:
        super().__init__()
        self.num_bins, self.topk = num_bins, topk
        self.mlp = MLP(4 * (topk + 1), hidden_dim, 1, num_layers)

    def forward(self, logits: torch.Tensor, corners: torch.Tensor) -> torch.Tensor:
        b, q, _ = corners.shape
        probabilities = F.softmax(corners.reshape(b, q, 4, self.num_bins + 1), dim=-1)
        top = probabilities.topk(self.topk, dim=-1).values
        stats = torch.cat([top, top.mean(dim=-1, keepdim=True)], dim=-1)
        return logits + self.mlp(stats.reshape(b, q, -1))
