"""HGNetv2 (B0-B6, and DEIMv2's three-stage Atto, Femto, Pico), the backbone of D-FINE and DEIMv2, registered as the
``hgnetv2`` backbone.

HGNetv2 is Baidu's GPU-friendly CNN (PP-HGNetV2). Its unit is the HG block: a chain of ``num_layers``
convolutions whose every intermediate output (and the block's input) is concatenated and squeezed back by two
1x1 convolutions, so one block sees receptive fields of every depth at once, with few, wide kernels that GPUs
run well. The first two stages use plain 3x3 convolutions; the later ones use "light" ones (a linear 1x1
convolution, then a depthwise 5x5, 3x3 in Atto), which is where most pixels have become channels. A stage after
the first starts with a strided depthwise 3x3 convolution without activation to halve the resolution, and every
block after a stage's first is residual. The stem reaches stride 4 through two paths, a 2x2 max-pool and two 2x2
convolutions, concatenated.

The small variants (B0-B3 and Atto-Pico in D-FINE's and DEIMv2's configs) scale each activation by a learnable affine
block (``use_lab``: one scalar scale and bias after the activation), which lets the optimiser re-scale a
thin network's ReLU outputs without touching BatchNorm.

Module names equal the original D-FINE / DEIMv2 ``HGNetv2`` (``stem.stem1.conv``, ``stages.{s}.blocks.{b}
.layers.{l}``, ``aggregation.{0,1}``, ``bn``, ``lab``), so their backbone files need no renaming;
transformers' ``HGNetV2Backbone`` names load through :func:`hgnetv2_state_dict_from_transformers` (table
below). Features come back as ``res{k}`` (stride ``2**k``: ``res3``, ``res4``, ``res5`` by default; ``res3``,
``res4`` for the three-stage variants, which end at stride 16), the keys and the ``out_channels`` attribute
:class:`pet.modeling.rtdetr.ResNetVd` gives its encoder, so a detector can take either backbone; ``out_strides`` names
the strides.

=========================================================  ==================================================
transformers ``HGNetV2Backbone``                           Pet (= D-FINE's ``HGNetv2``)
=========================================================  ==================================================
``embedder.stem{1,2a,2b,3,4}``                             ``stem.stem{1,2a,2b,3,4}``
``encoder.stages.{s}.downsample``                          ``stages.{s}.downsample``
``encoder.stages.{s}.blocks.{b}.layers.{l}[.conv{1,2}]``   ``stages.{s}.blocks.{b}.layers.{l}[.conv{1,2}]``
``encoder.stages.{s}.blocks.{b}.aggregation.{0,1}``        ``stages.{s}.blocks.{b}.aggregation.{0,1}``
each conv unit's ``convolution`` / ``normalization``       ``conv`` / ``bn`` (``lab`` keeps its name)
=========================================================  ==================================================
"""
from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from fvcore.common.config import CfgNode
from torch import nn
from torchvision.ops import FrozenBatchNorm2d

from pet.modeling.registry import BACKBONE_REGISTRY
from pet.modeling.rtdetr.layers import ACTIVATIONS
from pet.utils.errors import ConfigError

__all__ = ["HGNetV2", "HGNetV2Spec", "HGStageSpec", "HGNETV2_VARIANTS", "TRANSFORMERS_TO_PET",
           "hgnetv2", "hgnetv2_state_dict_from_transformers", "load_transformers_hgnetv2"]


@dataclass(frozen=True)
class HGStageSpec:
    """One stage: its channels, how many HG blocks of how many conv layers, and which kind of conv."""

    in_channels: int
    mid_channels: int
    out_channels: int
    num_blocks: int
    downsample: bool
    light_block: bool
    kernel_size: int
    num_layers: int


@dataclass(frozen=True)
class HGNetV2Spec:
    """A variant: the stem's two widths (after its first conv, at its output), its stages (four, or three for
    DEIMv2's smallest), and whether the variant's detectors use learnable affine blocks (the default of
    :class:`HGNetV2`'s ``use_lab``)."""

    stem_channels: tuple[int, int]
    stages: tuple[HGStageSpec, ...]
    use_lab: bool


def _variant(stem: tuple[int, int], rows: Sequence[tuple], use_lab: bool) -> HGNetV2Spec:
    return HGNetV2Spec(stem, tuple(HGStageSpec(*row) for row in rows), use_lab)


