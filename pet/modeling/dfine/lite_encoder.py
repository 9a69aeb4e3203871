"""DEIMv2's Lite encoder, the encoder of its smallest models (Atto, Femto, Pico on three-stage HGNetv2s).

Those backbones end at stride 16, and a stride-16 map is all the encoder reads; with no attention layer and a
single fusion block each way it costs a fraction of the hybrid encoder. The decoder still gets two levels:

1. the backbone's map projected to ``dim`` channels (1x1 ConvNorm, no activation): the fine level, stride 16;
2. the coarse level, stride 32: that map average-pooled (3x3, stride 2, padding 1) and mixed by a 1x1 ConvNorm-SiLU,
   then the image's mean (global average pooling) added to every location and mixed by another 1x1 ConvNorm-SiLU.
   With two levels and no attention this is where a location learns about the whole image;
3. top-down (FPN): the coarse map upsampled x2 (nearest) plus the fine map, through a RepNCSPELAN5 block; that is
   the fine output;
4. bottom-up (PAN): the fine output pooled and mixed as in 2 (its own 1x1 conv) plus the coarse map, through a
   second RepNCSPELAN5 block; that is the coarse output.

The fusion blocks are :class:`~pet.modeling.dfine.encoder.RepNCSPELAN5` with trailing 3x3 convs (the authors'
``RepNCSPELAN4`` on their ``CSPLayer2``, as the hybrid encoder of DEIMv2-N). Module names are transformers'
``Deimv2LiteEncoder``'s but for the CSP layers' ``blocks`` (its ``bottlenecks``), as in
:class:`~pet.modeling.dfine.encoder.Deimv2HybridEncoder`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pet.modeling.dfine.encoder import RepNCSPELAN5, csp_depth
from pet.modeling.rtdetr.layers import ConvNorm

__all__ = ["LiteEncoder"]


def halved(x: torch.Tensor) -> torch.Tensor:
    """3x3 average pooling at stride 2, padded by one (zeros counted): ``ceil(n / 2)`` per side."""
    return F.avg_pool2d(x, kernel_size=3, stride=2, padding=1)


class LiteEncoder(nn.Module):
    """The last backbone level (``in_channels`` wide, stride 16) -> two ``dim``-channel maps at strides 16 and 32,
    finest first, as :class:`~pet.modeling.rtdetr.encoder.HybridEncoder` returns them. ``expansion`` and
    ``depth_mult`` size the two RepNCSPELAN5 blocks as they do the hybrid encoder's (inner width
    ``round(expansion * dim // 2)``, CSP depth ``round(3 * depth_mult)``). A padded input whose sides divide by 32
    keeps the two levels' sizes exactly 2:1."""

    def __init__(self, in_channels: int, dim: int, *, expansion: float, depth_mult: float,
                 trailing_conv: bool = True) -> None:
        super().__init__()
        # A list of one, as the hybrid encoder's (and the reference's) per-level projections are indexed.
        self.input_proj = nn.ModuleList([ConvNorm(in_channels, dim, 1)])
        self.down_conv1 = ConvNorm(dim, dim, 1, activation="silu")
        self.down_conv2 = ConvNorm(dim, dim, 1, activation="silu")
        self.bi_fusion_conv = ConvNorm(dim, dim, 1, activation="silu")
        hidden, num_blocks = round(expansion * dim // 2), csp_depth(depth_mult)
        self.fpn_block = RepNCSPELAN5(dim, hidden, num_blocks, trailing_conv)
        self.pan_block = RepNCSPELAN5(dim, hidden, num_blocks, trailing_conv)

    def global_fusion(self, coarse: torch.Tensor) -> torch.Tensor:
        """The coarse map with the image's mean feature added everywhere, mixed by a 1x1 conv."""
        return self.bi_fusion_conv(coarse + F.adaptive_avg_pool2d(coarse, 1))

    def forward(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        fine = self.input_proj[0](features[-1])
        coarse = self.global_fusion(self.down_conv1(halved(fine)))
        fine_out = self.fpn_block(fine + F.interpolate(coarse, scale_factor=2.0, mode="nearest"))
        coarse_out = self.pan_block(coarse + self.down_conv2(halved(fine_out)))
        return [fine_out, coarse_out]
