"""Pascal VOC, read as the devkit lays it out: :func:`read_voc`.

``root/ImageSets/Main/<split>.txt`` lists the image ids (the first word of each line), each
with ``root/Annotations/<id>.xml`` and its image ``root/JPEGImages/<filename>`` (the XML's
``filename``, else ``<id>.jpg``). VOC coordinates are 1-based pixel indices, possibly floats; a
box becomes ``[xmin - 1, ymin - 1, xmax, ymax]`` in continuous 0-based coordinates, as
detectron2 reads them, so a box covering pixels 1..10 is 10 pixels wide. ``pose``, ``truncated``
and ``occluded`` are read past. A ``difficult`` object becomes a COCO crowd region: COCOeval and the
VOC metric ignore detections on it, and training leaves it out (as MMDetection does; detectron2
trains on it).

Without ``classes``, the class list is the sorted names over every XML in ``Annotations/`` (all
splits), which for VOC is its canonical order; images are numbered 1..N in the split file's order;
the sizes come from the XML (from the image header when it gives none).
"""
from __future__ import annotations

import math
import os
import xml.etree.ElementTree as ET
from collections.abc import Sequence

from pet.data.formats.common import ClassList, ReadAnnotations, image_size
from pet.utils.errors import DataError

__all__ = ["read_voc"]

_BOX_TAGS = ("xmin", "ymin", "xmax", "ymax")


def read_voc(root: str, split: str, classes: Sequence[str] | None = None) -> ReadAnnotations:
    """The images of ``ImageSets/Main/<split>.txt`` under the VOC ``root`` as a COCO dict; see the module doc."""
    ids = _split_ids(root, split)
    annotations_dir = os.path.join(root, "Annotations")
    if not os.path.isdir(annotations_dir):
        raise DataError(f"VOC root {root} has no Annotations/ folder (the XML files). Is `path` the VOC root (holding "
                        "Annotations/, JPEGImages/ and ImageSets/Main/)?")
    image_root = os.path.join(root, "JPEGImages")
    class_list = ClassList(classes)
    label_files = [os.path.join(root, "ImageSets", "Main", f"{split}.txt")]
    if not classes:  # the list comes from every XML, so each split of the root gets the same one
        label_files.append(annotations_dir)  # its listing: an XML added or removed changes the list
        for name in sorted(os.listdir(annotations_dir)):
            if name.endswith(".xml"):
                xml_file = os.path.join(annotations_dir, name)
                label_files.append(xml_file)
                for k, obj in enumerate(_parse(xml_file).findall("object"), 1):
                    class_list.see(_object_name(obj, xml_file, k), f"{xml_file}, <object> #{k}")

    images, annotations, origins = [], [], {}
    for image_id, (line_where, stem) in enumerate(ids, 1):
        xml_file = os.path.join(annotations_dir, f"{stem}.xml")
        label_files.append(xml_file)
        if not os.path.isfile(xml_file):
            raise DataError(f"{line_where}: image id '{stem}' has no annotation file {xml_file}. Add it or remove "
                            "the id from the split file.")
        tree = _parse(xml_file)
        file_name = (tree.findtext("filename") or "").strip() or f"{stem}.jpg"
        width, height = _size(tree, xml_file, os.path.join(image_root, file_name))
        images.append({"id": image_id, "file_name": file_name, "width": width, "height": height})
        for k, obj in enumerate(tree.findall("object"), 1):
            name = _object_name(obj, xml_file, k)
            where = f"{xml_file}, <object> #{k} ('{name}')"
            class_list.see(name, where)
            xmin, ymin, xmax, ymax = _box(obj, where)
            x, y, w, h = xmin - 1.0, ymin - 1.0, xmax - xmin + 1.0, ymax - ymin + 1.0
            ann_id = len(annotations) + 1
            annotations.append({"id": ann_id, "image_id": image_id, "category_id": name, "bbox": [x, y, w, h],
                                "area": max(w, 0.0) * max(h, 0.0), "iscrowd": int(_difficult(obj, where))})
            origins[ann_id] = where
    category_ids = class_list.ids()
    for ann in annotations:
        ann["category_id"] = category_ids[ann["category_id"]]
    coco = {"images": images, "annotations": annotations, "categories": class_list.categories()}
    return ReadAnnotations(coco, image_root, origins, label_files)


def _split_ids(root: str, split: str) -> list[tuple[str, str]]:
    """``(file:line, image id)`` for each line of the split file."""
    split_file = os.path.join(root, "ImageSets", "Main", f"{split}.txt")
    if not os.path.isfile(split_file):
        main = os.path.join(root, "ImageSets", "Main")
        found = sorted(f[:-4] for f in os.listdir(main) if f.endswith(".txt") and "_" not in f) \
            if os.path.isdir(main) else []
        hint = f" Splits there: {found}." if found else " Is `path` the VOC root (holding Annotations/, " \
            "JPEGImages/ and ImageSets/Main/)?"
        raise DataError(f"VOC split file not found: {split_file}.{hint}")
    with open(split_file, encoding="utf-8-sig") as f:  # -sig: Windows tools start the file with a BOM
        ids = [(f"{split_file}:{i}", line.split()[0]) for i, line in enumerate(f, 1) if line.strip()]
    if not ids:
        raise DataError(f"{split_file} lists no image ids; an empty split cannot be trained or tested on.")
    return ids


def _parse(xml_file: str) -> ET.Element:
    try:
        return ET.parse(xml_file).getroot()
    except ET.ParseError as exc:
        line = exc.position[0] if getattr(exc, "position", None) else "?"
        raise DataError(f"{xml_file}:{line}: not valid XML ({exc}). Fix or re-export the annotation file.") from None


def _object_name(obj: ET.Element, xml_file: str, k: int) -> str:
    name = (obj.findtext("name") or "").strip()
    if not name:
        raise DataError(f"{xml_file}, <object> #{k}: no <name>. Every object needs its class name.")
    return name


def _number(element: ET.Element, path: str, where: str) -> float | None:
    text = element.findtext(path)
    if text is None or not text.strip():
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):  # 'nan' and 'inf' parse as floats
        raise DataError(f"{where}: <{path}> is '{text.strip()[:40]}', not a number. Fix the annotation.")
    return value


def _box(obj: ET.Element, where: str) -> tuple[float, float, float, float]:
    if obj.find("bndbox") is None:
        raise DataError(f"{where}: no <bndbox>. Every object needs <bndbox> with xmin, ymin, xmax and ymax.")
    values = [_number(obj, f"bndbox/{tag}", where) for tag in _BOX_TAGS]
    missing = [tag for tag, v in zip(_BOX_TAGS, values) if v is None]
    if missing:
        raise DataError(f"{where}: <bndbox> lacks {', '.join(f'<{t}>' for t in missing)}. Fix the annotation.")
    return tuple(values)  # type: ignore[return-value]


def _difficult(obj: ET.Element, where: str) -> bool:
    value = _number(obj, "difficult", where)
    return bool(value) if value is not None else False


def _size(tree: ET.Element, xml_file: str, image_path: str) -> tuple[int, int]:
    """(width, height) from ``<size>``; from the image header when the XML gives none (or zeros)."""
    width, height = (_number(tree, f"size/{tag}", f"{xml_file}, <size>") for tag in ("width", "height"))
    if width and height:
        return int(width), int(height)
    return image_size(image_path, xml_file)
