"""torchvision's COCO weights through the shipped cfgs/coco configs, as a user runs them (issue 26).

A ``state_dict`` in the format of torchvision's released COCO models (``<arch>_resnet50_fpn(num_classes=91)``:
91-way class heads indexed by COCO category id) is evaluated with ``tools/test_net.py`` and the shipped config,
changed only by the dataset, the weights, the output folder and float32 on the command line. The dataset has
COCO's 80 categories (ids 1..90 with gaps, torchvision's names) and 800x800 images, which both sides leave
unresized. Nothing is downloaded: the weights are torchvision's initialisation with the heads' outputs rescaled to
O(1) (tests/support/against_reference.py) and the classifier biased towards two COCO ids, 13 ("stop sign") and 90
("toothbrush"), every other class pushed far below the score thresholds: so the right category ids are known, and a row
remapped, dropped or shifted by one shows up as wrong ids or wrong scores.

``bbox.json`` (and ``segm.json``) must be torchvision's detections of the same images: the same number, each
with torchvision's category id, box within 1e-3 px (bbox.json rounds to 1e-3) and score within 1e-5.
torchvision's model runs channels-last, as Pet does (tests/support/against_reference.py: the two are then
bit-identical).
"""
from __future__ import annotations

import json
import logging
import os

import cv2
import numpy as np
import pycocotools.mask as mask_util
import pytest
import torch

from pet.checkpoint import load_weights
from pet.config import load_cfg
from pet.data import coco_categories
from pet.modeling import build_model
from pet.utils.errors import ConfigError
from support.against_reference import (
    ARCHS,
    assert_results_match_torchvision,
    cheap_calibration,
    rescale_outputs,
    shapes_image,
)
from support.helpers import CFGS, SMALL_FLOPS, custom_datasets, run_tool_captured

FAVOURED = (13, 90)  # "stop sign" and "toothbrush": every other class is far below the score thresholds
SHAPE_TO_COCO = {1: 13, 2: 90, 3: 1}  # the shapes' circles, rectangles and triangles as COCO category ids
SIZE = 800  # INPUT.MIN_SIZE_TEST of the COCO configs: neither side resizes


# Per architecture: the classifier layer and the mean logit :func:`torchvision_coco_model` gives category 13's row
# (90's: 0.05 less; others -10, two-stage background 0), which puts the best detections well above the threshold.
CLASSIFIERS = {
    "faster_rcnn": ("roi_heads.box_predictor.cls_score", -1.0),
    "mask_rcnn": ("roi_heads.box_predictor.cls_score", -1.0),
    "retinanet": ("head.classification_head.cls_logits", -3.0),
    "fcos": ("head.classification_head.cls_logits", -2.0),
}


def cfg_file(arch: str) -> str:
    return os.path.join(CFGS, "coco", f"{arch}_R-50-FPN_1x.yaml")


def torchvision_coco_model(arch: str) -> torch.nn.Module:
    """torchvision's ``<arch>_resnet50_fpn(weights=None, weights_backbone=None, num_classes=91)``, its output
    layers rescaled to O(1) outputs (tests/support/against_reference.py), the classifier's row for category 90 made a
    copy of the row for 13, then its bias set so that, on calibration images, the mean logit of each class is its
    target: :data:`CLASSIFIERS`' for 13 and 0.05 less for 90 (so both fire where the features say so, and their best
    detections pass the score threshold and the per-image cap alike), 0 for the two-stage background and -10 for
    every other row. Eval mode, channels-last as Pet runs."""
    torch.manual_seed(0)
    model = ARCHS[arch].builder(weights=None, weights_backbone=None, num_classes=91).eval()
    name, favoured = CLASSIFIERS[arch]
    layer = model.get_submodule(name)
    logits = []
    with cheap_calibration(model) as calibration, torch.no_grad():
        rescale_outputs(model, ARCHS[arch].outputs, calibration)
        weight = layer.weight.view(-1, 91, *layer.weight.shape[1:])  # [anchors (one-stage) or 1, 91, ...]
        weight[:, FAVOURED[1]] = weight[:, FAVOURED[0]]  # both favoured classes fire on the same features
        handle = layer.register_forward_hook(lambda module, args, out: logits.append(out))
        model(calibration)
        handle.remove()
        # [R, 91] (two-stage) or [N, A * 91, H, W] (one-stage) -> the mean logit of each of the 91 classes
        per_class = [(out if out.dim() == 2 else out.unflatten(1, (-1, 91)).movedim(2, -1)).reshape(-1, 91)
                     for out in logits]
        mean = torch.cat(per_class).mean(0)
        target = torch.full((91,), -10.0)
        target[FAVOURED[0]], target[FAVOURED[1]] = favoured, favoured - 0.05  # 90 a little below 13
        if arch in ("faster_rcnn", "mask_rcnn"):
            target[0] = 0.0  # background
        layer.bias.view(-1, 91).add_(target - mean)
    return model.to(memory_format=torch.channels_last)


