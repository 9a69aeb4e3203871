"""One COCO-format annotation file, read and validated: :func:`load_coco_json` and the :class:`COCODataset` it returns.

Everything that can be checked without decoding images is checked here, so a broken dataset
fails in the main process with one message naming the file, image or annotation, instead of
deep inside a loader worker. Decoding images and concatenating datasets is :mod:`pet.data.dataset`'s job.
"""
from __future__ import annotations

import collections
import contextlib
import io
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from pycocotools.coco import COCO

from pet.data.categories import LabeledDataset, LabelSpace
from pet.data.formats.common import image_size
from pet.data.keypoints import KeypointMeta, check_keypoints
from pet.utils.errors import DataError

__all__ = ["COCODataset", "load_coco_json", "build_coco_dataset", "read_categories", "require_masks"]

logger = logging.getLogger(__name__)

# A box may stick out of its image by this many pixels (rounding in annotation tools) before it counts as outside.
_OUTSIDE_TOLERANCE = 1.0


class COCODataset(LabeledDataset):
    """One validated COCO annotation file.

    Attributes:
        name, json_file, image_root: where it comes from (``json_file``: the annotation source, for the other
            formats their ``path``: the data.yaml, the VOC root or the CSV file).
        format: the format it was read from: ``coco``, ``yolo``, ``voc`` or ``csv``.
        coco: the pycocotools ``COCO`` object of the annotations, the evaluation ground truth: a COCO file's
            as they are; for the other formats the boxes training uses (see :class:`_BoxFixer`).
        categories: the file's categories ``{id: name}``, by increasing id.
        label_space: the file's own contiguous :class:`~pet.data.categories.LabelSpace` (its categories
            sorted by id are labels 1..C), the labels of ``records``. A model's label space may differ
            (``MODEL.LABEL_SPACE``): :class:`~pet.data.dataset.DetectionDataset` maps the records into it.
        class_names, label_to_category_id, category_id_to_label: views of ``label_space``.
        records: one dict per image: ``image_id``, ``file_name`` (full path), ``height``, ``width``,
            ``boxes`` (float32 [N, 4] XYXY, clipped, crowd excluded), ``labels`` (int64 [N]) and
            ``segmentations`` (N entries in the order of ``boxes``: a list of float64 polygons
            (x0, y0, x1, y1, ...), an RLE dict, or None when the annotation has none); in a keypoint set also
            ``keypoints`` (float32 [N, K, 3], (x, y, visibility) in image pixels; all 0 for an object without).
        keypoint_meta: the set's :class:`~pet.data.keypoints.KeypointMeta` (names, flip map, skeleton, OKS
            sigmas), None when it has no keypoints.
        annotations_without_mask: ids of the annotations in ``records`` that have no usable segmentation.
    """

    def __init__(
        self,
        name: str,
        json_file: str,
        image_root: str,
        coco: COCO,
        records: list[dict[str, Any]],
        annotations_without_mask: Sequence[int] = (),
        format: str = "coco",
        keypoint_meta: KeypointMeta | None = None,
    ) -> None:
        self.name = name
        self.format = format
        self.json_file = json_file
        self.image_root = image_root
        self.coco = coco
        self.categories = {c["id"]: str(c["name"]) for c in sorted(coco.dataset["categories"], key=lambda c: c["id"])}
        self.label_space = LabelSpace.contiguous(self.categories)
        self.records = records
        self.annotations_without_mask = list(annotations_without_mask)
        self.keypoint_meta = keypoint_meta

    def __len__(self) -> int:
        return len(self.records)

    def instances_per_class(self) -> np.ndarray:
        """Number of usable (non-crowd, kept) boxes of each label; index i is label i + 1."""
        labels = np.concatenate([r["labels"] for r in self.records]) if self.records else np.zeros(0, np.int64)
        return np.bincount(labels - 1, minlength=len(self.class_names))

    def __repr__(self) -> str:
        return f"COCODataset(name={self.name!r}, images={len(self)}, classes={len(self.class_names)})"


