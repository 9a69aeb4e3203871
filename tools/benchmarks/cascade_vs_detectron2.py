"""Outside check: Pet's cascade RoI heads against detectron2's ``CascadeROIHeads`` with the same weights.

Both get the same inputs, image by image over a COCO set (default the shapes val set): Pet's backbone features
and RPN proposals of a Cascade R-CNN checkpoint. detectron2's heads are built from its own config for the same
architecture (three stages at IoU 0.5 / 0.6 / 0.7 with weights (10, 10, 5, 5), (20, 20, 10, 10), (30, 30, 15, 15),
two fully-connected layers of ``MODEL.ROI_BOX_HEAD.MLP_DIM`` per stage, class-agnostic regression, RoIAlign
without the half-pixel shift and Pet's sampling ratio) and given Pet's weights: ``fc6`` / ``fc7`` as ``fc1`` /
``fc2``, and the class-score rows moved from background first (torchvision's order) to background last
(detectron2's). The check prints how many detections each gives, how many pair up (same image, label and rank)
and the largest box and score differences; tools/benchmark.py exits with status 1 when they differ by more than
``--tol``.

detectron2 is not a dependency of Pet: run this with a Python where it is installed (built from its public
source; its compiled extension is not needed for these heads; it is imported only when this check runs), e.g.

    PYTHONPATH=$PWD:/tmp/d2 /tmp/d2venv/bin/python tools/benchmark.py cascade-detectron2 \\
        --cfg cfgs/shapes/cascade_rcnn_R-10-FPN.yaml --weights ckpts/bench/cascade_s1/model_final.pth
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

import torch
from torchvision.models.detection.image_list import ImageList as TvImageList

from pet.checkpoint import load_weights
from pet.config import load_cfg
from pet.data import build_test_loader
from pet.modeling import build_model
from pet.modeling.preprocess import image_sizes

from .common import format_fingerprint, reference_package

if TYPE_CHECKING:
    from detectron2.modeling.roi_heads.cascade_rcnn import CascadeROIHeads

__all__ = ["add_arguments", "cascade_vs_detectron2"]


def detectron2_heads(cfg, strides: dict[str, int]) -> CascadeROIHeads:
    """detectron2's cascade heads for Pet's config ``cfg`` over feature maps of ``strides``."""
    from detectron2.config import get_cfg
    from detectron2.layers import ShapeSpec
    from detectron2.modeling.roi_heads.cascade_rcnn import CascadeROIHeads

    box, cascade = cfg.MODEL.ROI_BOX_HEAD, cfg.MODEL.ROI_BOX_CASCADE_HEAD
    d2 = get_cfg()
    d2.MODEL.ROI_HEADS.NAME = "CascadeROIHeads"
    d2.MODEL.ROI_HEADS.IN_FEATURES = list(strides)
    d2.MODEL.ROI_HEADS.NUM_CLASSES = cfg.MODEL.NUM_CLASSES
    d2.MODEL.ROI_HEADS.IOU_THRESHOLDS = [cascade.IOUS[0]]
    d2.MODEL.ROI_HEADS.SCORE_THRESH_TEST = cfg.MODEL.ROI_HEADS.SCORE_THRESH_TEST
    d2.MODEL.ROI_HEADS.NMS_THRESH_TEST = cfg.MODEL.ROI_HEADS.NMS_THRESH_TEST
    d2.TEST.DETECTIONS_PER_IMAGE = cfg.MODEL.ROI_HEADS.DETECTIONS_PER_IMAGE
    d2.MODEL.ROI_BOX_HEAD.NAME = "FastRCNNConvFCHead"
    d2.MODEL.ROI_BOX_HEAD.NUM_FC = 2
    d2.MODEL.ROI_BOX_HEAD.FC_DIM = box.MLP_DIM
    d2.MODEL.ROI_BOX_HEAD.POOLER_TYPE = "ROIAlign"  # aligned=False, as torchvision's MultiScaleRoIAlign
    d2.MODEL.ROI_BOX_HEAD.POOLER_RESOLUTION = box.POOLER_RESOLUTION
    d2.MODEL.ROI_BOX_HEAD.POOLER_SAMPLING_RATIO = box.POOLER_SAMPLING_RATIO
    d2.MODEL.ROI_BOX_HEAD.CLS_AGNOSTIC_BBOX_REG = True
    d2.MODEL.ROI_BOX_CASCADE_HEAD.IOUS = list(cascade.IOUS)
    d2.MODEL.ROI_BOX_CASCADE_HEAD.BBOX_REG_WEIGHTS = [list(w) for w in cascade.BBOX_REG_WEIGHTS]
    d2.MODEL.MASK_ON = False
    shapes = {name: ShapeSpec(channels=cfg.MODEL.FPN.OUT_CHANNELS, stride=s) for name, s in strides.items()}
    return CascadeROIHeads(d2, shapes).eval()


def copy_weights(pet_heads: torch.nn.Module, d2_heads: CascadeROIHeads) -> None:
    """Pet's per-stage weights into detectron2's heads (names and class order translated)."""
    with torch.no_grad():
        for k in range(pet_heads.num_stages):
            head, predictor = pet_heads.box_head[k], pet_heads.box_predictor[k]
            d2_heads.box_head[k].fc1.weight.copy_(head.fc6.weight), d2_heads.box_head[k].fc1.bias.copy_(head.fc6.bias)
            d2_heads.box_head[k].fc2.weight.copy_(head.fc7.weight), d2_heads.box_head[k].fc2.bias.copy_(head.fc7.bias)
            order = [*range(1, predictor.cls_score.out_features), 0]  # background last
            d2_predictor = d2_heads.box_predictor[k]
            d2_predictor.cls_score.weight.copy_(predictor.cls_score.weight[order])
            d2_predictor.cls_score.bias.copy_(predictor.cls_score.bias[order])
            d2_predictor.bbox_pred.weight.copy_(predictor.bbox_pred.weight)
            d2_predictor.bbox_pred.bias.copy_(predictor.bbox_pred.bias)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cfg", default="cfgs/shapes/cascade_rcnn_R-10-FPN.yaml")
    parser.add_argument("--weights", required=True, help="a Pet Cascade R-CNN checkpoint")
    parser.add_argument("--tol", type=float, default=1e-3, help="largest box (px) and score difference accepted")
    parser.add_argument("--images", type=int, default=0, help="compare on the first N images only (0: all)")
    parser.add_argument("--opts", nargs="*", default=[], help="config overrides (KEY VALUE ...)")
    parser.add_argument("--out", default="benchmarks/cascade_detectron2.json")


def cascade_vs_detectron2(args: argparse.Namespace, fingerprint: dict) -> dict[str, Any]:
    """Both heads on the same features and proposals; ``agree`` says whether they gave the same detections."""
    with reference_package("detectron2", "cascade-detectron2",
                           "run it with a Python that has it (docs/benchmarks/cascade.md says how)."):
        from detectron2.structures import Boxes, ImageList, Instances
    print(format_fingerprint(fingerprint))
    cfg = load_cfg(args.cfg, [*args.opts, "TEST.IMS_PER_BATCH", "1", "DATA.NUM_WORKERS", "0"])
    model = build_model(cfg).eval()
    load_weights(model, args.weights, for_inference=True)
    names = model.roi_heads.box_roi_pool.featmap_names
    strides = {name: 2 ** (2 + i) for i, name in enumerate(names)}  # P2, P3, ...: FPN levels from stride 4
    d2_heads = detectron2_heads(cfg, strides)
    copy_weights(model.roi_heads, d2_heads)
    counts = {"pet": 0, "detectron2": 0, "paired": 0, "images": 0}
    worst = {"box": 0.0, "score": 0.0}
    with torch.no_grad():
        for index, (images, targets) in enumerate(build_test_loader(cfg, cfg.TEST.DATASETS[0])):
            if args.images and index >= args.images:
                break
            sizes = image_sizes(targets)
            x = model.normalizer(images, sizes)
            features = model.backbone(x)
            proposals, _ = model.rpn(TvImageList(x, sizes), features)
            ours, _ = model.roi_heads(features, proposals, sizes)
            instances = []
            for boxes, size in zip(proposals, sizes):
                instance = Instances(size)
                instance.proposal_boxes = Boxes(boxes)
                instances.append(instance)
            theirs, _ = d2_heads(ImageList(x, sizes), {n: features[n] for n in names}, instances)
            for mine, other in zip(ours, theirs):
                counts["images"] += 1
                counts["pet"] += len(mine["boxes"])
                counts["detectron2"] += len(other)
                n = min(len(mine["boxes"]), len(other))
                same = (mine["labels"][:n] == other.pred_classes[:n] + 1)
                counts["paired"] += int(same.all()) * n if n else 0
                if n:
                    box_gap = (mine["boxes"][:n] - other.pred_boxes.tensor[:n]).abs().max().item()
                    worst["box"] = max(worst["box"], box_gap)
                    worst["score"] = max(worst["score"], (mine["scores"][:n] - other.scores[:n]).abs().max().item())
    print(f"{counts['images']} images: Pet {counts['pet']} detections, detectron2 {counts['detectron2']}, "
          f"{counts['paired']} paired in order with the same label; largest box difference {worst['box']:.2e} px, "
          f"score difference {worst['score']:.2e}")
    agree = counts["pet"] == counts["detectron2"] == counts["paired"] and max(worst.values()) <= args.tol
    print("AGREE" if agree else "DIFFER")
    return {"cfg": args.cfg, "weights": args.weights, "tol": args.tol, "counts": counts,
            "largest_difference": worst, "agree": agree}