# D-FINE's ``HGNetv2.arch_configs`` (src/nn/backbone/hgnetv2.py; DEIMv2 repeats B0-B6 unchanged). Each row:
# in, mid, out channels, blocks, downsample, light block, kernel size, layers per block. ``use_lab`` is what
# the reference configs set: True for B0 (D-FINE-S/N, DEIMv2-N), B1, B2 (D-FINE-M), B3; absent, so False, for
# B4 (D-FINE-L), B5 (D-FINE-X), B6. transformers' ``HGNetV2Config()`` defaults are B4 with ``use_lab`` False.
# Atto, Femto and Pico are DEIMv2's (Intellindust-AI-Lab/DEIMv2, engine/backbone/hgnetv2.py): B0's stem and first two
# stages, and a third, last stage at stride 16 narrower or shallower than B0's (Atto: 256 wide, 3x3 kernels; Femto:
# B0's width and kernels, one block; Pico: B0's third stage). Their detectors read that stage alone (return_idx [2])
# and set use_lab; the authors start them from B0's ImageNet weights where the shapes agree.
HGNETV2_VARIANTS: dict[str, HGNetV2Spec] = {
    "Atto": _variant((16, 16), [(16, 16, 64, 1, False, False, 3, 3), (64, 32, 256, 1, True, False, 3, 3),
                                (256, 64, 256, 1, True, True, 3, 3)], True),
    "Femto": _variant((16, 16), [(16, 16, 64, 1, False, False, 3, 3), (64, 32, 256, 1, True, False, 3, 3),
                                 (256, 64, 512, 1, True, True, 5, 3)], True),
    "Pico": _variant((16, 16), [(16, 16, 64, 1, False, False, 3, 3), (64, 32, 256, 1, True, False, 3, 3),
                                (256, 64, 512, 2, True, True, 5, 3)], True),
    "B0": _variant((16, 16), [(16, 16, 64, 1, False, False, 3, 3), (64, 32, 256, 1, True, False, 3, 3),
                              (256, 64, 512, 2, True, True, 5, 3), (512, 128, 1024, 1, True, True, 5, 3)], True),
    "B1": _variant((24, 32), [(32, 32, 64, 1, False, False, 3, 3), (64, 48, 256, 1, True, False, 3, 3),
                              (256, 96, 512, 2, True, True, 5, 3), (512, 192, 1024, 1, True, True, 5, 3)], True),
    "B2": _variant((24, 32), [(32, 32, 96, 1, False, False, 3, 4), (96, 64, 384, 1, True, False, 3, 4),
                              (384, 128, 768, 3, True, True, 5, 4), (768, 256, 1536, 1, True, True, 5, 4)], True),
    "B3": _variant((24, 32), [(32, 32, 128, 1, False, False, 3, 5), (128, 64, 512, 1, True, False, 3, 5),
                              (512, 128, 1024, 3, True, True, 5, 5), (1024, 256, 2048, 1, True, True, 5, 5)], True),
    "B4": _variant((32, 48), [(48, 48, 128, 1, False, False, 3, 6), (128, 96, 512, 1, True, False, 3, 6),
                              (512, 192, 1024, 3, True, True, 5, 6), (1024, 384, 2048, 1, True, True, 5, 6)], False),
    "B5": _variant((32, 64), [(64, 64, 128, 1, False, False, 3, 6), (128, 128, 512, 2, True, False, 3, 6),
                              (512, 256, 1024, 5, True, True, 5, 6), (1024, 512, 2048, 2, True, True, 5, 6)], False),
    "B6": _variant((48, 96), [(96, 96, 192, 2, False, False, 3, 6), (192, 192, 512, 3, True, False, 3, 6),
                              (512, 384, 1024, 6, True, True, 5, 6), (1024, 768, 2048, 3, True, True, 5, 6)], False),
}


class LearnableAffine(nn.Module):
    """``scale * x + bias`` with one scalar each (PP-HGNetV2's "LAB"), starting as the identity."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x + self.bias


class ConvBNAct(nn.Module):
    """Convolution (no bias, "same" padding for odd kernels), BatchNorm or FrozenBN, activation, and a learnable
    affine block after the activation when ``use_lab``; a unit without activation never has one (as in the
    reference: the affine block re-scales activations, and a linear unit's BatchNorm already has an affine)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, groups: int = 1, *,
                 activation: str | None = "relu", use_lab: bool = False, frozen_bn_eps: float | None = None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, (kernel_size - 1) // 2,
                              groups=groups, bias=False)
        self.bn = (FrozenBatchNorm2d(out_channels, eps=frozen_bn_eps) if frozen_bn_eps is not None
                   else nn.BatchNorm2d(out_channels))
        self.act = ACTIVATIONS[activation]() if activation else nn.Identity()
        self.lab = LearnableAffine() if activation and use_lab else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lab(self.act(self.bn(self.conv(x))))


