"""ResNet-vd (R18/R34/R50/R101), the backbone of RT-DETR, registered as the ``resnet_vd`` backbone.

The "vd" ResNet (Bag of Tricks, He et al. 2019) differs from torchvision's in two places: the stem is
three 3x3 convolutions instead of one 7x7, and a down-sampling shortcut average-pools before its 1x1
convolution instead of striding it (so it sees every input pixel). Bottleneck blocks stride in the
3x3 convolution. The first block of every stage has a projection shortcut, also where channels and
stride do not change (the first stage of R18/R34), as in transformers' ``RTDetrResNetBackbone`` whose
weights this module takes (see :mod:`pet.modeling.rtdetr.weights`).
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from fvcore.common.config import CfgNode
from torch import nn

from pet.modeling.registry import BACKBONE_REGISTRY
from pet.modeling.rtdetr.layers import ConvNorm
from pet.utils.errors import ConfigError

__all__ = ["ResNetVd", "resnet_vd"]

# depth -> (block type, blocks per stage)
_DEPTHS = {"resnet18": ("basic", [2, 2, 2, 2]), "resnet34": ("basic", [3, 4, 6, 3]),
           "resnet50": ("bottleneck", [3, 4, 6, 3]), "resnet101": ("bottleneck", [3, 4, 23, 3])}


class Shortcut(nn.Module):
    """Projection shortcut: 2x2 average pooling when the block strides, then a 1x1 ConvNorm."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, frozen_bn_eps: float | None) -> None:
        super().__init__()
        self.pool = stride == 2
        self.proj = ConvNorm(in_channels, out_channels, 1, frozen_bn_eps=frozen_bn_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.avg_pool2d(x, 2, 2, ceil_mode=True) if self.pool else x)


class Block(nn.Module):
    """A basic (two 3x3) or bottleneck (1x1, strided 3x3, 1x1 with 4x the width) residual block."""

    def __init__(self, kind: str, in_channels: int, out_channels: int, stride: int, projection: bool,
                 frozen_bn_eps: float | None) -> None:
        super().__init__()
        eps = frozen_bn_eps
        if kind == "basic":
            convs = [ConvNorm(in_channels, out_channels, 3, stride, activation="relu", frozen_bn_eps=eps),
                     ConvNorm(out_channels, out_channels, 3, frozen_bn_eps=eps)]
        else:
            width = out_channels // 4
            convs = [ConvNorm(in_channels, width, 1, activation="relu", frozen_bn_eps=eps),
                     ConvNorm(width, width, 3, stride, activation="relu", frozen_bn_eps=eps),
                     ConvNorm(width, out_channels, 1, frozen_bn_eps=eps)]
        self.convs = nn.Sequential(*convs)
        self.shortcut = Shortcut(in_channels, out_channels, stride, eps) if projection else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.convs(x) + self.shortcut(x))


class ResNetVd(nn.Module):
    """Stem and four stages; returns the last three stages (strides 8, 16, 32) as an ordered dict."""

    def __init__(self, name: str, *, frozen_bn_eps: float | None = 1e-5, stem_channels: int = 64) -> None:
        super().__init__()
        if name not in _DEPTHS:
            raise ConfigError(f"MODEL.BACKBONE.NAME '{name}' is not a ResNet-vd depth: one of {', '.join(_DEPTHS)}")
        kind, depths = _DEPTHS[name]
        eps = frozen_bn_eps
        half = stem_channels // 2
        self.stem = nn.Sequential(ConvNorm(3, half, 3, 2, activation="relu", frozen_bn_eps=eps),
                                  ConvNorm(half, half, 3, activation="relu", frozen_bn_eps=eps),
                                  ConvNorm(half, stem_channels, 3, activation="relu", frozen_bn_eps=eps))
        widths = [stem_channels * 2**i * (4 if kind == "bottleneck" else 1) for i in range(4)]
        self.stages = nn.ModuleList()
        in_channels = stem_channels
        for i, (width, depth) in enumerate(zip(widths, depths)):
            stride = 1 if i == 0 else 2
            blocks = [Block(kind, in_channels, width, stride, True, eps)]
            blocks += [Block(kind, width, width, 1, False, eps) for _ in range(depth - 1)]
            self.stages.append(nn.Sequential(*blocks))
            in_channels = width
        self.out_channels = widths[1:]

    def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        x = F.max_pool2d(self.stem(x), 3, 2, 1)
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        for i, stage in enumerate(self.stages):
            x = stage(x)
            if i > 0:
                out[f"res{i + 2}"] = x
        return out


@BACKBONE_REGISTRY.register()
def resnet_vd(cfg: CfgNode) -> ResNetVd:
    """``MODEL.BACKBONE.NAME`` (resnet18/34/50/101) as a ResNet-vd; ``NORM`` FrozenBN (the reference's,
    for pre-trained weights) or BN (from scratch); ``FREEZE_AT`` > 0 freezes the stem and ``FREEZE_AT - 1`` stages."""
    backbone = cfg.MODEL.BACKBONE
    if backbone.NORM not in ("FrozenBN", "BN"):
        raise ConfigError(f"MODEL.BACKBONE.NORM '{backbone.NORM}' is not one resnet_vd has: FrozenBN or BN")
    model = ResNetVd(backbone.NAME, frozen_bn_eps=backbone.FROZEN_BN_EPS if backbone.NORM == "FrozenBN" else None,
                     stem_channels=cfg.MODEL.RTDETR.BACKBONE_WIDTH)
    frozen = ([model.stem] if backbone.FREEZE_AT > 0 else []) + list(model.stages[:max(backbone.FREEZE_AT - 1, 0)])
    for module in frozen:
        module.requires_grad_(False)
    return model