def load_coco_json(
    json_file: str,
    image_root: str,
    name: str | None = None,
    *,
    strict: bool = False,
    classes: Sequence[str] | None = None,
    oks_sigmas: Sequence[float] = (),
) -> COCODataset:
    """Read and validate a COCO annotation file (see :func:`build_coco_dataset`)."""
    name = name or os.path.splitext(os.path.basename(json_file))[0]
    return build_coco_dataset(_read_json(json_file, name), json_file, image_root, name, strict=strict,
                              classes=classes, oks_sigmas=oks_sigmas)


def build_coco_dataset(
    data: dict[str, Any],
    source: str,
    image_root: str,
    name: str,
    *,
    strict: bool = False,
    classes: Sequence[str] | None = None,
    origins: Mapping[int, str] | None = None,
    format: str = "coco",
    keypoint_meta: KeypointMeta | None = None,
    oks_sigmas: Sequence[float] = (),
) -> COCODataset:
    """Validate a COCO-format dict (read from ``source``) into a :class:`COCODataset`; ``data`` becomes the
    ground truth.

    Crowd annotations stay in ``coco`` (COCOeval ignores matches to them) but not in the
    training records. A box that is empty or sticks out of its image is rejected with a
    :class:`DataError` when ``strict``; otherwise it is clipped to the image (or dropped
    when nothing is left) and a warning reports how many; for a ``format`` other than ``coco``
    the ground truth is rewritten to match (see :class:`_BoxFixer`). ``classes`` renumbers the
    categories by name to ids 1..K in its order (an annotated category outside it is an error;
    unannotated ones are dropped). ``origins`` (annotation id -> where it was read, e.g. ``file:line``) names
    the culprit in messages about a box, for datasets read from other formats.

    A keypoint set (categories with ``keypoints`` names, or ``keypoint_meta`` from another format's reader) has
    every annotation's ``keypoints`` checked (:func:`pet.data.keypoints.check_keypoints`); the ground truth gains
    ``keypoints`` (zeros) and ``num_keypoints`` where an annotation lacks them, as COCOeval's keypoint task reads
    both. ``oks_sigmas`` (a ``DATA.CUSTOM`` entry's) replaces the set's sigmas.
    """
    where = f"{source} (dataset '{name}')"
    categories = _check_categories(data["categories"], where)
    keypoint_meta = keypoint_meta or _keypoint_meta(data["categories"], where)
    if keypoint_meta is not None and oks_sigmas:
        keypoint_meta = keypoint_meta.with_sigmas(oks_sigmas)
    elif oks_sigmas:
        raise DataError(f"{where} has no keypoints (no category lists `keypoints` names), so its `oks_sigmas` "
                        "mean nothing. Remove them from the DATA.CUSTOM entry, or add the keypoint names.")
    images = _check_images(data["images"], image_root, where)
    annotations = _check_annotations(data["annotations"], images, categories, where)
    if keypoint_meta is not None:
        keypoints = _check_all_keypoints(annotations, images, keypoint_meta.num_keypoints, where, origins or {})
    if classes:  # after the check: an id outside the file's categories would pass as one of the new ids
        categories = _apply_class_list(data, categories, classes, where, origins or {})

    cat_to_label = LabelSpace.contiguous(categories).category_id_to_label
    fixer = _BoxFixer(where, strict, origins or {})
    per_image: dict[int, list[tuple[list[float], int, Any, Any]]] = collections.defaultdict(list)
    without_mask = []
    dropped: set[Any] = set()
    for ann in annotations:
        if ann.get("iscrowd", 0):
            continue
        image = images[ann["image_id"]]
        box = fixer(ann, image["width"], image["height"])
        if box is None:
            dropped.add(ann["id"])
            continue
        if format != "coco":
            _set_box(ann, box)
        segmentation = _segmentation(ann, image, where)
        if segmentation is None:
            without_mask.append(ann["id"])
        points = keypoints[ann["id"]] if keypoint_meta is not None else None
        per_image[ann["image_id"]].append((box, cat_to_label[ann["category_id"]], segmentation, points))
    fixer.report(rewritten=format != "coco")
    if format != "coco":
        data["annotations"] = [ann for ann in annotations if ann["id"] not in dropped]

    coco = COCO()
    coco.dataset = data
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress lines
        coco.createIndex()

    records = []
    for image_id, image in images.items():
        objs = per_image.get(image_id, [])
        record = {
            "image_id": image_id,
            "file_name": os.path.join(image_root, image["file_name"]),
            "height": image["height"],
            "width": image["width"],
            "boxes": np.array([o[0] for o in objs], dtype=np.float32).reshape(-1, 4),
            "labels": np.array([o[1] for o in objs], dtype=np.int64),
            "segmentations": [o[2] for o in objs],
        }
        if keypoint_meta is not None:
            k = keypoint_meta.num_keypoints
            record["keypoints"] = np.array([o[3] for o in objs], dtype=np.float32).reshape(-1, k, 3)
        records.append(record)
    if not records:
        raise DataError(f"{where} lists no images; an empty dataset cannot be trained or tested on. "
                        "Point the dataset at an annotation file with images.")
    return COCODataset(name, source, image_root, coco, records, without_mask, format=format,
                       keypoint_meta=keypoint_meta)


