"""COCO box, mask and keypoint evaluation: pycocotools' COCOeval, or faster-coco-eval's (the same numbers).

:class:`COCOEvaluator` collects a model's detections batch by batch, turns them into
COCO results (the dataset's own category ids, XYWH boxes, RLE masks, flat keypoints), gathers
them from all processes and runs COCOeval on rank 0 (iouType "bbox"; "segm" when the model
outputs masks; "keypoints", OKS with the set's sigmas, when it outputs keypoints on a keypoint
set) with the backend of :mod:`pet.evaluation.backends`, then writes the diagnostics of
:mod:`pet.evaluation.diagnostics`. :func:`evaluate_results_file` re-scores a saved
``bbox.json``, ``segm.json`` or ``keypoints.json`` without the model. For a Pascal VOC dataset (``format`` voc)
the box metrics also hold ``VOC_AP50``, VOC's own mAP at IoU 0.5 (:mod:`pet.evaluation.voc`).
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pycocotools.mask as mask_util
import torch
from fvcore.common.config import CfgNode

from pet.data import get_dataset
from pet.evaluation.backends import COCOEvalResult, KeypointTask, resolve_coco_library, run_cocoeval
from pet.evaluation.build import EVALUATOR_REGISTRY
from pet.evaluation.diagnostics import write_diagnostics
from pet.evaluation.voc import voc_evaluate
from pet.utils import comm
from pet.utils.errors import DataError
from pet.utils.files import write_json_atomic
from pet.utils.table import format_table

__all__ = ["COCOEvaluator", "evaluate_results_file", "BOX_METRICS", "KEYPOINT_METRICS", "write_json_atomic"]

logger = logging.getLogger(__name__)

# Names of COCOeval's first six summary numbers (the same for bbox and segm).
BOX_METRICS = ("AP", "AP50", "AP75", "APs", "APm", "APl")
# COCOeval's first five keypoint numbers (OKS thresholds; keypoints have no "small" range).
KEYPOINT_METRICS = ("AP", "AP50", "AP75", "APm", "APl")
# COCOeval iouType -> the field of a COCO result it scores.
_RESULT_FIELD = {"bbox": "bbox", "segm": "segmentation", "keypoints": "keypoints"}


@EVALUATOR_REGISTRY.register()
class COCOEvaluator:
    """Box AP of a detector on a COCO-format dataset, and mask AP when its outputs have ``masks``.

    ``dataset`` is anything with ``coco`` (pycocotools ground truth) and ``label_to_category_id``
    (the model's labels -> category ids, see :class:`pet.data.LabelSpace`) — a loader's ``dataset``
    or :func:`pet.data.get_dataset` — or the registered name of a dataset.

    Scoring, per-class tables and diagnostics cover the categories of the ground truth, not the
    model's labels: with ``MODEL.LABEL_SPACE category_id`` the model has rows for category ids the
    dataset lacks (torchvision's COCO models: ten unused ids; a dataset with a subset of COCO's
    classes: more). Detections of such rows are left out of the results (COCOeval would ignore
    them anyway, so the AP is the same) and counted in the log.

    Use: ``reset()``, then ``process(targets, outputs)`` for every batch, then
    ``evaluate()``. Only the images seen by ``process`` are scored, so a partial run
    (or images skipped as unreadable) is scored on what was actually tested.

    ``backend``: "pycocotools" (the reference), "faster" (faster-coco-eval, same numbers) or
    "auto" (faster when installed); see :mod:`pet.evaluation.backends`. With ``diagnostics``
    and an ``output_dir``, ``evaluate()`` also writes PR curves, a confusion matrix and an
    error breakdown per task (:mod:`pet.evaluation.diagnostics`), at IoU ``diagnostics_iou``
    and, for the confusion matrix and the counts, score ``diagnostics_score``.
    """

    def __init__(
        self,
        dataset: Any,
        output_dir: str | None = None,
        *,
        backend: str = "auto",
        diagnostics: bool = True,
        diagnostics_iou: float = 0.5,
        diagnostics_score: float = 0.5,
    ) -> None:
        if isinstance(dataset, str):
            dataset = get_dataset(dataset)
        self.dataset = dataset
        self.output_dir = output_dir
        self.backend = resolve_coco_library(backend)
        self.diagnostics = diagnostics
        self.diagnostics_iou = diagnostics_iou
        self.diagnostics_score = diagnostics_score
        self.reset()

    @classmethod
    def from_config(cls, cfg: CfgNode, dataset: Any, output_dir: str | None = None) -> COCOEvaluator:
        """Built from ``TEST.COCO_BACKEND`` and ``TEST.DIAGNOSTICS.{ENABLED,IOU,SCORE}``."""
        diagnostics = cfg.TEST.DIAGNOSTICS
        return cls(dataset, output_dir, backend=cfg.TEST.COCO_BACKEND, diagnostics=diagnostics.ENABLED,
                   diagnostics_iou=diagnostics.IOU, diagnostics_score=diagnostics.SCORE)

    def reset(self) -> None:
        self._predictions: dict[int, list[dict[str, Any]]] = {}
        # Set by the first output with masks: even a batch without detections tells what to score.
        self._with_masks = False
        self._with_keypoints = False
        self._categories = _categories(self.dataset)
        self._left_out: Counter[int] = Counter()  # category id the ground truth lacks -> detections left out

    @property
    def predictions(self) -> list[dict[str, Any]]:
        """The COCO results collected so far by this process."""
        return [d for image_id in sorted(self._predictions) for d in self._predictions[image_id]]

    def process(self, inputs: Any, outputs: Sequence[Mapping[str, Any]]) -> None:
        """Add one batch: ``outputs[i]`` holds boxes (XYXY, original image pixels), scores and
        the model's labels for the image of ``targets[i]``, and optionally ``masks`` (uint8
        [N, H, W] 0/1 in the original image), which are kept as RLE.

        ``inputs`` is the loader's batch ``(images, targets)`` or just the ``targets`` list.
        """
        is_batch = isinstance(inputs, (tuple, list)) and len(inputs) == 2 and isinstance(inputs[0], torch.Tensor)
        targets = inputs[1] if is_batch else inputs
        for target, output in zip(targets, outputs):
            image_id = int(target["image_id"])
            self._with_masks |= "masks" in output
            self._with_keypoints |= "keypoints" in output
            if image_id in self._predictions:  # an image seen twice (a replaced bad image) counts once
                continue
            kept = self._predictions[image_id] = []
            for det in detections_to_coco(output, image_id, self.dataset.label_to_category_id):
                if det["category_id"] in self._categories:
                    kept.append(det)
                else:
                    self._left_out[det["category_id"]] += 1

    def evaluate(self) -> dict[str, dict[str, float]]:
        """``{"bbox": {"AP": .., "AP50": .., "AP75": .., "APs": .., "APm": .., "APl": .., "AP-<class>": ..}}``,
        plus the same under ``"segm"`` for mask AP when the outputs had masks.

        Values are percentages (0-100), as in detectron2; NaN where the dataset has no
        ground truth for a metric (e.g. APl without large objects). Gathers the
        predictions of all processes; only rank 0 evaluates, the others return ``{}``.
        Writes ``output_dir/bbox.json`` (and ``segm.json``; COCO results format) when
        ``output_dir`` is set, and with ``diagnostics`` the files of
        :func:`pet.evaluation.diagnostics.write_diagnostics` beside them.
        """
        if self._left_out:
            logger.info(f"Left out {sum(self._left_out.values())} detections of category ids "
                        f"{sorted(self._left_out)[:10]}, which dataset '{getattr(self.dataset, 'name', '?')}' "
                        "does not have (the model has more classes than the dataset; COCOeval ignores them).")
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
        image_ids = sorted(predictions)
        results = [d for image_id in image_ids for d in predictions[image_id]]
        with_masks = self._with_masks or any("segmentation" in d for d in results)
        with_keypoints = self._with_keypoints or any("keypoints" in d for d in results)
        tasks = ["bbox", *(["segm"] if with_masks else []), *(["keypoints"] if with_keypoints else [])]
        if with_keypoints and _keypoint_task(self.dataset) is None:
            logger.warning(f"The model predicts keypoints but dataset '{getattr(self.dataset, 'name', '?')}' has none "
                           "(no category names keypoints): keypoint AP is not computed.")
            tasks.remove("keypoints")
        metrics = {}
        for iou_type in tasks:
            task_results = _results_for(iou_type, results, self.dataset)
            if self.output_dir:
                path = os.path.join(self.output_dir, f"{iou_type}.json")
                write_json_atomic(path, task_results)
                logger.info(f"Saved {len(task_results)} detections to {path}")
            result = _cocoeval(self.dataset, task_results, image_ids, iou_type, self.backend)
            metrics[iou_type] = _metrics(result, self.dataset)
            if iou_type == "bbox":
                metrics[iou_type].update(_voc_metrics(self.dataset, task_results, image_ids))
            if self.diagnostics and self.output_dir:
                categories = _scored_categories(self.dataset, iou_type)
                write_diagnostics(self.output_dir, iou_type, result, self.dataset.coco, task_results, image_ids,
                                  list(categories.values()), list(categories),
                                  self.diagnostics_iou, self.diagnostics_score)
        return metrics


def evaluate_results_file(dataset: Any, results_json: str, backend: str = "auto") -> dict[str, dict[str, float]]:
    """Score a saved COCO results file against ``dataset`` on all its images.

    Detections with ``bbox`` are scored as boxes (``bbox.json``), detections with an RLE
    ``segmentation`` as masks (``segm.json``), detections with ``keypoints`` as keypoints (``keypoints.json``,
    on a keypoint set); a file whose detections have several gets each.
    ``dataset`` and ``backend`` are as in :class:`COCOEvaluator`. Returns the same dict as ``evaluate()``.
    """
    if isinstance(dataset, str):
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
                        "({image_id, category_id, bbox or segmentation, score}), as written by COCOEvaluator.")
    images = {img["id"]: img for img in dataset.coco.loadImgs(dataset.coco.getImgIds())}
    known_cats = set(dataset.coco.getCatIds())
    for i, det in enumerate(results):
        if (not isinstance(det, dict) or not {"image_id", "category_id", "score"} <= det.keys()
                or not det.keys() & {"bbox", "segmentation"}):
            raise DataError(f"Detection #{i} in {results_json} needs image_id, category_id, score and a bbox or "
                            f"segmentation: {str(det)[:200]}")
        if det["image_id"] not in images or det["category_id"] not in known_cats:
            raise DataError(f"Detection #{i} in {results_json} refers to image id {det['image_id']} / category id "
                            f"{det['category_id']}, which dataset '{getattr(dataset, 'name', '?')}' does not have. "
                            "Was the file made on another dataset?")
        if "segmentation" in det:
            _check_rle(det["segmentation"], images[det["image_id"]], f"Detection #{i} in {results_json}")
    iou_types = [t for t, field in _RESULT_FIELD.items() if all(field in d for d in results)] if results else ["bbox"]
    if "keypoints" in iou_types and _keypoint_task(dataset) is None:
        raise DataError(f"{results_json} holds keypoints but dataset '{getattr(dataset, 'name', '?')}' has none (no "
                        "category names keypoints). Was the file made on another dataset?")
    if not iou_types:
        raise DataError(f"{results_json} mixes detections with only a bbox and detections with only a segmentation; "
                        "keep boxes (bbox.json) and masks (segm.json) in separate files.")
    image_ids = sorted(images)
    backend = resolve_coco_library(backend)
    metrics = {t: _metrics(_cocoeval(dataset, _results_for(t, results, dataset), image_ids, t, backend), dataset)
               for t in iou_types}
    if "bbox" in metrics:
        metrics["bbox"].update(_voc_metrics(dataset, _results_for("bbox", results, dataset), image_ids))
    return metrics


def detections_to_coco(
    output: Mapping[str, Any], image_id: int, label_to_category_id: Mapping[int, int]
) -> list[dict[str, Any]]:
    """One image's detections as COCO result dicts (XYWH boxes, the dataset's category ids) with
    their masks as RLE ``segmentation`` when ``output`` has ``masks``, and their ``keypoints`` flat
    (x1, y1, s1, x2, ...) when it has ``keypoints``: the third value is the point's score
    (``keypoints_scores``), as detectron2 writes it (COCOeval reads only x and y of a detection)."""
    boxes = _to_numpy(output["boxes"]).astype(np.float64).reshape(-1, 4)
    scores = _to_numpy(output["scores"]).astype(np.float64).reshape(-1)
    labels = _to_numpy(output["labels"]).astype(np.int64).reshape(-1)
    boxes[:, 2:] -= boxes[:, :2]
    try:
        category_ids = [label_to_category_id[int(label)] for label in labels]
    except KeyError as exc:
        raise DataError(f"The model predicted label {exc.args[0]} for image {image_id}, but the dataset's labels "
                        f"are {min(label_to_category_id)}..{max(label_to_category_id)}; check MODEL.NUM_CLASSES."
                        ) from None
    results = [
        {"image_id": image_id, "category_id": cid, "bbox": [round(float(v), 3) for v in box], "score": float(score)}
        for box, score, cid in zip(boxes, scores, category_ids)
    ]
    if "masks" in output:
        for result, rle in zip(results, masks_to_rle(output["masks"])):
            result["segmentation"] = rle
    if "keypoints" in output:
        points = _to_numpy(output["keypoints"]).astype(np.float64).reshape(len(results), -1, 3)
        if "keypoints_scores" in output:
            points[..., 2] = _to_numpy(output["keypoints_scores"]).reshape(points.shape[:2])
        for result, p in zip(results, points):
            result["keypoints"] = [round(float(v), 3) for v in p.reshape(-1)]
    return results


def masks_to_rle(masks: Any) -> list[dict[str, Any]]:
    """COCO RLEs (``{"size": [H, W], "counts": str}``, JSON-ready) of 0/1 masks ``[N, H, W]``."""
    masks = _to_numpy(masks).astype(np.uint8, copy=False)
    if len(masks) == 0:
        return []
    rles = mask_util.encode(np.asfortranarray(masks.transpose(1, 2, 0)))  # pycocotools wants [H, W, N], Fortran
    return [{"size": [int(v) for v in rle["size"]], "counts": rle["counts"].decode("ascii")} for rle in rles]


def _results_for(iou_type: str, results: list[dict[str, Any]], dataset: Any) -> list[dict[str, Any]]:
    """The results without the other tasks' fields: COCO's ``loadRes`` takes a mask's area from
    its ``bbox`` when there is one, which would put masks in the wrong APs/APm/APl range. Keypoint
    results keep their box, as detectron2's do (``loadRes`` then takes their area, which places an
    unmatched detection in an area range, from the box, not from the points' extent), and only the
    detections of categories with keypoints are scored."""
    others = {"bbox": ("segmentation", "keypoints"), "segm": ("bbox", "keypoints"), "keypoints": ("segmentation",)}
    if iou_type == "keypoints":
        scored = set(_keypoint_task(dataset).category_ids)
        results = [d for d in results if d["category_id"] in scored and "keypoints" in d]
    return [{k: v for k, v in d.items() if k not in others[iou_type]} for d in results]


def _keypoint_task(dataset: Any) -> KeypointTask | None:
    """The sigmas and keypoint categories of ``dataset`` (:class:`~pet.data.keypoints.KeypointMeta`); None for a
    set without keypoints."""
    meta = getattr(dataset, "keypoint_meta", None)
    if meta is None:
        return None
    ids = tuple(c["id"] for c in dataset.coco.dataset["categories"] if c.get("keypoints"))
    return KeypointTask(tuple(meta.oks_sigmas), ids)


def _scored_categories(dataset: Any, iou_type: str) -> dict[int, str]:
    """The categories a task scores: all of the ground truth's, or for keypoints those with keypoints."""
    categories = _categories(dataset)
    if iou_type != "keypoints":
        return categories
    ids = set(_keypoint_task(dataset).category_ids)
    return {cid: name for cid, name in categories.items() if cid in ids}


