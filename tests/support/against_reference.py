"""Pet against the reference implementations: its five R-50-FPN detectors against torchvision's, same weights.

The ``*_parity_*`` tests (``pytest -q tests -k parity``) call :func:`check_inference_parity` and
:func:`check_training_parity`. Both sides run as shipped; the harness only chooses the weights and the inputs.
Its pairing of detections (:func:`match_detections`, :class:`Tolerance`) also serves RT-DETR against transformers'
and the ONNX export tests. (The export's own gate is :mod:`pet.deploy.parity`.)

**Models.** Pet's model is built from ``cfgs/coco/<arch>_R-50-FPN_1x.yaml`` as it ships (R-50, FrozenBN, stem and
res2 frozen, channels-last, torchvision's thresholds and sampling); only the loader's resize is made small
(``INPUT.MIN_SIZE_* 192``, ``INPUT.MAX_SIZE_* 288``), and the two-stage models' RoIs sampled per training image
(:attr:`Arch.roi_batch`, on both sides), to keep the tests cheap. torchvision's reference comes
from its own builder (``fasterrcnn_resnet50_fpn`` ...) given ImageNet weights, the path a user fine-tuning from
ImageNet takes (FrozenBatchNorm2d with eps 1e-5, ``trainable_backbone_layers=3``), with
:func:`imagenet_like_resnet50`'s weights handed to it in place of the download. Its ``min_size`` / ``max_size``
are Pet's, so it does not resize the loader's images again (scale 1). Its ``state_dict`` reaches Pet through
a file and ``load_weights``, as a user's would.

**Weights.** Random but not trivial. Every FrozenBatchNorm holds its own statistics and affine parameters, drawn
around the activations it sees, and the ResNet's convolutions are scaled down so that the running variances
span 1e-5 to 0.3: an eps of 1e-5 instead of 0 (or the reverse) then moves normalised activations by up to 30%,
so eps and the statistics path are exercised (with eps 0, or zeroed running means, in Pet's model both checks
fail for Faster R-CNN and RetinaNet). torchvision initialises the heads' output layers for training (every
score near the prior, every box an anchor); :func:`rescale_outputs` gives them O(1) logits and box deltas,
and :func:`_bias_scores` shifts the classifier so that, at the shipped score thresholds, images with shapes
keep real detections (Faster R-CNN and RetinaNet up to their per-image caps of 100 and 300, FCOS and Mask
R-CNN fewer, cut by the score threshold) while a flat grey image has none.

**Inputs.** Images of the shapes demo's kind (textured backgrounds, filled shapes, noise) of three sizes and aspect
ratios: one resized down from a larger original, one up, and the flat one, capped by ``MAX_SIZE_TEST``. They go
through Pet's own mapper and collator, so the batch is exactly what Pet's loader gives the model (uint8,
channels-last, padded to 32); torchvision's model gets the same pixels as floats, unpadded. The shapes are COCO
categories (:data:`SHAPE_CATEGORIES`, ids up to 90) labelled in the shipped configs' label space (``NUM_CLASSES 90``,
``LABEL_SPACE category_id``: label = category id, torchvision's 91-row COCO layout), as Pet's loader labels them.
For Keypoint R-CNN every shape is a person (its config's one class) with :data:`NUM_KEYPOINTS` keypoints
(:func:`add_keypoints`), added to the training targets after Pet's mapper: the harness tests the model, the
loader's keypoints are tested with the data.

**Memory format.** Pet runs channels-last (``MODEL.CHANNELS_LAST``, the default), torchvision contiguous. Their
convolutions add in different orders, so torchvision's own model gives slightly different numbers in the two
formats, while Pet's numbers are bit-identical to torchvision's model moved to channels-last. Inference is
compared with both: with the channels-last run as shipped (float32), with the contiguous run in float64 (the
``CONTIGUOUS`` tolerance below); training with the channels-last run only (see :func:`check_training_parity`).

Over 400 lines on purpose: the weights, inputs and both checks above form one harness, and the
checks only mean something when read together with how the weights and inputs were chosen.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple
from unittest import mock

import numpy as np
import pycocotools.mask as mask_util
import pytest
import torch
import torchvision
from torchvision.models import ResNet50_Weights
from torchvision.ops import FrozenBatchNorm2d

from pet.checkpoint import load_weights
from pet.config import load_cfg
from pet.data.build import collate_batch
from pet.data.categories import LabelSpace
from pet.data.mapper import DatasetMapper
from pet.data.shapes import render_picture
from pet.modeling import build_model, poolers
from support.helpers import ROOT

_SMALL_INPUT = ["INPUT.MIN_SIZE_TRAIN", "(192,)", "INPUT.MAX_SIZE_TRAIN", "288",
                "INPUT.MIN_SIZE_TEST", "192", "INPUT.MAX_SIZE_TEST", "288"]


class Arch(NamedTuple):
    builder: Callable[..., torch.nn.Module]  # torchvision's
    # The heads' output layers and the std (bias aside) that :func:`rescale_outputs` gives their outputs.
    outputs: dict[str, float]
    # The flat image's best score as a fraction of the score threshold (:func:`_bias_scores`): the lower,
    # the fewer detections the other images keep (Mask R-CNN's mask head is the costly part of its tests).
    flat_score: float
    # RoIs sampled per image for the box losses (MODEL.ROI_HEADS.BATCH_SIZE_PER_IMAGE, torchvision's
    # box_batch_size_per_image) on both sides, when not the shipped config's 512: the box head runs in float64 on
    # every sampled RoI, and Mask R-CNN's mask head (Keypoint R-CNN's eight 512-channel convolutions) on every
    # positive one, a quarter of them. With 64 (32) the training images' 25 to 42 positive proposals each are more
    # than the quota of 16 (8), so the sampler draws among both positives and negatives (with 512 it kept every
    # positive): the same sampling checked, at a fraction of the float64 convolutions.
    roi_batch: int | None = None


_TWO_STAGE = {"rpn.head.cls_logits": 1.0, "rpn.head.bbox_pred": 0.1,
              "roi_heads.box_predictor.cls_score": 1.0, "roi_heads.box_predictor.bbox_pred": 1.0}
ARCHS = {
    "faster_rcnn": Arch(torchvision.models.detection.fasterrcnn_resnet50_fpn, _TWO_STAGE, 0.5, roi_batch=64),
    "mask_rcnn": Arch(torchvision.models.detection.maskrcnn_resnet50_fpn,
                      {**_TWO_STAGE, "roi_heads.mask_predictor.mask_fcn_logits": 3.0}, 0.05, roi_batch=64),
    # Heatmap logits of std 3: distinct peaks, so that a keypoint moved by one heatmap cell shows. The head (eight
    # 512-channel convolutions per RoI) is the costly part, hence few detections.
    "keypoint_rcnn": Arch(torchvision.models.detection.keypointrcnn_resnet50_fpn,
                          {**_TWO_STAGE, "roi_heads.keypoint_predictor.kps_score_lowres": 3.0}, 0.08, roi_batch=32),
    "retinanet": Arch(torchvision.models.detection.retinanet_resnet50_fpn,
                      {"head.classification_head.cls_logits": 1.0, "head.regression_head.bbox_reg": 0.1}, 0.5),
    "fcos": Arch(torchvision.models.detection.fcos_resnet50_fpn,
                 {"head.classification_head.cls_logits": 2.0, "head.regression_head.bbox_reg": 1.0,
                  "head.regression_head.bbox_ctrness": 1.0}, 0.9),
}


def coco_cfg(arch: str):
    """The shipped COCO config of ``arch``, with the loader resizing to 192-288 px instead of 800-1333 (and the
    architecture's :attr:`Arch.roi_batch`)."""
    roi_batch = ARCHS[arch].roi_batch
    opts = ["MODEL.ROI_HEADS.BATCH_SIZE_PER_IMAGE", str(roi_batch)] if roi_batch else []
    return load_cfg(os.path.join(ROOT, "cfgs", "coco", f"{arch}_R-50-FPN_1x.yaml"), _SMALL_INPUT + opts)


# ---------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------

def shapes_image(seed: int, height: int, width: int) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """An RGB uint8 image of the shapes demo's kind and its objects (``label`` 1-3, visible ``mask``)."""
    bgr, objects = render_picture(np.random.default_rng(seed), height, width, [height // 4, height // 2], 4)
    return np.ascontiguousarray(bgr[:, :, ::-1]), [{"label": label + 1, "mask": mask} for label, mask in objects]


def flat_image(height: int, width: int) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """A flat grey image, without objects."""
    return np.full((height, width, 3), (120, 130, 140), dtype=np.uint8), []


# (original image, annotations): 1.5x larger than what the model sees, 1.2x smaller, and the flat image, whose
# long side MAX_SIZE_TEST caps. Batched, they are 256 x 288 px.
def inference_images() -> list[tuple[np.ndarray, list[dict[str, Any]]]]:
    return [shapes_image(1, 288, 384), shapes_image(2, 200, 160), flat_image(120, 320)]


def training_images() -> list[tuple[np.ndarray, list[dict[str, Any]]]]:
    return inference_images()[:2]


# The shapes' classes (``label`` 1-3 of :func:`shapes_image`) as COCO categories, COCO's last id (90) among them.
SHAPE_CATEGORIES = {1: (13, "stop sign"), 2: (90, "toothbrush"), 3: (1, "person")}
# For Keypoint R-CNN, whose COCO config has the one class person: every shape is one.
PERSON_SHAPES = {label: (1, "person") for label in SHAPE_CATEGORIES}
NUM_KEYPOINTS = 17  # COCO's person keypoints, as the shipped config


def shape_categories(cfg) -> dict[int, tuple[int, str]]:
    """The COCO category of each shape label under ``cfg``: :data:`SHAPE_CATEGORIES`, or :data:`PERSON_SHAPES`."""
    return PERSON_SHAPES if cfg.MODEL.META_ARCHITECTURE == "KeypointRCNN" else SHAPE_CATEGORIES


def label_space(cfg) -> LabelSpace:
    """The label space Pet's loader gives a dataset of :func:`shape_categories` under ``cfg``."""
    return LabelSpace.build(cfg.MODEL.LABEL_SPACE, dict(shape_categories(cfg).values()), cfg.MODEL.NUM_CLASSES)


def _record(image_id: int, annotations: list[dict[str, Any]], space: LabelSpace,
            categories: dict[int, tuple[int, str]]) -> dict[str, Any]:
    """A dataset record as Pet's dataset gives the mapper (boxes XYXY, labels of ``space``, RLE masks)."""
    boxes = []
    for ann in annotations:
        ys, xs = np.nonzero(ann["mask"])
        boxes.append([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1])
    return {"image_id": image_id, "boxes": np.asarray(boxes, dtype=np.float32).reshape(-1, 4),
            "labels": [space.category_id_to_label[categories[ann["label"]][0]] for ann in annotations],
            "segmentations": [mask_util.encode(np.asfortranarray(ann["mask"])) for ann in annotations]}


def pet_batch(cfg, images: list[tuple[np.ndarray, list[dict[str, Any]]]], *, train: bool):
    """``images`` through Pet's mapper (test or training transforms) and collator: the loader's batch; for Keypoint
    R-CNN in training with :func:`add_keypoints`' keypoints."""
    mapper = DatasetMapper.from_config(cfg, is_train=train)
    rng = np.random.default_rng(0)
    space, categories = label_space(cfg), shape_categories(cfg)
    samples = [mapper(_record(i + 1, anns, space, categories), image, rng) for i, (image, anns) in enumerate(images)]
    images, targets = collate_batch(samples, cfg.INPUT.SIZE_DIVISIBILITY)
    if train and cfg.MODEL.META_ARCHITECTURE == "KeypointRCNN":
        add_keypoints(targets, cfg.MODEL.ROI_KEYPOINT_HEAD.NUM_KEYPOINTS)
    return images, targets


def add_keypoints(targets: list[dict[str, Any]], num_keypoints: int, seed: int = 0) -> None:
    """Give each target ``keypoints`` float32 [N, K, 3] (torchvision's convention) in the resized image: per box,
    points drawn uniformly inside it with visibility 2, 1 or 0 (a third each), and the cases torchvision's
    ``keypoints_to_heatmap`` treats apart: keypoint 0 on the box's right edge and keypoint 1 on its bottom edge
    (put into the last heatmap cell), keypoint 2 left of the box (ignored by the loss)."""
    gen = torch.Generator().manual_seed(seed)
    for target in targets:
        boxes = target["boxes"].float()
        n = len(boxes)
        low, size = boxes[:, None, :2], (boxes[:, 2:] - boxes[:, :2])[:, None]
        xy = low + torch.rand(n, num_keypoints, 2, generator=gen) * size
        xy[:, 0, 0], xy[:, 1, 1] = boxes[:, 2], boxes[:, 3]
        xy[:, 2, 0] = boxes[:, 0] - 1
        visibility = torch.randint(0, 3, (n, num_keypoints, 1), generator=gen).float()
        visibility[:, :3] = 2
        target["keypoints"] = torch.cat([xy, visibility], dim=2)


def torchvision_inputs(images: torch.Tensor, targets: list[dict[str, Any]], fields: tuple[str, ...] = (),
                       dtype: torch.dtype = torch.float32):
    """The same pixels as torchvision's models take them (``dtype`` in [0, 1], unpadded) and ``fields`` of the
    targets (floating ones in ``dtype``, but keypoints: torchvision's RoIHeads accepts float32 keypoints only)."""
    sizes = [t["image_size"] for t in targets]
    return ([image[:, :h, :w].to(dtype) / 255 for image, (h, w) in zip(images, sizes)],
            [{k: t[k].to(dtype) if t[k].is_floating_point() and k != "keypoints" else t[k] for k in fields}
             for t in targets])


def _as_torchvision_input(image: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(image).permute(2, 0, 1).float() / 255


# ---------------------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------------------

def imagenet_like_resnet50(seed: int = 0) -> dict[str, torch.Tensor]:
    """A torchvision ResNet-50 classifier's ``state_dict`` (FrozenBatchNorm2d) with non-trivial statistics.

    The convolutions are torchvision's initialisation scaled by 10^U(-2, -1). Then each FrozenBatchNorm, in
    forward order on two calibration images, gets running mean = its input's mean + 0.3 std x N(0, 1),
    running var = its input's variance x U(0.5, 2), weight U(0.5, 1.5) and bias 0.3 N(0, 1), so that
    activations stay O(1) through all 50 layers while every statistic and eps matter.
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    net = torchvision.models.resnet50(norm_layer=FrozenBatchNorm2d).eval()

    def uniform(n: int, low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(n, generator=gen)

    def calibrate(bn: FrozenBatchNorm2d, args: tuple[torch.Tensor]) -> None:
        x, n = args[0], len(bn.weight)
        mean, var = x.mean((0, 2, 3)), x.var((0, 2, 3))
        bn.running_mean.copy_(mean + 0.3 * var.sqrt() * torch.randn(n, generator=gen))
        bn.running_var.copy_(var * uniform(n, 0.5, 2.0))
        bn.weight.copy_(uniform(n, 0.5, 1.5))
        bn.bias.copy_(0.3 * torch.randn(n, generator=gen))

    with torch.no_grad():
        for module in net.modules():
            if isinstance(module, torch.nn.Conv2d):
                module.weight.mul_(10 ** uniform(1, -2.0, -1.0))
        hooks = [m.register_forward_pre_hook(calibrate) for m in net.modules() if isinstance(m, FrozenBatchNorm2d)]
        x = torch.stack([_as_torchvision_input(shapes_image(100 + i, 160, 192)[0]) for i in range(2)])
        net(torchvision.transforms.functional.normalize(x, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]))
        for hook in hooks:
            hook.remove()
    return net.state_dict()


def torchvision_reference(arch: str, cfg, seed: int = 0) -> torch.nn.Module:
    """torchvision's builder for ``arch`` given :func:`imagenet_like_resnet50` as its ImageNet weights, with Pet's
    classes (``NUM_CLASSES + 1`` outputs, as torchvision's COCO models) and resize sizes; the heads initialised by
    torchvision, then rescaled (:func:`rescale_outputs`) and biased (:func:`_bias_scores`). In eval mode."""
    backbone = imagenet_like_resnet50(seed)
    torch.manual_seed(seed)
    with mock.patch.object(ResNet50_Weights, "get_state_dict", lambda self, *args, **kwargs: backbone):
        roi_batch = ARCHS[arch].roi_batch
        model = ARCHS[arch].builder(weights=None, weights_backbone=ResNet50_Weights.IMAGENET1K_V1,
                                    num_classes=cfg.MODEL.NUM_CLASSES + 1,
                                    min_size=cfg.INPUT.MIN_SIZE_TEST, max_size=cfg.INPUT.MAX_SIZE_TEST,
                                    **({"box_batch_size_per_image": roi_batch} if roi_batch else {})).eval()
    heads = getattr(model, "roi_heads", model)
    thresholds = heads.score_thresh, heads.detections_per_img
    heads.score_thresh, heads.detections_per_img = 0.0, 2  # a few detections: the mask head runs, cheaply
    with torch.no_grad():
        calibration = [_as_torchvision_input(shapes_image(200 + i, 160, 192)[0]) for i in range(2)]
        rescale_outputs(model, ARCHS[arch].outputs, calibration)
        flat, flat_targets = pet_batch(cfg, inference_images()[-1:], train=False)
        flat = torchvision_inputs(flat, flat_targets)[0][0]
        if cfg.MODEL.NUM_CLASSES == 1:
            _turn_to_shapes(model, calibration, flat)
        _bias_scores(model, arch, flat, thresholds[0] * ARCHS[arch].flat_score)
    heads.score_thresh, heads.detections_per_img = thresholds
    return model


@contextlib.contextmanager
def cheap_calibration(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Two small shapes images (RGB in [0, 1]) to calibrate a torchvision detector's outputs on, with the model
    made cheap to run on them until the block ends: its transform resizes to 192 px (288 at most), and a two-stage
    model keeps two detections an image (the heads behind the boxes, Mask R-CNN's masks or Keypoint R-CNN's eight
    512-channel convolutions, are scaled on those; the classifier's logits are those of every proposal, or every
    anchor, whatever the cap). Uncapped, those heads ran on 100 detections an image: 6 s (masks) to 25 s (keypoints)
    of CPU."""
    images = [torch.from_numpy(shapes_image(300 + i, 160, 192)[0]).permute(2, 0, 1).float() / 255 for i in range(2)]
    sizes = model.transform.min_size, model.transform.max_size
    heads = getattr(model, "roi_heads", None)
    thresholds = (heads.score_thresh, heads.detections_per_img) if heads is not None else None
    model.transform.min_size, model.transform.max_size = (192,), 288
    if heads is not None:
        heads.score_thresh, heads.detections_per_img = 0.0, 2
    try:
        yield images
    finally:
        model.transform.min_size, model.transform.max_size = sizes
        if heads is not None:
            heads.score_thresh, heads.detections_per_img = thresholds


def rescale_outputs(model: torch.nn.Module, targets: dict[str, float], images: list[torch.Tensor]) -> None:
    """Scale the weight of each output layer named in ``targets`` so that, on ``images``, its output less its
    bias has the std given there. Layers are rescaled in forward order, each on its first call (the first FPN
    level), so later ones see the rescaled outputs."""

    def rescale(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        handles.pop(module).remove()
        bias = module.bias.view(1, -1, *([1] * (output.dim() - 2)))
        factor = targets[names[module]] / (output - bias).std()
        module.weight.mul_(factor)
        return (output - bias) * factor + bias

    names = {model.get_submodule(name): name for name in targets}
    handles = {module: module.register_forward_hook(rescale) for module in names}
    model(images)
    assert not handles, f"{[names[m] for m in handles]} never ran"


def _turn_to_shapes(model: torch.nn.Module, shapes: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Point a one-class detector's class row from the flat image's mean box feature to the shapes images'.

    With random weights and one class, the best of the flat image's proposals scores as high as any of the
    shapes images' (with COCO's 90 classes the shapes' richer features win somewhere), so no bias would leave
    detections on the shapes and none on the flat image. Along this direction every proposal of the calibration
    shapes scores above every flat one; the row is scaled to logits of std 1 over the shapes' proposals."""
    features: list[torch.Tensor] = []
    handle = model.roi_heads.box_head.register_forward_hook(lambda module, args, out: features.append(out))
    model(shapes)
    model([flat])
    handle.remove()
    on_shapes, on_flat = features
    direction = on_shapes.mean(0) - on_flat.mean(0)
    model.roi_heads.box_predictor.cls_score.weight[1] = direction / (on_shapes @ direction).std()


def _two_stage_score(outputs: dict[str, Any], shift: float) -> float:
    logits = outputs["roi_heads.box_predictor"][0].clone()
    logits[:, 0] -= shift  # the background
    return logits.softmax(-1)[:, 1:].max().item()


def _retinanet_score(outputs: dict[str, Any], shift: float) -> float:
    return torch.sigmoid(outputs["head.classification_head"].max() + shift).item()


def _fcos_score(outputs: dict[str, Any], shift: float) -> float:
    logits, ctrness = outputs["head.classification_head"], outputs["head.regression_head"][1]
    return torch.sqrt(torch.sigmoid(logits + shift) * torch.sigmoid(ctrness)).max().item()


class _Scores(NamedTuple):
    """What :func:`_bias_scores` records and shifts for one architecture."""

    recorded: list[str]  # modules whose outputs ``best`` reads
    layer: str  # the classifier whose bias is shifted
    entries: slice  # ... in these entries
    sign: float  # ... by sign x shift
    best: Callable[[dict[str, Any], float], float]  # an image's best score after a shift; grows with it


_TWO_STAGE_SCORES = _Scores(["roi_heads.box_predictor"], "roi_heads.box_predictor.cls_score", slice(0, 1), -1.0,
                            _two_stage_score)
_SCORES = {
    "faster_rcnn": _TWO_STAGE_SCORES,
    "mask_rcnn": _TWO_STAGE_SCORES,
    "keypoint_rcnn": _TWO_STAGE_SCORES,
    "retinanet": _Scores(["head.classification_head"], "head.classification_head.cls_logits", slice(None), 1.0,
                         _retinanet_score),
    "fcos": _Scores(["head.classification_head", "head.regression_head"], "head.classification_head.cls_logits",
                    slice(None), 1.0, _fcos_score),
}


def _bias_scores(model: torch.nn.Module, arch: str, flat: torch.Tensor, target: float) -> None:
    """Shift the classifier's bias so that the flat image's best score is ``target`` (below the threshold)."""
    scores = _SCORES[arch]
    outputs: dict[str, Any] = {}
    handles = [model.get_submodule(name).register_forward_hook(
        lambda module, args, output, name=name: outputs.__setitem__(name, output)) for name in scores.recorded]
    model([flat])
    for handle in handles:
        handle.remove()
    low, high = -100.0, 100.0
    for _ in range(60):  # bisection
        mid = (low + high) / 2
        low, high = (low, mid) if scores.best(outputs, mid) > target else (mid, high)
    model.get_submodule(scores.layer).bias[scores.entries] += scores.sign * low


@functools.lru_cache(maxsize=2)  # test_zoo.py runs inference for both, then training
def _cached_pair(arch: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    cfg = coco_cfg(arch)
    reference = torchvision_reference(arch, cfg)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{arch}.pth")
        torch.save(reference.state_dict(), path)
        model = build_model(cfg)
        assert load_weights(model, path) == {"missing": [], "unexpected": [], "mismatched": []}
    return model, reference


def model_pair(arch: str) -> tuple[Any, torch.nn.Module, torch.nn.Module]:
    """``(cfg, Pet's model, torchvision's)`` for ``arch``, holding the same weights, in eval mode: fresh copies of
    models built once (per architecture, for the last two asked for)."""
    model, reference = _cached_pair(arch)
    return coco_cfg(arch), copy.deepcopy(model).eval(), copy.deepcopy(reference).eval()


# ---------------------------------------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------------------------------------

def run_torchvision(reference: torch.nn.Module, pixels: list[torch.Tensor], original_sizes: list[tuple[int, int]],
                    *, channels_last: bool) -> tuple[list[dict[str, torch.Tensor]], list[bool]]:
    """torchvision's detections of ``pixels``, mapped to ``original_sizes`` by its own postprocess, in torchvision's
    memory format or (``channels_last``) Pet's, with label 0 dropped as Pet drops it (``pet.modeling.one_stage``);
    and per image whether it held the per-image maximum of detections before that."""
    reference.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    postprocess = reference.transform.postprocess
    with torch.no_grad(), mock.patch.object(reference.transform, "postprocess",
                                            lambda result, sizes, _: postprocess(result, sizes, original_sizes)):
        detections = reference(pixels)
    cap = getattr(reference, "roi_heads", reference).detections_per_img
    return [{k: v[d["labels"] > 0] for k, v in d.items()} for d in detections], [len(d["boxes"]) == cap
                                                                                 for d in detections]


def mask_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of each pair of boolean masks [N, H, W]; two empty masks count as identical."""
    inter = (a & b).flatten(1).sum(1).float()
    union = (a | b).flatten(1).sum(1).float()
    return torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(union))


class Tolerance(NamedTuple):
    box: float  # px in the original image, any coordinate
    score: float
    mask_iou: float = 0.99


def match_detections(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], tol: Tolerance,
                     score_thresh: float, capped: bool) -> list[tuple[int, int]]:
    """Pairs ``(i, j)`` of Pet's detection i and torchvision's j, asserting that everything else is a near-tie.

    The matching rule: two detections match when they have the same label, scores within ``tol.score`` and every
    box coordinate within ``tol.box``; one-to-one, greedily in Pet's order (class-wise NMS leaves at most one
    detection of a label within ``tol.box`` of a box, so greedy is exact). A detection left without a match, on
    either side, must be one the other side may have cut at a near-tie: its score is within ``tol.score`` of the
    score threshold or, when the image holds the per-image maximum of detections (``capped``), of the other
    side's lowest score. Both sides list detections by decreasing score, so their orders can differ only between
    detections whose scores are within ``tol.score``.
    """
    taken = torch.zeros(len(theirs["boxes"]), dtype=torch.bool)
    pairs = []
    for i, (box, score, label) in enumerate(zip(ours["boxes"], ours["scores"], ours["labels"])):
        close = (~taken & (theirs["labels"] == label) & ((theirs["scores"] - score).abs() <= tol.score)
                 & ((theirs["boxes"] - box).abs().amax(dim=1) <= tol.box))
        if close.any():
            j = int(close.nonzero()[0])
            taken[j] = True
            pairs.append((i, j))
    for side, other, matched in ((ours, theirs, {i for i, _ in pairs}), (theirs, ours, {j for _, j in pairs})):
        cutoffs = [score_thresh] + ([other["scores"].min().item()] if capped and len(other["scores"]) else [])
        for k, score in enumerate(side["scores"].tolist()):
            assert k in matched or min(abs(score - c) for c in cutoffs) <= tol.score, (
                f"detection {k} (label {side['labels'][k]}, score {score:.6f}, box {side['boxes'][k].tolist()}) "
                f"has no counterpart and is no near-tie at the cut-offs {cutoffs}")
    return pairs


def detection_tensors(detections: Any) -> dict[str, torch.Tensor]:
    """A Predictor's ``Detections`` (numpy arrays) as the tensors :func:`match_detections` pairs."""
    return {name: torch.as_tensor(getattr(detections, name)) for name in ("boxes", "scores", "labels")}


def assert_same_detections(ours: list[dict[str, torch.Tensor]], theirs: list[dict[str, torch.Tensor]],
                           tol: Tolerance, score_thresh: float, capped: list[bool]) -> dict[str, float]:
    """Per image, :func:`match_detections` and, for matched pairs, masks of IoU >= ``tol.mask_iou`` and keypoints
    within ``tol.box`` px with scores within ``tol.score``. Returns the largest box, score, keypoint and keypoint
    score differences and the lowest mask IoU over the matched pairs, and how many detections were unmatched or
    matched out of order."""
    worst = {"box": 0.0, "score": 0.0, "mask_iou": 1.0, "keypoint": 0.0, "keypoint_score": 0.0,
             "unmatched": 0, "reordered": 0}
    for mine, ref, image_capped in zip(ours, theirs, capped):
        pairs = match_detections(mine, ref, tol, score_thresh, image_capped)
        worst["unmatched"] += len(mine["boxes"]) + len(ref["boxes"]) - 2 * len(pairs)
        worst["reordered"] += sum(i != j for i, j in pairs)
        if not pairs:
            continue
        i, j = (torch.tensor(index) for index in zip(*pairs))
        worst["box"] = max(worst["box"], (mine["boxes"][i] - ref["boxes"][j]).abs().max().item())
        worst["score"] = max(worst["score"], (mine["scores"][i] - ref["scores"][j]).abs().max().item())
        if "masks" in mine:
            assert mine["masks"].dtype == torch.uint8 and set(mine["masks"].unique().tolist()) <= {0, 1}
            iou = mask_iou(mine["masks"][i].bool(), ref["masks"][j, 0] >= 0.5).min().item()
            worst["mask_iou"] = min(worst["mask_iou"], iou)
            assert iou >= tol.mask_iou
        if "keypoints" in ref:
            assert mine["keypoints"].dtype == mine["keypoints_scores"].dtype == torch.float32
            assert (mine["keypoints"][..., 2] == 1).all()
            keypoint = (mine["keypoints"][i] - ref["keypoints"][j]).abs().max().item()
            keypoint_score = (mine["keypoints_scores"][i] - ref["keypoints_scores"][j]).abs().max().item()
            worst["keypoint"] = max(worst["keypoint"], keypoint)
            worst["keypoint_score"] = max(worst["keypoint_score"], keypoint_score)
            assert keypoint <= tol.box and keypoint_score <= tol.score, (keypoint, keypoint_score)
    return worst


# Measured on the parity models: Pet's detections are bit-identical to torchvision's run channels-last (float32, as
# shipped), on every CPU class tried (Intel AVX-512 with AMX, and oneDNN capped to AVX512_CORE_BF16, AVX512_CORE,
# AVX2; and the numeric tests' pass as on another CPU, SSE4.1 with ATen's vectorised kernels off, on 2 threads).
# Against torchvision's default (contiguous) run the convolutions add in another order, so float32 puts them up to
# 2.6e-3 px and 2.3e-5 in score apart (2.6e-3 px under the AVX2 cap and on an AMD machine, 2.3e-5 on
# the Intel part, where the old tolerance of 5e-5 had twice that): an amount set by the CPU's kernels, not by Pet.
# So that comparison runs in float64, where the same orders leave 4.3e-12 px and 6.4e-14 in score (measured on the
# Intel part and under the caps; about the float32 differences x 2^-29): the tolerances below leave a factor of
# 1500 for any CPU's summation order, and still fail a box moved by 1e-8 px or a score by 1e-10 (scaling RetinaNet's
# box regression weights by 1 + 1e-6 moves boxes 9e-5 px: within SAME_FORMAT, caught here).
SAME_FORMAT = Tolerance(box=1e-4, score=1e-5)
CONTIGUOUS = Tolerance(box=1e-8, score=1e-10)
# Training parity runs in float64 (see check_training_parity): relative differences of losses and gradients.
TRAINING_TOL = 1e-10
# Parameters whose exact gradient is 0: the keypoint loss is a softmax cross-entropy over each heatmap, which a
# constant added to the whole heatmap (the deconvolution's bias, up-sampled bilinearly) leaves unchanged. Their
# computed gradients are rounding (~1e-13 in float64), so they are checked to be that, not compared in direction.
_ZERO_GRADIENTS = {"roi_heads.keypoint_predictor.kps_score_lowres.bias"}


def _float64(cfg, model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in float64, with the config's mean and std straight to float64 as torchvision's transform takes them
    (Pet's buffers were rounded to float32 before ``.double()``)."""
    model.double()
    for name, values in (("mean", cfg.MODEL.PIXEL_MEAN), ("std", cfg.MODEL.PIXEL_STD)):
        setattr(model.normalizer, name, torch.tensor(values, dtype=torch.float64).view(1, -1, 1, 1) / 255)
    return model


# The two comparisons of :func:`check_inference_parity`, as a test's parameters: the float32 one is in the numeric
# group (.ci/run runs it again as on another CPU, where its summation orders change); the float64 one leaves
# rounding 2000x below its tolerance whatever the order, so a foreign CPU has nothing to tip there.
INFERENCE_COMPARISONS = [pytest.param("same_format", marks=pytest.mark.numeric), "contiguous"]


def check_inference_parity(arch: str, comparison: str) -> dict[str, float]:
    """Pet's detections (and masks) of the inference batch against torchvision's, ``comparison``:
    ``same_format``, torchvision run channels-last as Pet runs, both in float32 as shipped (``SAME_FORMAT``; no
    detection unmatched or reordered), or ``contiguous``, torchvision in its default memory format, both in float64
    (``CONTIGUOUS``: in float32 the two formats' summation orders, which depend on the CPU's kernels, put them
    further apart than any fixed tolerance can say). Returns the measured worst differences."""
    cfg, model, reference = model_pair(arch)
    images, targets = pet_batch(cfg, inference_images(), train=False)
    originals = [t["orig_size"] for t in targets]
    score_thresh = getattr(reference, "roi_heads", reference).score_thresh
    channels_last, dtype, tol = {"same_format": (True, torch.float32, SAME_FORMAT),
                                 "contiguous": (False, torch.float64, CONTIGUOUS)}[comparison]
    if dtype == torch.float64:
        model, reference = _float64(cfg, model), reference.double()
    pixels, _ = torchvision_inputs(images, targets, dtype=dtype)
    with torch.no_grad():
        ours = model(images, targets)
    theirs, capped = run_torchvision(reference, pixels, originals, channels_last=channels_last)
    # the case the weights were made for: real detections on the images with shapes, none on the flat one
    assert [len(d["boxes"]) > 0 for d in theirs] == [True, True, False]
    measured = assert_same_detections(ours, theirs, tol, score_thresh, capped)
    if comparison == "same_format":
        assert measured["unmatched"] == measured["reordered"] == 0
    return measured


def check_training_parity(arch: str) -> dict[str, float]:
    """One training step of Pet's model and of torchvision's, both in float64 and run channels-last as Pet runs, on
    the same batch from Pet's training mapper (resize, random flip) and with the same sampling: loss terms within
    :data:`TRAINING_TOL` (relative), and the gradient of every parameter tensor at a cosine >= 1 - TRAINING_TOL of
    torchvision's and with its norm within TRAINING_TOL (relative) of torchvision's: the cosine alone passes a
    gradient scaled by a constant (the same tensors get one: stem and res2 are frozen on both sides). Pet's
    two-stage models pool RoIs with their own sparse RoIAlign in training (``pet.modeling.poolers``), torchvision's
    with its kernel.

    Why float64: in float32 the two sides' convolutions sum in whatever order the CPU's oneDNN kernels choose, and
    that order differs between CPU classes (an Intel AVX-512 BF16 part put a gradient norm 1.3e-4 apart where an
    AMD one stayed under 1e-4), so any float32 tolerance is a test of the CPU. In float64 the rounding is ~1e-13
    whatever the order (measured: losses 6e-15 apart, cosines 1 - 3e-14, norms 2e-13), and :data:`TRAINING_TOL`
    still fails a gradient scaled by 1 + 1e-9, a loss term off by as much, or a dropped term.

    The two-stage detectors sample anchors (RPN) and proposals (RoI heads) with torchvision's
    BalancedPositiveNegativeSampler (``torch.randperm``) on both sides; a forward pre-hook reseeds torch's
    generator as each model's RPN starts, so the samplers draw the same numbers provided that Pet calls
    them in torchvision's order on the same candidates. (torchvision's transform draws a random resize
    size before that, which Pet's models do not.) torchvision's model runs channels-last because in its
    default memory format near-ties among the RPN's proposals can resolve differently, and the sampled
    RoIs with them. Returns the worst loss ratio, the lowest cosine and the largest relative norm difference.
    """
    cfg, model, reference = model_pair(arch)
    model, reference = _float64(cfg, model), reference.double()
    images, targets = pet_batch(cfg, training_images(), train=True)
    # float32 keypoints, as torchvision's RoIHeads demands (both sides then compute their heatmap targets in float64)
    targets = [{k: v.double() if torch.is_tensor(v) and v.is_floating_point() and k != "keypoints" else v
                for k, v in t.items()} for t in targets]
    pixels, tv_targets = torchvision_inputs(images, targets, getattr(model, "target_fields", ("boxes", "labels")),
                                            dtype=torch.float64)
    reference.to(memory_format=torch.channels_last)
    if hasattr(reference, "roi_heads") and reference.roi_heads.has_keypoint():
        # torchvision's keypointrcnn_loss views the heatmaps, which it cannot do channels-last: hand it the same
        # values contiguous, as Pet's predictor returns them.
        reference.roi_heads.keypoint_predictor.register_forward_hook(lambda module, args, out: out.contiguous())
    losses = []
    with mock.patch("pet.modeling.poolers.roi_align_sparse", wraps=poolers.roi_align_sparse) as sparse:
        for detector, inputs in ((model, (images, targets)), (reference, (pixels, tv_targets))):
            detector.train()
            if hasattr(detector, "rpn"):
                detector.rpn.register_forward_pre_hook(lambda module, args: torch.manual_seed(0) and None)
            loss = detector(*inputs)
            sum(loss.values()).backward()
            losses.append({name if name.startswith("loss_") else f"loss_{name}": value.item()
                           for name, value in loss.items()})
    assert sparse.called == hasattr(model, "roi_heads")  # Pet's training RoIAlign is the one compared
    ours, theirs = losses
    assert set(ours) == set(theirs)
    ratio = max(abs(ours[k] - theirs[k]) / abs(theirs[k]) for k in theirs)
    assert ratio <= TRAINING_TOL, (ours, theirs)

    expected = dict(reference.named_parameters())
    cosine, norm = 1.0, 0.0
    for name, param in model.named_parameters():
        assert (param.grad is None) == (expected[name].grad is None), name
        if param.grad is None:
            continue
        a, b = param.grad.flatten().double(), expected[name].grad.flatten().double()
        if name in _ZERO_GRADIENTS:  # both rounding: next to the weight's gradient, nothing
            scale = expected[name.replace(".bias", ".weight")].grad.norm()
            assert a.norm() <= TRAINING_TOL * scale and b.norm() <= TRAINING_TOL * scale, (name, a.norm(), b.norm())
            continue
        assert b.norm() > 0, name
        # The direction and the length: a gradient scaled by a constant keeps its cosine.
        cosine = min(cosine, (a @ b / (a.norm() * b.norm())).item())
        norm = max(norm, abs((a.norm() / b.norm()).item() - 1))
        assert cosine >= 1 - TRAINING_TOL and norm <= TRAINING_TOL, (name, cosine, norm)
    return {"loss_ratio": ratio, "cosine": cosine, "norm_ratio": norm}


def assert_results_match_torchvision(results: list[dict],
                                     expected: dict[int, dict[str, np.ndarray]]) -> dict[str, float]:
    """One-to-one: each torchvision detection has a result of its image with the same category id, score within
    1e-5 and box within 1e-3 px (``bbox.json``) or mask IoU >= 0.99 (``segm.json``); none is left over on either
    side. Returns the largest differences."""
    by_image: dict[int, list[dict]] = {}
    for det in results:
        by_image.setdefault(det["image_id"], []).append(det)
    assert set(by_image) <= set(expected)
    worst = {"box": 0.0, "score": 0.0, "mask_iou": 1.0}
    for image_id, theirs in expected.items():
        ours = by_image.get(image_id, [])
        # The same number, with no near-tie let off at the threshold or the cap: the two models run channels-last
        # in this process on the same threads, and are then bit-identical (tests/support/against_reference.py).
        assert len(ours) == len(theirs["scores"]) > 0, (image_id, len(ours), len(theirs["scores"]))
        taken = np.zeros(len(ours), dtype=bool)
        for j in range(len(theirs["scores"])):
            close = [i for i, d in enumerate(ours) if not taken[i] and d["category_id"] == theirs["labels"][j]
                     and abs(d["score"] - theirs["scores"][j]) <= 1e-5 and _same_region(d, theirs, j)]
            assert close, (f"torchvision's detection {j} of image {image_id} (category {theirs['labels'][j]}, score "
                           f"{theirs['scores'][j]:.6f}, box {theirs['boxes'][j].round(3).tolist()}) is not in Pet's")
            taken[close[0]] = True
            ours_j = ours[close[0]]
            worst["score"] = max(worst["score"], abs(ours_j["score"] - theirs["scores"][j]))
            if "bbox" in ours_j:
                worst["box"] = max(worst["box"], np.abs(np.asarray(ours_j["bbox"]) - theirs["boxes"][j]).max())
            else:
                worst["mask_iou"] = min(worst["mask_iou"], _mask_iou(ours_j, theirs["masks"][j]))
    return worst


def _same_region(det: dict, theirs: dict[str, np.ndarray], j: int) -> bool:
    if "bbox" in det:
        return np.abs(np.asarray(det["bbox"]) - theirs["boxes"][j]).max() <= 1e-3
    return _mask_iou(det, theirs["masks"][j]) >= 0.99


def _mask_iou(det: dict, mask: np.ndarray) -> float:
    ours = mask_util.decode(det["segmentation"]).astype(bool)
    union = (ours | mask).sum()
    return float((ours & mask).sum() / union) if union else 1.0
