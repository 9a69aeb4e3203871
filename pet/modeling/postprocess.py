"""Map detections from the network's input back to the original images."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.functional import interpolate
from torchvision.models.detection.roi_heads import expand_boxes, expand_masks
from torchvision.ops import clip_boxes_to_image

from pet.utils.tensor import at_least_float32

__all__ = ["detections_to_original", "paste_masks"]

def detections_to_original(
    detections: list[dict[str, torch.Tensor]], targets: Sequence[dict[str, Any]]
) -> list[dict[str, torch.Tensor]]:
    """Scale boxes by ``orig_size / image_size`` and clip them to the original image; paste
    mask probabilities (``masks`` [N, 1, M, M], when present) into it with :func:`paste_masks`;
    scale keypoints (``keypoints`` [N, K, 3], when present) by the same ratios, unclipped, as
    torchvision's ``resize_keypoints`` does.

    The scale is computed in float32 as torchvision's ``resize_boxes`` does, and masks are
    pasted into the scaled boxes before clipping as torchvision's ``postprocess`` does, so
    detections match torchvision's for the same weights and input.
    """
    for det, target in zip(detections, targets):
        (h, w), (orig_h, orig_w) = target["image_size"], target["orig_size"]
        boxes = det["boxes"]
        sizes = torch.tensor([[orig_w, orig_h], [w, h]], dtype=torch.float32, device=boxes.device)
        ratio_w, ratio_h = sizes[0] / sizes[1]
        scale = torch.stack([ratio_w, ratio_h, ratio_w, ratio_h]).to(boxes.dtype)
        boxes = boxes * scale
        if "masks" in det:
            det["masks"] = paste_masks(det["masks"], boxes, (int(orig_h), int(orig_w)))
        if "keypoints" in det:
            keypoints = det["keypoints"]
            ratios = torch.stack([ratio_w, ratio_h, torch.ones_like(ratio_w)]).to(keypoints.dtype)
            det["keypoints"] = keypoints * ratios
        det["boxes"] = clip_boxes_to_image(boxes, (int(orig_h), int(orig_w)))
    return detections


def paste_masks(
    mask_probs: torch.Tensor, boxes: torch.Tensor, image_size: tuple[int, int], threshold: float = 0.5
) -> torch.Tensor:
    """uint8 [N, H, W] 0/1 masks: probabilities ``[N, 1, M, M]`` resized into ``boxes`` (XYXY, in the
    ``image_size`` (H, W) frame) exactly as torchvision's ``paste_masks_in_image`` resizes them, then
    ``>= threshold``.

    torchvision fills a full-image float canvas per mask (100 masks of a COCO image: ~430 MB of
    zeros and copies) and a binarising pass would go over all of it again. Here each mask is
    resized, thresholded and written only within its box, into one zeroed uint8 array: the same
    pixels (same padding, box expansion, rounding and bilinear resize), a quarter of the memory.
    """
    height, width = image_size
    masks = torch.zeros((len(boxes), height, width), dtype=torch.uint8, device=boxes.device)
    if len(boxes) == 0:
        return masks
    padded, scale = expand_masks(at_least_float32(mask_probs), padding=1)
    for out, mask, box in zip(masks, padded, expand_boxes(boxes, scale).to(torch.int64).tolist()):
        x0, y0, x1, y1 = box
        w, h = max(x1 - x0 + 1, 1), max(y1 - y0 + 1, 1)
        resized = interpolate(mask[None], size=(h, w), mode="bilinear", align_corners=False)[0, 0]
        top, left, bottom, right = max(y0, 0), max(x0, 0), min(y1 + 1, height), min(x1 + 1, width)
        if bottom > top and right > left:
            out[top:bottom, left:right] = resized[top - y0:bottom - y0, left - x0:right - x0] >= threshold
    return masks
