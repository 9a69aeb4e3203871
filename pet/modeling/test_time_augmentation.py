"""Test-time augmentation (``TEST.AUG``): run a detector at several scales, mirrored and not, and merge its detections.

One wrapper serves every architecture because the detector contract (:class:`pet.modeling.detector.Detector`) already
does the hard part: a detector maps its detections to the original image through ``targets[i]["image_size"]`` and
``orig_size``. So a pass only has to rebuild the batch at another size (``image_size`` the new size, ``orig_size``
unchanged) and, for a mirrored pass, mirror the detections back; everything is then in the original image's pixels
and the passes merge by class-wise NMS or weighted box fusion. Masks and keypoints follow the detection they belong
to; they are not re-predicted from the merged boxes (detectron2's R-CNN-only TTA does that), which keeps the wrapper
architecture-agnostic.

The test loader resizes to the largest scale when ``TEST.AUG.ENABLED`` (:func:`pet.data.build_augmentations`), so
each pass resizes down from at least as many pixels as it needs.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from fvcore.common.config import CfgNode
from torch.nn.functional import interpolate
from torchvision.ops import batched_nms, box_iou

from pet.utils.errors import ConfigError

__all__ = ["DetectorWithTTA", "TTAPass", "MERGE_METHODS", "merge_detections", "weighted_box_fusion"]

MERGE_METHODS = ("nms", "wbf")


class TTAPass(NamedTuple):
    """One forward pass: the scale (shorter side, or square side with a fixed-size input) and whether mirrored."""

    size: int
    flip: bool


class DetectorWithTTA(torch.nn.Module):
    """``model`` (any module with Pet's batch contract) run once per :class:`TTAPass`, its detections merged.

    ``min_sizes``: the scales, each a shorter side with the longer one capped at ``max_size`` (0: no cap), or with
    ``fixed_size`` a square side (RT-DETR's stretched input). ``flip`` adds a mirrored pass per scale; a keypoint
    model's mirrored points are renumbered by ``keypoint_flip_map`` (:attr:`pet.data.keypoints.KeypointMeta.flip_map`).
    Each pass's batch is padded to a multiple of ``size_divisibility`` and of the model's ``size_multiple``.
    ``merge`` ("nms" or "wbf") and ``iou_thresh``: :func:`merge_detections`; each image keeps the model's
    ``detections_per_img`` best.

    In training mode the wrapper is transparent (a validation loss computes the model's own losses).
    """

    def __init__(self, model: torch.nn.Module, min_sizes: Sequence[int], *, max_size: int = 0, flip: bool = True,
                 fixed_size: bool = False, merge: str = "nms", iou_thresh: float = 0.5, size_divisibility: int = 0,
                 keypoint_flip_map: Sequence[int] | None = None) -> None:
        super().__init__()
        if not min_sizes or not all(isinstance(s, int) and s > 0 for s in min_sizes):
            raise ConfigError(f"TEST.AUG.MIN_SIZES must list sizes in pixels, got {tuple(min_sizes)!r}.")
        if merge not in MERGE_METHODS:
            raise ConfigError(f"TEST.AUG.MERGE must be one of {', '.join(MERGE_METHODS)}, got {merge!r}.")
        if not 0.0 < iou_thresh <= 1.0:
            raise ConfigError(f"TEST.AUG.IOU_THRESH must be in (0, 1], got {iou_thresh}.")
        self.model = model
        self.passes = [TTAPass(size, mirrored) for size in min_sizes for mirrored in ((False, True) if flip else
                                                                                      (False,))]
        self.max_size = max_size
        self.fixed_size = fixed_size
        self.merge = merge
        self.iou_thresh = iou_thresh
        self.pad_multiple = math.lcm(max(size_divisibility, 1), max(int(getattr(model, "size_multiple", 1)), 1))
        self.keypoint_flip_map = list(keypoint_flip_map) if keypoint_flip_map is not None else None

    @classmethod
    def from_config(cls, cfg: CfgNode, model: torch.nn.Module,
                    keypoint_flip_map: Sequence[int] | None = None) -> DetectorWithTTA:
        """``model`` wrapped as ``cfg``'s ``TEST.AUG`` says (``INPUT.FIXED_SIZE_TEST`` set: square scales)."""
        aug = cfg.TEST.AUG
        return cls(model, list(aug.MIN_SIZES), max_size=aug.MAX_SIZE, flip=aug.FLIP,
                   fixed_size=bool(cfg.INPUT.FIXED_SIZE_TEST), merge=aug.MERGE, iou_thresh=aug.IOU_THRESH,
                   size_divisibility=cfg.INPUT.SIZE_DIVISIBILITY, keypoint_flip_map=keypoint_flip_map)

    # The detector contract's model-level answers, which predict and the engine read from the model they are given.
    @property
    def score_thresh(self) -> float | None:
        return getattr(self.model, "score_thresh", None)

    @property
    def detections_per_img(self) -> int | None:
        return getattr(self.model, "detections_per_img", None)

    @property
    def keypoint_count(self) -> Any:
        return getattr(self.model, "keypoint_count", None)

    def forward(self, images: torch.Tensor, targets: list[dict[str, Any]]) -> Any:
        if self.training:
            return self.model(images, targets)
        outputs = [self.pass_detections(images, targets, tta) for tta in self.passes]
        return [merge_detections([out[i] for out in outputs], self.merge, self.iou_thresh, self.detections_per_img)
                for i in range(len(targets))]

    def pass_detections(self, images: torch.Tensor, targets: Sequence[dict[str, Any]], tta: TTAPass
                        ) -> list[dict[str, torch.Tensor]]:
        """The model's detections on one pass's batch (:meth:`pass_batch`), per image, in the original unmirrored
        image's pixels."""
        batch_images, batch_targets = self.pass_batch(images, targets, tta)
        detections = self.model(batch_images, batch_targets)
        if tta.flip:
            detections = [self._unflip(det, int(t["orig_size"][1])) for det, t in zip(detections, targets)]
        return detections

    def input_size(self, orig_size: Sequence[int], size: int) -> tuple[int, int]:
        """(h, w) of an image of ``orig_size`` (h, w) at scale ``size``: a square, or the shorter side ``size``
        with the longer capped at ``max_size`` (rounded as the test loader's resize rounds)."""
        if self.fixed_size:
            return size, size
        height, width = int(orig_size[0]), int(orig_size[1])
        scale = size / min(height, width)
        if self.max_size > 0 and max(height, width) * scale > self.max_size:
            scale = self.max_size / max(height, width)
        return max(1, round(height * scale)), max(1, round(width * scale))

    def pass_batch(self, images: torch.Tensor, targets: Sequence[dict[str, Any]], tta: TTAPass
                   ) -> tuple[torch.Tensor, list[dict[str, Any]]]:
        """The batch of one pass, in the batch contract: each delivered image cropped to its ``image_size``, resized
        (bilinear, antialiased when shrinking), mirrored if ``tta.flip``, zero-padded bottom/right to
        :attr:`pad_multiple`; its targets with the new ``image_size`` (``orig_size`` unchanged)."""
        sizes = [self.input_size(t["orig_size"], tta.size) for t in targets]
        height = -(-max(h for h, _ in sizes) // self.pad_multiple) * self.pad_multiple
        width = -(-max(w for _, w in sizes) // self.pad_multiple) * self.pad_multiple
        # Channels-last, as the test loader's batches are (pet.data.collate_batch).
        batch = torch.zeros((len(targets), height, width, 3), dtype=torch.uint8, device=images.device)
        batch = batch.permute(0, 3, 1, 2)
        for i, (target, (new_h, new_w)) in enumerate(zip(targets, sizes)):
            h, w = int(target["image_size"][0]), int(target["image_size"][1])
            image = _resized(images[i, :, :h, :w], new_h, new_w)
            batch[i, :, :new_h, :new_w] = image.flip(-1) if tta.flip else image
        return batch, [{**target, "image_size": size} for target, size in zip(targets, sizes)]

    def _unflip(self, det: dict[str, torch.Tensor], width: int) -> dict[str, torch.Tensor]:
        """A mirrored pass's detections in the unmirrored original image (``width`` its width): x -> width - x for
        boxes and keypoints, masks mirrored, and each point renumbered (the left wrist seen in a mirror is the right
        one)."""
        det = dict(det)
        boxes = det["boxes"]
        det["boxes"] = torch.stack([width - boxes[:, 2], boxes[:, 1], width - boxes[:, 0], boxes[:, 3]], dim=1)
        if "masks" in det:
            det["masks"] = det["masks"].flip(-1)
        if "keypoints" in det:
            flip_map = self._flip_map(det["keypoints"].shape[1])
            points = det["keypoints"].clone()
            points[..., 0] = width - points[..., 0]
            det["keypoints"] = points[:, flip_map]
            if "keypoints_scores" in det:
                det["keypoints_scores"] = det["keypoints_scores"][:, flip_map]
        return det

    def _flip_map(self, num_keypoints: int) -> list[int]:
        if self.keypoint_flip_map is None:
            raise ConfigError("TEST.AUG.FLIP mirrors a keypoint model's input, and mapping its points back needs the "
                              "keypoint flip map (which point is whose mirror), which was not given: pass "
                              "keypoint_flip_map, or set TEST.AUG.FLIP False.")
        if len(self.keypoint_flip_map) != num_keypoints:
            raise ConfigError(f"The keypoint flip map has {len(self.keypoint_flip_map)} points but the model predicts "
                              f"{num_keypoints}: TEST.DATASETS[0] is not the set the model was trained for.")
        return self.keypoint_flip_map


def _resized(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [3, h, w] -> uint8 [3, height, width]: torch's bilinear resize, antialiased when shrinking (as
    ``INPUT.FIXED_SIZE_TEST``'s resize), in float32 whatever autocast is on."""
    if tuple(image.shape[-2:]) == (height, width):
        return image
    shrinking = height < image.shape[-2] or width < image.shape[-1]
    with torch.autocast(image.device.type, enabled=False):
        out = interpolate(image[None].float(), size=(height, width), mode="bilinear", align_corners=False,
                          antialias=shrinking)
    return out[0].round_().clamp_(0, 255).to(torch.uint8)


def merge_detections(passes: Sequence[dict[str, torch.Tensor]], method: str = "nms", iou_thresh: float = 0.5,
                     limit: int | None = None) -> dict[str, torch.Tensor]:
    """One image's detections from every pass (in the original image's pixels), merged: class-wise NMS
    (torchvision's ``batched_nms``) or :func:`weighted_box_fusion` at ``iou_thresh``, best first, at most ``limit``.

    Every per-detection tensor follows its detection (in WBF, the cluster's best-scoring member's). Masks are
    gathered for the kept detections only: the passes' full-image masks are never concatenated.
    """
    keys = list(passes[0])
    joined = {k: torch.cat([p[k] for p in passes]) for k in keys if k != "masks"}
    boxes, scores, labels = joined["boxes"], joined["scores"], joined["labels"]
    if method == "nms":
        keep = batched_nms(boxes.float(), scores.float(), labels, iou_thresh)[:limit]
        merged = {k: v[keep] for k, v in joined.items()}
    elif method == "wbf":
        fused, fused_scores, members = weighted_box_fusion(boxes, scores, labels, iou_thresh, len(passes))
        order = torch.argsort(fused_scores, descending=True, stable=True)[:limit]
        keep = members[order]
        merged = {k: v[keep] for k, v in joined.items()}
        merged["boxes"] = fused[order].to(boxes.dtype)
        merged["scores"] = fused_scores[order].to(scores.dtype)
    else:
        raise ConfigError(f"TEST.AUG.MERGE must be one of {', '.join(MERGE_METHODS)}, got {method!r}.")
    if "masks" in keys:
        merged["masks"] = _gather([p["masks"] for p in passes], keep)
    return {k: merged[k] for k in keys}


def _gather(parts: Sequence[torch.Tensor], keep: torch.Tensor) -> torch.Tensor:
    """``torch.cat(parts)[keep]`` without the concatenation."""
    ends = torch.tensor([len(part) for part in parts]).cumsum(0)
    keep = keep.cpu()
    which = torch.searchsorted(ends, keep, right=True)
    out = parts[0].new_empty((len(keep), *parts[0].shape[1:]))
    for p, part in enumerate(parts):
        rows = (which == p).nonzero()[:, 0]
        if len(rows):
            first = int(ends[p]) - len(part)
            out[rows.to(out.device)] = part[(keep[rows] - first).to(part.device)]
    return out


def weighted_box_fusion(boxes: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor, iou_thresh: float,
                        num_passes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted box fusion (Solovyev, Wang, Gabruseva, "Weighted boxes fusion", 2021), class by class.

    Boxes are visited in decreasing score; one joins the cluster whose fused box it overlaps most when that IoU is
    at least ``iou_thresh``, else starts a cluster. A cluster's box is the score-weighted mean of its members; its
    score the members' mean times ``min(members, num_passes) / num_passes`` (the paper's rescaling: an object
    found by few of the passes scores lower). Unlike NMS, overlapping detections refine the box instead of being
    dropped.

    Returns the fused boxes [M, 4], their scores [M] (float32, on ``boxes``' device) and for each the index of its
    best-scoring member, whose label, mask and keypoints the fused detection takes.
    """
    device = boxes.device
    boxes, scores, labels = boxes.detach().float().cpu(), scores.detach().float().cpu(), labels.cpu()
    order = torch.argsort(scores, descending=True, stable=True)
    fused_boxes, fused_scores, members = [], [], []
    for label in labels.unique().tolist():
        indices = order[labels[order] == label].tolist()
        box_sums = torch.zeros((len(indices), 4))
        weight_sums = torch.zeros(len(indices))
        counts = torch.zeros(len(indices))
        cluster_boxes = torch.zeros((len(indices), 4))
        best = []
        for index in indices:
            box, weight = boxes[index], max(float(scores[index]), 1e-12)  # a zero score still places its box
            n = len(best)
            if n:
                overlaps = box_iou(box[None], cluster_boxes[:n])[0]
                c = int(overlaps.argmax())
                if overlaps[c] >= iou_thresh:
                    box_sums[c] += weight * box
                    weight_sums[c] += weight
                    counts[c] += 1
                    cluster_boxes[c] = box_sums[c] / weight_sums[c]
                    continue
            box_sums[n], weight_sums[n], counts[n], cluster_boxes[n] = weight * box, weight, 1, box
            best.append(index)
        n = len(best)
        fused_boxes.append(cluster_boxes[:n])
        mean = weight_sums[:n] / counts[:n]
        fused_scores.append(mean * counts[:n].clamp(max=num_passes) / num_passes)
        members.append(torch.tensor(best, dtype=torch.int64))
    if not members:
        return torch.zeros((0, 4), device=device), torch.zeros(0, device=device), torch.zeros(0, dtype=torch.int64,
                                                                                              device=device)
    return torch.cat(fused_boxes).to(device), torch.cat(fused_scores).to(device), torch.cat(members).to(device)
