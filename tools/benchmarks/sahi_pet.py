"""SAHI's sliced prediction of Pet's own model: the reference that ``benchmark.py tiles --sahi`` measures Pet's
tiling against.

Only that option imports this module, with sahi importable (a venv, or ``pip install --target DIR --no-deps sahi``
plus its missing pure-python dependencies on PYTHONPATH): sahi is the yardstick here, not a dependency of Pet (and
it pulls opencv-python, which would replace the project's opencv-python-headless).
"""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
from sahi.models.base import DetectionModel
from sahi.predict import get_sliced_prediction
from sahi.prediction import ObjectPrediction
from sahi.slicing import get_slice_bboxes
from sahi.utils.compatibility import fix_full_shape_list, fix_shift_amount_list

from pet.engine.models import model_device
from pet.predict import Detections, Predictor

__all__ = ["PetDetectionModel", "sahi_grid", "sahi_predict"]


class PetDetectionModel(DetectionModel):
    """A :class:`Predictor` without tiles as a SAHI detection model.

    Each slice, and SAHI's whole-image pass, goes through the predictor's test transform and precision as a
    picture of Pet's own does, so SAHI and Pet's tiling differ only in how they slice and merge. The slices
    SAHI hands over in one call (its ``batch_size``) run as one forward pass, as Pet's tiles do; a detection
    is kept above ``confidence_threshold`` (SAHI's default 0.3), labelled with the model's category ids.

    ``cache``, a dict when set, keeps each picture's detections by its pixels: SAHI's merge settings can then be
    compared on one set of slice predictions.
    """

    cache: dict[bytes, Detections] | None = None

    def __init__(self, predictor: Predictor, confidence_threshold: float = 0.3) -> None:
        if predictor.tiles is not None:
            raise ValueError("SAHI slices the picture itself: give it a Predictor without tiles.")
        super().__init__(model=predictor, device=str(model_device(predictor.model)),
                         confidence_threshold=confidence_threshold)

    def set_model(self, model: Any, **kwargs: Any) -> None:
        self.model = model
        space = model.label_space
        self.category_mapping = {str(i): name for i, name in zip(space.category_ids, space.names)}

    def perform_inference(self, image: np.ndarray) -> None:
        self._original_predictions = self._predict([image])

    def perform_batch_inference(self, images: list[np.ndarray]) -> None:
        self._original_predictions = self._predict(images)

    def _predict(self, images: list[np.ndarray]) -> list[Detections]:
        """RGB arrays (SAHI's convention) -> their detections, in one forward pass."""
        predictor: Predictor = self.model
        bgr = [np.ascontiguousarray(image[..., ::-1]) for image in images]
        if self.cache is None:
            return predictor.predict_many(bgr, batch_size=len(images))
        keys = [hashlib.blake2b(image.tobytes() + str(image.shape).encode(), digest_size=16).digest() for image in bgr]
        missing = [k for k, key in enumerate(keys) if key not in self.cache]
        if missing:
            for k, det in zip(missing, predictor.predict_many([bgr[k] for k in missing], batch_size=len(missing))):
                self.cache[keys[k]] = det
        return [self.cache[key] for key in keys]

    def _create_object_prediction_list_from_original_predictions(
            self, shift_amount_list: list[list[int | float]] | None = None,
            full_shape_list: list[list[int | float]] | None = None) -> None:
        shifts = fix_shift_amount_list(shift_amount_list)
        shapes = fix_full_shape_list(full_shape_list)
        per_image = []
        for k, det in enumerate(self._original_predictions):
            keep = np.flatnonzero(det.scores > self.confidence_threshold)
            per_image.append([
                ObjectPrediction(bbox=det.boxes[i].tolist(), category_id=int(det.labels[i]), category_name=det.names[i],
                                 score=float(det.scores[i]), shift_amount=shifts[k],
                                 full_shape=None if shapes is None else shapes[k])
                for i in keep])
        self._object_prediction_list_per_image = per_image


def sahi_grid(height: int, width: int, tile: int, overlap: float) -> np.ndarray:
    """int64 [T, 4] the slices (x0, y0, x1, y1) SAHI cuts with ``tile`` px and ``overlap``, in its order."""
    return np.array(get_slice_bboxes(height, width, tile, tile, auto_slice_resolution=False,
                                     overlap_height_ratio=overlap, overlap_width_ratio=overlap), dtype=np.int64)


def sahi_predict(model: PetDetectionModel, image: str | np.ndarray, tile: int, overlap: float, *, batch: int,
                 standard_pred: bool, setting: tuple[str, str, bool] = ("GREEDYNMM", "IOS", False)
                 ) -> tuple[Detections, dict[str, float]]:
    """``get_sliced_prediction`` of ``image`` (a file SAHI decodes, or a BGR array) with the merge ``setting``
    (``postprocess_type``, ``postprocess_match_metric``, ``postprocess_class_agnostic``; SAHI's default: GREEDYNMM,
    IOS 0.5, class-wise), with or without its whole-image pass: :class:`Detections` (best first) and SAHI's own
    seconds per stage (slice, prediction, postprocess)."""
    if isinstance(image, np.ndarray):
        image = np.ascontiguousarray(image[..., ::-1])  # SAHI takes arrays as RGB
    postprocess, metric, agnostic = setting
    result = get_sliced_prediction(image, model, slice_height=tile, slice_width=tile, overlap_height_ratio=overlap,
                                   overlap_width_ratio=overlap, perform_standard_pred=standard_pred, batch_size=batch,
                                   postprocess_type=postprocess, postprocess_match_metric=metric,
                                   postprocess_class_agnostic=agnostic, force_postprocess_type=True, verbose=0)
    found = sorted(result.object_prediction_list, key=lambda p: -p.score.value)
    return (Detections(boxes=np.array([p.bbox.to_xyxy() for p in found], dtype=np.float32).reshape(-1, 4),
                       scores=np.array([p.score.value for p in found], dtype=np.float32),
                       labels=np.array([p.category.id for p in found], dtype=np.int64),
                       names=[p.category.name for p in found], path=image if isinstance(image, str) else ""),
            dict(result.durations_in_seconds))
