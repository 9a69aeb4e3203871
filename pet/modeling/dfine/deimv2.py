"""DEIMv2 (Huang et al., "Real-Time Object Detection Meets DINOv3", 2025) on HGNetv2, in Pet's batch contract.

D-FINE with DEIM's training and lighter parts: the encoder fuses two maps by their sum in RepNCSPELAN5 blocks
(:class:`pet.modeling.dfine.encoder.Deimv2HybridEncoder`; for Atto / Femto / Pico, on three-stage HGNetv2s, the Lite
encoder, :class:`pet.modeling.dfine.lite_encoder.LiteEncoder`, ``MODEL.DFINE.ENCODER lite``); the decoder layers
normalise with RMSNorm and feed forward through SwiGLU, the query position head has three layers; the matchability-aware
loss (MAL) replaces the varifocal one, and dense one-to-one matching (the union of every layer's matches) supervises the
boxes and distributions (:mod:`pet.modeling.dfine.deimv2_criterion`). Equal to transformers'
``Deimv2ForObjectDetection`` for the same weights and pixels (tests/modeling/test_deimv2_parity.py); its ``state_dict``
loads through :func:`convert_transformers_state_dict` below. The DINOv3 variants are not in Pet.

Named by its path, ``MODEL.META_ARCHITECTURE: pet.modeling.dfine.DEIMV2``; its keys are D-FINE's, ``MODEL.DFINE``, and
the few marked DEIMv2 only (:mod:`pet.modeling.dfine.config`).
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from fvcore.common.config import CfgNode
from torch import nn

from pet.modeling.build import META_ARCH_REGISTRY
from pet.modeling.dfine.deimv2_criterion import Deimv2Criterion
from pet.modeling.dfine.detector import DFINE
from pet.modeling.dfine.encoder import Deimv2HybridEncoder
from pet.modeling.dfine.lite_encoder import LiteEncoder
from pet.modeling.dfine.weights import TRANSFORMERS_TO_PET as DFINE_TO_PET
from pet.modeling.dfine.weights import convert_transformers_state_dict as convert_dfine_state_dict
from pet.modeling.state_dict_names import convert_state_dict
from pet.utils.errors import ConfigError

__all__ = ["DEIMV2", "TRANSFORMERS_TO_PET", "convert_transformers_state_dict"]

_BACKBONE = "model.conv_encoder.model."
_LAYER = r"model\.decoder\.layers\.(\d+)\."
# transformers' DEIMv2 names -> Pet's, before D-FINE's table (pet.modeling.dfine.weights), which takes the rest. Its
# files name tensors as its modules do. The hybrid encoder's fusion blocks are fpn_blocks.{i} / pan_blocks.{i}, the
# Lite encoder's fpn_block / pan_block (its other modules keep their names under D-FINE's model.encoder. rule, and
# its model.conv_encoder.encoder_input_proj are identities, without tensors).
TRANSFORMERS_TO_PET: list[tuple[str, str]] = [
    (r"model\.conv_encoder\.encoder_input_proj\.(\d+)\.", r"encoder.input_proj.\1."),
    (r"model\.encoder\.((?:fpn|pan)_block(?:s\.\d+)?)\.csp_rep([12])\.bottlenecks\.",
     r"encoder.\1.csp_rep\2.blocks."),
    (_LAYER + r"encoder_attn_layer_norm\.", r"decoder.layers.\1.norm2."),
    (_LAYER + r"mlp\.", r"decoder.layers.\1.ffn."),
    *DFINE_TO_PET,
]
_RULES = [(re.compile(pattern), replacement) for pattern, replacement in TRANSFORMERS_TO_PET]


def is_transformers_state_dict(state: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``state`` has transformers' DEIMv2 names (its HGNetv2 backbone's stem is there)."""
    return any(k.startswith(_BACKBONE + "embedder.") for k in state)


def convert_transformers_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` under Pet's names, as D-FINE's are converted
    (:func:`pet.modeling.dfine.weights.convert_transformers_state_dict`) but for the backbone's prefix and the rules
    above."""
    return convert_dfine_state_dict(state, backbone_prefix=_BACKBONE, rules=_RULES)


@META_ARCH_REGISTRY.register()
class DEIMV2(DFINE):
    """``forward(images, targets)`` as :class:`pet.modeling.dfine.DFINE`."""

    # MODEL.DFINE.ENCODER's values: transformers' Deimv2Config.encoder_type's.
    encoders = ("hybrid", "lite")

    @staticmethod
    def build_encoder(node: CfgNode, in_channels: list[int]) -> nn.Module:
        """``MODEL.DFINE.ENCODER``: the hybrid encoder on the backbone levels of ``in_channels`` (the last
        ``NUM_LEVELS``), or the Lite encoder on the last of them."""
        if node.ENCODER == "lite":
            if node.NUM_LEVELS != 2:
                raise ConfigError(f"MODEL.DFINE.NUM_LEVELS {node.NUM_LEVELS}: the lite encoder gives the decoder two "
                                  "levels (the backbone's last, stride 16, and one pooled from it); set 2.")
            return LiteEncoder(in_channels[-1], node.HIDDEN_DIM, expansion=node.EXPANSION,
                               depth_mult=node.DEPTH_MULT, trailing_conv=node.TRAILING_CONV)
        return Deimv2HybridEncoder(in_channels, node.HIDDEN_DIM, num_heads=node.ENCODER_HEADS,
                                   ffn_dim=node.ENCODER_FFN_DIM, num_layers=node.ENCODER_LAYERS,
                                   expansion=node.EXPANSION, depth_mult=node.DEPTH_MULT,
                                   trailing_conv=node.TRAILING_CONV)

    @staticmethod
    def decoder_options(node: CfgNode) -> dict:
        return {"norm": "rms", "ffn": "swiglu", "gateway": node.GATEWAY, "query_pos_layers": 3,
                "query_pos_activation": node.QUERY_POS_ACTIVATION, "share_box_head": node.SHARE_BOX_HEAD}

    def build_criterion(self, cfg: CfgNode) -> nn.Module:
        return Deimv2Criterion(cfg, self.num_classes)

    @staticmethod
    def convert_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' DEIMv2 names to Pet's (:data:`TRANSFORMERS_TO_PET`); anything else as other models."""
        if is_transformers_state_dict(state):
            return convert_transformers_state_dict(state)
        return convert_state_dict(state)
