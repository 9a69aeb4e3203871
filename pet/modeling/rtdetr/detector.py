"""RT-DETR (Zhao et al., "DETRs Beat YOLOs on Real-time Object Detection", CVPR 2024) in Pet's batch contract.

ResNet-vd backbone -> hybrid encoder -> query selection -> decoder with deformable attention; one prediction
per query, matched one-to-one to the objects in training, so there is no NMS: the test-time output is the
top-scoring (query, class) pairs. Equal to transformers' ``RTDetrForObjectDetection`` for the same weights and
pixels (tests/modeling/test_rtdetr_parity.py); its ``state_dict`` loads through :mod:`pet.modeling.rtdetr.weights`.

Boxes are predicted as (cx, cy, w, h) in [0, 1] of the padded input tensor (the reference resizes every image
to a square without padding, where the two coincide); targets are normalised the same way.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from fvcore.common.config import CfgNode
from torchvision.ops import box_convert

from pet.modeling.backbone import build_backbone
from pet.modeling.build import META_ARCH_REGISTRY
from pet.modeling.detector import Detector
from pet.modeling.postprocess import detections_to_original
from pet.modeling.preprocess import Normalizer, image_sizes
from pet.modeling.rtdetr.criterion import RTDETRCriterion
from pet.modeling.rtdetr.decoder import RTDETRDecoder
from pet.modeling.rtdetr.encoder import HybridEncoder
from pet.modeling.rtdetr.matcher import build_matcher
from pet.modeling.rtdetr.queries import ContrastiveDenoising
from pet.modeling.rtdetr.weights import convert_transformers_state_dict, is_transformers_state_dict
from pet.modeling.state_dict_names import convert_state_dict
from pet.utils.errors import ConfigError
from pet.utils.timers import timed

__all__ = ["QueryDetector", "RTDETR", "normalised_targets"]


class QueryDetector(Detector):
    """What RT-DETR and its successors (:class:`pet.modeling.dfine.DFINE`) share: the backbone, the batch contract,
    the training targets and the top-k test-time output. A subclass's ``__init__`` calls this one with its config
    node, then builds ``encoder`` (backbone levels -> fused maps), ``decoder`` (maps -> per-layer ``logits`` /
    ``boxes``, the last used at test time), ``matcher`` and ``criterion`` (``(decoder outputs, targets, matcher)
    -> losses``)."""

    # The class heads (and the denoising label embedding) have one row per class.
    class_dependent_prefixes: tuple[str, ...] = ("decoder.class_heads.", "decoder.query_selection.score_head.",
                                                 "decoder.denoising.label_embed.")
    # The encoder doubles the stride-32 map and concatenates it with the stride-16 one (and so on down to stride 8):
    # the padded height and width must divide by 32 (INPUT.SIZE_DIVISIBILITY, and the export's sizes).
    size_multiple = 32

    def __init__(self, cfg: CfgNode, node_name: str) -> None:
        super().__init__()
        node = cfg.MODEL[node_name]
        divisibility = cfg.INPUT.SIZE_DIVISIBILITY
        if divisibility <= 0 or divisibility % self.size_multiple:
            raise ConfigError(f"{type(self).__name__} needs INPUT.SIZE_DIVISIBILITY a multiple of "
                              f"{self.size_multiple}, got {divisibility}: its encoder doubles the stride-32 map onto "
                              f"the stride-16 one, so every padded batch must divide by {self.size_multiple}. Set "
                              f"INPUT.SIZE_DIVISIBILITY {self.size_multiple}.")
        self.num_classes = cfg.MODEL.NUM_CLASSES
        self.detections_per_img = node.DETECTIONS_PER_IMAGE
        self.score_thresh = node.SCORE_THRESH_TEST
        self.normalizer = Normalizer(cfg)
        self.backbone = build_backbone(cfg)
        self.matcher = build_matcher(cfg, node_name)

    def forward(self, images: torch.Tensor, targets: list[dict[str, Any]]
                ) -> dict[str, torch.Tensor] | list[dict[str, torch.Tensor]]:
        return self._forward(images, targets, to_original=True)

    def network_detections(self, images: torch.Tensor, targets: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return self._forward(images, targets, to_original=False)

    def _forward(self, images: torch.Tensor, targets: list[dict[str, Any]], to_original: bool) -> Any:
        sizes = image_sizes(targets)
        x = self.normalizer(images, sizes)
        height, width = x.shape[-2:]
        with timed("backbone"):
            features = list(self.backbone(x).values())
        with timed("encoder"):
            features = self.encoder(features)
        if self.training:
            gt = [normalised_targets(t, height, width, x.dtype) for t in targets]
            outputs = self.decoder(features, gt)
            # The losses outside autocast, on float32 outputs, as the RT-DETR and D-FINE authors' training loops
            # compute them: matching costs, box distances and D-FINE's softmax over bins lose too much in bfloat16
            # (its distillation loss, a KL divergence, came out negative; docs/benchmarks/dfine.md has the AP).
            with torch.autocast(x.device.type, enabled=False):
                return self.criterion(_at_least_float32(outputs), gt, self.matcher)
        with timed("decoder"):
            outputs = self.decoder(features)
        with timed("postprocess"):
            boxes, scores, labels, keep = self.top_detections(outputs["logits"][-1], outputs["boxes"][-1], height,
                                                              width)
            detections = [{"boxes": b[k], "scores": s[k], "labels": c[k]}
                          for b, s, c, k in zip(boxes, scores, labels, keep)]
            return detections_to_original(detections, targets) if to_original else detections

    def top_detections(self, logits: torch.Tensor, boxes: torch.Tensor, height: int, width: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per image, the ``DETECTIONS_PER_IMAGE`` highest (query, class) sigmoid scores: their query's box in input
        pixels ``[B, K, 4]``, the scores and labels ``[B, K]`` (decreasing score) and which are above
        ``SCORE_THRESH_TEST``. One query may give several classes, as in the reference's post-processing."""
        x0, y0, x1, y1 = box_convert(boxes.float(), "cxcywh", "xyxy").unbind(-1)
        corners = torch.stack([x0 * width, y0 * height, x1 * width, y1 * height], -1)
        classes = logits.shape[-1]
        top = min(self.detections_per_img, logits.shape[1] * classes)
        scores, index = logits.float().sigmoid().flatten(1).topk(top, dim=1)
        query = torch.div(index, classes, rounding_mode="floor")
        picked = corners.gather(1, query.unsqueeze(-1).expand(-1, -1, 4))
        return picked, scores, index - query * classes + 1, scores > self.score_thresh


