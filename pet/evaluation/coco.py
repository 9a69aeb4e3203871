"""COCO box evaluation through pycocotools.

:class:`COCOEvaluator` collects a model's detections batch by batch, turns them into
COCO results (the dataset's own category ids, XYWH boxes), gathers them from all
processes and runs COCOeval on rank 0. :func:`evaluate_results_file` re-scores a saved
``bbox.json`` without the model.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from pycocotools.cocoeval import COCOeval

from pet.utils import comm
from pet.utils.errors import DataError
from pet.utils.registry import EVALUATOR_REGISTRY
from pet.utils.table import format_table

__all__ = ["COCOEvaluator", "evaluate_results_file", "BOX_METRICS"]

logger = logging.getLogger(__name__)

# Names of COCOeval's first six summary numbers.
BOX_METRICS = ("AP", "AP50", "AP75", "APs", "APm", "APl")


@EVALUATOR_REGISTRY.register()
class COCOEvaluator:
    """Box AP of a detector on a COCO-format dataset.

    ``dataset`` is anything with ``coco`` (pycocotools ground truth), ``class_names`` and
    ``label_to_category_id`` — a loader's ``dataset`` or :func:`pet.data.get_dataset` —
    or the registered name of a dataset.

    Use: ``reset()``, then ``process(targets, outputs)`` for every batch, then
    ``evaluate()``. Only the images seen by ``process`` are scored, so a partial run
    (or images skipped as unreadable) is scored on what was actually tested.
    """

    def __init__(self, dataset: Any, output_dir: str | None = None) -> None:
        if isinstance(dataset, str):
            from pet.data import get_dataset

            dataset = get_dataset(dataset)
        self.dataset = dataset
        self.output_dir = output_dir
        self.reset()

    def reset(self) -> None:
        self._predictions: dict[int, list[dict[str, Any]]] = {}

    @property
    def predictions(self) -> list[dict[str, Any]]:
        """The COCO results collected so far by this process."""
        return [d for image_id in sorted(self._predictions) for d in self._predictions[image_id]]

    def process(self, inputs: Any, outputs: Sequence[Mapping[str, Any]]) -> None:
        """Add one batch: ``outputs[i]`` holds boxes (XYXY, original image pixels), scores and
        contiguous labels for the image of ``targets[i]``.

        ``inputs`` is the loader's batch ``(images, targets)`` or just the ``targets`` list.
        """
        is_batch = isinstance(inputs, (tuple, list)) and len(inputs) == 2 and isinstance(inputs[0], torch.Tensor)
        targets = inputs[1] if is_batch else inputs
        for target, output in zip(targets, outputs):
            image_id = int(target["image_id"])
            if image_id not in self._predictions:  # an image seen twice (a replaced bad image) counts once
                self._predictions[image_id] = detections_to_coco(output, image_id, self.dataset.label_to_category_id)

    def evaluate(self) -> dict[str, dict[str, float]]:
        """``{"bbox": {"AP": .., "AP50": .., "AP75": .., "APs": .., "APm": .., "APl": .., "AP-<class>": ..}}``.

        Values are percentages (0-100), as in detectron2; NaN where the dataset has no
        ground truth for a metric (e.g. APl without large objects). Gathers the
        predictions of all processes; only rank 0 evaluates, the others return ``{}``.
        Writes ``output_dir/bbox.json`` (COCO results format) when ``output_dir`` is set.
        """
        predictions = self._predictions
        if comm.get_world_size() > 1:
            predictions = {}
            for part in comm.all_gather_object(self._predictions):
                for image_id, dets in part.items():
                    predictions.setdefault(image_id, dets)
            if not comm.is_main_process():
                return {}
        if not predictions:
            logger.warning("COCOEvaluator.evaluate() called without any processed image; returning {}.")
            return {}
        results = [d for image_id in sorted(predictions) for d in predictions[image_id]]
        if self.output_dir:
            path = os.path.join(self.output_dir, "bbox.json")
            write_json_atomic(path, results)
            logger.info(f"Saved {len(results)} detections to {path}")
        metrics = _evaluate_boxes(self.dataset, results, image_ids=sorted(predictions))
        return {"bbox": metrics}


def evaluate_results_file(dataset: Any, results_json: str) -> dict[str, dict[str, float]]:
    """Score a saved COCO results file (such as ``bbox.json``) against ``dataset`` on all its images.

    ``dataset`` is as in :class:`COCOEvaluator`. Returns the same dict as ``evaluate()``.
    """
    if isinstance(dataset, str):
        from pet.data import get_dataset

        dataset = get_dataset(dataset)
    if not os.path.isfile(results_json):
        raise DataError(f"Results file not found: {results_json}")
    try:
        with open(results_json) as f:
            results = json.load(f)
    except json.JSONDecodeError as exc:
        raise DataError(f"Results file {results_json} is not valid JSON: {exc}") from exc
    if not isinstance(results, list):
        raise DataError(f"Results file {results_json} must hold a list of detections "
                        "({image_id, category_id, bbox, score}), as written by COCOEvaluator.")
    known_images = set(dataset.coco.getImgIds())
    known_cats = set(dataset.coco.getCatIds())
    for i, det in enumerate(results):
        if not isinstance(det, dict) or not {"image_id", "category_id", "bbox", "score"} <= det.keys():
            raise DataError(f"Detection #{i} in {results_json} needs image_id, category_id, bbox and score: {det!r}")
        if det["image_id"] not in known_images or det["category_id"] not in known_cats:
            raise DataError(f"Detection #{i} in {results_json} refers to image id {det['image_id']} / category id "
                            f"{det['category_id']}, which dataset '{getattr(dataset, 'name', '?')}' does not have. "
                            "Was the file made on another dataset?")
    return {"bbox": _evaluate_boxes(dataset, results, image_ids=sorted(known_images))}


def detections_to_coco(
    output: Mapping[str, Any], image_id: int, label_to_category_id: Mapping[int, int]
) -> list[dict[str, Any]]:
    """One image's detections as COCO result dicts (XYWH boxes, the dataset's category ids)."""
    boxes = _to_numpy(output["boxes"]).astype(np.float64).reshape(-1, 4)
    scores = _to_numpy(output["scores"]).astype(np.float64).reshape(-1)
    labels = _to_numpy(output["labels"]).astype(np.int64).reshape(-1)
    boxes[:, 2:] -= boxes[:, :2]
    try:
        category_ids = [label_to_category_id[int(label)] for label in labels]
    except KeyError as exc:
        raise DataError(f"The model predicted label {exc.args[0]} for image {image_id}, but the dataset's labels "
                        f"are {sorted(label_to_category_id)}; check MODEL.NUM_CLASSES.") from None
    return [
        {"image_id": image_id, "category_id": cid, "bbox": [round(float(v), 3) for v in box], "score": float(score)}
        for box, score, cid in zip(boxes, scores, category_ids)
    ]


def write_json_atomic(path: str, obj: Any) -> None:
    """Write JSON to a temporary file in the same folder, then rename it over ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _evaluate_boxes(dataset: Any, results: list[dict[str, Any]], image_ids: Iterable[int]) -> dict[str, float]:
    class_names = list(dataset.class_names)
    if not results:
        logger.warning(f"No detections at all on dataset '{getattr(dataset, 'name', '?')}': every AP is 0.")
        return {**{m: 0.0 for m in BOX_METRICS}, **{f"AP-{n}": 0.0 for n in class_names}}
    coco_gt = dataset.coco
    with contextlib.redirect_stdout(io.StringIO()):
        coco_dt = coco_gt.loadRes(copy.deepcopy(results))  # loadRes adds fields to the dicts it gets
        coco_eval = COCOeval(coco_gt, coco_dt, "bbox")
        coco_eval.params.imgIds = list(image_ids)
        coco_eval.evaluate()
        coco_eval.accumulate()
    summary = io.StringIO()
    with contextlib.redirect_stdout(summary):
        coco_eval.summarize()
    logger.info(f"COCOeval bbox summary on '{getattr(dataset, 'name', '?')}':\n{summary.getvalue().rstrip()}")
    metrics = {m: _percent(v) for m, v in zip(BOX_METRICS, coco_eval.stats[:6])}
    metrics.update(_per_category_ap(coco_eval, dataset))
    _log_tables(metrics, class_names)
    return metrics


