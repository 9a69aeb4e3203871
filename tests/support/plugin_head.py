"""A box head that lives outside Pet and brings its own config key: what a researcher's plugin looks like.

Named in YAML by dotted path (``MODEL.ROI_BOX_HEAD.NAME: support.plugin_head.ScaledBoxHead``), this
module is imported while the config loads, and :func:`add_config` adds ``MODEL.SCALED_BOX_HEAD``
to the defaults before the YAML is merged. Nothing in pet/ knows about it.
"""
from __future__ import annotations

import torch
from fvcore.common.config import CfgNode

from pet.modeling.roi_heads import TwoMLPHead


def add_config(cfg: CfgNode) -> None:
    cfg.MODEL.SCALED_BOX_HEAD = CfgNode()
    # Multiplies the head's features (a stand-in for whatever a real new head would configure).
    cfg.MODEL.SCALED_BOX_HEAD.SCALE = 1.0


class ScaledBoxHead(TwoMLPHead):
    def __init__(self, cfg: CfgNode, in_channels: int) -> None:
        super().__init__(cfg, in_channels)
        self.scale = cfg.MODEL.SCALED_BOX_HEAD.SCALE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale
