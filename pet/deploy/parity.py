"""The parity gate an ONNX export (and its OpenVINO IR) must pass before it counts.

:func:`check_parity` runs the PyTorch model and the exported model (in onnxruntime or OpenVINO) on the same
batches (:func:`parity_batches`: test images of several sizes and a blank one, in batches of 2 and 1) and
raises :class:`ParityError` unless, on every image, they agree within :class:`Tolerance`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from fvcore.common.config import CfgNode
from torch import Tensor

from pet.data import DatasetMapper, collate_batch, get_dataset, read_image, register_custom_datasets
from pet.deploy.exported_model import ExportedModel
from pet.deploy.onnx import Batch
from pet.modeling.postprocess import detections_to_original
from pet.utils.errors import DataError, PetError

__all__ = ["ParityError", "Tolerance", "ParityReport", "parity_batches", "check_parity"]


class ParityError(PetError):
    """The exported model's detections differ from the PyTorch model's beyond the tolerances."""


@dataclass(frozen=True)
class Tolerance:
    """How far the ONNX model's detections may be from the PyTorch model's, per image.

    Each detection must have a counterpart with the same label (one to one; a detection either side may cut at a
    near-tie is the exception, see :func:`check_parity`) and:
    ``box``: every coordinate within ``box`` x the original image's longer side, in px (0.64 px for a
    640 px image), and so every keypoint; ``score`` absolute, and relative for keypoint scores (heatmap logits,
    O(10)); ``mask_iou``: the pasted masks' IoU at least this, not counting the
    pixels whose pasted probability in the PyTorch mask is within ``mask_band`` of the 0.5 threshold. Those
    are decided by float rounding, not by the export: pasting interpolates between mask cells, and a saturated
    mask (cells of 0 and 1) resized by a whole factor puts pixels exactly halfway, at 0.5.
    """

    box: float = 1e-3
    score: float = 1e-4
    mask_iou: float = 0.99
    mask_band: float = 0.01


def parity_batches(cfg: CfgNode) -> list[Batch]:
    """The batches the gate compares on, as the test loader would give them (``INPUT`` transforms, padding).

    The first two images of ``TEST.DATASETS[0]``, the first one again cropped to three quarters of its width
    (another size), and a blank grey image of another shape: the dataset's two in a batch (the export's
    example), the crop with the blank one (a batch whose images have and have not detections), and the blank
    one alone (a batch without any).
    """
    register_custom_datasets(cfg)
    name = cfg.TEST.DATASETS[0] if cfg.TEST.DATASETS else ""
    try:
        records = get_dataset(name, strict=cfg.DATA.STRICT).records[:2]
    except DataError as exc:
        raise DataError(f"The parity gate needs test images, but TEST.DATASETS[0] '{name}' cannot be loaded "
                        f"({exc}). Name a dataset you have, e.g. TEST.DATASETS \"('shapes_val',)\" (the demo set, "
                        "generated on first use).") from exc
    if not records:
        raise DataError(f"The parity gate needs test images, but TEST.DATASETS[0] '{name}' has none.")
    images = [read_image(r["file_name"], r["image_id"]) for r in records]
    height, width = images[0].shape[:2]
    images.append(np.ascontiguousarray(images[0][:, : max(1, width * 3 // 4)]))
    images.append(np.full((max(1, height * 3 // 4), width, 3), 127, dtype=np.uint8))
    mapper = DatasetMapper.from_config(cfg, is_train=False)
    empty = {"boxes": np.zeros((0, 4), dtype=np.float32), "labels": []}
    samples = [mapper({"image_id": i + 1, **empty}, image, np.random.default_rng(0)) for i, image in enumerate(images)]
    groups = [samples[:2], samples[2:4], samples[-1:]]
    return [collate_batch(group, cfg.INPUT.SIZE_DIVISIBILITY) for group in groups]


@dataclass
class ParityReport:
    """What the gate measured: the largest differences over all paired detections, and any disagreement."""

    tolerance: Tolerance
    runtime: str = "onnxruntime"  # what ran the export, in messages
    images: int = 0
    detections: int = 0
    box_px: float = 0.0  # largest coordinate difference, px
    box_fraction: float = 0.0  # ... as a fraction of its image's longer side
    score: float = 0.0
    mask_iou: float | None = None  # lowest, for models with masks
    keypoint_px: float | None = None  # largest keypoint coordinate difference, for models with keypoints
    keypoint_score: float | None = None  # ... and relative keypoint score difference
    near_ties: int = 0  # detections paired as translated near-ties (see check_parity)
    problems: list[str] = field(default_factory=list)

    def summary(self) -> str:
        tol = self.tolerance
        masks = f", lowest mask IoU {self.mask_iou:.4f} (at least {tol.mask_iou})" if self.mask_iou is not None else ""
        if self.keypoint_px is not None:
            masks += (f", keypoints {self.keypoint_px:.3g} px and keypoint scores {self.keypoint_score:.3g} "
                      "(relative) apart")
        ties = f"; {self.near_ties} paired as translated near-ties" if self.near_ties else ""
        return (f"{self.images} images, {self.detections} detections{ties}; largest differences: box "
                f"{self.box_px:.3g} px = {self.box_fraction:.3g} of the image size (tolerance {tol.box:g}), "
                f"score {self.score:.3g} (tolerance {tol.score:g}){masks}")


def check_parity(model: torch.nn.Module, onnx_model: ExportedModel, batches: Sequence[Batch],
                 tolerance: Tolerance = Tolerance()) -> ParityReport:
    """Compare ``model`` (PyTorch, eval mode, float32) and ``onnx_model`` on ``batches``; returns the report.

    On every image each PyTorch detection must pair with one of the export's of the same label within
    ``tolerance``, and the reverse (pairs are found greedily in score order, so two detections whose order flips
    on a near-tie still pair). Masks are compared pasted into the same box, the
    PyTorch one: the paste rounds box corners to whole pixels, so a box 1e-4 px off can shift a thin mask by a
    pixel, and the boxes are checked on their own (see :class:`Tolerance` for the pixels left out).

    One exception: on a uniform region (the blank image) many translated copies of a box score within float
    rounding of each other, and NMS keeps whichever the runtime's last bit favours. A detection left without a
    partner therefore pairs with a leftover one of the same label, score (within tolerance) and width and height
    (within the box tolerance): a translated near-tie, counted in the report, at most one per ten detections of an
