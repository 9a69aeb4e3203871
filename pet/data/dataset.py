"""The torch Dataset the loaders use: validated COCO datasets concatenated, images decoded, samples mapped.

:class:`DetectionDataset` concatenates one or more :class:`~pet.data.coco_json.COCODataset`
(one label space), decodes images with opencv (:func:`read_image`) and applies a mapper (the
transforms). Reading and validating the annotation files is :mod:`pet.data.coco_json`'s job.
"""
from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cv2
import numpy as np
import torch

from pet.data.augmentations import Progress
from pet.data.categories import LabeledDataset, LabelSpace
from pet.data.coco_json import COCODataset
from pet.data.formats.common import TRANSPOSED_ORIENTATIONS, exif_orientation
from pet.utils.errors import DataError

__all__ = ["DetectionDataset", "LoadFailure", "read_image"]

logger = logging.getLogger(__name__)


def read_image(path: str, image_id: int | None = None) -> np.ndarray:
    """Decode an image file into an RGB uint8 array [H, W, 3] (gray and RGBA become RGB)."""
    what = f"image {path}" + (f" (image id {image_id})" if image_id is not None else "")
    try:
        buffer = np.fromfile(path, dtype=np.uint8)
    except OSError as exc:
        raise DataError(f"Cannot read {what}: {exc.strerror or exc}. Check that the file exists "
                        "under the dataset's image root.") from exc
    try:
        image = cv2.imdecode(buffer, cv2.IMREAD_COLOR) if buffer.size else None
    except cv2.error as exc:  # opencv raises, rather than returning None, for a header over its pixel limit
        raise DataError(f"Cannot decode {what}: opencv refuses it ({exc.err}); if it has more pixels than opencv's "
                        "limit (2^30), set the environment variable OPENCV_IO_MAX_IMAGE_PIXELS above its width x "
                        "height. Else replace or remove it, or set DATA.ON_BAD_IMAGE skip to skip such "
                        "images.") from exc
    if image is None:
        raise DataError(f"Cannot decode {what}: the file is empty, corrupt or not an image. "
                        "Replace or remove it, or set DATA.ON_BAD_IMAGE skip to skip such images.")
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


class LoadFailure:
    """A :class:`DataError` raised while loading a sample in a worker, carried to the main process as data.

    The loader re-raises it there with the original one-line message, instead of the
    worker traceback PyTorch would show.
    """

    def __init__(self, message: str) -> None:
        self.message = message