def _per_category_ap(coco_eval: COCOeval, dataset: Any) -> dict[str, float]:
    # precision: [IoU thresholds, recall points, categories, area ranges, max dets]; area "all", 100 dets.
    precision = coco_eval.eval["precision"]
    cat_index = {cid: k for k, cid in enumerate(coco_eval.params.catIds)}
    result = {}
    for label, name in enumerate(dataset.class_names, start=1):
        p = precision[:, :, cat_index[dataset.label_to_category_id[label]], 0, -1]
        p = p[p > -1]
        result[f"AP-{name}"] = float(p.mean() * 100) if p.size else float("nan")
    return result


def _log_tables(metrics: dict[str, float], class_names: list[str]) -> None:
    logger.info("Evaluation results for bbox (AP in %):\n" + format_table(
        BOX_METRICS, [[f"{metrics[m]:.3f}" for m in BOX_METRICS]]
    ))
    cells = [(n, f"{metrics[f'AP-{n}']:.3f}") for n in class_names]
    per_row = 3
    cells += [("", "")] * (-len(cells) % per_row)
    rows = [sum((list(c) for c in cells[i:i + per_row]), []) for i in range(0, len(cells), per_row)]
    logger.info("Per-category bbox AP:\n" + format_table(["category", "AP"] * per_row, rows))


def _percent(value: float) -> float:
    return float(value * 100) if value >= 0 else float("nan")  # COCOeval reports -1 when there is no GT


def _to_numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return (value.float() if value.is_floating_point() else value).numpy()  # numpy has no bfloat16
    return np.asarray(value)
