"""Map detections from the network's input back to the original images."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torchvision.ops import clip_boxes_to_image

__all__ = ["detections_to_original"]


def detections_to_original(
    detections: list[dict[str, torch.Tensor]], targets: Sequence[dict[str, Any]]
) -> list[dict[str, torch.Tensor]]:
    """Scale boxes by ``orig_size / image_size`` and clip them to the original image.

    The scale is computed in float32 as torchvision's ``resize_boxes`` does, so detections
    match torchvision's for the same weights and input.
    """
    for det, target in zip(detections, targets):
        (h, w), (orig_h, orig_w) = target["image_size"], target["orig_size"]
        boxes = det["boxes"]
        sizes = torch.tensor([[orig_w, orig_h], [w, h]], dtype=torch.float32, device=boxes.device)
        ratio_w, ratio_h = sizes[0] / sizes[1]
        scale = torch.stack([ratio_w, ratio_h, ratio_w, ratio_h]).to(boxes.dtype)
        det["boxes"] = clip_boxes_to_image(boxes * scale, (int(orig_h), int(orig_w)))
    return detections
