"""One small detection set written in all four formats Pet reads: COCO JSON, YOLO, Pascal VOC and CSV.

Each format is written the way its own tools lay it out (not through Pet), from the same
images (byte for byte) and integer pixel boxes: 12 images of 40-64 px a side, four classes
(``star`` is rare: one image), two background images (an empty and a missing YOLO label file;
``path,,,,,`` and an all-zero box in the CSV) and one ignored region (COCO ``iscrowd``, VOC
``difficult``; absent from YOLO and CSV, which have no such notion).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np

CLASSES = ("circle", "rectangle", "star", "triangle")  # sorted, so every format's default ids agree
RARE = "star"
NUM_IMAGES = 12
BACKGROUND = ("img_003", "img_008")  # no boxes


@dataclass
class Box:
    x: int
    y: int
    w: int
    h: int
    name: str
    crowd: bool = False


@dataclass
class Image:
    stem: str
    width: int
    height: int
    jpeg: bytes
    boxes: list[Box] = field(default_factory=list)


def make_images(seed: int = 0) -> list[Image]:
    rng = np.random.default_rng(seed)
    images = []
    for i in range(1, NUM_IMAGES + 1):
        stem = f"img_{i:03d}"
        width, height = (int(v) for v in rng.integers(40, 65, size=2))
        pixels = rng.integers(0, 80, size=(height, width, 3), dtype=np.uint8)
        image = Image(stem, width, height, b"")
        if stem not in BACKGROUND:
            for k in range(max(int(rng.integers(1, 4)), 2 if i == 7 else 1)):  # image 7: a crowd box and more
                w, h = (int(v) for v in rng.integers(8, 20, size=2))
                x, y = int(rng.integers(0, width - w)), int(rng.integers(0, height - h))
                if i == 1 and k == 0:
                    x = y = 0  # on the image's edge: YOLO's normalised 0 must read back as exactly 0
                name = RARE if i == 5 and k == 0 else ("circle", "rectangle", "triangle")[int(rng.integers(3))]
                image.boxes.append(Box(x, y, w, h, name, crowd=(i == 7 and k == 0)))
                colour = tuple(int(c) for c in (60 + 60 * CLASSES.index(name), 255, 200 - 40 * CLASSES.index(name)))
                cv2.rectangle(pixels, (x, y), (x + w - 1, y + h - 1), colour, -1)
        image.jpeg = cv2.imencode(".jpg", pixels, [cv2.IMWRITE_JPEG_QUALITY, 95])[1].tobytes()
        images.append(image)
    return images


def _write_coco(root: Path, images: list[Image]) -> dict:
    (root / "images").mkdir(parents=True)
    entries, annotations = [], []
    for image_id, im in enumerate(images, 1):
        (root / "images" / f"{im.stem}.jpg").write_bytes(im.jpeg)
        entries.append({"id": image_id, "file_name": f"{im.stem}.jpg", "width": im.width, "height": im.height})
        for b in im.boxes:
            annotations.append({"id": len(annotations) + 1, "image_id": image_id,
                                "category_id": CLASSES.index(b.name) + 1, "bbox": [b.x, b.y, b.w, b.h],
                                "area": b.w * b.h, "iscrowd": int(b.crowd)})
    categories = [{"id": i + 1, "name": n} for i, n in enumerate(CLASSES)]
    (root / "ann.json").write_text(json.dumps({"images": entries, "annotations": annotations,
                                               "categories": categories}))
    return {"format": "coco", "path": str(root / "ann.json"), "images": str(root / "images")}


def _write_yolo(root: Path, images: list[Image]) -> dict:
    """Ultralytics' layout: images/train, labels/train, data.yaml; no crowd regions in YOLO."""
    (root / "images" / "train").mkdir(parents=True)
    (root / "labels" / "train").mkdir(parents=True)
    for im in images:
        (root / "images" / "train" / f"{im.stem}.jpg").write_bytes(im.jpeg)
        if im.stem == BACKGROUND[1]:
            continue  # a missing label file is a background image too
        lines = [f"{CLASSES.index(b.name)} {(b.x + b.w / 2) / im.width:.10g} {(b.y + b.h / 2) / im.height:.10g} "
                 f"{b.w / im.width:.10g} {b.h / im.height:.10g}" for b in im.boxes if not b.crowd]
        (root / "labels" / "train" / f"{im.stem}.txt").write_text("".join(line + "\n" for line in lines))
    names = "".join(f"  {i}: {n}\n" for i, n in enumerate(CLASSES))
    (root / "data.yaml").write_text(f"path: .\ntrain: images/train\nval: images/train\nnames:\n{names}")
    return {"format": "yolo", "path": str(root / "data.yaml"), "split": "train"}


