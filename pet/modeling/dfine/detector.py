"""D-FINE (Peng et al., "D-FINE: Redefine Regression Task in DETRs as Fine-grained Distribution Refinement",
ICLR 2025) in Pet's batch contract.

HGNetv2 backbone -> D-FINE's hybrid encoder -> RT-DETR's query selection and denoising -> a decoder whose layers
refine each box edge's distribution around a fixed anchor (:mod:`pet.modeling.dfine.decoder`), trained with
RT-DETR's losses plus fine-grained localization and distillation from the last layer to the earlier ones
(:mod:`pet.modeling.dfine.criterion`). No NMS: the test-time output is the top-scoring (query, class) pairs, as
RT-DETR's. Equal to transformers' ``DFineForObjectDetection`` for the same weights and pixels
(tests/modeling/test_dfine_parity.py); its ``state_dict`` loads through :mod:`pet.modeling.dfine.weights`.

Named by its path in a config (``MODEL.META_ARCHITECTURE: pet.modeling.dfine.DFINE``), which also adds its keys,
``MODEL.DFINE`` (:mod:`pet.modeling.dfine.config`).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from fvcore.common.config import CfgNode
from torch import nn

from pet.modeling.build import META_ARCH_REGISTRY
from pet.modeling.dfine.criterion import DFineCriterion
from pet.modeling.dfine.decoder import DFineDecoder
from pet.modeling.dfine.encoder import DFineHybridEncoder, csp_depth
from pet.modeling.dfine.weights import convert_transformers_state_dict, is_transformers_state_dict
from pet.modeling.rtdetr.detector import QueryDetector
from pet.modeling.rtdetr.encoder import HybridEncoder
from pet.modeling.rtdetr.queries import ContrastiveDenoising
from pet.modeling.state_dict_names import convert_state_dict
from pet.utils.errors import ConfigError

__all__ = ["DFINE"]


@META_ARCH_REGISTRY.register()
class DFINE(QueryDetector):
    """``forward(images, targets)`` as :class:`pet.modeling.RTDETR`: training returns the loss terms, eval per-image
    ``boxes`` / ``scores`` / ``labels`` (1..NUM_CLASSES) in original-image pixels. Test-time timers: ``backbone``,
    ``encoder``, ``decoder`` (query selection included) and ``postprocess``."""

    score_thresh_key = "MODEL.DFINE.SCORE_THRESH_TEST"
    # MODEL.DFINE.ENCODER's values (built by build_encoder): D-FINE's own hybrid encoder, or RT-DETR's (CSP-RepVGG
    # fusion blocks, strided 3x3 downsampling), an ablation of what D-FINE's lighter encoder parts change.
    encoders = ("hybrid", "rtdetr")

    def __init__(self, cfg: CfgNode) -> None:
        if "DFINE" not in cfg.MODEL:
            name = type(self).__name__
            raise ConfigError(f"MODEL.DFINE is missing: name {name} by its path, MODEL.META_ARCHITECTURE "
                              f"pet.modeling.dfine.{name}, so that its config keys are added (or call "
                              "pet.modeling.dfine.add_config(cfg) before setting them).")
        super().__init__(cfg, "DFINE")
        node = cfg.MODEL.DFINE
        levels = list(self.backbone.out_channels)
        if not 1 < node.NUM_LEVELS <= len(levels):
            raise ConfigError(f"MODEL.DFINE.NUM_LEVELS {node.NUM_LEVELS}: the backbone returns {len(levels)} levels; "
                              f"{type(self).__name__} uses the last 2 or 3 of them.")
        points = list(node.DECODER_POINTS)
        if len(points) != node.NUM_LEVELS:
            raise ConfigError(f"MODEL.DFINE.DECODER_POINTS {points} needs one number of sampling points per level "
                              f"(MODEL.DFINE.NUM_LEVELS {node.NUM_LEVELS}).")
        if node.ENCODER not in self.encoders:
            raise ConfigError(f"MODEL.DFINE.ENCODER {node.ENCODER!r} is not one of {', '.join(self.encoders)}.")
        self.encoder = self.build_encoder(node, levels[-node.NUM_LEVELS:])
        denoising = ContrastiveDenoising(node.DECODER_DIM, self.num_classes, node.NUM_DENOISING,
                                         node.LABEL_NOISE_RATIO, node.BOX_NOISE_SCALE)
        self.decoder = DFineDecoder(node.HIDDEN_DIM, node.DECODER_DIM, self.num_classes, num_queries=node.NUM_QUERIES,
                                    num_layers=node.DECODER_LAYERS, num_heads=node.DECODER_HEADS,
                                    ffn_dim=node.DECODER_FFN_DIM, points=points, offset_scale=node.OFFSET_SCALE,
                                    num_bins=node.NUM_BINS, reg_scale=node.REG_SCALE, up=node.UP,
                                    lqe_topk=node.LQE_TOPK, lqe_hidden_dim=node.LQE_HIDDEN_DIM,
                                    lqe_layers=node.LQE_LAYERS, denoising=denoising, **self.decoder_options(node))
        self.criterion = self.build_criterion(cfg)
        if cfg.MODEL.CHANNELS_LAST:
            self.to(memory_format=torch.channels_last)

    @staticmethod
    def build_encoder(node: CfgNode, in_channels: list[int]) -> nn.Module:
        """``MODEL.DFINE.ENCODER``: D-FINE's hybrid encoder on the backbone levels of ``in_channels``, or RT-DETR's
        with ``round(3 * DEPTH_MULT)`` RepVGG blocks of ``EXPANSION * HIDDEN_DIM`` channels in each fusion block."""
        if node.ENCODER == "rtdetr":
            return HybridEncoder(in_channels, node.HIDDEN_DIM, num_heads=node.ENCODER_HEADS,
                                 ffn_dim=node.ENCODER_FFN_DIM, num_layers=node.ENCODER_LAYERS,
                                 num_blocks=csp_depth(node.DEPTH_MULT), expansion=node.EXPANSION)
        return DFineHybridEncoder(in_channels, node.HIDDEN_DIM, num_heads=node.ENCODER_HEADS,
                                  ffn_dim=node.ENCODER_FFN_DIM, num_layers=node.ENCODER_LAYERS,
                                  expansion=node.EXPANSION, depth_mult=node.DEPTH_MULT)

    @staticmethod
    def decoder_options(node: CfgNode) -> dict:
        """What the decoder's layers and heads are made of beyond their sizes (D-FINE's: the defaults)."""
        return {}

    def build_criterion(self, cfg: CfgNode) -> nn.Module:
        return DFineCriterion(cfg, self.num_classes)

    @staticmethod
    def convert_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' D-FINE names to Pet's (:mod:`pet.modeling.dfine.weights`); anything else as other models."""
        if is_transformers_state_dict(state):
            return convert_transformers_state_dict(state)
        return convert_state_dict(state)