@META_ARCH_REGISTRY.register()
class RTDETR(QueryDetector):
    """``forward(images, targets)`` as :class:`pet.modeling.FasterRCNN`: uint8 ``[B, 3, H, W]`` padded images and
    per-image targets; training returns the loss terms (:mod:`pet.modeling.rtdetr.criterion`), eval per-image
    ``boxes`` / ``scores`` / ``labels`` (1..NUM_CLASSES) in original-image pixels. Test-time timers: ``backbone``,
    ``encoder``, ``decoder`` (query selection included) and ``postprocess``."""

    score_thresh_key = "MODEL.RTDETR.SCORE_THRESH_TEST"

    def __init__(self, cfg: CfgNode) -> None:
        super().__init__(cfg, "RTDETR")
        node = cfg.MODEL.RTDETR
        dim = node.HIDDEN_DIM
        self.encoder = HybridEncoder(list(self.backbone.out_channels), dim, num_heads=node.ENCODER_HEADS,
                                     ffn_dim=node.ENCODER_FFN_DIM, num_layers=node.ENCODER_LAYERS,
                                     num_blocks=node.CSP_BLOCKS, expansion=node.EXPANSION)
        denoising = ContrastiveDenoising(node.DECODER_DIM, self.num_classes, node.NUM_DENOISING,
                                         node.LABEL_NOISE_RATIO, node.BOX_NOISE_SCALE)
        self.decoder = RTDETRDecoder(dim, node.DECODER_DIM, self.num_classes, num_queries=node.NUM_QUERIES,
                                     num_layers=node.DECODER_LAYERS, num_heads=node.DECODER_HEADS,
                                     ffn_dim=node.DECODER_FFN_DIM, num_levels=len(self.backbone.out_channels),
                                     num_points=node.DECODER_POINTS, denoising=denoising)
        self.criterion = RTDETRCriterion(cfg, self.num_classes)
        if cfg.MODEL.CHANNELS_LAST:
            self.to(memory_format=torch.channels_last)

    @staticmethod
    def convert_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' RT-DETR names to Pet's (:mod:`pet.modeling.rtdetr.weights`); anything else as other models."""
        if is_transformers_state_dict(state):
            return convert_transformers_state_dict(state)
        return convert_state_dict(state)


def normalised_targets(target: dict[str, Any], height: int, width: int,
                       dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Pet's target (``boxes`` xyxy in input pixels, ``labels`` 1..K) as RT-DETR's: (cx, cy, w, h) over the padded
    input's ``width`` and ``height``, labels 0..K-1. Boxes in float32, or in ``dtype`` where that is wider (a model
    run in float64 compares with its targets in float64)."""
    boxes = target["boxes"].to(torch.promote_types(dtype, torch.float32))
    scale = torch.tensor([width, height, width, height], dtype=boxes.dtype, device=boxes.device)
    return {"labels": target["labels"] - 1, "boxes": box_convert(boxes, "xyxy", "cxcywh") / scale}


def _at_least_float32(value: Any) -> Any:
    """``value`` (tensors in nested dicts, lists and tuples) with bfloat16 / float16 tensors made float32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() and value.dtype.itemsize < 4 else value
    if isinstance(value, dict):
        return {k: _at_least_float32(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_at_least_float32(v) for v in value)
    return value
