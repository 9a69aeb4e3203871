"""Class balance of a training set: how often each class appears, and LVIS' repeat factors that even it out.

With ``f_c`` the fraction of training images that contain class ``c`` and ``t`` the threshold
(``DATA.REPEAT_THRESHOLD``), class ``c`` has the repeat factor ``r_c = max(1, sqrt(t / f_c))``
and an image the largest factor of its classes (1 for a background image), as in LVIS (Gupta et
al., 2019) and detectron2's ``RepeatFactorTrainingSampler``. A class in fewer than a fraction
``t`` of the images is thus seen more often; classes above it are left alone.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from pet.utils.table import format_table

__all__ = ["images_per_class", "repeat_factors", "log_repeat_factors"]

logger = logging.getLogger(__name__)


def images_per_class(image_labels: Sequence[np.ndarray], num_classes: int) -> np.ndarray:
    """How many images contain each label 1..``num_classes`` (index i is label i + 1)."""
    counts = np.zeros(num_classes, dtype=np.int64)
    for labels in image_labels:
        counts[np.unique(np.asarray(labels, dtype=np.int64)) - 1] += 1
    return counts


def repeat_factors(image_labels: Sequence[np.ndarray], num_classes: int, threshold: float) -> np.ndarray:
    """Per image, ``max(1, max over its classes of sqrt(threshold / f_c))`` (float64; 1 for an image without boxes)."""
    if not image_labels:
        return np.zeros(0, dtype=np.float64)
    fraction = images_per_class(image_labels, num_classes) / len(image_labels)
    with np.errstate(divide="ignore"):
        class_factor = _class_factor(fraction, threshold)  # inf only for absent classes, never looked up
    return np.array([max(1.0, float(class_factor[np.asarray(labels) - 1].max())) if len(labels) else 1.0
                     for labels in image_labels], dtype=np.float64)


def _class_factor(fraction: np.ndarray | float, threshold: float) -> np.ndarray | float:
    """r_c = max(1, sqrt(t / f_c))."""
    return np.maximum(1.0, np.sqrt(threshold / fraction))


def log_repeat_factors(
    image_labels: Sequence[np.ndarray], factors: np.ndarray, class_names: Sequence[str], threshold: float
) -> None:
    """Log, per class, its share of the images before and after repeat-factor sampling (the effective frequency)."""
    num_images = len(image_labels)
    expected = float(factors.sum())
    has = np.zeros((num_images, len(class_names) + 1), dtype=bool)  # last column: background image
    for i, labels in enumerate(image_labels):
        if len(labels):
            has[i, np.asarray(labels) - 1] = True
        else:
            has[i, -1] = True
    names = [*class_names, "(background)"]
    rows = []
    for c, name in enumerate(names):
        images = int(has[:, c].sum())
        class_factor = _class_factor(images / num_images, threshold) if c < len(class_names) and images else 1.0
        effective = float(factors[has[:, c]].sum())
        rows.append([name, images, f"{images / num_images:.4f}", f"{class_factor:.2f}", f"{effective:.1f}",
                     f"{effective / expected:.4f}"])
    header = ["category", "#images", "fraction f_c", "repeat r_c", "images/epoch", "effective fraction"]
    logger.info(
        f"Repeat-factor sampling (DATA.REPEAT_THRESHOLD {threshold}): an epoch draws {expected:.1f} images in "
        f"expectation instead of {num_images}. Per class (an image counts once per class it contains):\n"
        + format_table(header, rows)
    )
