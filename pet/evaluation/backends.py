"""The two COCOeval implementations Pet scores with, and the rule that picks one.

``pycocotools`` is the reference. ``faster`` is faster-coco-eval (``pip install faster-coco-eval``,
the ``fast-eval`` extra): the same algorithm with the per-image matching and the accumulation in
C++, about 3-4x faster on COCO-sized sets. Both give the same numbers (tests/evaluation/test_coco_backends.py
requires the 12 summary numbers to agree within 1e-6 on perturbed, empty, crowd and area-range cases;
measured: equal up to float summation order, ~1e-16). What that needs from faster-coco-eval,
checked on 1.8.0:

- its default ``COCOeval_faster`` settings: ``iouType`` "bbox" / "segm" (not "boundary"),
  ``lvis_style=False``, ``use_area=True`` (area ranges from the ground truth's ``area``, as
  pycocotools), the default area ranges, ``separate_eval`` either way;
- the same image ids (both evaluate ``sorted(set(ids))``; the order of ties between images
  follows it) and the same results list, in the same order (ties between equal scores keep it);
- its own copies of the ground truth and the results: it adds fields (``ignore``, ``rle``, ...)
  to the annotation dicts it is given, which must not leak into the dataset's pycocotools object;
- only the first 12 of its ``stats`` (10 for keypoints): it appends AR50 and AR75 after COCO's 12;
- for ``keypoints``, the sigmas given to both (``kpt_oks_sigmas``; pycocotools' default is COCO's 17 for
  any K) and the same ``catIds`` (the categories with keypoints), so that neither scores a class without
  points.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import logging
import warnings
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from pet.utils.errors import ConfigError

__all__ = ["BACKENDS", "COCOEvalResult", "KeypointTask", "resolve_coco_library", "run_cocoeval"]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "pycocotools", "faster")
# The faster-coco-eval ground truth made from a pycocotools COCO object, kept while that object
# lives: building it copies every annotation, which periodic validation need not repeat.
_FASTER_GT: weakref.WeakKeyDictionary[COCO, Any] = weakref.WeakKeyDictionary()


@dataclass
class COCOEvalResult:
    """What Pet reads from a finished COCOeval, the same whichever backend ran it.

    ``stats``: COCO's 12 summary numbers (AP, AP50, AP75, APs, APm, APl, AR1, AR10, AR100, ARs,
    ARm, ARl), -1 where there is no ground truth; for ``keypoints`` its 10 (AP, AP50, AP75, APm, APl, AR,
    AR50, AR75, ARm, ARl: OKS thresholds instead of IoU, no small range, 20 detections per image).
    ``precision`` [T, R, K, A, M] and ``scores``
    (same shape) are COCOeval's ``eval`` arrays: interpolated precision and the score reached
    at each IoU threshold ``iou_thresholds[T]``, recall threshold ``recall_thresholds[R]``,
    category ``category_ids[K]``, area range ``area_ranges[A]`` ("all", "small", "medium",
    "large") and max detections ``max_dets[M]`` (1, 10, 100); -1 where undefined.
    """

    backend: str
    iou_type: str
    stats: np.ndarray
    precision: np.ndarray
    scores: np.ndarray
    iou_thresholds: np.ndarray
    recall_thresholds: np.ndarray
    category_ids: list[int]
    area_ranges: list[str]
    max_dets: list[int]
    summary: str


def faster_available() -> bool:
    """Whether faster-coco-eval can be imported."""
    return importlib.util.find_spec("faster_coco_eval") is not None


def resolve_coco_library(name: str) -> str:
    """The COCO evaluation library, ``"pycocotools"`` or ``"faster"`` (faster-coco-eval), for a
    ``TEST.COCO_BACKEND`` value ("auto": faster when installed).

    Raises :class:`ConfigError` for an unknown name, or for "faster" when faster-coco-eval is missing.
    """
    if name not in BACKENDS:
        raise ConfigError(f"TEST.COCO_BACKEND must be one of {', '.join(BACKENDS)}, got '{name}'")
    if name == "auto":
        return "faster" if faster_available() else "pycocotools"
    if name == "faster" and not faster_available():
        raise ConfigError("TEST.COCO_BACKEND faster needs faster-coco-eval: pip install faster-coco-eval "
                          "(or pip install -e '.[fast-eval]'), or set TEST.COCO_BACKEND pycocotools")
    return name


def resolve_backend(name: str) -> str:
    """Deprecated name of :func:`resolve_coco_library` (``resolve_backend`` also named the runtime choice of
    :mod:`pet.deploy.backend`); warns until Pet 0.4.0."""
    warnings.warn("pet.evaluation.backends.resolve_backend is now resolve_coco_library; the old name goes in Pet "
                  "0.4.0.", DeprecationWarning, stacklevel=2)
    return resolve_coco_library(name)


@dataclass(frozen=True)
class KeypointTask:
    """What the ``keypoints`` task needs besides the results: the OKS sigmas (one per point) and the ids of the
    categories that have keypoints (the only ones scored)."""

    oks_sigmas: tuple[float, ...]
    category_ids: tuple[int, ...]


def run_cocoeval(
    coco_gt: COCO, results: list[dict[str, Any]], iou_type: str, image_ids: Iterable[int], backend: str,
    keypoints: KeypointTask | None = None,
) -> COCOEvalResult:
    """Run COCOeval (evaluate, accumulate, summarize) of ``results`` on ``image_ids`` with ``backend``.

    ``coco_gt`` is the dataset's pycocotools object; ``results`` are COCO result dicts for
    ``iou_type`` ("bbox", "segm" or "keypoints", which needs ``keypoints``); neither is modified.
    ``backend`` is "pycocotools" or "faster" (see :func:`resolve_coco_library`). An empty ``results`` is
    scored too: AP 0 wherever there is ground truth.
    """
    image_ids = sorted(set(image_ids))
    if (iou_type == "keypoints") != (keypoints is not None):
        raise ValueError("the keypoints task, and only it, needs its KeypointTask (sigmas and categories)")
    if backend == "pycocotools":
        return _run_pycocotools(coco_gt, results, iou_type, image_ids, keypoints)
    if backend == "faster":
        return _run_faster(coco_gt, results, iou_type, image_ids, keypoints)
    raise ValueError(f"backend must be 'pycocotools' or 'faster', got '{backend}'")


def _run_pycocotools(
    coco_gt: COCO, results: list[dict[str, Any]], iou_type: str, image_ids: list[int], keypoints: KeypointTask | None
) -> COCOEvalResult:
    with contextlib.redirect_stdout(io.StringIO()):
        coco_dt = coco_gt.loadRes(copy.deepcopy(results)) if results else _empty_results(coco_gt)
        coco_eval = COCOeval(coco_gt, coco_dt, iou_type)
        coco_eval.params.imgIds = image_ids
        if keypoints is not None:
            coco_eval.params.kpt_oks_sigmas = np.asarray(keypoints.oks_sigmas, dtype=np.float64)
            coco_eval.params.catIds = sorted(keypoints.category_ids)
        coco_eval.evaluate()
        coco_eval.accumulate()
    summary = io.StringIO()
    with contextlib.redirect_stdout(summary):
        coco_eval.summarize()
    return _result("pycocotools", coco_eval, summary.getvalue())


def _empty_results(coco_gt: COCO) -> COCO:
    """A results object without detections (pycocotools' loadRes cannot load an empty list)."""
    coco_dt = COCO()
    coco_dt.dataset = {"images": list(coco_gt.dataset["images"]), "categories": list(coco_gt.dataset["categories"]),
                       "annotations": []}
    coco_dt.createIndex()
    return coco_dt


def _run_faster(
    coco_gt: COCO, results: list[dict[str, Any]], iou_type: str, image_ids: list[int], keypoints: KeypointTask | None
) -> COCOEvalResult:
    from faster_coco_eval import COCOeval_faster  # optional ("fast-eval" extra): only this backend needs it

    lines: list[str] = []
    faster_gt = _faster_ground_truth(coco_gt)
    coco_dt = faster_gt.loadRes(copy.deepcopy(results))
    sigmas = list(keypoints.oks_sigmas) if keypoints is not None else None
    coco_eval = COCOeval_faster(faster_gt, coco_dt, iou_type, print_function=lambda *args: None,
                                kpt_oks_sigmas=sigmas)
    coco_eval.params.imgIds = image_ids
    if keypoints is not None:
        coco_eval.params.catIds = sorted(keypoints.category_ids)
    coco_eval.evaluate()
    coco_eval.accumulate()
    coco_eval.print_function = lines.append
    coco_eval.summarize()
    return _result("faster", coco_eval, "\n".join(lines))


def _faster_ground_truth(coco_gt: COCO) -> Any:
    """faster-coco-eval's COCO object for ``coco_gt``, on a deep copy of its annotations (cached)."""
    from faster_coco_eval import COCO as FasterCOCO  # optional, as in _run_faster

    if coco_gt not in _FASTER_GT:
        _FASTER_GT[coco_gt] = FasterCOCO(copy.deepcopy(coco_gt.dataset), print_function=lambda *args: None)
    return _FASTER_GT[coco_gt]


def _result(backend: str, coco_eval: Any, summary: str) -> COCOEvalResult:
    params = coco_eval.params
    return COCOEvalResult(
        backend=backend,
        iou_type=params.iouType,
        stats=np.asarray(coco_eval.stats[:10 if params.iouType == "keypoints" else 12], dtype=np.float64),
        precision=np.asarray(coco_eval.eval["precision"]),
        scores=np.asarray(coco_eval.eval["scores"]),
        iou_thresholds=np.asarray(params.iouThrs),
        recall_thresholds=np.asarray(params.recThrs),
        category_ids=[int(c) for c in params.catIds],
        area_ranges=list(params.areaRngLbl),
        max_dets=list(params.maxDets),
        summary=summary.rstrip(),
    )
