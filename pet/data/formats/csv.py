"""A CSV of boxes, one row per box, as annotation tools and keras-retinanet / DeepForest write it: :func:`read_csv`.

Columns ``image_path, xmin, ymin, xmax, ymax, label`` (pixels, XYXY), in that order when the file
has no header. A header (told apart by its non-numeric coordinate columns) may order them freely
and add others; ``columns`` (``{role: header name}``) names them when the header uses other
names, e.g. ``{image_path: filename, label: class}``. An image without boxes is a row with the
path and nothing else (``path,,,,,``) or with an all-zero box (``path,0,0,0,0,label``).

Image paths are relative to ``image_root`` (default: the CSV's folder) unless absolute. Images
are numbered 1..N in the order they first appear; their sizes come from the file headers, after
EXIF orientation, as opencv decodes them. Without ``classes``, the class list is the sorted labels
of the file's boxes.
"""
from __future__ import annotations

import csv
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from pet.data.formats.common import ClassList, ReadAnnotations, image_size, relative_to
from pet.utils.errors import DataError

__all__ = ["read_csv", "CSV_COLUMNS"]

CSV_COLUMNS = ("image_path", "xmin", "ymin", "xmax", "ymax", "label")
_COORDS = CSV_COLUMNS[1:5]


def read_csv(
    csv_file: str,
    image_root: str | None = None,
    classes: Sequence[str] | None = None,
    columns: Mapping[str, str] | None = None,
) -> ReadAnnotations:
    """The boxes of ``csv_file`` as a COCO dict; see the module doc."""
    image_root = os.path.abspath(image_root or os.path.dirname(os.path.abspath(csv_file)))
    rows = _rows(csv_file)
    names, index, rows = _columns(rows, csv_file, columns)
    class_list = ClassList(classes)
    images: dict[str, dict[str, Any]] = {}
    boxes: list[tuple[str, str, list[float], str]] = []  # (image path, label, xyxy, where)
    for line_no, row in rows:
        where = f"{csv_file}:{line_no}"
        if len(row) != len(names):
            raise DataError(f"{where}: {len(row)} columns where {len(names)} are expected ({', '.join(names)}). "
                            "Fix the row.")
        path_text = row[index["image_path"]].strip()
        if not path_text:
            raise DataError(f"{where}: no image path. Every row names its image.")
        path = os.path.normpath(os.path.join(image_root, path_text))
        if path not in images:
            width, height = image_size(path, where)
            images[path] = {"id": len(images) + 1, "file_name": relative_to(path, image_root),
                            "width": width, "height": height}
        coords_text = [row[index[c]].strip() for c in _COORDS]
        label = row[index["label"]].strip()
        if not any(coords_text):
            if label:
                raise DataError(f"{where}: label '{label}' without a box. Give the box (xmin, ymin, xmax, ymax in "
                                "pixels), or leave the label empty too to mark an image without boxes.")
            continue  # an image without boxes
        coords = _coords(coords_text, where)
        if coords == [0.0, 0.0, 0.0, 0.0]:
            continue  # DeepForest's way of listing an image without boxes
        if not label:
            raise DataError(f"{where}: a box without a label. Add the class name, or leave the whole row empty "
                            "but for the image path to mark an image without boxes.")
        class_list.see(label, where)
        boxes.append((path, label, coords, where))
    if not images:
        raise DataError(f"{csv_file} lists no images; an empty dataset cannot be trained or tested on.")

    category_ids = class_list.ids()
    annotations, origins = [], {}
    for path, label, (x1, y1, x2, y2), where in boxes:
        ann_id = len(annotations) + 1
        annotations.append({"id": ann_id, "image_id": images[path]["id"], "category_id": category_ids[label],
                            "bbox": [x1, y1, x2 - x1, y2 - y1], "area": max(x2 - x1, 0) * max(y2 - y1, 0),
                            "iscrowd": 0})
        origins[ann_id] = where
    coco = {"images": list(images.values()), "annotations": annotations, "categories": class_list.categories()}
    return ReadAnnotations(coco, image_root, origins)


def _rows(csv_file: str) -> list[tuple[int, list[str]]]:
    """``(line number, fields)`` of every non-blank row."""
    if not os.path.isfile(csv_file):
        raise DataError(f"CSV file not found: {csv_file}. Point `path` of the DATA.CUSTOM entry at it.")
    rows = []
    try:
        with open(csv_file, encoding="utf-8-sig", newline="") as f:
            reader = csv.reader(f)
            for row in reader:
                if any(field.strip() for field in row):
                    rows.append((reader.line_num, row))
    except (csv.Error, UnicodeDecodeError) as exc:
        raise DataError(f"{csv_file} is not a readable CSV file ({exc}). Save it as UTF-8 CSV.") from exc
    if not rows:
        raise DataError(f"{csv_file} is empty; an empty dataset cannot be trained or tested on.")
    return rows


def _columns(
    rows: list[tuple[int, list[str]]], csv_file: str, columns: Mapping[str, str] | None
) -> tuple[list[str], dict[str, int], list[tuple[int, list[str]]]]:
    """The file's column names, where each role's column is, and the data rows (without the header, if any)."""
    unknown = sorted(set(columns or {}) - set(CSV_COLUMNS))
    if unknown:
        raise DataError(f"`columns` of the CSV dataset {csv_file} names unknown roles {unknown}; the roles are "
                        f"{list(CSV_COLUMNS)}.")
    first = [field.strip() for field in rows[0][1]]
    if not columns and not _is_header(first):
        return list(CSV_COLUMNS), {c: i for i, c in enumerate(CSV_COLUMNS)}, rows
    wanted = {role: (columns or {}).get(role, role) for role in CSV_COLUMNS}
    missing = [f"{role} ('{name}')" if name != role else role for role, name in wanted.items() if name not in first]
    if missing:
        raise DataError(f"{csv_file}:{rows[0][0]}: the header {first} lacks the columns {missing}. Name the file's "
                        "columns with `columns: {image_path: ..., xmin: ..., ymin: ..., xmax: ..., ymax: ..., "
                        "label: ...}` in the DATA.CUSTOM entry.")
    return first, {role: first.index(name) for role, name in wanted.items()}, rows[1:]


def _is_header(fields: list[str]) -> bool:
    """A first row whose coordinate columns hold words (not numbers, not empty) is a header."""
    for text in fields[1:5]:
        if text:
            try:
                float(text)
            except ValueError:
                return True
    return False


def _coords(texts: list[str], where: str) -> list[float]:
    try:
        coords = [float(t) for t in texts]
    except ValueError:
        coords = [math.nan]
    if not all(math.isfinite(c) for c in coords):  # 'nan' and 'inf' parse as floats
        raise DataError(f"{where}: the box {texts} is not four numbers (xmin, ymin, xmax, ymax in pixels). "
                        "Fix the row, or leave all four and the label empty for an image without boxes.")
    return coords
