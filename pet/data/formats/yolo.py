"""Ultralytics' YOLO layout, read as it is: :func:`read_yolo`.

A ``data.yaml`` names the dataset root (``path``, relative to the yaml's folder; the folder itself
when absent), the splits (``train``, ``val``, ``test``: a folder searched recursively for images, a
text file listing image paths (relative ones from the text file's folder), or a list of those; a
single split path starting with ``../`` that does not exist is read without the ``../``, as
Ultralytics does for Roboflow's exports) and the classes (``names``: a list, or a dict
``{index: name}`` whose indices may be quoted; ``nc``, if given, must be their number; ``nc`` alone
names them ``class_0``, ``class_1``, ...). Each image's label file is its path with the last ``/images/``
replaced by ``/labels/`` and the extension by ``.txt`` (Ultralytics' ``img2label_paths``). A label
line is ``class cx cy w h`` normalised by the image size, or ``class x1 y1 x2 y2 ...`` (three or
more points), a polygon, used as the segmentation and its extent as the box; in a pose set
(``kpt_shape: [K, 2 or 3]`` in the yaml) it is the box alone or the box and its K keypoints
(``x y`` or ``x y visibility`` each, normalised like the box; with two values a point is visible
(COCO's 2) except one at exactly (0, 0), which converters write for a missing point (0); a box alone has
none labelled), nothing else. ``flip_idx`` (the point each one becomes in a mirrored image; default:
each stays itself) and ``kpt_names`` (a list, or a dict {index: name}; default ``kp_0``, ``kp_1``, ...)
make the set's :class:`~pet.data.keypoints.KeypointMeta`. A missing or empty label file makes a
background image. A line repeated in one file is read once, with a warning, as Ultralytics does: a
repeat is one object counted twice, a sure miss in evaluation.

Images are numbered 1..N in sorted path order (Ultralytics' order); their sizes come from the
file headers, after EXIF orientation, as opencv decodes them. Class index i is ``names[i]``, id
i + 1 (or its place in the entry's ``classes``). Unlike Ultralytics, which drops an image with a
bad label and goes on, a bad line stops loading with its ``file:line``.
"""
from __future__ import annotations

import glob
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import yaml

from pet.data.formats.common import (
    IMAGE_EXTENSIONS,
    ClassList,
    ReadAnnotations,
    check_class_names,
    image_size,
    relative_to,
)
from pet.data.keypoints import KeypointMeta
from pet.utils.errors import DataError

__all__ = ["read_yolo", "label_path"]

logger = logging.getLogger(__name__)

# Normalised values may overshoot [0, 1] by this much (Ultralytics' own tolerance for rounding in tools);
# what then sticks out of the image is clipped (or rejected with DATA.STRICT) like any box.
_TOLERANCE = 0.01
# Pixel coordinates from normalised labels are rounded to this many decimals (see _annotation).
_DECIMALS = 6


def label_path(image_path: str) -> str:
    """The label file of an image: the last ``/images/`` of its path becomes ``/labels/``, the extension ``.txt``."""
    images, labels = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
    return labels.join(image_path.rsplit(images, 1)).rsplit(".", 1)[0] + ".txt"