class LightConvBNAct(nn.Module):
    """A linear 1x1 ConvBN to the new width, then a depthwise ``kernel_size`` ConvBNAct: a wide kernel for the
    price of a 1x1 convolution."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, *, activation: str, use_lab: bool,
                 frozen_bn_eps: float | None) -> None:
        super().__init__()
        self.conv1 = ConvBNAct(in_channels, out_channels, 1, activation=None, frozen_bn_eps=frozen_bn_eps)
        self.conv2 = ConvBNAct(out_channels, out_channels, kernel_size, groups=out_channels, activation=activation,
                               use_lab=use_lab, frozen_bn_eps=frozen_bn_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.conv1(x))


class StemBlock(nn.Module):
    """Stride 4 in two paths: a strided 3x3 conv, then (a) a 2x2 max-pool and (b) two 2x2 convs, each padded by
    one pixel on the right and bottom so the size stays; (a) and (b) concatenated, a strided 3x3 and a 1x1 conv."""

    def __init__(self, mid_channels: int, out_channels: int, *, activation: str, use_lab: bool,
                 frozen_bn_eps: float | None) -> None:
        super().__init__()
        kw = {"activation": activation, "use_lab": use_lab, "frozen_bn_eps": frozen_bn_eps}
        self.stem1 = ConvBNAct(3, mid_channels, 3, 2, **kw)
        self.stem2a = ConvBNAct(mid_channels, mid_channels // 2, 2, **kw)
        self.stem2b = ConvBNAct(mid_channels // 2, mid_channels, 2, **kw)
        self.stem3 = ConvBNAct(mid_channels * 2, mid_channels, 3, 2, **kw)
        self.stem4 = ConvBNAct(mid_channels, out_channels, 1, **kw)
        self.pool = nn.MaxPool2d(kernel_size=2, stride=1, ceil_mode=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(self.stem1(x), (0, 1, 0, 1))
        convs = self.stem2b(F.pad(self.stem2a(x), (0, 1, 0, 1)))
        return self.stem4(self.stem3(torch.cat([self.pool(x), convs], dim=1)))


class HGBlock(nn.Module):
    """``num_layers`` chained convs; the input and every layer's output concatenated, squeezed to half the output
    width and expanded to it by two 1x1 ConvBNActs; plus the input when ``residual``."""

    def __init__(self, in_channels: int, spec: HGStageSpec, residual: bool, *, activation: str, use_lab: bool,
                 frozen_bn_eps: float | None) -> None:
        super().__init__()
        kw = {"activation": activation, "use_lab": use_lab, "frozen_bn_eps": frozen_bn_eps}
        self.residual = residual
        self.layers = nn.ModuleList()
        for i in range(spec.num_layers):
            width = in_channels if i == 0 else spec.mid_channels
            self.layers.append(LightConvBNAct(width, spec.mid_channels, spec.kernel_size, **kw) if spec.light_block
                               else ConvBNAct(width, spec.mid_channels, spec.kernel_size, **kw))
        total = in_channels + spec.num_layers * spec.mid_channels
        self.aggregation = nn.Sequential(ConvBNAct(total, spec.out_channels // 2, 1, **kw),
                                         ConvBNAct(spec.out_channels // 2, spec.out_channels, 1, **kw))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = [x]
        for layer in self.layers:
            outputs.append(layer(outputs[-1]))
        y = self.aggregation(torch.cat(outputs, dim=1))
        return y + x if self.residual else y


class HGStage(nn.Module):
    """An optional stride-2 depthwise 3x3 ConvBN (linear, so no affine block), then ``num_blocks`` HG blocks,
    all but the first residual."""

    def __init__(self, spec: HGStageSpec, *, activation: str, use_lab: bool, frozen_bn_eps: float | None) -> None:
        super().__init__()
        self.downsample = (ConvBNAct(spec.in_channels, spec.in_channels, 3, 2, groups=spec.in_channels,
                                     activation=None, frozen_bn_eps=frozen_bn_eps)
                           if spec.downsample else nn.Identity())
        kw = {"activation": activation, "use_lab": use_lab, "frozen_bn_eps": frozen_bn_eps}
        self.blocks = nn.Sequential(*(HGBlock(spec.in_channels if i == 0 else spec.out_channels, spec, i > 0, **kw)
                                      for i in range(spec.num_blocks)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


class HGNetV2(nn.Module):
    """Stem (stride 4) and four stages (strides 4, 8, 16, 32; three, to stride 16, for Atto, Femto, Pico); returns
    the stages in ``return_stages`` (0-based, D-FINE's ``return_idx``) as an ordered dict ``res{k}`` -> features of
    stride ``2**k``.

    ``name``: a variant of :data:`HGNETV2_VARIANTS`. ``use_lab``: learnable affine blocks, None for the variant's
    reference setting. ``return_stages``: None for every stage from stride 8 on (D-FINE's [1, 2, 3]; [1, 2] for a
    three-stage variant). ``frozen_bn_eps``: FrozenBN with that eps (pre-trained weights, D-FINE's ``freeze_norm``),
    None for trainable BatchNorm. Stages after the last returned one are built (their weights load) but not run.
    """

    def __init__(self, name: str = "B4", *, use_lab: bool | None = None, return_stages: Sequence[int] | None = None,
                 activation: str = "relu", frozen_bn_eps: float | None = 1e-5) -> None:
        super().__init__()
        if name not in HGNETV2_VARIANTS:
            raise ConfigError(f"'{name}' is not an HGNetv2 variant: one of {', '.join(HGNETV2_VARIANTS)}")
        if activation not in ACTIVATIONS:
            raise ConfigError(f"HGNetv2 activation '{activation}' is not one of {', '.join(ACTIVATIONS)}")
        spec = HGNETV2_VARIANTS[name]
        if return_stages is None:
            return_stages = range(1, len(spec.stages))
        self.return_stages = sorted(set(return_stages))
        if not self.return_stages or not all(0 <= i < len(spec.stages) for i in self.return_stages):
            raise ConfigError(f"HGNetv2 return_stages {list(return_stages)} must name stages 0..{len(spec.stages) - 1}")
        self.variant = name
        self.use_lab = spec.use_lab if use_lab is None else use_lab
        kw = {"activation": activation, "use_lab": self.use_lab, "frozen_bn_eps": frozen_bn_eps}
        self.stem = StemBlock(*spec.stem_channels, **kw)
        self.stages = nn.ModuleList(HGStage(stage, **kw) for stage in spec.stages)
        strides = [4 * 2 ** sum(s.downsample for s in spec.stages[:i + 1]) for i in range(len(spec.stages))]
        self.out_strides = [strides[i] for i in self.return_stages]
        self.out_channels = [spec.stages[i].out_channels for i in self.return_stages]
        self.out_features = [f"res{stride.bit_length() - 1}" for stride in self.out_strides]

    def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        x = self.stem(x)
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        names = dict(zip(self.return_stages, self.out_features))
        for i, stage in enumerate(self.stages[:self.return_stages[-1] + 1]):
            x = stage(x)
            if i in names:
                out[names[i]] = x
        return out


@BACKBONE_REGISTRY.register()
def hgnetv2(cfg: CfgNode) -> HGNetV2:
    """``MODEL.BACKBONE.NAME`` (B0-B6, Atto, Femto, Pico) as an HGNetv2 returning res3-res5 (res3, res4 for the
    three-stage variants), with the variant's reference ``use_lab``; ``NORM`` FrozenBN or BN; ``FREEZE_AT`` > 0
    freezes the stem and ``FREEZE_AT - 1`` stages (as ``resnet_vd``; D-FINE's ``freeze_at: 0`` with
    ``freeze_stem_only`` is ``FREEZE_AT 1`` here)."""
    backbone = cfg.MODEL.BACKBONE
    if backbone.NORM not in ("FrozenBN", "BN"):
        raise ConfigError(f"MODEL.BACKBONE.NORM '{backbone.NORM}' is not one hgnetv2 has: FrozenBN or BN")
    if backbone.NAME not in HGNETV2_VARIANTS:
        raise ConfigError(f"MODEL.BACKBONE.NAME '{backbone.NAME}' is not an HGNetv2 variant: "
                          f"one of {', '.join(HGNETV2_VARIANTS)}")
    model = HGNetV2(backbone.NAME, frozen_bn_eps=backbone.FROZEN_BN_EPS if backbone.NORM == "FrozenBN" else None)
    frozen = ([model.stem] if backbone.FREEZE_AT > 0 else []) + list(model.stages[:max(backbone.FREEZE_AT - 1, 0)])
    for module in frozen:
        module.requires_grad_(False)
    return model


# transformers' module path -> Pet's (full match), the table in the module docstring. The last two components of
# every key (the conv unit and its tensor) go through _UNIT_TENSORS.
TRANSFORMERS_TO_PET: list[tuple[str, str]] = [
    (r"embedder\.(stem1|stem2a|stem2b|stem3|stem4)", r"stem.\1"),
    (r"encoder\.stages\.(\d+)\.downsample", r"stages.\1.downsample"),
    (r"encoder\.stages\.(\d+)\.blocks\.(\d+)\.layers\.(\d+)(\.conv[12])?", r"stages.\1.blocks.\2.layers.\3\4"),
    (r"encoder\.stages\.(\d+)\.blocks\.(\d+)\.aggregation\.([01])", r"stages.\1.blocks.\2.aggregation.\3"),
]
_RULES = [(re.compile(pattern), replacement) for pattern, replacement in TRANSFORMERS_TO_PET]
_UNIT_TENSORS = {"convolution.weight": "conv.weight", "lab.scale": "lab.scale", "lab.bias": "lab.bias",
                 **{f"normalization.{t}": f"bn.{t}"
                    for t in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")}}


def _pet_name(key: str) -> str | None:
    parts = key.rsplit(".", 2)
    if len(parts) != 3 or f"{parts[1]}.{parts[2]}" not in _UNIT_TENSORS:
        return None
    for pattern, replacement in _RULES:
        match = pattern.fullmatch(parts[0])
        if match:
            return f"{match.expand(replacement)}.{_UNIT_TENSORS[parts[1] + '.' + parts[2]]}"
    return None


def _listed(keys: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(keys[:limit])
    return f"{shown}, ... ({len(keys)} in all)" if len(keys) > limit else shown


def hgnetv2_state_dict_from_transformers(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' ``HGNetV2Backbone.state_dict()`` renamed to :class:`HGNetV2`'s names. Strict: a key no rule
    of :data:`TRANSFORMERS_TO_PET` maps raises a :class:`ConfigError` naming it, so nothing is dropped unseen
    (a D-FINE checkpoint's ``model.backbone.model.`` prefix must be stripped first)."""
    out, unmapped = {}, []
    for key, value in state.items():
        name = _pet_name(key)
        if name is None:
            unmapped.append(key)
        else:
            out[name] = value
    if unmapped:
        raise ConfigError(f"{len(unmapped)} tensors of the transformers HGNetV2 state_dict have no Pet name: "
                          f"{_listed(unmapped)} (expected HGNetV2Backbone's embedder.* and encoder.stages.*)")
    return out


def load_transformers_hgnetv2(model: HGNetV2, state: Mapping[str, torch.Tensor]) -> None:
    """Load transformers' ``HGNetV2Backbone`` weights into ``model``, strictly: every tensor renamed, every one of
    the model's filled, shapes equal, or a :class:`ConfigError` naming what differs (typically another variant,
    or ``use_lab`` set differently). BatchNorm's ``num_batches_tracked`` counters are dropped when the model has
    FrozenBN, which has none (they count training steps and change no output)."""
    renamed = hgnetv2_state_dict_from_transformers(state)
    expected = model.state_dict()
    renamed = {k: v for k, v in renamed.items() if k in expected or not k.endswith(".num_batches_tracked")}
    missing = [k for k in expected if k not in renamed]
    unexpected = [k for k in renamed if k not in expected]
    shapes = [f"{k} {tuple(renamed[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items()
              if k in renamed and renamed[k].shape != v.shape]
    problems = [f"{what}: {_listed(keys)}" for what, keys in
                (("missing", missing), ("unexpected", unexpected), ("shape (file vs model)", shapes)) if keys]
    if problems:
        raise ConfigError(f"transformers HGNetV2 weights do not fit HGNetv2-{model.variant} "
                          f"(use_lab={model.use_lab}): " + "; ".join(problems))
    model.load_state_dict(renamed, strict=True)