@pytest.fixture(scope="module")
def coco_mini(tmp_path_factory):
    """A COCO-format set with COCO's 80 categories and one 800x800 image of shapes labelled with COCO ids:
    ``(json file, image folder, RGB images by id)``."""
    root = tmp_path_factory.mktemp("coco_mini")
    (root / "images").mkdir()
    images, annotations, pixels = [], [], {}
    for image_id in (1,):
        rgb, objects = shapes_image(image_id, SIZE, SIZE)
        cv2.imwrite(str(root / "images" / f"{image_id}.png"), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
        pixels[image_id] = rgb
        images.append({"id": image_id, "file_name": f"{image_id}.png", "width": SIZE, "height": SIZE})
        for obj in objects:
            rle = mask_util.encode(np.asfortranarray(obj["mask"].astype(np.uint8)))
            annotations.append({"id": len(annotations) + 1, "image_id": image_id,
                                "category_id": SHAPE_TO_COCO[obj["label"]],
                                "bbox": [float(v) for v in mask_util.toBbox(rle)], "area": float(mask_util.area(rle)),
                                "iscrowd": 0, "segmentation": {"size": rle["size"], "counts": rle["counts"].decode()}})
    categories = [{"id": i, "name": name, "supercategory": ""} for i, name in coco_categories().items()]
    json_file = root / "instances_mini.json"
    json_file.write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    return str(json_file), str(root / "images"), pixels


def torchvision_detections(model: torch.nn.Module, pixels: dict[int, np.ndarray]) -> dict[int, dict[str, np.ndarray]]:
    """torchvision's detections of each image (label 0 dropped, as Pet drops it), boxes XYWH as in COCO results.

    On both cores: nothing else runs meanwhile (the suite's processes use one thread each otherwise)."""
    out = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    with torch.no_grad():
        for image_id, rgb in pixels.items():
            det = model([torch.from_numpy(rgb).permute(2, 0, 1).float() / 255])[0]
            keep = det["labels"] > 0
            boxes = det["boxes"][keep].double().numpy()
            boxes[:, 2:] -= boxes[:, :2]
            out[image_id] = {"boxes": boxes, "scores": det["scores"][keep].double().numpy(),
                             "labels": det["labels"][keep].numpy()}
            if "masks" in det:
                out[image_id]["masks"] = (det["masks"][keep, 0] >= 0.5).numpy()
    torch.set_num_threads(threads)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(CLASSIFIERS))
def test_shipped_coco_config_evaluates_torchvision_weights_as_torchvision(arch, coco_mini, tmp_path):
    json_file, image_dir, pixels = coco_mini
    reference = torchvision_coco_model(arch)
    weights = tmp_path / f"{arch}_coco.pth"
    torch.save(reference.state_dict(), weights)
    expected = torchvision_detections(reference, pixels)
    assert {int(c) for d in expected.values() for c in d["labels"]} == set(FAVOURED)  # the case the weights make
    ckpt = tmp_path / "run"
    proc = run_tool_captured("test_net.py", "--cfg", cfg_file(arch), "CKPT", ckpt,
                             "DATA.CUSTOM", custom_datasets(("coco_mini", json_file, image_dir)),
                             "TEST.DATASETS", "('coco_mini',)", "TEST.WEIGHTS", weights, "TEST.AMP.ENABLED", "False",
                             *SMALL_FLOPS, threads=2)  # the threads torchvision_detections ran on
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "did not load" not in proc.stderr + proc.stdout
    for task in ("bbox", "segm") if arch == "mask_rcnn" else ("bbox",):
        worst = assert_results_match_torchvision(json.loads((ckpt / "test" / f"{task}.json").read_text()), expected)
        print(f"{arch} {task}: largest differences from torchvision's {worst}")
    metrics = json.loads((ckpt / "test" / "metrics.json").read_text())["metrics"]
    # the per-class table has the dataset's 80 categories, not the head's 90 rows
    assert sum(k.startswith("bbox/AP-") for k in metrics) == 80 and "bbox/AP-N/A" not in metrics


@pytest.fixture(scope="module")
def torchvision_files(tmp_path_factory) -> dict[str, str]:
    """Per architecture, a saved torchvision ``<arch>_resnet50_fpn(num_classes=91)`` state_dict (untrained)."""
    root = tmp_path_factory.mktemp("torchvision_weights")
    files = {}
    for arch in CLASSIFIERS:
        torch.manual_seed(0)
        files[arch] = str(root / f"{arch}.pth")
        torch.save(ARCHS[arch].builder(weights=None, weights_backbone=None, num_classes=91).state_dict(), files[arch])
    return files


# The class-dependent layers of each architecture, as the re-initialisation line names them.
CLASS_HEADS = {
    "faster_rcnn": "roi_heads.box_predictor.cls_score, roi_heads.box_predictor.bbox_pred",
    "mask_rcnn": ("roi_heads.box_predictor.cls_score, roi_heads.box_predictor.bbox_pred, "
                  "roi_heads.mask_predictor.mask_fcn_logits"),
    "retinanet": "head.classification_head.cls_logits",
    "fcos": "head.classification_head.cls_logits",
}


