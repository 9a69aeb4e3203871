"""Pictures of test results: detections (class, score, and a mask or keypoints model's masks and points) drawn over
the ground truth."""
from __future__ import annotations

import logging
import os
from typing import Any

import cv2
import numpy as np
from pycocotools import mask as mask_util

from pet.data import read_image
from pet.engine.hooks import HOOKS, TestCallback
from pet.utils import comm
from pet.utils.visualization import draw_detections

__all__ = ["VisualizationHook"]

logger = logging.getLogger(__name__)


@HOOKS.register()
class VisualizationHook(TestCallback):
    """After the test, write the first ``num_images`` test images with their detections to ``CKPT/test/vis/``.

    Ground truth is drawn in thin white, detections scoring at least ``score_thresh`` in a
    colour per class with ``class score``, their masks blended in and their keypoints as dots joined by the
    set's skeleton when the results have them. It reads the saved COCO results, not the model's
    raw outputs, so a picture shows exactly what was scored. ``tools/test_net.py --vis N``
    adds it; in YAML: ``TEST.HOOKS: [{type: VisualizationHook, num_images: 8}]``. (Before 0.2.0 it was
    called ``DetectionVisualizer``; that name still works, with a warning, until 0.3.0.)
    """

    def __init__(self, output_dir: str, num_images: int = 8, score_thresh: float = 0.5) -> None:
        self.vis_dir = os.path.join(output_dir, "test", "vis")
        self.num_images = num_images
        self.score_thresh = score_thresh
        self.dataset: Any = None
        self.written: list[str] = []

    def before_test(self, data_loader: Any = None, **kwargs: Any) -> None:
        self.dataset = getattr(data_loader, "dataset", None)

    def after_test(self, results: list[dict[str, Any]] | None = None, **kwargs: Any) -> None:
        if not comm.is_main_process() or self.dataset is None or results is None:
            return
        coco = self.dataset.coco
        space = self.dataset.label_space  # the model's classes, named as the model names them
        names = dict(zip(space.category_ids, space.names))
        by_image: dict[int, list[dict[str, Any]]] = {}
        for det in results:
            if det["score"] >= self.score_thresh:
                by_image.setdefault(det["image_id"], []).append(det)
        os.makedirs(self.vis_dir, exist_ok=True)
        for image_id in sorted(coco.getImgIds())[: self.num_images]:
            info = coco.loadImgs(image_id)[0]
            image = read_image(os.path.join(self.dataset.image_root, info["file_name"]), image_id)
            gt = [a["bbox"] for a in coco.loadAnns(coco.getAnnIds(imgIds=image_id, iscrowd=None))]
            dets = by_image.get(image_id, [])
            canvas = draw_detections(
                image,
                _xywh_to_xyxy([d["bbox"] for d in dets]),
                [names[d["category_id"]] for d in dets],
                [d["score"] for d in dets],
                gt_boxes=_xywh_to_xyxy(gt),
                masks=_masks(dets),
                keypoints=_keypoints(dets),
                skeleton=self.dataset.keypoint_meta.skeleton if getattr(self.dataset, "keypoint_meta", None) else (),
            )
            path = os.path.join(self.vis_dir, f"{os.path.splitext(os.path.basename(info['file_name']))[0]}.png")
            cv2.imwrite(path, cv2.cvtColor(canvas, cv2.COLOR_RGB2BGR))
            self.written.append(path)
        logger.info(f"Wrote {len(self.written)} detection pictures (score >= {self.score_thresh}) to {self.vis_dir}")


HOOKS.register_renamed("DetectionVisualizer", "VisualizationHook", removed_in="0.3.0")


def _xywh_to_xyxy(boxes: list[list[float]]) -> np.ndarray:
    array = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    array[:, 2:] += array[:, :2]
    return array


def _masks(dets: list[dict[str, Any]]) -> np.ndarray | None:
    """The detections' RLE ``segmentation`` decoded to [N, H, W]; None unless every one has a mask."""
    if not dets or any("segmentation" not in d for d in dets):
        return None
    return np.stack([mask_util.decode(d["segmentation"]) for d in dets])


def _keypoints(dets: list[dict[str, Any]]) -> np.ndarray | None:
    """The detections' flat ``keypoints`` (x, y, score, ...) as [N, K, 3], zeros (not drawn) for a detection
    without them; None when none has them."""
    points = [None if "keypoints" not in d else np.asarray(d["keypoints"], np.float32).reshape(-1, 3) for d in dets]
    shape = next((p.shape for p in points if p is not None), None)
    if shape is None:
        return None
    return np.stack([np.zeros(shape, np.float32) if p is None else p for p in points])