def _write_voc(root: Path, images: list[Image]) -> dict:
    """The devkit's layout: Annotations/, JPEGImages/, ImageSets/Main/train.txt; 1-based inclusive coordinates."""
    for folder in ("Annotations", "JPEGImages", "ImageSets/Main"):
        (root / folder).mkdir(parents=True)
    for im in images:
        (root / "JPEGImages" / f"{im.stem}.jpg").write_bytes(im.jpeg)
        objects = "".join(
            f"<object><name>{b.name}</name><pose>Unspecified</pose><truncated>0</truncated>"
            f"<difficult>{int(b.crowd)}</difficult><bndbox><xmin>{b.x + 1}</xmin><ymin>{b.y + 1}</ymin>"
            f"<xmax>{b.x + b.w}</xmax><ymax>{b.y + b.h}</ymax></bndbox></object>" for b in im.boxes)
        (root / "Annotations" / f"{im.stem}.xml").write_text(
            f"<annotation><folder>VOC</folder><filename>{im.stem}.jpg</filename><size><width>{im.width}</width>"
            f"<height>{im.height}</height><depth>3</depth></size><segmented>0</segmented>{objects}</annotation>")
    (root / "ImageSets" / "Main" / "train.txt").write_text("".join(f"{im.stem}\n" for im in images))
    return {"format": "voc", "path": str(root), "split": "train"}


def _write_csv(root: Path, images: list[Image]) -> dict:
    """DeepForest's layout: a header, paths relative to the image folder, background as ``,,,,,`` or a zero box."""
    (root / "images").mkdir(parents=True)
    rows = ["image_path,xmin,ymin,xmax,ymax,label"]
    for im in images:
        (root / "images" / f"{im.stem}.jpg").write_bytes(im.jpeg)
        boxes = [b for b in im.boxes if not b.crowd]
        if not boxes:
            rows.append(f"{im.stem}.jpg,,,,," if im.stem == BACKGROUND[0] else f"{im.stem}.jpg,0,0,0,0,circle")
        rows += [f"{im.stem}.jpg,{b.x},{b.y},{b.x + b.w},{b.y + b.h},{b.name}" for b in boxes]
    (root / "boxes.csv").write_text("\n".join(rows) + "\n")
    return {"format": "csv", "path": str(root / "boxes.csv"), "images": str(root / "images")}


# The writers are private so that write_coco means one thing in tests/: support.helpers.write_coco, a registered COCO
# set.
WRITERS = {"coco": _write_coco, "yolo": _write_yolo, "voc": _write_voc, "csv": _write_csv}


def write_all_formats(root: Path, seed: int = 0) -> dict[str, dict]:
    """The set in each format under ``root/<format>``; returns each one's DATA.CUSTOM entry (without a name)."""
    images = make_images(seed)
    return {fmt: writer(root / fmt, images) for fmt, writer in WRITERS.items()}


def entry(spec: dict, name: str, **extra: object) -> dict:
    """A DATA.CUSTOM entry: ``spec`` (from :func:`write_all_formats`) named ``name``."""
    return {"name": name, **spec, **extra}


__all__ = ["CLASSES", "RARE", "BACKGROUND", "make_images", "write_all_formats", "entry", "WRITERS"]