def _check_rle(segmentation: Any, image: dict[str, Any], where: str) -> None:
    if not isinstance(segmentation, dict) or not {"size", "counts"} <= segmentation.keys():
        raise DataError(f"{where} has a segmentation that is not an RLE dict with size and counts: "
                        f"{str(segmentation)[:80]}")
    if list(segmentation["size"]) != [image["height"], image["width"]]:
        raise DataError(f"{where} has a mask of size {list(segmentation['size'])} (height, width) but image "
                        f"{image['id']} is {image['height']}x{image['width']}. Was the file made on another dataset?")


def _cocoeval(
    dataset: Any, results: list[dict[str, Any]], image_ids: Iterable[int], iou_type: str, backend: str
) -> COCOEvalResult:
    name = getattr(dataset, "name", "?")
    if not results:
        logger.warning(f"No detections at all on dataset '{name}': {iou_type} AP is 0 wherever there is ground truth.")
    start = time.perf_counter()
    keypoints = _keypoint_task(dataset) if iou_type == "keypoints" else None
    result = run_cocoeval(dataset.coco, results, iou_type, image_ids, backend, keypoints)
    logger.info(f"COCOeval {iou_type} summary on '{name}' ({backend}, {time.perf_counter() - start:.2f} s):\n"
                f"{result.summary}")
    return result


