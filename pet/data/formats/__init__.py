"""Annotation formats read as they are: COCO JSON, Ultralytics YOLO, Pascal VOC and CSV.

Each reader turns its files into a COCO-format dict in memory (:class:`ReadAnnotations`), which
then goes through the same validation as a COCO file (:func:`pet.data.coco_json.build_coco_dataset`),
so every format gives the same kind of dataset to training, evaluation and the tools. Class ids
follow docs/data.md: the entry's ``classes`` list when given, else COCO's categories, YOLO's ``names``
(index i -> id i + 1), or the sorted class names of a VOC or CSV set (ids 1..K).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from pet.data.formats.common import ReadAnnotations, image_size
from pet.data.formats.csv import CSV_COLUMNS, read_csv
from pet.data.formats.voc import read_voc
from pet.data.formats.yolo import read_yolo

__all__ = ["FORMATS", "CSV_COLUMNS", "ReadAnnotations", "image_size", "read_annotations", "read_csv",
           "read_voc", "read_yolo"]

# The values of a DATA.CUSTOM entry's `format`.
FORMATS = ("coco", "yolo", "voc", "csv")


def read_annotations(
    format: str,
    path: str,
    *,
    images: str = "",
    split: str = "",
    classes: Sequence[str] | None = None,
    columns: Mapping[str, str] | None = None,
) -> ReadAnnotations:
    """The annotations of a ``yolo``, ``voc`` or ``csv`` dataset (``coco`` files are read by ``load_coco_json``)."""
    if format == "yolo":
        return read_yolo(path, split, classes)
    if format == "voc":
        return read_voc(path, split, classes)
    if format == "csv":
        return read_csv(path, images or None, classes, columns)
    raise ValueError(f"read_annotations reads {FORMATS[1:]}, not {format!r}")
