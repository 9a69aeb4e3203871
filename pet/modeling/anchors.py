"""torchvision's AnchorGenerator from config sizes, checked against the backbone's levels.

The RPN (``MODEL.RPN``) and RetinaNet (``MODEL.RETINANET``) both give one list of anchor
sizes per FPN level; a wrong count would otherwise fail deep inside torchvision with a
message about zipping lists.
"""
from __future__ import annotations

from collections.abc import Sequence

from torchvision.models.detection.anchor_utils import AnchorGenerator

from pet.utils.errors import ConfigError

__all__ = ["build_anchor_generator"]


def build_anchor_generator(
    sizes: Sequence[Sequence[int]], aspect_ratios: Sequence[float], num_levels: int, key: str
) -> AnchorGenerator:
    """Anchors of ``sizes[i]`` x ``aspect_ratios`` on level i of ``num_levels``; ``key`` names the
    config entry of ``sizes`` in errors (e.g. ``MODEL.RPN.ANCHOR_SIZES``)."""
    if len(sizes) != num_levels:
        raise ConfigError(
            f"{key} has {len(sizes)} entries but the backbone gives {num_levels} feature levels: "
            f"give one list of sizes per level, e.g. {[[32 * 2**i] for i in range(num_levels)]}"
        )
    levels = tuple(tuple(level) for level in sizes)
    if len({len(level) for level in levels}) != 1:
        raise ConfigError(f"{key}: every level needs the same number of sizes, got {levels}")
    return AnchorGenerator(levels, (tuple(aspect_ratios),) * num_levels)
