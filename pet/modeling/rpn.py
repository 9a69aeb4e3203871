"""Region proposal network from ``MODEL.RPN``: torchvision's RPN with Pet's config and a head
chosen from ``RPN_HEAD_REGISTRY`` by ``MODEL.RPN.HEAD_NAME`` (torchvision's ``RPNHead`` by default)."""
from __future__ import annotations

import torch
from fvcore.common.config import CfgNode
from torchvision.models.detection import rpn as tv_rpn

from pet.modeling.anchors import build_anchor_generator
from pet.modeling.registry import RPN_HEAD_REGISTRY
from pet.utils.tensor import at_least_float32

__all__ = ["RPNHead", "build_rpn"]


@RPN_HEAD_REGISTRY.register()
class RPNHead(tv_rpn.RPNHead):
    """torchvision's RPN head (same parameters: ``conv``, ``cls_logits``, ``bbox_pred``) whose outputs
    are always float32.

    Under bfloat16 autocast the box deltas would otherwise be decoded in bfloat16, which
    rounds proposal coordinates to whole pixels (or coarser) before the RoI head sees them.
    It has nothing to configure: ``cfg`` is there for the registry's call signature.
    """

    def __init__(self, cfg: CfgNode, in_channels: int, num_anchors: int) -> None:
        super().__init__(in_channels, num_anchors)

    def forward(self, x: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        logits, deltas = super().forward(x)
        return [at_least_float32(t) for t in logits], [at_least_float32(t) for t in deltas]


def build_rpn(cfg: CfgNode, in_channels: int, num_levels: int) -> tv_rpn.RegionProposalNetwork:
    """The RPN over ``num_levels`` feature maps of ``in_channels`` channels each."""
    rpn = cfg.MODEL.RPN
    anchors = build_anchor_generator(rpn.ANCHOR_SIZES, rpn.ASPECT_RATIOS, num_levels, "MODEL.RPN.ANCHOR_SIZES")
    return tv_rpn.RegionProposalNetwork(
        anchors,
        RPN_HEAD_REGISTRY.get(rpn.HEAD_NAME)(cfg, in_channels, anchors.num_anchors_per_location()[0]),
        fg_iou_thresh=rpn.FG_IOU_THRESH,
        bg_iou_thresh=rpn.BG_IOU_THRESH,
        batch_size_per_image=rpn.BATCH_SIZE_PER_IMAGE,
        positive_fraction=rpn.POSITIVE_FRACTION,
        pre_nms_top_n={"training": rpn.PRE_NMS_TOPK_TRAIN, "testing": rpn.PRE_NMS_TOPK_TEST},
        post_nms_top_n={"training": rpn.POST_NMS_TOPK_TRAIN, "testing": rpn.POST_NMS_TOPK_TEST},
        nms_thresh=rpn.NMS_THRESH,
    )
