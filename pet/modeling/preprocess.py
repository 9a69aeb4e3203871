"""What every detector does to a batch before its backbone sees it.

Pet's data loader already resized and padded the images (see the batch contract), so
unlike torchvision's ``GeneralizedRCNNTransform`` nothing here resizes: the model only
turns uint8 pixels into normalised floats, in the memory format its convolutions run
fastest in.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from fvcore.common.config import CfgNode

__all__ = ["Normalizer", "image_sizes"]


class Normalizer(torch.nn.Module):
    """uint8 RGB ``[B, 3, H, W]`` -> ``(x - MODEL.PIXEL_MEAN) / MODEL.PIXEL_STD`` as float32.

    Mean and std are on the 0-255 scale (torchvision's 0-1 values times 255). The padding
    beyond each image's ``image_size`` is set to 0 after normalising, as torchvision and
    detectron2 pad normalised images (uint8 zeros would become ``-mean / std``). With
    ``MODEL.CHANNELS_LAST`` the result is channels-last, which the model's convolution
    weights also are: on CPU that makes the backward pass several times faster.
    """

    def __init__(self, cfg: CfgNode) -> None:
        super().__init__()
        # Normalised on the 0-1 scale, in torchvision's order of operations: the same uint8 input
        # then gives bit-identical floats, which torchvision parity relies on.
        mean = torch.tensor([v / 255 for v in cfg.MODEL.PIXEL_MEAN])
        std = torch.tensor([v / 255 for v in cfg.MODEL.PIXEL_STD])
        # Not saved in checkpoints: they come from the config, which is the source of truth.
        self.register_buffer("mean", mean.view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", std.view(1, -1, 1, 1), persistent=False)
        self.channels_last = bool(cfg.MODEL.CHANNELS_LAST)

    def forward(self, images: torch.Tensor, sizes: Sequence[tuple[int, int]]) -> torch.Tensor:
        x = (images.to(self.mean.dtype) / 255 - self.mean) / self.std
        for i, (h, w) in enumerate(sizes):
            x[i, :, h:] = 0
            x[i, :, :h, w:] = 0
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x


def image_sizes(targets: Sequence[dict[str, Any]]) -> list[tuple[int, int]]:
    """``(h, w)`` of each image before padding, from ``targets[i]["image_size"]``."""
    return [(int(t["image_size"][0]), int(t["image_size"][1])) for t in targets]
