"""Region proposal network from ``MODEL.RPN``: torchvision's RPN with Pet's config."""
from __future__ import annotations

import torch
from fvcore.common.config import CfgNode
from torchvision.models.detection import rpn as tv_rpn
from torchvision.models.detection.anchor_utils import AnchorGenerator

from pet.utils.errors import ConfigError

__all__ = ["RPNHead", "build_rpn"]


class RPNHead(tv_rpn.RPNHead):
    """torchvision's RPN head (same parameters) whose outputs are always float32.

    Under bfloat16 autocast the box deltas would otherwise be decoded in bfloat16, which
    rounds proposal coordinates to whole pixels (or coarser) before the RoI head sees them.
    """

    def forward(self, x: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        logits, deltas = super().forward(x)
        return [t.float() for t in logits], [t.float() for t in deltas]


def build_rpn(cfg: CfgNode, in_channels: int, num_levels: int) -> tv_rpn.RegionProposalNetwork:
    """The RPN over ``num_levels`` feature maps of ``in_channels`` channels each."""
    rpn = cfg.MODEL.RPN
    if len(rpn.ANCHOR_SIZES) != num_levels:
        raise ConfigError(
            f"MODEL.RPN.ANCHOR_SIZES has {len(rpn.ANCHOR_SIZES)} entries but the backbone gives {num_levels} "
            f"feature levels: give one list of sizes per level, e.g. {[[32 * 2**i] for i in range(num_levels)]}"
        )
    sizes = tuple(tuple(level) for level in rpn.ANCHOR_SIZES)
    if len({len(level) for level in sizes}) != 1:
        raise ConfigError(f"MODEL.RPN.ANCHOR_SIZES: every level needs the same number of sizes, got {sizes}")
    anchors = AnchorGenerator(sizes, (tuple(rpn.ASPECT_RATIOS),) * num_levels)
    return tv_rpn.RegionProposalNetwork(
        anchors,
        RPNHead(in_channels, anchors.num_anchors_per_location()[0]),
        fg_iou_thresh=rpn.FG_IOU_THRESH,
        bg_iou_thresh=rpn.BG_IOU_THRESH,
        batch_size_per_image=rpn.BATCH_SIZE_PER_IMAGE,
        positive_fraction=rpn.POSITIVE_FRACTION,
        pre_nms_top_n={"training": rpn.PRE_NMS_TOPK_TRAIN, "testing": rpn.PRE_NMS_TOPK_TEST},
        post_nms_top_n={"training": rpn.POST_NMS_TOPK_TRAIN, "testing": rpn.POST_NMS_TOPK_TEST},
        nms_thresh=rpn.NMS_THRESH,
    )