def _metrics(result: COCOEvalResult, dataset: Any) -> dict[str, float]:
    categories = _scored_categories(dataset, result.iou_type)
    names = KEYPOINT_METRICS if result.iou_type == "keypoints" else BOX_METRICS
    metrics = {m: _percent(v) for m, v in zip(names, result.stats)}
    metrics.update(_per_category_ap(result, categories))
    _log_tables(metrics, names, list(categories.values()), result.iou_type)
    return metrics


def _voc_metrics(dataset: Any, results: list[dict[str, Any]], image_ids: Sequence[int]) -> dict[str, float]:
    """``{"VOC_AP50": ...}`` (VOC2010+ mAP at IoU 0.5, in %) for a Pascal VOC dataset, with a per-class table
    in the log; ``{}`` for other formats."""
    if getattr(dataset, "format", "coco") != "voc":
        return {}
    aps = voc_evaluate(dataset.coco, results, image_ids)
    categories = _categories(dataset)
    per_class = [aps[cid] for cid in categories]
    scored = [ap for ap in per_class if ap == ap]  # classes without ground truth (NaN) are left out, as in COCO
    mean = float(np.mean(scored) * 100) if scored else float("nan")
    cells = [(name, f"{ap * 100:.2f}") for name, ap in zip(categories.values(), per_class)]
    logger.info(f"Pascal VOC mAP@0.5 (VOC2010+ all-point AP, difficult objects ignored): {mean:.2f}\n"
                + _per_class_table(cells, "VOC AP50"))
    return {"VOC_AP50": mean}


