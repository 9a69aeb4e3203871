"""train / infer: Pet's detectors against torchvision's on the same weights, inputs, precision and memory format.

Each architecture is a pair built from the same random weights: Pet's model from its config,
torchvision's assembled as its builders assemble it (``*_resnet50_fpn`` with weights: FrozenBN,
stem and res2 frozen; for the demo, the demo's own slim heads). Both sides run in the same memory
format (``--memory-format``, Pet's default channels-last) and under the same autocast
(``--precision``, ``auto`` as Pet's rule picks it for this CPU).

Random weights give no detections (every class score below the threshold), so inference would
skip post-processing and the mask head. The classifiers' biases are therefore set so that every
proposal or anchor scores above the threshold for a few classes: each image reaches the
per-image detection cap, and NMS, box decoding and mask pasting are timed at full load. The
table prints the detections per image of both sides.

Training is seconds per step (forward, backward) at ``--batch``; inference milliseconds per image
at batch 1 (and at ``--batch`` when it is larger). Rounds alternate which side runs first.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torchvision.models import ResNet, detection, resnet18, resnet50
from torchvision.models.detection.backbone_utils import BackboneWithFPN, _resnet_fpn_extractor
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.rpn import AnchorGenerator, RPNHead
from torchvision.models.resnet import BasicBlock
from torchvision.ops import FrozenBatchNorm2d, MultiScaleRoIAlign
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool, LastLevelP6P7

from pet.config import load_cfg
from pet.engine.precision import Precision, choose_precision
from pet.engine.speed_probe import model_probe
from pet.modeling import build_model

from .common import format_fingerprint, interleaved

__all__ = ["ARCHS", "detectors", "add_arguments"]

# --arch name -> (Pet's config, torchvision's model class, returned ResNet stages, top FPN block).
ARCHS = {
    "faster_rcnn": ("coco/faster_rcnn_R-50-FPN_1x.yaml", "FasterRCNN", [1, 2, 3, 4], "maxpool"),
    "retinanet": ("coco/retinanet_R-50-FPN_1x.yaml", "RetinaNet", [2, 3, 4], "p6p7"),
    "fcos": ("coco/fcos_R-50-FPN_1x.yaml", "FCOS", [2, 3, 4], "p6p7"),
    "mask_rcnn": ("coco/mask_rcnn_R-50-FPN_1x.yaml", "MaskRCNN", [1, 2, 3, 4], "maxpool"),
    "demo": ("shapes/faster_rcnn_R-10-FPN.yaml", "FasterRCNN", None, "maxpool"),
}
# The demo pair runs on what the demo trains on: batches of 8 images of 256x256.
DEMO_SIZE, DEMO_BATCH = (256, 256), 8


def _pet_cfg(arch: str, memory_format: str):
    return load_cfg(os.path.join("cfgs", ARCHS[arch][0]),
                    ["MODEL.CHANNELS_LAST", str(memory_format == "channels_last")])


# The demo's backbone built from torchvision directly (ResNet-10: its ResNet class with one BasicBlock per stage).
_DEMO_BODIES: dict[str, Callable[..., ResNet]] = {"resnet10": partial(ResNet, BasicBlock, [1, 1, 1, 1]),
                                                  "resnet18": resnet18}


def _demo_reference(cfg, size: tuple[int, int]) -> torch.nn.Module:
    """torchvision's FasterRCNN with the demo's parts, read from its config (trainable BN, slim heads)."""
    layers, channels = list(cfg.MODEL.FPN.RETURNED_LAYERS), cfg.MODEL.FPN.OUT_CHANNELS
    body = _DEMO_BODIES[cfg.MODEL.BACKBONE.NAME](norm_layer=torch.nn.BatchNorm2d)
    backbone = BackboneWithFPN(body, {f"layer{k}": str(i) for i, k in enumerate(layers)},
                               [64 * 2 ** (k - 1) for k in layers], channels, extra_blocks=LastLevelMaxPool())
    rpn, box, heads = cfg.MODEL.RPN, cfg.MODEL.ROI_BOX_HEAD, cfg.MODEL.ROI_HEADS
    anchors = AnchorGenerator(tuple(tuple(s) for s in rpn.ANCHOR_SIZES),
                              (tuple(rpn.ASPECT_RATIOS),) * len(rpn.ANCHOR_SIZES))
    return detection.FasterRCNN(
        backbone, min_size=min(size), max_size=max(size), rpn_anchor_generator=anchors,
        rpn_head=RPNHead(channels, len(rpn.ASPECT_RATIOS)),
        rpn_pre_nms_top_n_train=rpn.PRE_NMS_TOPK_TRAIN, rpn_post_nms_top_n_train=rpn.POST_NMS_TOPK_TRAIN,
        rpn_pre_nms_top_n_test=rpn.PRE_NMS_TOPK_TEST, rpn_post_nms_top_n_test=rpn.POST_NMS_TOPK_TEST,
        box_roi_pool=MultiScaleRoIAlign([str(i) for i in range(len(layers))], box.POOLER_RESOLUTION,
                                        box.POOLER_SAMPLING_RATIO),
        box_head=TwoMLPHead(channels * box.POOLER_RESOLUTION**2, box.MLP_DIM),
        box_predictor=FastRCNNPredictor(box.MLP_DIM, cfg.MODEL.NUM_CLASSES + 1),
        box_batch_size_per_image=heads.BATCH_SIZE_PER_IMAGE, box_score_thresh=heads.SCORE_THRESH_TEST,
    )


def _r50_reference(arch: str, size: tuple[int, int], num_classes: int) -> torch.nn.Module:
    """torchvision's ``*_resnet50_fpn`` as its builders assemble it, with ``num_classes`` + 1 outputs (Pet's COCO
    configs: 90 + 1, torchvision's COCO layout)."""
    _, model_class, returned_layers, top_block = ARCHS[arch]
    extra_blocks = LastLevelMaxPool() if top_block == "maxpool" else LastLevelP6P7(256, 256)
    backbone = _resnet_fpn_extractor(resnet50(norm_layer=FrozenBatchNorm2d), 3, returned_layers, extra_blocks)
    return getattr(detection, model_class)(backbone, num_classes=num_classes + 1, min_size=min(size),
                                           max_size=max(size))


