"""A training transform from outside Pet, named in INPUT.AUGMENTATIONS by its dotted path."""
from __future__ import annotations

from typing import Any

import torch
from torchvision import tv_tensors


class Invert:
    """Inverts the pixels with probability ``p`` (drawn from torch's generator, as Pet's pipeline seeds it)."""

    def __init__(self, p: float = 1.0) -> None:
        self.p = p

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        if torch.rand(1) >= self.p:
            return sample
        return {**sample, "image": tv_tensors.wrap(255 - sample["image"], like=sample["image"])}