image (at least one), so that boxes shifted as a whole do not pass as near-ties; and what such a swap pushes out of
    (or into) the list is accepted when its score is within the score tolerance of a cut-off: the score
    threshold or, on an image at the per-image cap, the other side's lowest score. So is a detection whose score
    is that close to the threshold and which only one side keeps (the two sides' scores differ in their last
    bits, and the CPU's kernels decide which way): the two sides' counts may then differ. Anything else raises
    :class:`ParityError`, whose message has the report.
    """
    # The runtime's name in messages: OnnxRuntimeModel's and OpenVinoModel's say (a stand-in without one: onnxruntime).
    report = ParityReport(tolerance, getattr(onnx_model, "runtime", "onnxruntime"))
    model.eval()
    with torch.inference_mode(), torch.autocast("cpu", enabled=False):
        for images, targets in batches:
            expected, expected_masks = _pytorch_detections(model, images, targets)
            network = onnx_model.network_detections(images, targets)
            actual = detections_to_original([dict(d) for d in network], targets)
            for k, (target, ref, ours) in enumerate(zip(targets, expected, actual)):
                masks = (None if expected_masks is None else
                         _same_box_masks(expected_masks[k], network[k], target, tolerance.mask_band))
                cutoffs = _cutoffs(ref, ours, model.score_thresh, model.detections_per_img)
                problem = _compare_image(report, ref, ours, max(target["orig_size"]), cutoffs, masks)
                if problem:
                    report.problems.append(f"image {int(target['image_id'])}: {problem}")
    if report.problems:
        shown = "; ".join(report.problems[:3]) + ("; ..." if len(report.problems) > 3 else "")
        raise ParityError(f"{onnx_model.path} disagrees with the PyTorch model on {len(report.problems)} image(s): "
                          f"{shown}. {report.summary()}. Do not use this export.")
    return report


def _pytorch_detections(model: torch.nn.Module, images: Tensor,
                        targets: list[dict[str, Any]]) -> tuple[list[dict[str, Tensor]], list[dict] | None]:
    """The model's detections and, for a model with masks, its detections before they are mapped to the original
    images (boxes in the network input's pixels, mask probabilities: :meth:`pet.modeling.Detector.network_detections`),
    mapped as the model's eval forward maps them."""
    network = model.network_detections(images, targets)
    masked = any("masks" in d for d in network)
    # detections_to_original replaces the dicts' entries: it gets copies, and the network's stay as they are.
    detections = detections_to_original([dict(d) for d in network], targets)
    return detections, (network if masked else None)


def _same_box_masks(ref: dict[str, Tensor], ours: dict[str, Tensor], target: dict[str, Any],
                    band: float) -> Callable[[int, int], float]:
    """``iou(i, j)``: the IoU of PyTorch's mask ``i`` and onnxruntime's mask ``j`` (probabilities in ``ref`` /
    ``ours``) both pasted into PyTorch's box ``i`` as :func:`detections_to_original` pastes, leaving out the pixels
    whose PyTorch probability is within ``band`` of the threshold. Probabilities shifted by ``band`` paste
    the pixels above ``0.5 + band`` and ``0.5 - band`` (interpolation is linear)."""

    def paste(i: int, probabilities: Tensor) -> Tensor:
        detection = {"boxes": ref["boxes"][i : i + 1], "masks": probabilities[None]}
        return detections_to_original([detection], [target])[0]["masks"][0].bool()

    def iou(i: int, j: int) -> float:
        expected, actual = paste(i, ref["masks"][i]), paste(i, ours["masks"][j])
        decided = paste(i, ref["masks"][i] - band) | ~paste(i, ref["masks"][i] + band)
        return _mask_iou(expected & decided, actual & decided)

    return iou


def _cutoffs(ref: dict[str, Tensor], ours: dict[str, Tensor], score_thresh: float, cap: int) -> list[float]:
    """The scores at which a detection may be cut: the threshold, and on a capped image both sides' lowest."""
    capped = len(ref["scores"]) == cap and len(ours["scores"]) == cap
    return [score_thresh] + ([float(ref["scores"].min()), float(ours["scores"].min())] if capped else [])


def _compare_image(report: ParityReport, ref: dict[str, Tensor], ours: dict[str, Tensor], side: int,
                   cutoffs: list[float], mask_iou: Callable[[int, int], float] | None) -> str:
    """Pair one image's detections (PyTorch ``ref``, onnxruntime ``ours``) into ``report``; what disagrees, or ''.

    ``side`` is the original image's longer side, the unit of the box tolerance; ``cutoffs`` the scores where a
    near-tie may have cut a detection (see :func:`check_parity`); ``mask_iou(i, j)`` the IoU of the two sides'
    masks ``i`` and ``j``, for models with masks."""
    report.images += 1
    report.detections += len(ref["boxes"])
    tol, box_tol = report.tolerance, report.tolerance.box * side
    free = torch.ones(len(ours["boxes"]), dtype=torch.bool)
    leftover = []
    for i in range(len(ref["boxes"])):
        box = (ours["boxes"] - ref["boxes"][i]).abs().amax(dim=1)
        score = (ours["scores"] - ref["scores"][i]).abs()
        close = free & (ours["labels"] == ref["labels"][i]) & (score <= tol.score) & (box <= box_tol)
        if not close.any():
            leftover.append(i)
            continue
        j = int(torch.where(close, box, torch.inf).argmin())
        free[j] = False
        report.box_px, report.score = max(report.box_px, float(box[j])), max(report.score, float(score[j]))
        report.box_fraction = max(report.box_fraction, float(box[j]) / side)
        if mask_iou is not None:
            iou = mask_iou(i, j)
            report.mask_iou = min(iou, 1.0 if report.mask_iou is None else report.mask_iou)
            if iou < tol.mask_iou:
                return (f"detection {i} (label {int(ref['labels'][i])}) has a mask of IoU {iou:.4f} with "
                        f"{report.runtime}'s")
        if "keypoints" in ref:
            problem = _compare_keypoints(report, ref, ours, i, j, box_tol)
            if problem:
                return problem
    unpaired = []
    ties_allowed = max(1, len(ref["boxes"]) // 10)  # a near-tie is a rare swap, not a shift of every box
    for i in leftover:
        size = (_sizes(ours["boxes"]) - _sizes(ref["boxes"][i : i + 1])).abs().amax(dim=1)
        score = (ours["scores"] - ref["scores"][i]).abs()
        tie = free & (ours["labels"] == ref["labels"][i]) & (score <= tol.score) & (size <= box_tol)
        if tie.any() and ties_allowed > 0:
            ties_allowed -= 1
            free[int(tie.nonzero()[0])] = False
            report.near_ties += 1
        else:
            unpaired.append(i)
    # What is left on either side (a count that differs included) must be a near-tie at a cut-off.
    far = [i for i in unpaired if not _near(float(ref["scores"][i]), cutoffs, tol.score)]
    if far:
        return _unpaired(ref, ours, far[0], report.runtime)
    extra = [j for j in free.nonzero().flatten().tolist() if not _near(float(ours["scores"][j]), cutoffs, tol.score)]
    if extra:
        j = extra[0]
        return (f"{report.runtime}'s detection {j} (label {int(ours['labels'][j])}, score "
                f"{float(ours['scores'][j]):.4f}) has no PyTorch counterpart ({len(ref['boxes'])} detections in "
                f"PyTorch, {len(ours['boxes'])} in {report.runtime})")
    return ""


def _near(score: float, cutoffs: list[float], tolerance: float) -> bool:
    """Whether ``score`` is within ``tolerance`` of one of the scores where a near-tie may cut a detection."""
    return min(abs(score - cutoff) for cutoff in cutoffs) <= tolerance


def _compare_keypoints(report: ParityReport, ref: dict[str, Tensor], ours: dict[str, Tensor], i: int, j: int,
                       box_tol: float) -> str:
    """Keypoints of the paired detections ``i`` (PyTorch) and ``j`` (onnxruntime) into ``report``: every coordinate
    within the box tolerance, every score within the score tolerance relative to its size; what disagrees, or ''.
    """
    px = float((ours["keypoints"][j] - ref["keypoints"][i]).abs().max())
    expected = ref["keypoints_scores"][i]
    score = float(((ours["keypoints_scores"][j] - expected).abs() / expected.abs().clamp(min=1)).max())
    report.keypoint_px = max(px, report.keypoint_px or 0.0)
    report.keypoint_score = max(score, report.keypoint_score or 0.0)
    if px > box_tol or score > report.tolerance.score:
        return (f"detection {i} (label {int(ref['labels'][i])}) has keypoints {px:.3g} px and keypoint scores "
                f"{score:.3g} (relative) from {report.runtime}'s")
    return ""


def _unpaired(ref: dict[str, Tensor], ours: dict[str, Tensor], i: int, runtime: str) -> str:
    """Why PyTorch's detection ``i`` has no partner: how far the nearest box of its label from ``runtime`` is."""
    label = int(ref["labels"][i])
    what = f"detection {i} (label {label}, score {float(ref['scores'][i]):.4f}) has no {runtime} counterpart"
    same = ours["labels"] == label
    if not same.any():
        return f"{what} (none of that label)"
    box = (ours["boxes"][same] - ref["boxes"][i]).abs().amax(dim=1)
    j = int(box.argmin())
    return (f"{what}: the nearest box of that label is {float(box[j]):.3g} px off, its score "
            f"{abs(float(ours['scores'][same][j] - ref['scores'][i])):.3g} off")


def _sizes(boxes: Tensor) -> Tensor:
    """Width and height of XYXY ``boxes [N, 4]``, as ``[N, 2]``."""
    return boxes[:, 2:] - boxes[:, :2]


def _mask_iou(a: Tensor, b: Tensor) -> float:
    """IoU of two 0/1 masks; two empty masks are identical."""
    a, b = a.bool(), b.bool()
    union = int((a | b).sum())
    return int((a & b).sum()) / union if union else 1.0
