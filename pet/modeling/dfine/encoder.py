"""D-FINE's hybrid encoder: RT-DETR's (AIFI on the coarsest level, then top-down and bottom-up fusion) with
lighter parts: lateral convs without activation, RepNCSPELAN4 fusion blocks (GELAN, from YOLOv9) and SCDown
(a pointwise then a depthwise stride-2 conv) for downsampling. DEIMv2's fuses two maps by their sum rather than
their concatenation, in RepNCSPELAN5 blocks."""
from __future__ import annotations

import torch
from torch import nn

from pet.modeling.rtdetr.encoder import CSPRepLayer, HybridEncoder, RepVggBlock
from pet.modeling.rtdetr.layers import ConvNorm

__all__ = ["DFineHybridEncoder", "Deimv2HybridEncoder", "RepNCSPELAN4", "RepNCSPELAN5", "SCDown", "csp_depth"]


def csp_depth(depth_mult: float) -> int:
    """RepVGG blocks per CSP layer of a fusion block for a depth multiplier, as D-FINE and DEIMv2 round it (N's and
    S's 0.34: one block; L's 1.0: three)."""
    return round(3 * depth_mult)


class SCDown(nn.Module):
    """Spatial-channel decoupled downsampling (YOLOv10): 1x1 ConvNorm, then a depthwise 3x3 stride-2 ConvNorm."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = ConvNorm(channels, channels, 1)
        self.conv2 = ConvNorm(channels, channels, 3, 2, groups=channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.conv1(x))


class RepNCSPELAN4(nn.Module):
    """GELAN fusion block: a 1x1 conv to ``2 * dim`` split in halves; the second half goes through two CSP-RepVGG
    layers (each followed by a 3x3 conv) of ``hidden`` channels; all four parts are concatenated and a 1x1 conv
    brings them back to ``dim``."""

    def __init__(self, dim: int, hidden: int, num_blocks: int) -> None:
        super().__init__()
        self.conv1 = ConvNorm(2 * dim, 2 * dim, 1, activation="silu")
        self.csp_rep1 = CSPRepLayer(dim, hidden, num_blocks, 1.0)
        self.conv2 = ConvNorm(hidden, hidden, 3, activation="silu")
        self.csp_rep2 = CSPRepLayer(hidden, hidden, num_blocks, 1.0)
        self.conv3 = ConvNorm(hidden, hidden, 3, activation="silu")
        self.conv4 = ConvNorm(2 * dim + 2 * hidden, dim, 1, activation="silu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept, processed = self.conv1(x).chunk(2, dim=1)
        y2 = self.conv2(self.csp_rep1(processed))
        y3 = self.conv3(self.csp_rep2(y2))
        return self.conv4(torch.cat([kept, processed, y2, y3], dim=1))


class DFineHybridEncoder(HybridEncoder):
    """:class:`~pet.modeling.rtdetr.encoder.HybridEncoder` with D-FINE's parts. ``expansion`` sets the fusion
    blocks' inner width, ``round(expansion * dim // 2)``, and ``depth_mult`` their CSP depth, ``round(3 * depth_mult)``
    (D-FINE's rounding: N's 0.34 x 128 // 2 gives 21 channels)."""

    def __init__(self, in_channels: list[int], dim: int, *, num_heads: int, ffn_dim: int, num_layers: int,
                 expansion: float, depth_mult: float) -> None:
        super().__init__(in_channels, dim, num_heads=num_heads, ffn_dim=ffn_dim, num_layers=num_layers,
                         num_blocks=csp_depth(depth_mult), expansion=expansion)

    def lateral_conv(self) -> nn.Module:
        return ConvNorm(self.dim, self.dim, 1)

    def fusion_block(self) -> nn.Module:
        return RepNCSPELAN4(self.dim, round(self.expansion * self.dim // 2), self.num_blocks)

    def downsample_conv(self) -> nn.Module:
        return SCDown(self.dim)


class SplitCSPLayer(nn.Module):
    """DEIMv2's CSP layer: one 1x1 conv to twice ``out_channels``, split into a residual half and a half through
    RepVGG blocks, summed, then (``trailing_conv``) a 3x3 conv."""

    def __init__(self, in_channels: int, out_channels: int, num_blocks: int, trailing_conv: bool) -> None:
        super().__init__()
        self.conv1 = ConvNorm(in_channels, 2 * out_channels, 1, activation="silu")
        self.blocks = nn.Sequential(*[RepVggBlock(out_channels) for _ in range(num_blocks)])
        self.conv2 = ConvNorm(out_channels, out_channels, 3, activation="silu") if trailing_conv else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual, path = self.conv1(x).chunk(2, dim=1)
        return self.conv2(residual + self.blocks(path))


class RepNCSPELAN5(nn.Module):
    """DEIMv2's fusion block: RepNCSPELAN4 without the 3x3 convs after its two CSP layers, on a ``dim``-channel
    input (the sum of two maps)."""

    def __init__(self, dim: int, hidden: int, num_blocks: int, trailing_conv: bool) -> None:
        super().__init__()
        self.conv1 = ConvNorm(dim, 2 * dim, 1, activation="silu")
        self.csp_rep1 = SplitCSPLayer(dim, hidden, num_blocks, trailing_conv)
        self.csp_rep2 = SplitCSPLayer(hidden, hidden, num_blocks, trailing_conv)
        self.conv2 = ConvNorm(2 * dim + 2 * hidden, dim, 1, activation="silu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept, processed = self.conv1(x).chunk(2, dim=1)
        y3 = self.csp_rep1(processed)
        return self.conv2(torch.cat([kept, processed, y3, self.csp_rep2(y3)], dim=1))


class Deimv2HybridEncoder(DFineHybridEncoder):
    """D-FINE's encoder with DEIMv2's fusion: two maps summed into a RepNCSPELAN5 block (``trailing_conv``: its CSP
    layers end with a 3x3 conv, as DEIMv2-N/S; M/L/X do without)."""

    def __init__(self, in_channels: list[int], dim: int, *, num_heads: int, ffn_dim: int, num_layers: int,
                 expansion: float, depth_mult: float, trailing_conv: bool) -> None:
        self.trailing_conv = trailing_conv
        super().__init__(in_channels, dim, num_heads=num_heads, ffn_dim=ffn_dim, num_layers=num_layers,
                         expansion=expansion, depth_mult=depth_mult)

    def fusion_block(self) -> nn.Module:
        return RepNCSPELAN5(self.dim, round(self.expansion * self.dim // 2), self.num_blocks, self.trailing_conv)

    def fuse(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b