def read_yolo(data_yaml: str, split: str, classes: Sequence[str] | None = None) -> ReadAnnotations:
    """The ``split`` (a key of ``data_yaml``: ``train``, ``val`` or ``test``) as a COCO dict; see the module doc."""
    config = _read_yaml(data_yaml)
    folder = os.path.dirname(os.path.abspath(data_yaml))
    root = os.path.normpath(os.path.join(folder, str(config.get("path") or "")))
    if split not in config or not config[split]:
        present = [k for k in ("train", "val", "test") if config.get(k)]
        raise DataError(f"{data_yaml} has no '{split}' split (it has {present}). Set `split` in the DATA.CUSTOM "
                        "entry to one of them.")
    names = _names(config, data_yaml)
    class_list = ClassList(classes, default=names)
    image_paths, label_files = _list_images(config[split], root, data_yaml, split)
    category_ids = class_list.ids()  # known up-front: `names` (or `classes`) lists every class
    kpt_shape = _kpt_shape(config, data_yaml)
    keypoint_meta = _keypoint_meta(config, kpt_shape, data_yaml) if kpt_shape else None

    images, annotations, origins = [], [], {}
    for image_id, path in enumerate(image_paths, 1):
        labels = label_path(path)
        label_files.append(labels)
        width, height = image_size(path, labels if os.path.isfile(labels) else data_yaml)
        images.append({"id": image_id, "file_name": relative_to(path, root), "width": width, "height": height})
        for line_no, cls, values, points in _read_label_file(labels, names, kpt_shape):
            where = f"{labels}:{line_no}"
            class_list.see(names[cls], where)
            ann = _annotation(len(annotations) + 1, image_id, values, width, height)
            ann["category_id"] = category_ids[names[cls]]
            if kpt_shape:
                ann["keypoints"] = _keypoints(points, kpt_shape, width, height)
            annotations.append(ann)
            origins[ann["id"]] = where
    coco = {"images": images, "annotations": annotations, "categories": class_list.categories()}
    return ReadAnnotations(coco, root, origins, label_files, keypoint_meta)


