"""What a keypoint set's points mean: :class:`KeypointMeta`, and the check of one annotation's keypoints.

A keypoint set names K points per object (COCO's person: 17 joints), says which point a horizontal
flip turns each one into (``flip_map``: left wrist <-> right wrist), which pairs to draw joined
(``skeleton``) and how far a prediction may stray and still count (``oks_sigmas``, the per-point
spreads of COCO's Object Keypoint Similarity). Points are torchvision's ``[K, 3]`` rows
``(x, y, visibility)`` in image pixels, visibility 0 (not labelled), 1 (labelled, hidden) or 2
(labelled, visible), as COCO stores them flat in ``keypoints``.

Where the metadata comes from: a COCO file's category ``keypoints`` names and ``skeleton`` (1-based
pairs, as COCO writes them), a YOLO pose set's ``kpt_shape`` and ``flip_idx``; the flip map of named
points swaps every ``left`` with ``right`` in the names (COCO person's map, the one detectron2 and
torchvision hard-code); ``oks_sigmas`` is COCO's 17 for COCO's person, else a ``DATA.CUSTOM`` entry's
``oks_sigmas``, else :data:`DEFAULT_OKS_SIGMA` for every point.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pet.utils.errors import DataError

__all__ = ["KeypointMeta", "COCO_PERSON_KEYPOINTS", "COCO_PERSON_SKELETON", "COCO_OKS_SIGMAS",
           "DEFAULT_OKS_SIGMA", "MAX_OKS_SIGMA", "flip_map_from_names", "check_keypoints"]

COCO_PERSON_KEYPOINTS = (
    "nose", "left_eye", "right_eye", "left_ear", "right_ear", "left_shoulder", "right_shoulder", "left_elbow",
    "right_elbow", "left_wrist", "right_wrist", "left_hip", "right_hip", "left_knee", "right_knee", "left_ankle",
    "right_ankle",
)
# person_keypoints_*.json's skeleton: 1-based pairs of COCO_PERSON_KEYPOINTS.
COCO_PERSON_SKELETON = (
    (16, 14), (14, 12), (17, 15), (15, 13), (12, 13), (6, 12), (7, 13), (6, 7), (6, 8), (7, 9), (8, 10), (9, 11),
    (2, 3), (1, 2), (1, 3), (2, 4), (3, 5), (4, 6), (5, 7),
)
# pycocotools' COCOeval kpt_oks_sigmas (Params.setKpParams): the spread of human annotators per joint.
COCO_OKS_SIGMAS = (
    0.026, 0.025, 0.025, 0.035, 0.035, 0.079, 0.079, 0.072, 0.072, 0.062, 0.062, 0.107, 0.107, 0.087, 0.087,
    0.089, 0.089,
)
# The sigma of every point of a set that gives none: the mean of COCO's 17 (0.067), so an unknown point is scored
# like COCO's average joint, neither as strictly as an eye (0.025) nor as loosely as a hip (0.107). A set whose
# points are sharper or vaguer than that says so with `oks_sigmas`. (Ultralytics' default, 1/K per point, is 0.25
# for K = 4: a metric that loose passes almost any guess.)
DEFAULT_OKS_SIGMA = 0.067
# COCO's largest sigma: a larger one makes the metric looser than COCO's loosest joint; Pet refuses it.
MAX_OKS_SIGMA = 0.107
# A visible point may lie this many pixels outside its image (annotation tools round) before it is an error.
_OUTSIDE_TOLERANCE = 1.0


@dataclass(frozen=True)
class KeypointMeta:
    """The K points of a keypoint set: ``names``, ``flip_map`` (point i becomes point ``flip_map[i]`` in a mirrored
    image), ``skeleton`` (1-based pairs of points to join, COCO's convention) and ``oks_sigmas``."""

    names: tuple[str, ...]
    flip_map: tuple[int, ...]
    skeleton: tuple[tuple[int, int], ...] = ()
    oks_sigmas: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        k = len(self.names)
        if sorted(self.flip_map) != list(range(k)) or any(self.flip_map[j] != i for i, j in enumerate(self.flip_map)):
            raise DataError(f"The keypoint flip map {list(self.flip_map)} is not a permutation of 0..{k - 1} that "
                            "undoes itself (point i <-> flip_map[i]); fix `flip_idx` (YOLO) or the point names.")
        if any(not (1 <= a <= k and 1 <= b <= k) for a, b in self.skeleton):
            raise DataError(f"The keypoint skeleton {[list(p) for p in self.skeleton]} joins points outside 1..{k} "
                            "(skeleton pairs are 1-based, as in COCO's files).")
        if len(self.oks_sigmas) != k:
            raise DataError(f"{len(self.oks_sigmas)} OKS sigmas for {k} keypoints; give one per point.")
        if any(not 0 < s <= MAX_OKS_SIGMA for s in self.oks_sigmas):
            raise DataError(f"OKS sigmas {list(self.oks_sigmas)} must lie in (0, {MAX_OKS_SIGMA}] (COCO's largest, the "
                            "hips'): a larger one scores a point more loosely than any COCO joint.")

    @classmethod
    def build(
        cls,
        names: Sequence[str],
        *,
        flip_map: Sequence[int] | None = None,
        skeleton: Sequence[Sequence[int]] = (),
        oks_sigmas: Sequence[float] | None = None,
    ) -> KeypointMeta:
        """The metadata of points ``names``; the flip map from the names and the sigmas by the module's rules
        when not given."""
        names = tuple(str(n) for n in names)
        if flip_map is None:
            flip_map = flip_map_from_names(names)
        if not oks_sigmas:
            oks_sigmas = COCO_OKS_SIGMAS if names == COCO_PERSON_KEYPOINTS else (DEFAULT_OKS_SIGMA,) * len(names)
        return cls(names, tuple(int(i) for i in flip_map), tuple((int(a), int(b)) for a, b in skeleton),
                   tuple(float(s) for s in oks_sigmas))

    @property
    def num_keypoints(self) -> int:
        return len(self.names)

    def with_sigmas(self, oks_sigmas: Sequence[float]) -> KeypointMeta:
        """The same points scored with ``oks_sigmas`` (a ``DATA.CUSTOM`` entry's)."""
        return KeypointMeta(self.names, self.flip_map, self.skeleton, tuple(float(s) for s in oks_sigmas))


def flip_map_from_names(names: Sequence[str]) -> tuple[int, ...]:
    """Point i's mirror: the point whose name has ``left`` and ``right`` swapped (any case, as a word or a prefix
    such as ``left_eye``), or i itself when there is none (``nose``)."""
    index = {n: i for i, n in enumerate(names)}
    swap = {"left": "right", "right": "left", "Left": "Right", "Right": "Left", "LEFT": "RIGHT", "RIGHT": "LEFT"}
    pattern = re.compile("|".join(swap))
    return tuple(index.get(pattern.sub(lambda m: swap[m.group(0)], n), i) for i, n in enumerate(names))


def check_keypoints(values: Any, num_keypoints: int, width: float, height: float, what: str) -> np.ndarray:
    """An annotation's flat ``keypoints`` (x1, y1, v1, ...) as float32 [K, 3], checked; ``what`` names the annotation
    (file and id, or ``file:line``) in the :class:`DataError` a bad value raises: a count other than 3K, a value
    that is not a finite number, a visibility outside {0, 1, 2}, a visible point outside the image."""
    if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != 3 * num_keypoints:
        count = len(values) if isinstance(values, (list, tuple, np.ndarray)) else type(values).__name__
        raise DataError(f"{what} has {count} keypoint values; this set has {num_keypoints} keypoints, so "
                        f"'keypoints' must hold {3 * num_keypoints} numbers (x, y, visibility per point). Fix the "
                        "annotation, or the category's keypoint names.")
    try:
        points = np.asarray(values, dtype=np.float64).reshape(num_keypoints, 3)
    except (TypeError, ValueError):
        points = None
    if points is None or not np.isfinite(points).all():
        raise DataError(f"{what} has keypoints that are not all finite numbers: {str(list(values))[:80]}.")
    visibility = points[:, 2]
    bad = np.flatnonzero(~np.isin(visibility, (0, 1, 2)))
    if len(bad):
        raise DataError(f"{what}: keypoint {int(bad[0]) + 1} has visibility {visibility[bad[0]]:g}; COCO's values are "
                        "0 (not labelled), 1 (labelled, hidden) and 2 (labelled, visible). Fix the annotation.")
    tol = _OUTSIDE_TOLERANCE
    x, y = points[:, 0], points[:, 1]
    outside = np.flatnonzero((visibility == 2) & ((x < -tol) | (y < -tol) | (x > width + tol) | (y > height + tol)))
    if len(outside):
        i = int(outside[0])
        raise DataError(f"{what}: keypoint {i + 1} is visible (v=2) at ({x[i]:g}, {y[i]:g}), outside the "
                        f"{width:g}x{height:g} image. Fix its position, or mark it 1 (hidden) or 0 (not labelled).")
    return points.astype(np.float32)