def read_categories(json_file: str, name: str | None = None) -> dict[int, str]:
    """The categories ``{id: name}`` of a COCO annotation file, checked, without validating its images or
    annotations (no image is opened)."""
    name = name or os.path.splitext(os.path.basename(json_file))[0]
    categories = _check_categories(_read_json(json_file, name)["categories"], f"{json_file} (dataset '{name}')")
    return dict(sorted(categories.items()))


def require_masks(datasets: Sequence[COCODataset]) -> None:
    """Fail up-front (not in a worker) when an annotation used for training has no segmentation."""
    for d in datasets:
        if d.annotations_without_mask:
            ids = d.annotations_without_mask
            raise DataError(
                f"MODEL.MASK_ON is True but {len(ids)} annotations of dataset '{d.name}' ({d.json_file}) have no "
                f"usable 'segmentation' (polygons with at least 3 points, or RLE), e.g. annotation ids {ids[:5]}. "
                "Add their masks, or set MODEL.MASK_ON False to train on boxes only."
            )


def _read_json(json_file: str, name: str) -> dict[str, Any]:
    if not os.path.isfile(json_file):
        raise DataError(f"Annotation file of dataset '{name}' not found: {json_file}. "
                        "Check the path (see data/README.md for the expected layout).")
    try:
        with open(json_file, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"Annotation file {json_file} of dataset '{name}' is not valid JSON ({exc}); it may be "
                        "truncated: fix or re-download it.") from exc
    if isinstance(data, list):
        raise DataError(f"Annotation file {json_file} of dataset '{name}' holds a list (it looks like a detection "
                        "results file), not a COCO dataset dict with 'images', 'annotations' and 'categories'.")
    if not isinstance(data, dict) or not isinstance(data.get("images"), list) or not isinstance(
        data.get("categories"), list
    ):
        keys = sorted(data)[:8] if isinstance(data, dict) else type(data).__name__
        raise DataError(f"Annotation file {json_file} of dataset '{name}' is not in COCO format: it needs the lists "
                        f"'images', 'annotations' and 'categories' (found {keys}).")
    data.setdefault("annotations", [])  # image-info files (test sets) have none
    if not isinstance(data["annotations"], list):
        raise DataError(f"'annotations' in {json_file} must be a list of COCO annotations.")
    return data


def _check_categories(categories: list[Any], where: str) -> dict[int, str]:
    result: dict[int, str] = {}
    for i, cat in enumerate(categories):
        if not isinstance(cat, dict) or not isinstance(cat.get("id"), int) or "name" not in cat:
            raise DataError(f"Category #{i} in {where} needs an integer 'id' and a 'name', got {cat!r}.")
        if cat["id"] in result:
            raise DataError(f"Category id {cat['id']} appears twice in {where}; category ids must be unique.")
        result[cat["id"]] = str(cat["name"])
    if not result:
        raise DataError(f"{where} defines no categories; add the 'categories' list.")
    return result