def _categories(dataset: Any) -> dict[int, str]:
    """The categories ``{id: name}`` of ``dataset``'s ground truth, by increasing id: what is scored."""
    coco = dataset.coco
    return {c["id"]: c["name"] for c in sorted(coco.loadCats(coco.getCatIds()), key=lambda c: c["id"])}


def _per_category_ap(result: COCOEvalResult, categories: Mapping[int, str]) -> dict[str, float]:
    # precision: [IoU thresholds, recall points, categories, area ranges, max dets]; area "all", 100 dets.
    cat_index = {cid: k for k, cid in enumerate(result.category_ids)}
    metrics = {}
    for category_id, name in categories.items():
        p = result.precision[:, :, cat_index[category_id], 0, -1]
        p = p[p > -1]
        metrics[f"AP-{name}"] = float(p.mean() * 100) if p.size else float("nan")
    return metrics


def _log_tables(metrics: dict[str, float], names: Sequence[str], class_names: list[str], iou_type: str) -> None:
    logger.info(f"Evaluation results for {iou_type} (AP in %):\n" + format_table(
        list(names), [[f"{metrics[m]:.3f}" for m in names]]
    ))
    cells = [(n, f"{metrics[f'AP-{n}']:.3f}") for n in class_names]
    logger.info(f"Per-category {iou_type} AP:\n" + _per_class_table(cells, "AP"))


def _per_class_table(cells: list[tuple[str, str]], value: str, per_row: int = 3) -> str:
    """``(class, value)`` cells laid out ``per_row`` classes to a row."""
    cells = cells + [("", "")] * (-len(cells) % per_row)
    rows = [sum((list(c) for c in cells[i:i + per_row]), []) for i in range(0, len(cells), per_row)]
    return format_table(["category", value] * per_row, rows)


def _percent(value: float) -> float:
    return float(value * 100) if value >= 0 else float("nan")  # COCOeval reports -1 when there is no GT


def _to_numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return (value.float() if value.is_floating_point() else value).numpy()  # numpy has no bfloat16
    return np.asarray(value)
