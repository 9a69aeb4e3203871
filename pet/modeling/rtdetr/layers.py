"""Small building blocks the RT-DETR parts share: a convolution with its norm, an MLP, attention, box helpers."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import FrozenBatchNorm2d

__all__ = ["ConvNorm", "MLP", "SelfAttention", "FeedForward", "inverse_sigmoid", "ACTIVATIONS"]

ACTIVATIONS = {"relu": nn.ReLU, "silu": nn.SiLU, "gelu": nn.GELU}


class ConvNorm(nn.Module):
    """Convolution (no bias), BatchNorm (or FrozenBN) and an optional activation: the unit of every RT-DETR conv."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 1, stride: int = 1, *,
                 groups: int = 1, activation: str | None = None, frozen_bn_eps: float | None = None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, (kernel_size - 1) // 2, groups=groups,
                              bias=False)
        self.norm = (FrozenBatchNorm2d(out_channels, eps=frozen_bn_eps) if frozen_bn_eps is not None
                     else nn.BatchNorm2d(out_channels))
        self.act = ACTIVATIONS[activation]() if activation else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.conv(x)))


class MLP(nn.Module):
    """``num_layers`` linear layers with an activation between them, ReLU by default (DETR's box and query-position
    heads)."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int, num_layers: int, activation: str = "relu") -> None:
        super().__init__()
        dims = [in_dim] + [hidden_dim] * (num_layers - 1)
        self.layers = nn.ModuleList(nn.Linear(i, o) for i, o in zip(dims, dims[1:] + [out_dim]))
        self.act = ACTIVATIONS[activation]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = self.act(x)
        return x


class FeedForward(nn.Module):
    """The transformer layers' two-layer feed-forward block."""

    def __init__(self, dim: int, hidden_dim: int, activation: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.act = ACTIVATIONS[activation]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SelfAttention(nn.Module):
    """Multi-head self-attention whose queries and keys (not values) get a position embedding added.

    Separate q/k/v/o projections rather than ``nn.MultiheadAttention``'s packed one, so that each
    projection is one tensor in a checkpoint (and transformers' RT-DETR names map one to one).
    """

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [B, N, C]; ``mask`` [N, N] added to the attention logits (0 or -inf), or None."""
        b, n, c = x.shape
        qk = x if pos is None else x + pos

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.num_heads, c // self.num_heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(qk)), heads(self.k_proj(qk)), heads(self.v_proj(x)),
                                             attn_mask=None if mask is None else mask.to(x.dtype))
        return self.o_proj(out.transpose(1, 2).reshape(b, n, c))


def inverse_sigmoid(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``logit(x)`` with ``x`` clamped to [0, 1] and both ``x`` and ``1 - x`` to at least ``eps``."""
    x = x.clamp(0, 1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))
