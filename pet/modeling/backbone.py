"""ResNet + FPN backbones built from ``MODEL.BACKBONE`` and ``MODEL.FPN``.

torchvision's ResNet and FeaturePyramidNetwork are used unchanged, under the module
names of torchvision's detection models (``body.*``, ``fpn.*``), so torchvision
detection weights load without renaming. Another neck on the same ResNet is another
``BACKBONE_REGISTRY`` entry built on :func:`build_resnet` (see :mod:`pet.modeling.registry`).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torchvision
from fvcore.common.config import CfgNode
from torchvision.models.detection.backbone_utils import BackboneWithFPN
from torchvision.ops import FrozenBatchNorm2d
from torchvision.ops.feature_pyramid_network import ExtraFPNBlock, LastLevelMaxPool, LastLevelP6P7

from pet.modeling.registry import BACKBONE_REGISTRY
from pet.utils.errors import ConfigError

__all__ = ["build_backbone", "build_resnet", "resnet10", "freeze_stages", "resnet_fpn", "num_fpn_levels", "fpn_strides"]

def resnet10(*, weights: None = None, **kwargs: Any) -> torchvision.models.ResNet:
    """torchvision's ResNet with one BasicBlock per stage (ResNet-18 has two): the same stem, stages and widths
    at two thirds of the cost. There are no ImageNet weights for it; it is meant for training from scratch."""
    if weights is not None:
        raise ConfigError("There are no pre-trained weights for resnet10; train it from scratch (TRAIN.WEIGHTS '').")
    return torchvision.models.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1], **kwargs)


_RESNETS: dict[str, tuple[Callable[..., torchvision.models.ResNet], list[int]]] = {
    "resnet10": (resnet10, [64, 128, 256, 512]),
    "resnet18": (torchvision.models.resnet18, [64, 128, 256, 512]),
    "resnet34": (torchvision.models.resnet34, [64, 128, 256, 512]),
    "resnet50": (torchvision.models.resnet50, [256, 512, 1024, 2048]),
    "resnet101": (torchvision.models.resnet101, [256, 512, 1024, 2048]),
}
# SyncBN is built as BN, then converted: torchvision's ResNet passes only num_features to norm_layer.
_NORMS = {"FrozenBN": FrozenBatchNorm2d, "BN": torch.nn.BatchNorm2d, "SyncBN": torch.nn.BatchNorm2d}
# Stages in the order FREEZE_AT counts them: the stem, then res2..res5 (torchvision's layer1..layer4).
_STAGES = (("conv1", "bn1"), ("layer1",), ("layer2",), ("layer3",), ("layer4",))
_TOP_BLOCKS = ("maxpool", "p6p7")


def build_resnet(name: str, norm: str, frozen_bn_eps: float = 1e-5) -> tuple[torchvision.models.ResNet, list[int]]:
    """A torchvision ResNet with random weights and the output channels of its four stages.

    ``frozen_bn_eps`` is FrozenBN's eps (``MODEL.BACKBONE.FROZEN_BN_EPS``); stages frozen later keep it.
    """
    if name not in _RESNETS:
        raise ConfigError(f"MODEL.BACKBONE.NAME '{name}' is not one of {', '.join(_RESNETS)}")
    if norm not in _NORMS:
        raise ConfigError(f"MODEL.BACKBONE.NORM '{norm}' is not one of {', '.join(_NORMS)}")
    constructor, channels = _RESNETS[name]
    norm_layer = functools.partial(FrozenBatchNorm2d, eps=frozen_bn_eps) if norm == "FrozenBN" else _NORMS[norm]
    model = constructor(weights=None, norm_layer=norm_layer)
    if norm == "SyncBN":
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model, channels


def freeze_stages(resnet: torchvision.models.ResNet, freeze_at: int) -> None:
    """Freeze the stem and the first ``freeze_at - 1`` residual stages.

    0 trains everything; 2 (the usual fine-tuning choice) freezes the stem and res2, as
    torchvision's ``trainable_backbone_layers=3``. Frozen stages also get FrozenBN, so a
    trainable-BN backbone does not keep updating statistics nobody learns from.
    """
    if not 0 <= freeze_at <= len(_STAGES):
        raise ConfigError(f"MODEL.BACKBONE.FREEZE_AT must be in [0, {len(_STAGES)}], got {freeze_at}")
    for stage in _STAGES[:freeze_at]:
        for name in stage:
            module = _frozen_batchnorm(getattr(resnet, name))
            module.requires_grad_(False)
            setattr(resnet, name, module)


def _frozen_batchnorm(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with every (Sync)BatchNorm2d replaced by a FrozenBatchNorm2d holding its statistics."""
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
        frozen = FrozenBatchNorm2d(module.num_features, eps=module.eps)
        for name in ("weight", "bias", "running_mean", "running_var"):
            getattr(frozen, name).copy_(getattr(module, name).detach())
        return frozen
    for name, child in module.named_children():
        setattr(module, name, _frozen_batchnorm(child))
    return module