def _apply_class_list(
    data: dict[str, Any], categories: dict[int, str], classes: Sequence[str], where: str, origins: Mapping[int, str]
) -> dict[int, str]:
    """Renumber ``data``'s categories (in place) to ids 1..K in the order of ``classes``, matched by name."""
    new_id = {name: i + 1 for i, name in enumerate(classes)}
    annotated = {ann.get("category_id"): ann for ann in data["annotations"] if isinstance(ann, dict)}
    for cid, name in categories.items():
        if name not in new_id and cid in annotated:
            ann = annotated[cid]
            culprit = origins.get(ann.get("id"), f"annotation {ann.get('id')}")
            raise DataError(f"{where}: class '{name}' ({culprit}) is not in the dataset's `classes` list "
                            f"{list(classes)}. Add it to `classes` in the DATA.CUSTOM entry, or remove its "
                            "annotations.")
    old_to_new = {cid: new_id[name] for cid, name in categories.items() if name in new_id}
    for ann in data["annotations"]:
        if isinstance(ann, dict) and ann.get("category_id") in old_to_new:
            ann["category_id"] = old_to_new[ann["category_id"]]
    old = {str(c["name"]): c for c in data["categories"]}  # keypoint names and skeleton stay with their class
    data["categories"] = [{**old.get(name, {}), "id": i + 1, "name": name} for i, name in enumerate(classes)]
    return {i + 1: name for i, name in enumerate(classes)}


def _check_images(images: list[Any], image_root: str, where: str) -> dict[int, dict[str, Any]]:
    result: dict[int, dict[str, Any]] = {}
    for i, img in enumerate(images):
        if not isinstance(img, dict) or "id" not in img or "file_name" not in img:
            raise DataError(f"Image #{i} in {where} needs an 'id' and a 'file_name', got {img!r}.")
        if img["id"] in result:
            raise DataError(f"Image id {img['id']} appears twice in {where}; image ids must be unique.")
        sizes = [img.get(k) for k in ("width", "height")]
        if any(v and (not isinstance(v, (int, float)) or isinstance(v, bool)) for v in sizes):
            raise DataError(f"Image id {img['id']} in {where} has width {sizes[0]!r} and height {sizes[1]!r}; "
                            "they must be numbers of pixels (or left out, to be read from the image).")
        if not img.get("height") or not img.get("width"):
            img["width"], img["height"] = _size_from_header(os.path.join(image_root, img["file_name"]), img["id"])
        result[img["id"]] = img
    return result


def _size_from_header(path: str, image_id: Any) -> tuple[int, int]:
    """(width, height) for images whose JSON entry lacks them, from the file header only (as opencv decodes it)."""
    return image_size(path, f"Image id {image_id} (no width/height in the JSON)")


def _check_annotations(
    annotations: list[Any], images: dict[int, dict[str, Any]], categories: dict[int, str], where: str
) -> list[dict[str, Any]]:
    seen: set[Any] = set()
    for i, ann in enumerate(annotations):
        if not isinstance(ann, dict) or not {"id", "image_id", "category_id", "bbox"} <= ann.keys():
            raise DataError(f"Annotation #{i} in {where} needs 'id', 'image_id', 'category_id' and 'bbox', "
                            f"got {ann!r}.")
        ann_id = ann["id"]
        if ann_id in seen:
            raise DataError(f"Annotation id {ann_id} appears twice in {where}; annotation ids must be unique.")
        if ann_id == 0:
            raise DataError(f"Annotation id 0 in {where}: pycocotools' COCOeval reads id 0 as 'unmatched', "
                            "so the AP would be wrong. Number annotations from 1.")
        seen.add(ann_id)
        if ann["image_id"] not in images:
            raise DataError(f"Annotation {ann_id} in {where} refers to image id {ann['image_id']!r}, "
                            "which is not in 'images'. Fix the image_id or add the image.")
        if ann["category_id"] not in categories:
            raise DataError(f"Annotation {ann_id} in {where} (image id {ann['image_id']}) has category id "
                            f"{ann['category_id']!r}, which is not in 'categories' (known ids: "
                            f"{sorted(categories)}). Fix the category_id or add the category.")
        bbox = ann["bbox"]
        if not isinstance(bbox, (list, tuple)) or len(bbox) != 4 or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in bbox
        ):
            raise DataError(f"Annotation {ann_id} in {where} (image id {ann['image_id']}) has bbox {bbox!r}; "
                            "COCO boxes are [x, y, width, height] numbers.")
        if not all(math.isfinite(v) for v in bbox):  # NaN compares False to every bound: it would pass as a box
            raise DataError(f"Annotation {ann_id} in {where} (image id {ann['image_id']}) has bbox {bbox!r}, which "
                            "holds NaN or infinity. Fix or remove the annotation.")
        ann.setdefault("iscrowd", 0)
        ann.setdefault("area", float(bbox[2]) * float(bbox[3]))
    return annotations


