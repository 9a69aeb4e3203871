"""RT-DETR's hybrid encoder: AIFI (self-attention within the coarsest level) and CCFM (cross-scale fusion).

Attention over every level of a multi-scale map is what makes Deformable DETR's encoder slow; RT-DETR
runs it only on the stride-32 map (AIFI: few tokens, the most semantic features) and fuses the levels
with convolutions, top-down then bottom-up (CCFM, a PAN whose fusion blocks are CSP layers of RepVGG
blocks). The input projections (1x1 ConvNorm per backbone level) are part of this module here; in
transformers they belong to the model (``encoder_input_proj``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pet.modeling.rtdetr.layers import ConvNorm, FeedForward, SelfAttention

__all__ = ["HybridEncoder", "sine_position_embedding"]


def sine_position_embedding(height: int, width: int, dim: int, temperature: float = 10000.0, *,
                            device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Fixed 2D sine-cosine embedding ``[1, H * W, dim]`` of a row-major grid, laid out ``[sin y | cos y | sin x |
    cos x]``, computed in float64 (as transformers does; the original RT-DETR code lays the grid out column-major,
    which differs on non-square maps)."""
    if dim % 4:
        raise ValueError(f"the position embedding's dimension must be a multiple of 4, got {dim}")
    omega = 1.0 / temperature ** (torch.arange(dim // 4, dtype=torch.float64, device=device) / (dim // 4))
    y, x = torch.meshgrid(torch.arange(height, dtype=torch.float64, device=device),
                          torch.arange(width, dtype=torch.float64, device=device), indexing="ij")
    y, x = y.flatten()[:, None] * omega, x.flatten()[:, None] * omega
    return torch.cat([y.sin(), y.cos(), x.sin(), x.cos()], dim=1).to(dtype)[None]


class EncoderLayer(nn.Module):
    """Post-norm transformer encoder layer (AIFI): self-attention with the sine embedding, then a GELU FFN."""

    def __init__(self, dim: int, num_heads: int, ffn_dim: int) -> None:
        super().__init__()
        self.self_attn = SelfAttention(dim, num_heads)
        self.norm1 = nn.LayerNorm(dim)
        self.ffn = FeedForward(dim, ffn_dim, "gelu")
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.self_attn(x, pos))
        return self.norm2(x + self.ffn(x))


class RepVggBlock(nn.Module):
    """A 3x3 and a 1x1 ConvNorm in parallel, summed, then SiLU (RepVGG's training-time form, not re-parameterised)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = ConvNorm(channels, channels, 3)
        self.conv2 = ConvNorm(channels, channels, 1)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv1(x) + self.conv2(x))


class CSPRepLayer(nn.Module):
    """CCFM's fusion block: two 1x1 branches of ``expansion * out`` channels, RepVGG blocks on one, summed."""

    def __init__(self, in_channels: int, out_channels: int, num_blocks: int, expansion: float) -> None:
        super().__init__()
        hidden = int(out_channels * expansion)
        self.conv1 = ConvNorm(in_channels, hidden, 1, activation="silu")
        self.conv2 = ConvNorm(in_channels, hidden, 1, activation="silu")
        self.blocks = nn.Sequential(*[RepVggBlock(hidden) for _ in range(num_blocks)])
        self.conv3 = ConvNorm(hidden, out_channels, 1, activation="silu") if hidden != out_channels else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv3(self.blocks(self.conv1(x)) + self.conv2(x))


class HybridEncoder(nn.Module):
    """Backbone levels (finest first; only the last ``len(in_channels)`` are used) -> as many fused ``dim``-channel
    maps at the same strides.

    The three kinds of CCFM parts are made by :meth:`lateral_conv`, :meth:`fusion_block` and :meth:`downsample_conv`,
    and two maps meet in :meth:`fuse`, which a variant overrides (D-FINE's and DEIMv2's encoders,
    :mod:`pet.modeling.dfine.encoder`).
    """

    def __init__(self, in_channels: list[int], dim: int, *, num_heads: int, ffn_dim: int, num_layers: int,
                 num_blocks: int, expansion: float, temperature: float = 10000.0) -> None:
        super().__init__()
        self.dim, self.temperature = dim, temperature
        self.num_blocks, self.expansion = num_blocks, expansion
        self.input_proj = nn.ModuleList(ConvNorm(c, dim, 1) for c in in_channels)
        self.aifi = nn.ModuleList(EncoderLayer(dim, num_heads, ffn_dim) for _ in range(num_layers))
        levels = len(in_channels) - 1
        self.lateral_convs = nn.ModuleList(self.lateral_conv() for _ in range(levels))
        self.fpn_blocks = nn.ModuleList(self.fusion_block() for _ in range(levels))
        self.downsample_convs = nn.ModuleList(self.downsample_conv() for _ in range(levels))
        self.pan_blocks = nn.ModuleList(self.fusion_block() for _ in range(levels))

    def lateral_conv(self) -> nn.Module:
        """The 1x1 conv on a coarser map before it is upsampled onto the next finer one."""
        return ConvNorm(self.dim, self.dim, 1, activation="silu")

    def fusion_block(self) -> nn.Module:
        """The block fusing two concatenated maps (``2 * dim`` channels) into one (``dim``)."""
        return CSPRepLayer(2 * self.dim, self.dim, self.num_blocks, self.expansion)

    def downsample_conv(self) -> nn.Module:
        """The stride-2 conv taking a fused map onto the next coarser level in the bottom-up pass."""
        return ConvNorm(self.dim, self.dim, 3, 2, activation="silu")

    def fuse(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Two maps of one level into the fusion block's input: concatenated (so its input has ``2 * dim`` channels)."""
        return torch.cat([a, b], dim=1)

    def forward(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        features = features[len(features) - len(self.input_proj):]
        maps = [proj(f) for proj, f in zip(self.input_proj, features)]
        if len(self.aifi):
            top = maps[-1]
            b, c, h, w = top.shape
            tokens = top.flatten(2).transpose(1, 2)
            pos = sine_position_embedding(h, w, c, self.temperature, device=top.device, dtype=tokens.dtype)
            for layer in self.aifi:
                tokens = layer(tokens, pos)
            maps[-1] = tokens.transpose(1, 2).reshape(b, c, h, w).contiguous()
        # Top-down: the lateral conv's output of the coarser map is kept for the bottom-up pass.
        inner = [maps[-1]]
        for i, (lateral, block) in enumerate(zip(self.lateral_convs, self.fpn_blocks)):
            inner[-1] = lateral(inner[-1])
            up = F.interpolate(inner[-1], scale_factor=2.0, mode="nearest")
            inner.append(block(self.fuse(up, maps[-2 - i])))
        inner.reverse()
        outs = [inner[0]]
        for i, (down, block) in enumerate(zip(self.downsample_convs, self.pan_blocks)):
            outs.append(block(self.fuse(down(outs[-1]), inner[i + 1])))
        return outs