def _read_yaml(data_yaml: str) -> dict[str, Any]:
    if not os.path.isfile(data_yaml):
        raise DataError(f"YOLO data file not found: {data_yaml}. Point `path` of the DATA.CUSTOM entry at the "
                        "dataset's data.yaml.")
    try:
        with open(data_yaml, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{data_yaml}:{mark.line + 1}" if mark else data_yaml
        raise DataError(f"{where}: not valid YAML ({getattr(exc, 'problem', exc)}). Fix the data.yaml.") from exc
    if not isinstance(config, dict):
        raise DataError(f"{data_yaml} is not a YOLO data.yaml: it must be a mapping with 'path', 'train', 'val' "
                        "and 'names'.")
    return config


def _names(config: dict[str, Any], data_yaml: str) -> list[str]:
    names, nc = config.get("names"), config.get("nc")
    if isinstance(names, dict):
        try:  # keys '0', '1' (a yaml written with quoted keys) are indices too, as Ultralytics reads them
            indexed = {int(k): v for k, v in names.items()}
        except (TypeError, ValueError):
            indexed = {}
        if sorted(indexed) != list(range(len(names))):
            raise DataError(f"'names' in {data_yaml} must be indexed 0..{len(names) - 1} (class index -> name), "
                            f"got indices {sorted(names, key=str)[:10]}.")
        names = [indexed[i] for i in range(len(names))]
    if isinstance(names, list) and isinstance(nc, int) and nc != len(names):  # Ultralytics refuses it too
        raise DataError(f"{data_yaml}: 'nc' is {nc} but 'names' lists {len(names)} classes. Make nc the number "
                        "of names, or drop nc.")
    if names is None and isinstance(nc, int):
        names = [f"class_{i}" for i in range(nc)]  # Ultralytics' names for a set that gives only nc
    if not isinstance(names, list) or not names:
        raise DataError(f"{data_yaml} has no class list: add 'names' (a list, or a dict {{0: name, ...}}).")
    return check_class_names(names, data_yaml)


def _kpt_shape(config: dict[str, Any], data_yaml: str) -> tuple[int, int] | None:
    """``kpt_shape`` ([K, 2] or [K, 3]) of a pose set, checked; None for a detection set."""
    shape = config.get("kpt_shape")
    if shape is None:
        return None
    if (not isinstance(shape, list) or len(shape) != 2 or not all(isinstance(v, int) for v in shape)
            or shape[0] < 1 or shape[1] not in (2, 3)):
        raise DataError(f"{data_yaml}: kpt_shape {shape!r} must be [K, 2] or [K, 3] (K keypoints of x, y or x, y, "
                        "visibility), as in Ultralytics' pose sets.")
    return shape[0], shape[1]


def _keypoint_meta(config: dict[str, Any], kpt_shape: tuple[int, int], data_yaml: str) -> KeypointMeta:
    """The points of a pose set: ``kpt_names`` (default ``kp_<i>``) and ``flip_idx`` (default: no point swaps)."""
    k = kpt_shape[0]
    names = config.get("kpt_names")
    if isinstance(names, dict):  # Ultralytics writes {0: nose, ...}, or per class {0: [nose, ...]}: one list for all
        names = next(iter(names.values())) if names and isinstance(next(iter(names.values())), list) else \
            [names.get(i, names.get(str(i))) for i in range(len(names))]
    names = names or [f"kp_{i}" for i in range(k)]
    if len(names) != k:
        raise DataError(f"{data_yaml}: kpt_names lists {len(names)} names but kpt_shape says {k} keypoints. Make them "
                        "agree.")
    flip = config.get("flip_idx")
    if flip is None:
        flip = list(range(k))
    if not isinstance(flip, list) or len(flip) != k or not all(isinstance(i, int) for i in flip):
        raise DataError(f"{data_yaml}: flip_idx {flip!r} must list {k} point indices (point i becomes point "
                        f"flip_idx[i] in a horizontally flipped image), as kpt_shape says {k} keypoints.")
    try:
        return KeypointMeta.build([str(n) for n in names], flip_map=flip)
    except DataError as exc:
        raise DataError(f"{data_yaml}: {exc}") from None


def _keypoints(points: np.ndarray | None, kpt_shape: tuple[int, int], width: int, height: int) -> list[float]:
    """COCO's flat (x, y, visibility) * K in pixels of a label line's normalised points (None: a box alone)."""
    k, ndim = kpt_shape
    if points is None:
        return [0.0] * (3 * k)
    points = points.reshape(k, ndim)
    xy = np.round(points[:, :2] * np.array([width, height], dtype=np.float64), _DECIMALS)
    if ndim == 3:
        visibility = points[:, 2]
    else:  # x y alone: labelled and visible, but for the (0, 0) converters write for a missing point
        visibility = np.where((points[:, 0] == 0) & (points[:, 1] == 0), 0.0, 2.0)
    xy[visibility == 0] = 0.0
    return np.concatenate([xy, visibility[:, None]], axis=1).reshape(-1).tolist()


def _list_images(source: Any, root: str, data_yaml: str, split: str) -> tuple[list[str], list[str]]:
    """Image paths of a split, sorted (Ultralytics sorts the images of all its sources together), and where they
    were listed: every folder searched and every list file, whose times change when an image is added or removed
    (the dataset cache's stamp, :func:`pet.data.catalog.get_dataset`)."""
    paths: list[str] = []
    listings: list[str] = []
    for entry in source if isinstance(source, list) else [source]:
        where = os.path.normpath(os.path.join(root, str(entry)))
        if not os.path.exists(where) and isinstance(source, str) and source.startswith("../"):
            # Roboflow's export: `train: ../train/images` beside the yaml; Ultralytics then drops the ../
            where = os.path.normpath(os.path.join(root, source[3:]))
        if os.path.isdir(where):
            listings += [folder for folder, _, _ in os.walk(where, followlinks=True)]  # glob's ** follows links too
            paths += [p for p in glob.glob(os.path.join(glob.escape(where), "**", "*.*"), recursive=True)
                      if p.lower().endswith(IMAGE_EXTENSIONS)]
        elif os.path.isfile(where):
            listings.append(where)
            with open(where, encoding="utf-8-sig") as f:  # -sig: Windows tools start the file with a BOM
                lines = [line.strip() for line in f if line.strip()]
            paths += [os.path.normpath(os.path.join(os.path.dirname(where), line)) for line in lines]
        else:
            raise DataError(f"{data_yaml}: the '{split}' images {where} do not exist (a folder or a text file of "
                            "image paths is expected). Fix the path in the data.yaml.")
    if not paths:
        raise DataError(f"{data_yaml}: the '{split}' split has no images in {source}. Check the path.")
    return sorted(paths), listings


def _read_label_file(
    path: str, names: Sequence[str], kpt_shape: tuple[int, int] | None
) -> list[tuple[int, int, np.ndarray, np.ndarray | None]]:
    """``(line number, class index, box or polygon values, keypoint values or None)`` of each label line; a missing
    file has none (a background image)."""
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8-sig") as f:
        lines = f.read().splitlines()
    box_values = 5 if kpt_shape is None else 5 + kpt_shape[0] * kpt_shape[1]  # a pose set: the box, then keypoints
    rows, seen, duplicates = [], set(), 0
    for line_no, line in enumerate(lines, 1):
        fields = line.split()
        if not fields:
            continue
        where = f"{path}:{line_no}"
        try:
            values = np.array([float(v) for v in fields], dtype=np.float64)
        except ValueError:
            values = None
        if values is None or not np.isfinite(values).all():  # 'nan' and 'inf' parse as floats
            raise DataError(f"{where}: '{line.strip()[:80]}' is not numbers; a YOLO label line is "
                            "'class cx cy w h' (or 'class x1 y1 x2 y2 ...' for a polygon).")
        if kpt_shape is not None and len(values) not in (5, box_values):  # not a polygon: a pose set has none
            raise DataError(f"{where}: {len(values)} values; with kpt_shape {list(kpt_shape)} in the data.yaml a label "
                            f"line is 'class cx cy w h' and {box_values - 5} keypoint values ({box_values} in all). "
                            "Fix the line, or the data.yaml's kpt_shape.")
        points = values[5:] if kpt_shape is not None and len(values) > 5 else None
        if kpt_shape is not None:
            values = values[:5]
        if len(values) != 5 and (len(values) < 7 or len(values) % 2 == 0):
            raise DataError(f"{where}: {len(values)} values; a YOLO label line is 'class cx cy w h' (5 values) or "
                            "'class x1 y1 x2 y2 x3 y3 ...' (a polygon of 3 or more points). Fix the line.")
        cls = values[0]
        if cls != int(cls) or not 0 <= cls < len(names):
            raise DataError(f"{where}: class index {fields[0]} is not one of the {len(names)} classes of the "
                            f"data.yaml (0..{len(names) - 1}). Fix the label or the data.yaml's 'names'.")
        coords = values[1:]
        if coords.min() < -_TOLERANCE or coords.max() > 1 + _TOLERANCE:
            raise DataError(f"{where}: coordinates {fields[1:][:8]} are not normalised to [0, 1] (YOLO labels "
                            "are fractions of the image width and height; these look like pixels). Divide them by "
                            "the image size.")
        key = tuple(values) + (tuple(points) if points is not None else ())
        if key in seen:
            duplicates += 1
            continue
        seen.add(key)
        rows.append((line_no, int(cls), coords, points))
    if duplicates:
        logger.warning(f"{path}: removed {duplicates} duplicate label lines (each repeats an earlier line of the "
                       "file), as Ultralytics does. Remove them from the file to silence this.")
    return rows


def _annotation(ann_id: int, image_id: int, coords: np.ndarray, width: int, height: int) -> dict[str, Any]:
    """The COCO annotation of one label line, in pixels rounded to 1e-6 px: far below the labels' own
    precision, it removes the float noise of the normalisation, so that a box written from pixel
    coordinates reads back as exactly those (a label's 0.0 edge is 0, not 2e-9)."""
    scale = np.array([width, height], dtype=np.float64)
    if len(coords) == 4:
        cx, cy, w, h = coords * np.tile(scale, 2)
        x0, y0, x1, y1 = np.round([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], _DECIMALS)
        box = [float(x0), float(y0), float(x1 - x0), float(y1 - y0)]
        return {"id": ann_id, "image_id": image_id, "bbox": box, "area": box[2] * box[3], "iscrowd": 0}
    points = np.round(coords.reshape(-1, 2) * scale, _DECIMALS)
    (x0, y0), (x1, y1) = points.min(axis=0), points.max(axis=0)
    xs, ys = points[:, 0], points[:, 1]
    area = 0.5 * abs(float(np.dot(xs, np.roll(ys, 1)) - np.dot(ys, np.roll(xs, 1))))  # shoelace
    box = [float(x0), float(y0), float(x1 - x0), float(y1 - y0)]
    return {"id": ann_id, "image_id": image_id, "bbox": box, "area": area, "iscrowd": 0,
            "segmentation": [points.reshape(-1).tolist()]}