def _top_block(kind: str, channels: int) -> ExtraFPNBlock:
    if kind not in _TOP_BLOCKS:
        raise ConfigError(f"MODEL.FPN.TOP_BLOCK '{kind}' is not one of {', '.join(_TOP_BLOCKS)}")
    return LastLevelMaxPool() if kind == "maxpool" else LastLevelP6P7(channels, channels)


def num_fpn_levels(cfg: CfgNode) -> int:
    """How many feature maps the FPN returns (anchor sizes need one entry per level)."""
    return len(cfg.MODEL.FPN.RETURNED_LAYERS) + (1 if cfg.MODEL.FPN.TOP_BLOCK == "maxpool" else 2)


def fpn_strides(cfg: CfgNode) -> list[int]:
    """Input pixels per feature-map cell of each FPN level: 2**(k+1) for ResNet stage k
    (layer1 = stride 4), then twice the previous one for each top-block level (FCOS sizes its points by them)."""
    strides = [2 ** (layer + 1) for layer in cfg.MODEL.FPN.RETURNED_LAYERS]
    extra = num_fpn_levels(cfg) - len(strides)
    return strides + [strides[-1] * 2 ** (i + 1) for i in range(extra)]


@BACKBONE_REGISTRY.register()
def resnet_fpn(cfg: CfgNode) -> BackboneWithFPN:
    """ResNet stages ``MODEL.FPN.RETURNED_LAYERS`` into an FPN, plus the ``MODEL.FPN.TOP_BLOCK`` levels.

    Returns ``{"0": P2, "1": P3, ...}`` (``"pool"`` for the max-pooled P6, ``"p6"``/``"p7"``),
    exactly the outputs of torchvision's ``resnet_fpn_backbone``.
    """
    resnet, channels = build_resnet(cfg.MODEL.BACKBONE.NAME, cfg.MODEL.BACKBONE.NORM,
                                    cfg.MODEL.BACKBONE.FROZEN_BN_EPS)
    freeze_stages(resnet, cfg.MODEL.BACKBONE.FREEZE_AT)
    layers = list(cfg.MODEL.FPN.RETURNED_LAYERS)
    if not layers or sorted(set(layers)) != layers or not set(layers) <= {1, 2, 3, 4}:
        raise ConfigError(f"MODEL.FPN.RETURNED_LAYERS must be increasing stage numbers from 1-4, got {layers}")
    out_channels = cfg.MODEL.FPN.OUT_CHANNELS
    return BackboneWithFPN(
        resnet,
        return_layers={f"layer{layer}": str(i) for i, layer in enumerate(layers)},
        in_channels_list=[channels[layer - 1] for layer in layers],
        out_channels=out_channels,
        extra_blocks=_top_block(cfg.MODEL.FPN.TOP_BLOCK, out_channels),
    )


def build_backbone(cfg: CfgNode) -> torch.nn.Module:
    """The backbone named by ``MODEL.BACKBONE.TYPE``."""
    return BACKBONE_REGISTRY.get(cfg.MODEL.BACKBONE.TYPE)(cfg)