class DetectionDataset(LabeledDataset, torch.utils.data.Dataset):
    """One or more :class:`COCODataset` concatenated, decoded and mapped into training/test samples.

    The label space must be the same in every dataset. Records are pickled into one
    numpy buffer: compact, cheap to send to workers, and reading one in a worker touches
    no shared Python objects (whose reference counts would make forked workers copy
    memory pages).

    An index is either an int or ``(index, seed)``; the seed drives the random
    transforms, so a sample does not depend on which worker (or how many) loads it.
    ``mapper(record, image, rng)`` turns a record and its decoded image into a sample.
    Unreadable images raise :class:`DataError`, or are replaced by another image and
    counted in ``num_skipped`` when ``on_bad_image`` is "skip".

    ``label_space`` (default: the datasets' own contiguous one) is what the model's labels mean
    (``MODEL.LABEL_SPACE``, built by :func:`pet.data.build.build_label_space`): every record's
    ``labels`` are mapped into it, so the mapper's samples carry the model's labels, and
    ``class_names`` / ``label_to_category_id`` / ``category_id_to_label`` are its views.
    ``categories`` stays the datasets' own ``{id: name}`` (what evaluation scores).

    Attributes of the first dataset are exposed (``name`` joins all names) so that
    evaluators and tools can use a loader's dataset directly.
    """

    def __init__(
        self,
        datasets: Sequence[COCODataset],
        mapper: Callable[[dict[str, Any], np.ndarray, np.random.Generator], dict[str, Any]],
        *,
        is_train: bool,
        filter_empty: bool = True,
        on_bad_image: str = "error",
        label_space: LabelSpace | None = None,
    ) -> None:
        if on_bad_image not in ("error", "skip"):
            raise DataError(f"on_bad_image must be 'error' or 'skip', got {on_bad_image!r}")
        check_same_categories(datasets)
        first = datasets[0]
        self.datasets = list(datasets)
        self.name = "+".join(d.name for d in datasets)
        self.json_file, self.image_root, self.coco = first.json_file, first.image_root, first.coco
        self.format = first.format
        self.keypoint_meta = first.keypoint_meta
        self.categories = first.categories
        self.label_space = label_space or first.label_space
        self.mapper = mapper
        self.is_train = is_train
        self.on_bad_image = on_bad_image
        self.num_skipped = 0

        records = [r for d in datasets for r in _relabelled(d, self.label_space)]
        if is_train and filter_empty:
            records = [r for r in records if len(r["labels"])]
            if not records:
                raise DataError(f"Dataset '{self.name}' has no image with a usable (non-crowd, non-empty) box. "
                                "Check the annotations, or set DATA.FILTER_EMPTY False to train on empty images.")
            dropped = sum(len(d) for d in datasets) - len(records)
            if dropped:
                logger.info(f"Removed {dropped} images without annotations from '{self.name}' (DATA.FILTER_EMPTY).")
        records = self._check_files_exist(records)
        self.image_sizes = np.array([(r["height"], r["width"]) for r in records], dtype=np.int64).reshape(-1, 2)
        self.aspect_ratios = (self.image_sizes[:, 1] / self.image_sizes[:, 0]).astype(np.float32)
        serialized = [np.frombuffer(pickle.dumps(r, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
                      for r in records]
        self._offsets = np.cumsum([0] + [len(s) for s in serialized])
        self._buffer = np.concatenate(serialized)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def record(self, index: int) -> dict[str, Any]:
        """The annotation record of image ``index`` (a fresh copy)."""
        return pickle.loads(self._buffer[self._offsets[index]:self._offsets[index + 1]].tobytes())

    def load(self, index: int) -> tuple[dict[str, Any], np.ndarray]:
        """Image ``index``'s record and decoded pixels; a :class:`DataError` when they cannot be read or disagree."""
        record = self.record(index)
        image = read_image(record["file_name"], record["image_id"])
        _check_size(image, record)
        return record, image

    def __getitem__(self, key: int | tuple[int, ...]) -> dict[str, Any]:
        """Sample ``key``: an index, ``(index, seed)``, or ``(index, seed, iteration, epoch)`` from a training
        batch sampler that stamps progress (a mapper with ``needs_dataset`` gets it, with the dataset)."""
        index, seed, *progress = key if isinstance(key, tuple) else (key, key)
        rng = np.random.default_rng(seed)
        for _attempt in range(10):
            try:
                record, image = self.load(index)
            except DataError as exc:
                if self.on_bad_image == "error":
                    raise
                self.num_skipped += 1
                last = self.record(index)["file_name"]
                logger.warning(f"{exc} Skipped (DATA.ON_BAD_IMAGE skip); {self.num_skipped} skipped by this process.")
                index = int(rng.integers(len(self))) if self.is_train else (index + 1) % len(self)
                continue
            if getattr(self.mapper, "needs_dataset", False):
                return self.mapper(record, image, rng, progress=Progress(*progress), dataset=self)
            return self.mapper(record, image, rng)
        raise DataError(f"10 unreadable images in a row in dataset '{self.name}' (last: {last}); "
                        "the image files look broken. Check the image root.")

    def __getitems__(self, keys: Sequence[int | tuple[int, int]]) -> list[Any]:
        """Batch fetch used by DataLoader: a :class:`DataError` becomes a :class:`LoadFailure` sample."""
        try:
            return [self[key] for key in keys]
        except DataError as exc:
            return [LoadFailure(str(exc))]

    def _check_files_exist(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Find missing image files up-front with one directory listing per folder (cheap even for COCO)."""
        listings: dict[str, set[str]] = {}
        missing = []
        for r in records:
            folder, base = os.path.split(r["file_name"])
            if folder not in listings:
                listings[folder] = set(os.listdir(folder)) if os.path.isdir(folder) else set()
            if base not in listings[folder]:
                missing.append(r)
        if not missing:
            return records
        first = missing[0]
        message = (f"{len(missing)} of {len(records)} image files of dataset '{self.name}' are missing, e.g. "
                   f"{first['file_name']} (image id {first['image_id']}).")
        if self.on_bad_image == "error":
            raise DataError(message + " Check the dataset's image root (see data/README.md), "
                            "or set DATA.ON_BAD_IMAGE skip to leave them out.")
        logger.warning(message + " They are left out (DATA.ON_BAD_IMAGE skip).")
        self.num_skipped += len(missing)
        gone = {id(r) for r in missing}
        kept = [r for r in records if id(r) not in gone]
        if not kept:
            raise DataError(f"No image file of dataset '{self.name}' exists; check its image root.")
        return kept


def _relabelled(dataset: COCODataset, label_space: LabelSpace) -> list[dict[str, Any]]:
    """``dataset``'s records with their labels (the dataset's own contiguous ones) mapped into ``label_space``.

    Shallow copies: the cached dataset's records stay as they are."""
    if label_space == dataset.label_space:
        return dataset.records
    to_label = np.zeros(dataset.label_space.num_classes + 1, dtype=np.int64)
    for label, category_id in dataset.label_to_category_id.items():
        if category_id not in label_space.category_id_to_label:
            raise DataError(f"Category id {category_id} ('{dataset.categories[category_id]}') of dataset "
                            f"'{dataset.name}' has no label in the given label space; build it from the "
                            "dataset's categories (pet.data.build_label_space).")
        to_label[label] = label_space.category_id_to_label[category_id]
    return [{**r, "labels": to_label[r["labels"]]} for r in dataset.records]


def check_same_categories(datasets: Sequence[COCODataset]) -> None:
    """Datasets used together (concatenated, or trained and tested in one run) must share one label space:
    the same category ids and names. A mismatch is a :class:`DataError` naming the classes and the files."""
    first = datasets[0]
    reference = list(first.categories.items())
    for other in datasets[1:]:
        categories = list(other.categories.items())
        if categories != reference:
            only_first = [n for n in first.class_names if n not in other.class_names]
            only_other = [n for n in other.class_names if n not in first.class_names]
            if only_first or only_other:
                what = "; ".join(f"classes {names} only in '{d.name}'" for names, d in
                                 ((only_first, first), (only_other, other)) if names)
            else:
                what = f"the same names with other ids ({reference} against {categories})"
            raise DataError(
                f"Datasets '{first.name}' ({first.json_file}) and '{other.name}' ({other.json_file}) have different "
                f"categories: {what}. Datasets trained or tested together need the same category ids and names: "
                "give their DATA.CUSTOM entries the same `classes: [...]` list."
            )
        points = [d.keypoint_meta.names if d.keypoint_meta else None for d in (first, other)]
        if points[0] != points[1]:
            raise DataError(
                f"Datasets '{first.name}' ({first.json_file}) and '{other.name}' ({other.json_file}) have different "
                f"keypoints: {points[0] or 'none'} against {points[1] or 'none'}. Datasets trained or tested together "
                "need the same keypoint names in the same order."
            )


def _check_size(image: np.ndarray, record: dict[str, Any]) -> None:
    """The decoded image must have the annotated size. A phone photo's EXIF orientation turns it a quarter as
    opencv decodes it; a tool that ignores the tag (LabelImg) records the stored size and boxes in the stored
    pixels, so the advice then is to drop the tag: swapping the annotated size would misplace every box."""
    h, w = image.shape[:2]
    if (h, w) == (record["height"], record["width"]):
        return
    path, size = record["file_name"], f"{record['width']}x{record['height']}"
    orientation = exif_orientation(path) if (w, h) == (record["height"], record["width"]) else 1
    if orientation in TRANSPOSED_ORIENTATIONS:
        raise DataError(
            f"Image {path} (image id {record['image_id']}) decodes to {w}x{h} pixels, turned a quarter by its EXIF "
            f"orientation {orientation}, but the annotations say {size}, its size before the turn: a labelling tool "
            "that ignores EXIF orientation (LabelImg does) wrote them, with boxes in the unturned pixels, so "
            "swapping width and height would misplace them. Remove the orientation tag, keeping the pixels "
            f"(exiftool -Orientation=1 -n {path}), so that the image decodes as it was labelled."
        )
    raise DataError(f"Image {path} (image id {record['image_id']}) decodes to {w}x{h} pixels but the annotations "
                    f"say {size}. Fix its width/height in the annotation file.")