@torch.no_grad()
def _make_confident(model: torch.nn.Module) -> None:
    """Set the classifier biases so every proposal / anchor clears the score threshold for a few classes."""
    if hasattr(model, "roi_heads"):  # softmax over background + classes: ~0.07-0.3 each on 10 classes
        bias = model.roi_heads.box_predictor.cls_score.bias
        bias.zero_()
        bias[0] = -4.0
        bias[1:11] = 3.0
    elif isinstance(model, detection.FCOS):  # sqrt(sigmoid(0) x centerness ~0.5) = 0.5 > 0.2
        model.head.classification_head.cls_logits.bias.zero_()
    else:  # RetinaNet: sigmoid(-2.2) = 0.1 > 0.05
        model.head.classification_head.cls_logits.bias.fill_(-2.2)


def _model_pair(arch: str, size: tuple[int, int], memory_format: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Pet's model and torchvision's, holding the same random weights, in ``memory_format``."""
    cfg = _pet_cfg(arch, memory_format)
    torch.manual_seed(0)
    reference = _demo_reference(cfg, size) if arch == "demo" else _r50_reference(arch, size, cfg.MODEL.NUM_CLASSES)
    _make_confident(reference)
    pet_model = build_model(cfg)
    pet_model.load_state_dict(reference.state_dict(), strict=True)
    fmt = torch.channels_last if memory_format == "channels_last" else torch.contiguous_format
    return pet_model, reference.to(memory_format=fmt)


def _random_scene(batch: int, size: tuple[int, int], num_classes: int, seed: int = 0) -> tuple[torch.Tensor, list]:
    """Random ``size`` images with 4 boxes each, zero-padded to multiples of 32 as Pet's loader pads them
    (torchvision pads the same way inside its model)."""
    gen = torch.Generator().manual_seed(seed)
    height, width = size
    images = torch.zeros((batch, 3, -(-height // 32) * 32, -(-width // 32) * 32), dtype=torch.uint8)
    images[:, :, :height, :width] = torch.randint(0, 256, (batch, 3, height, width), dtype=torch.uint8, generator=gen)
    scale = torch.tensor([width, height], dtype=torch.float32)
    targets = []
    for i in range(batch):
        xy = torch.rand(4, 2, generator=gen) * scale * 0.6
        wh = (0.05 + torch.rand(4, 2, generator=gen) * 0.3) * scale
        targets.append({"image_id": i, "image_size": size, "orig_size": size, "boxes": torch.cat([xy, xy + wh], 1),
                        "labels": torch.randint(1, num_classes + 1, (4,), generator=gen)})
    return images, targets


def _with_masks(targets: list[dict], size: tuple[int, int]) -> list[dict]:
    """Box-shaped instance masks, for Mask R-CNN's training step."""
    for t in targets:
        masks = torch.zeros((len(t["boxes"]), *size), dtype=torch.uint8)
        for mask, box in zip(masks, t["boxes"].round().int().tolist()):
            mask[box[1]:box[3], box[0]:box[2]] = 1
        t["masks"] = masks
    return targets


def _train_step(model: torch.nn.Module, precision: Precision, *inputs: Any) -> None:
    model.train()
    with precision.autocast():
        losses = model(*inputs)
    model.zero_grad(set_to_none=True)
    sum(losses.values()).backward()


def _infer(model: torch.nn.Module, precision: Precision, *inputs: Any) -> list[dict]:
    model.eval()
    with torch.inference_mode(), precision.autocast():
        return model(*inputs)


def _seconds_per_call(fn: Callable[[], Any], iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def _arch_cases(arch: str, args: argparse.Namespace) -> tuple[dict, dict]:
    """``case -> (Pet's step, torchvision's step, seconds-to-unit factor)`` and the inputs' description, with the
    precision both sides run in: ``--precision``, where ``auto`` is Pet's rule for this model on this CPU (measured
    on Pet's model where the CPU has bfloat16 instructions, as a training or test run decides)."""
    size, batch = (DEMO_SIZE, DEMO_BATCH) if arch == "demo" else (tuple(args.size[-2:]), args.batch)
    pet_model, reference = _model_pair(arch, size, args.memory_format)
    images, targets = _random_scene(batch, size, 3 if arch == "demo" else 80)
    if arch == "mask_rcnn":
        targets = _with_masks(targets, size)
    tv_images = [im[:, :size[0], :size[1]].float() / 255 for im in images]
    tv_targets = [{k: t[k] for k in ("boxes", "labels", "masks") if k in t} for t in targets]
    training = args.command == "train"
    precision = choose_precision(args.precision, "auto", "cpu", training=training,
                                 key="SOLVER.AMP" if training else "TEST.AMP",
                                 probe=lambda: model_probe(pet_model, (images, targets), training=training))
    described = {"size": list(size), "batch": batch, "precision": precision.name,
                 "precision_reason": precision.reason}
    if args.command == "train":
        return {f"train b{batch}": (partial(_train_step, pet_model, precision, images, targets),
                                    partial(_train_step, reference, precision, tv_images, tv_targets), 1.0)}, described
    detections = [len(d["boxes"]) for d in _infer(pet_model, precision, images[:1], targets[:1])]
    tv_detections = [len(d["boxes"]) for d in _infer(reference, precision, tv_images[:1])]
    described["detections_per_image"] = {"pet": detections[0], "torchvision": tv_detections[0]}
    cases = {"infer b1": (partial(_infer, pet_model, precision, images[:1], targets[:1]),
                          partial(_infer, reference, precision, tv_images[:1]), 1000.0)}
    if batch > 1:
        cases[f"infer b{batch}"] = (partial(_infer, pet_model, precision, images, targets),
                                    partial(_infer, reference, precision, tv_images), 1000.0 / batch)
    return cases, described


def detectors(args: argparse.Namespace, fingerprint: dict) -> dict:
    """Time each architecture's cases, Pet and torchvision in alternating order; medians and ratios."""
    result: dict = {"memory_format": args.memory_format, "iters": args.iters, "repeats": args.repeats, "archs": {}}
    unit = "s/iter" if args.command == "train" else "ms/image"
    print(format_fingerprint(fingerprint))
    print(f"{args.command}: the same precision on both sides (--precision {args.precision}; the column says which); "
          f"{args.memory_format} on both sides; random images with "
          f"4 boxes each; median of {args.repeats} alternating rounds of {args.iters} call(s) after one warm-up "
          f"call ({unit}; the demo at {DEMO_BATCH}x{DEMO_SIZE[0]}x{DEMO_SIZE[1]}, R-50 at "
          f"{args.batch}x{args.size[0]}x{args.size[-1]})")
    print(f"{'model':<12} {'case':<10} {'precision':<9} {'Pet':>10} {'torchvision':>12} {'Pet/tv':>8} "
          f"{'dets/img Pet, tv':>17}")
    for arch in args.arch:
        cases, described = _arch_cases(arch, args)
        result["archs"][arch] = {**described, "cases": {}}
        dets = described.get("detections_per_image")
        for case, (pet_fn, tv_fn, factor) in cases.items():
            pet_fn(), tv_fn()  # warm-up: allocator, lazy initialisation
            samples = interleaved({"pet": partial(_seconds_per_call, pet_fn, args.iters),
                                   "torchvision": partial(_seconds_per_call, tv_fn, args.iters)}, args.repeats)
            med = {k: statistics.median(v) for k, v in samples.items()}
            row = {"pet": med["pet"] * factor, "torchvision": med["torchvision"] * factor,
                   "ratio": med["pet"] / med["torchvision"], "samples_s": samples}
            result["archs"][arch]["cases"][case] = row
            unit_name = "s" if case.startswith("train") else "ms"
            dets_text = f"{dets['pet']}, {dets['torchvision']}" if dets else ""
            print(f"{arch:<12} {case:<10} {described['precision']:<9} {row['pet']:>8.3f} {unit_name:<2}"
                  f"{row['torchvision']:>9.3f} {unit_name:<2} "
                  f"{row['ratio']:>7.2f} {dets_text:>17}", flush=True)
    return result


def add_arguments(parser: argparse.ArgumentParser, kind: str) -> None:
    parser.add_argument("--arch", nargs="+", choices=sorted(ARCHS), default=["faster_rcnn", "retinanet", "fcos",
                                                                             "mask_rcnn", "demo"])
    parser.add_argument("--size", type=int, nargs="+", default=[800, 1333], metavar="H [W]",
                        help="R-50 input height and width (one number: square); the demo uses its own 256x256")
    parser.add_argument("--batch", type=int, default=1, help="R-50 training batch / the second inference batch")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: the cores)")
    parser.add_argument("--precision", default="auto", type=lambda v: {"True": True, "False": False}.get(v, v),
                        choices=["auto", True, False],
                        help="autocast on both sides: auto (Pet's rule for this CPU), True (bfloat16), False (float32)")
    parser.add_argument("--memory-format", choices=["channels_last", "contiguous"], default="channels_last",
                        help="both sides' memory format (Pet's default MODEL.CHANNELS_LAST is channels_last)")
    parser.add_argument("--iters", type=int, default=1, help="calls per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds; the median counts")
    parser.add_argument("--out", default=f"benchmarks/{kind}.json")