@pytest.mark.parametrize("arch", list(CLASS_HEADS))
def test_fine_tuning_from_torchvision_weights_reinitialises_the_class_head_with_one_info_line(
        arch, torchvision_files, caplog):
    """train_net's TRAIN.WEIGHTS load (``load_weights`` in training mode) with the shipped config set for 3 classes:
    everything else loads, the class head keeps its fresh initialisation, and the log says so in one info line."""
    cfg = load_cfg(cfg_file(arch), ["MODEL.NUM_CLASSES", "3", "MODEL.LABEL_SPACE", "contiguous"])
    torch.manual_seed(1)
    model = build_model(cfg)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="pet.checkpoint.loading"):
        report = load_weights(model, torchvision_files[arch])
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    lines = [r.getMessage() for r in caplog.records if "re-initialised" in r.getMessage()]
    assert len(lines) == 1 and f"The class head ({CLASS_HEADS[arch]}) is re-initialised for 3 classes" in lines[0]
    assert report["missing"] == report["unexpected"] == []
    theirs = torch.load(torchvision_files[arch], weights_only=True)
    for key, value in model.state_dict().items():
        expected = fresh[key] if key in report["mismatched"] else theirs[key]
        assert torch.equal(value, expected), key


def test_test_net_refuses_weights_that_leave_the_fpn_random(coco_mini, torchvision_files, tmp_path):
    json_file, image_dir, _ = coco_mini
    state = torch.load(torchvision_files["faster_rcnn"], weights_only=True)
    partial = tmp_path / "no_fpn.pth"
    torch.save({k: v for k, v in state.items() if not k.startswith("backbone.fpn.")}, partial)
    proc = run_tool_captured("test_net.py", "--cfg", cfg_file("faster_rcnn"), "CKPT", tmp_path / "run",
                             "DATA.CUSTOM", custom_datasets(("coco_mini", json_file, image_dir)),
                             "TEST.DATASETS", "('coco_mini',)", "TEST.WEIGHTS", partial)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ")
    assert "backbone.fpn.* (16 tensors missing)" in lines[0] and "TEST.ALLOW_RANDOM_WEIGHTS" in lines[0]
    assert not (tmp_path / "run" / "test" / "bbox.json").exists()


def test_evaluating_with_a_class_head_of_another_size_is_an_error_naming_the_setting(torchvision_files, caplog):
    """The issue's first trap: torchvision's 91-row weights into an 81-row head (NUM_CLASSES 80), which used to
    leave the class head random with a warning and evaluate anyway. Opting in turns the error into the warning."""
    cfg = load_cfg(cfg_file("faster_rcnn"), ["MODEL.NUM_CLASSES", "80", "MODEL.LABEL_SPACE", "contiguous"])
    model = build_model(cfg)
    with pytest.raises(ConfigError, match=r"roi_heads\.box_predictor\.\* \(4 tensors mismatched\).*"
                                          r"MODEL.NUM_CLASSES 80.*90 and category_id"):
        load_weights(model, torchvision_files["faster_rcnn"], for_inference=True)
    with caplog.at_level(logging.INFO, logger="pet.checkpoint.loading"):
        report = load_weights(model, torchvision_files["faster_rcnn"], for_inference=True, allow_random=True)
    assert len(report["mismatched"]) == 4
    assert [r.levelno for r in caplog.records if "did not load" in r.getMessage()] == [logging.WARNING]
    assert "re-initialised" not in caplog.text


@pytest.mark.numeric
def test_frozen_bn_eps_0_computes_as_torchvision_does_with_its_released_weights(tmp_path):
    """torchvision's builders set FrozenBatchNorm's eps to 0 when they load the released Faster R-CNN, Mask R-CNN
    and RetinaNet COCO weights; ``MODEL.BACKBONE.FROZEN_BN_EPS 0.0`` makes Pet's backbone compute the same. The
    running variances are made small (as some of a trained network's are), so that eps shows."""
    torch.manual_seed(0)
    theirs = ARCHS["faster_rcnn"].builder(weights=None, weights_backbone=None, num_classes=91).eval()
    with torch.no_grad():
        for bn in theirs.backbone.modules():
            if isinstance(bn, torch.nn.BatchNorm2d):
                bn.running_var.uniform_(1e-4, 1e-3)
                bn.running_mean.normal_(0, 0.01)
                bn.weight.copy_(bn.running_var.sqrt())  # outputs stay O(1) through the 50 layers
                bn.eps = 0.0  # torchvision's overwrite_eps(model, 0.0)
    weights = tmp_path / "released_like.pth"
    torch.save(theirs.state_dict(), weights)
    x = torch.randn(1, 3, 96, 128)
    with torch.no_grad():
        expected = theirs.backbone(x)
        for eps, same in ((0.0, True), (1e-5, False)):
            model = build_model(load_cfg(cfg_file("faster_rcnn"), ["MODEL.BACKBONE.FROZEN_BN_EPS", str(eps)])).eval()
            load_weights(model, str(weights), for_inference=True)
            got = model.backbone(x)
            # float32 round-off relative to the largest activation (measured ~3e-6), against ~0.3 for the other eps
            close = all((got[k] - expected[k]).abs().max() <= 1e-4 * expected[k].abs().max() for k in expected)
            assert close is same, f"FROZEN_BN_EPS {eps}"
