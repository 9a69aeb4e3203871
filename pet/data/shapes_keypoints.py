"""Keypoints for the shapes demo set: the corners of its rectangles and triangles, :func:`generate_shapes_keypoints`.

The images and boxes stay those of the box/mask demo (``data/shapes``): the keypoint set is only new annotation
files, ``<root>/annotations/{train,val}.json``, whose images point into the demo set's folders. The corners are
not guessed from the masks: each image's random stream is replayed (:func:`pet.data.shapes.render_objects`) to
get the vertices every shape was drawn from, and each object is checked against the demo's annotation (same
class, same box) before its corners are written.

One list of seven points serves every class, as a keypoint model predicts the same K points for every box:
a rectangle's four corners (axis-aligned: ``rect_top_left`` ... ``rect_bottom_left``), a triangle's three
vertices (``tri_top``, the highest; ``tri_left`` and ``tri_right``, the other two by x); the points a class lacks
are unlabelled, and circles have none. The names give the flip map (``left`` <-> ``right``). A corner under an
object drawn later is labelled hidden (visibility 1), as COCO labels an occluded joint. A triangle turned so
that two vertices are nearly level has an ambiguous ``tri_top``: the keypoint AP of triangles pays for it.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import cv2
import numpy as np

from pet.data.shapes import SHAPE_CLASSES, DrawnObject, generate_shapes, is_complete, render_objects
from pet.utils.files import atomic_path

__all__ = ["SHAPE_KEYPOINTS", "SHAPE_SKELETON", "SHAPES_OKS_SIGMAS", "generate_shapes_keypoints",
           "prepare_shapes_keypoints", "shape_keypoints"]

logger = logging.getLogger(__name__)

SHAPE_KEYPOINTS = ("rect_top_left", "rect_top_right", "rect_bottom_right", "rect_bottom_left", "tri_top",
                   "tri_left", "tri_right")
# 1-based pairs (COCO's convention): each shape's outline.
SHAPE_SKELETON = ((1, 2), (2, 3), (3, 4), (4, 1), (5, 6), (6, 7), (7, 5))
# The demo's OKS sigmas: a drawn corner is as sharply defined as a point gets, so one sigma for every point,
# Pet's default for a set that names none (the mean of COCO's 17; see pet.data.keypoints).
SHAPES_OKS_SIGMAS = (0.067,) * len(SHAPE_KEYPOINTS)
_MARKER = ".complete.json"


def shape_keypoints(obj: DrawnObject) -> list[float]:
    """COCO's flat (x, y, visibility) * 7 of one drawn object (all 0 for a circle)."""
    points = np.zeros((len(SHAPE_KEYPOINTS), 3), np.float64)
    labelled = np.zeros(len(SHAPE_KEYPOINTS), bool)
    name = SHAPE_CLASSES[obj.label]
    v = obj.vertices
    if name == "rectangle":  # drawn as [-w, -h], [w, -h], [w, h], [-w, h]: TL, TR, BR, BL
        points[:4, :2] = v
        labelled[:4] = True
    elif name == "triangle":
        top = int(np.argmin(v[:, 1]))
        left, right = sorted((i for i in range(3) if i != top), key=lambda i: v[i, 0])
        points[4:7, :2] = v[[top, left, right]]
        labelled[4:] = True
    h, w = obj.covered.shape
    for i in np.flatnonzero(labelled):
        x = min(max(int(round(points[i, 0])), 0), w - 1)
        y = min(max(int(round(points[i, 1])), 0), h - 1)
        points[i, 2] = 1 if obj.covered[y, x] else 2
    return [round(float(p), 2) for p in points.reshape(-1)]


def generate_shapes_keypoints(root: str, shapes_root: str) -> str:
    """Write the keypoint annotations of the shapes set at ``shapes_root`` (:func:`pet.data.shapes.generate_shapes`
    wrote it, with any arguments) under ``root`` unless a complete copy for that set is there; returns ``root``.
    Files are written atomically, as the demo set's are."""
    if not is_complete(shapes_root):
        raise FileNotFoundError(f"{shapes_root} holds no complete shapes set; generate it first (generate_shapes)")
    root, shapes_root = os.path.abspath(root), os.path.abspath(shapes_root)
    with open(os.path.join(shapes_root, _MARKER)) as f:
        params = json.load(f)
    marker = {"shapes": params, "keypoints": list(SHAPE_KEYPOINTS)}
    if _complete(root, marker):
        return root
    start = time.perf_counter()
    logger.info(f"Writing the shapes keypoint annotations for {shapes_root} into {root} ...")
    os.makedirs(os.path.dirname(root), exist_ok=True)
    with atomic_path(root) as tmp:
        os.makedirs(os.path.join(tmp, "annotations"))
        for split, split_seed in (("train", 0), ("val", 1)):
            with open(os.path.join(shapes_root, "annotations", f"{split}.json")) as f:
                coco = json.load(f)
            _add_keypoints(coco, (params["seed"], split_seed), params)
            with open(os.path.join(tmp, "annotations", f"{split}.json"), "w") as f:
                json.dump(coco, f)
        with open(os.path.join(tmp, _MARKER), "w") as f:
            json.dump(marker, f)
    logger.info(f"Shapes keypoint annotations written in {time.perf_counter() - start:.1f} s")
    return root


def prepare_shapes_keypoints(root: str, shapes_root: str) -> str:
    """The demo set (generated if needed, with its default arguments), then its keypoint annotations."""
    generate_shapes(shapes_root)
    return generate_shapes_keypoints(root, shapes_root)


def _complete(root: str, marker: dict[str, Any]) -> bool:
    try:
        with open(os.path.join(root, _MARKER)) as f:
            return json.load(f) == marker
    except (OSError, ValueError):
        return False


def _add_keypoints(coco: dict[str, Any], seed: tuple[int, int], params: dict[str, Any]) -> None:
    """Replay each image's stream and give its annotations (in the order they were written) their corners."""
    by_image: dict[int, list[dict[str, Any]]] = {}
    for ann in coco["annotations"]:
        by_image.setdefault(ann["image_id"], []).append(ann)
    for image in coco["images"]:
        rng = np.random.default_rng([*seed, image["id"]])
        height, width = (int(v) for v in rng.integers(params["image_size"][0], params["image_size"][1] + 1, size=2))
        _, objects = render_objects(rng, height, width, params["object_size"], params["max_objects"])
        anns = by_image.get(image["id"], [])
        if (height, width) != (image["height"], image["width"]) or len(objects) != len(anns):
            raise RuntimeError(f"image {image['id']}: the replayed picture differs from the demo set's; regenerate "
                               "the demo set with this version of Pet")
        for ann, obj in zip(anns, objects):
            if ann["category_id"] != obj.label + 1 or ann["bbox"] != list(cv2.boundingRect(obj.visible)):
                raise RuntimeError(f"annotation {ann['id']}: the replayed object differs from the demo set's")
            ann["keypoints"] = shape_keypoints(obj)
            ann["num_keypoints"] = sum(1 for v in ann["keypoints"][2::3] if v > 0)
    for cat in coco["categories"]:
        if cat["name"] != "circle":
            cat["keypoints"] = list(SHAPE_KEYPOINTS)
            cat["skeleton"] = [list(p) for p in SHAPE_SKELETON]
