"""Map detections from the network's input back to the original images."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torchvision.models.detection.roi_heads import paste_masks_in_image
from torchvision.ops import clip_boxes_to_image

__all__ = ["detections_to_original", "paste_masks"]

# Masks pasted at a time: bounds the float32 [chunk, H, W] buffer torchvision's pasting stacks.
_PASTE_CHUNK = 16


def detections_to_original(
    detections: list[dict[str, torch.Tensor]], targets: Sequence[dict[str, Any]]
) -> list[dict[str, torch.Tensor]]:
    """Scale boxes by ``orig_size / image_size`` and clip them to the original image; paste
    mask probabilities (``masks`` [N, 1, M, M], when present) into it with :func:`paste_masks`.

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
        det["boxes"] = clip_boxes_to_image(boxes, (int(orig_h), int(orig_w)))
    return detections


def paste_masks(
    mask_probs: torch.Tensor, boxes: torch.Tensor, image_size: tuple[int, int], threshold: float = 0.5
) -> torch.Tensor:
    """uint8 [N, H, W] 0/1 masks: probabilities ``[N, 1, M, M]`` resized into ``boxes`` (XYXY, in
    the ``image_size`` (H, W) frame) with torchvision's ``paste_masks_in_image``, then ``>= threshold``.

    Binarising chunk by chunk keeps one byte per pixel instead of a float per pixel for
    every detection (100 float masks of a COCO image are ~400 MB).
    """
    masks = torch.empty((len(boxes), *image_size), dtype=torch.uint8, device=boxes.device)
    for i in range(0, len(boxes), _PASTE_CHUNK):
        pasted = paste_masks_in_image(mask_probs[i:i + _PASTE_CHUNK].float(), boxes[i:i + _PASTE_CHUNK], image_size)
        masks[i:i + _PASTE_CHUNK] = pasted[:, 0] >= threshold
    return masks