def _keypoint_meta(categories: list[dict[str, Any]], where: str) -> KeypointMeta | None:
    """The points the categories name (``keypoints`` and ``skeleton``, COCO's person_keypoints layout); one list for
    every category that has one, as a model predicts the same K points for every class. None when none has."""
    named = [c for c in categories if c.get("keypoints")]
    if not named:
        return None
    names = named[0]["keypoints"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise DataError(f"Category '{named[0]['name']}' in {where} has keypoints {str(names)[:80]}; it must be a "
                        "list of point names, as in COCO's person_keypoints files.")
    for other in named[1:]:
        if other["keypoints"] != names:
            raise DataError(f"Categories '{named[0]['name']}' and '{other['name']}' in {where} name different "
                            f"keypoints ({names} against {other['keypoints']}); a keypoint model predicts one list "
                            "of points for every class. Give every category the same `keypoints` list (points a "
                            "class lacks stay unlabelled, visibility 0).")
    skeleton = next((c["skeleton"] for c in named if c.get("skeleton")), [])
    if not isinstance(skeleton, list) or not all(isinstance(p, list) and len(p) == 2 for p in skeleton):
        raise DataError(f"The keypoint skeleton in {where} is {str(skeleton)[:80]}; it must be a list of 1-based "
                        "pairs [[a, b], ...] of points to join, as in COCO's files.")
    return KeypointMeta.build(names, skeleton=skeleton)


def _check_all_keypoints(
    annotations: list[dict[str, Any]], images: dict[int, dict[str, Any]], num_keypoints: int, where: str,
    origins: Mapping[int, str],
) -> dict[Any, np.ndarray]:
    """Every annotation's keypoints [K, 3], checked; the ground truth gains ``keypoints`` (zeros) and
    ``num_keypoints`` (the labelled points) where an annotation lacks them."""
    result = {}
    for ann in annotations:
        if ann.get("keypoints") is None:
            ann["keypoints"] = [0] * (3 * num_keypoints)
        image = images[ann["image_id"]]
        what = origins.get(ann["id"]) or f"Annotation {ann['id']} in {where} (image id {ann['image_id']})"
        points = check_keypoints(ann["keypoints"], num_keypoints, image["width"], image["height"], what)
        ann.setdefault("num_keypoints", int(np.count_nonzero(points[:, 2])))
        result[ann["id"]] = points
    return result


def _set_box(ann: dict[str, Any], box: list[float]) -> None:
    """Write the XYXY ``box`` training uses into a converted annotation when clipping changed it (the area of a
    box without a polygon follows); an unchanged one keeps its exact numbers."""
    x, y, w, h = (float(v) for v in ann["bbox"])
    if box != [x, y, x + w, y + h]:
        ann["bbox"] = [box[0], box[1], box[2] - box[0], box[3] - box[1]]
        if "segmentation" not in ann:
            ann["area"] = ann["bbox"][2] * ann["bbox"][3]


def _segmentation(ann: dict[str, Any], image: dict[str, Any], where: str) -> Any:
    """The annotation's mask as float64 polygons or an RLE dict; None when it has none.

    Polygons with fewer than 3 points are dropped (pycocotools would read a 2-point one
    as a box). A malformed segmentation or an RLE of another size than the image is an error.
    """
    segm = ann.get("segmentation")
    if not segm:
        return None
    what = f"Annotation {ann['id']} in {where} (image id {ann['image_id']})"
    if isinstance(segm, dict):
        if "counts" not in segm or "size" not in segm:
            raise DataError(f"{what} has an RLE segmentation without 'counts' and 'size': {str(segm)[:80]}.")
        if list(segm["size"]) != [image["height"], image["width"]]:
            raise DataError(f"{what} has an RLE mask of size {list(segm['size'])} (height, width) but the image is "
                            f"{image['height']}x{image['width']}. Fix the mask or the image's width/height.")
        return segm
    try:
        polygons = [np.asarray(p, dtype=np.float64) for p in segm]
    except (TypeError, ValueError) as exc:
        raise DataError(f"{what} has a segmentation that is neither RLE nor a list of polygons "
                        f"[x0, y0, x1, y1, ...]: {str(segm)[:80]}.") from exc
    if any(p.ndim != 1 for p in polygons):
        raise DataError(f"{what} has a segmentation that is neither RLE nor a list of polygons "
                        f"[x0, y0, x1, y1, ...]: {str(segm)[:80]}.")
    polygons = [p for p in polygons if len(p) >= 6 and len(p) % 2 == 0]
    return polygons or None


class _BoxFixer:
    """Turns COCO [x, y, w, h] into XYXY, rejecting (strict) or clipping/dropping bad boxes and counting them.

    What is scored follows what is trained on for the sets Pet converts (YOLO, VOC, CSV): their
    evaluation ground truth leaves the dropped boxes out and holds the clipped ones as clipped, so a
    box no detector could find (an empty one, one outside its image) is not counted as a miss. A
    COCO file is the user's own ground truth and is scored as it is.
    """

    def __init__(self, where: str, strict: bool, origins: Mapping[int, str]) -> None:
        self.where = where
        self.strict = strict
        self.origins = origins
        self.clipped: list[Any] = []
        self.dropped: list[Any] = []

    def __call__(self, ann: dict[str, Any], width: int, height: int) -> list[float] | None:
        x, y, w, h = (float(v) for v in ann["bbox"])
        x1, y1, x2, y2 = x, y, x + w, y + h
        degenerate = not (w > 0 and h > 0)
        tol = _OUTSIDE_TOLERANCE
        outside = x1 < -tol or y1 < -tol or x2 > width + tol or y2 > height + tol
        if not (degenerate or outside):
            return [max(x1, 0.0), max(y1, 0.0), min(x2, width), min(y2, height)]
        problem = "has zero or negative size" if degenerate else f"lies outside the {width}x{height} image"
        if self.strict:
            if ann["id"] in self.origins:
                culprit = f"{self.origins[ann['id']]}: box (x1, y1, x2, y2) = {_rounded((x1, y1, x2, y2))}"
            else:
                culprit = f"Annotation {ann['id']} in {self.where} (image id {ann['image_id']}): bbox {ann['bbox']}"
            raise DataError(f"{culprit} {problem}. Fix it, or set DATA.STRICT False to clip such boxes.")
        box = [min(max(x1, 0.0), width), min(max(y1, 0.0), height), min(max(x2, 0.0), width),
               min(max(y2, 0.0), height)]
        culprit = self.origins.get(ann["id"], ann["id"])
        if box[2] - box[0] <= 0 or box[3] - box[1] <= 0:
            self.dropped.append(culprit)
            return None
        self.clipped.append(culprit)
        return box

    def report(self, rewritten: bool) -> None:
        """One warning for all the boxes fixed; ``rewritten``: the ground truth was changed to match (see above)."""
        if self.clipped or self.dropped:
            what = "labels" if self.origins else "annotation ids"
            scored = "evaluation scores against the same boxes" if rewritten else \
                "evaluation scores against the file as it is"
            logger.warning(
                f"{self.where}: clipped {len(self.clipped)} boxes that stick out of their image "
                f"(e.g. {what} {self.clipped[:5]}) and dropped {len(self.dropped)} empty or fully "
                f"outside boxes (e.g. {self.dropped[:5]}) for training; {scored}. Set DATA.STRICT True to "
                "reject them instead."
            )


def _rounded(values: Sequence[float]) -> tuple[float, ...]:
    return tuple(round(float(v), 2) for v in values)
