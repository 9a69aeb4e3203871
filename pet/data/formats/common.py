"""What the format readers share: the in-memory COCO dict they produce, class ids, image sizes from headers.

Every reader (YOLO, Pascal VOC, CSV) turns its files into a COCO-format dict plus, for each
annotation, the place it came from (``file:line`` or file and XML element). The dict then goes
through the same validation as a COCO file (:func:`pet.data.coco_json.build_coco_dataset`), so a
box outside its image is clipped or rejected by one rule whatever the format, and evaluation,
diagnostics and the tools see one kind of dataset.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pet.data.keypoints import KeypointMeta
from pet.utils.errors import DataError

__all__ = ["ReadAnnotations", "ClassList", "check_class_names", "image_size", "exif_orientation", "relative_to",
           "IMAGE_EXTENSIONS", "TRANSPOSED_ORIENTATIONS"]

# Image files a folder listing picks up (Ultralytics' list, less the formats opencv cannot decode).
IMAGE_EXTENSIONS = (".bmp", ".dng", ".jpeg", ".jpg", ".jp2", ".png", ".tif", ".tiff", ".webp", ".pfm")

# EXIF orientations (tag 0x0112) that turn the image a quarter: opencv then swaps width and height.
TRANSPOSED_ORIENTATIONS = (5, 6, 7, 8)


@dataclass
class ReadAnnotations:
    """A reader's result: ``coco`` (``images``, ``annotations``, ``categories``; image ``file_name`` relative to
    ``image_root``), ``origins``, annotation id -> where it was read (for messages about that box), and
    ``label_files``, the label files it read or looked for besides the dataset's path (YOLO's ``.txt`` and the
    split's folders or list files, VOC's split file and XMLs), whose edits the dataset cache must notice
    (:func:`pet.data.catalog.get_dataset`). ``keypoint_meta``: a pose set's points (YOLO's ``kpt_shape``)."""

    coco: dict[str, Any]
    image_root: str
    origins: dict[int, str] = field(default_factory=dict)
    label_files: list[str] = field(default_factory=list)
    keypoint_meta: KeypointMeta | None = None


class ClassList:
    """Class name -> category id for one dataset, by the rules of docs/data.md ("Class ids").

    With ``classes`` (the DATA.CUSTOM entry's list), class i of it is id i + 1 and a name outside
    it is an error naming where it was found. Without, ``default`` gives the list (YOLO's ``names``),
    or, when ``default`` is None, the sorted names found over the whole dataset (VOC, CSV).
    """

    def __init__(self, classes: Sequence[str] | None, default: Sequence[str] | None = None) -> None:
        self.fixed = list(classes) if classes else (list(default) if default is not None else None)
        self.given = bool(classes)
        self._found: set[str] = set()

    def see(self, name: str, where: str) -> None:
        """Note a class name read at ``where``; with a fixed list, an unknown name is a :class:`DataError`."""
        if self.fixed is not None and name not in self.fixed:
            source = "the dataset's `classes` list" if self.given else "the dataset's class names"
            raise DataError(f"{where}: class '{name}' is not in {source} {self.fixed}. Fix the label, or add "
                            f"'{name}' to `classes` in the DATA.CUSTOM entry (every split must use the same list).")
        self._found.add(name)

    def ids(self) -> dict[str, int]:
        """name -> category id (1-based)."""
        names = self.fixed if self.fixed is not None else sorted(self._found)
        return {name: i + 1 for i, name in enumerate(names)}

    def categories(self) -> list[dict[str, Any]]:
        return [{"id": cid, "name": name} for name, cid in self.ids().items()]


def check_class_names(classes: Iterable[Any], where: str) -> list[str]:
    """A ``classes`` list as strings; empty names or repeats are a :class:`DataError` naming ``where``."""
    names = [str(c) for c in classes]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated or any(not n.strip() for n in names):
        problem = f"repeats {repeated}" if repeated else "has an empty name"
        raise DataError(f"The class list of {where} {problem}; each class must be named once.")
    return names


def image_size(path: str, where: str) -> tuple[int, int]:
    """(width, height) of an image as opencv decodes it, from the file header only (no pixel decoding).

    opencv applies the EXIF orientation (JPEG, PNG, WebP, TIFF): a quarter turn (orientations 5-8)
    swaps width and height, so the size the file stores is swapped too. ``where`` names the label
    that refers to the image, for the error when it is missing or not an image.
    """
    from PIL import Image, UnidentifiedImageError  # torchvision's dependency; only needed for sets without sizes

    try:
        with Image.open(path) as im:
            width, height = _stored_size(im)
            orientation = _exif_orientation(im)
    except FileNotFoundError as exc:
        raise DataError(f"{where}: image {path} does not exist. Check the dataset's image paths.") from exc
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise DataError(f"{where}: image {path} is not a readable image ({exc}). Replace or remove it.") from exc
    if orientation in TRANSPOSED_ORIENTATIONS:
        return height, width
    return width, height


def exif_orientation(path: str) -> int:
    """The EXIF orientation of the image at ``path`` from its header (1 when it has none or Pillow cannot
    read it): what explains a size that differs from the one a labelling tool recorded."""
    from PIL import Image  # torchvision's dependency; only needed to explain a size mismatch

    try:
        with Image.open(path) as im:
            return _exif_orientation(im)
    except (OSError, SyntaxError, ValueError):  # opencv reads formats Pillow does not (PFM): no tag known
        return 1


def _stored_size(im: Any) -> tuple[int, int]:
    """(width, height) as the file stores the pixels, before any orientation.

    Pillow reports that size for every format but TIFF, whose size recent Pillows (13 here) already
    report turned by the orientation tag and older ones, which setup.py admits, do not; the TIFF's
    own ImageWidth and ImageLength tags (256, 257) are the stored size on every version.
    """
    tags = getattr(im, "tag_v2", None)
    if tags and 256 in tags and 257 in tags:
        return int(tags[256]), int(tags[257])
    return im.size


def _exif_orientation(im: Any) -> int:
    """The EXIF orientation the header carries (1 when none), without decoding pixels.

    ``Image.getexif()`` would decode a whole PNG to look for an EXIF chunk after the pixels;
    opencv only reads one before them, which is what ``info["exif"]`` holds after ``open``.
    """
    from PIL import Image  # torchvision's dependency; only sets without sizes need it

    raw = im.info.get("exif")
    if raw:
        exif = Image.Exif()
        try:
            exif.load(raw)
        except Exception:  # a broken EXIF block: opencv ignores it too
            return 1
        return int(exif.get(0x0112, 1) or 1)
    tags = getattr(im, "tag_v2", None)  # TIFF keeps the orientation among its own tags
    return int(tags.get(0x0112, 1)) if tags else 1


def relative_to(path: str, root: str) -> str:
    """``path`` relative to ``root`` (a COCO ``file_name``), or absolute when on another drive."""
    try:
        return os.path.relpath(path, root)
    except ValueError:
        return os.path.abspath(path)
