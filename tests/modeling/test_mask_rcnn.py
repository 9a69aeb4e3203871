"""Mask R-CNN: torchvision parity, parameter count, mask losses and outputs, a swappable mask head, segm
evaluation."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from pet.config import load_cfg
from pet.data import get_dataset
from pet.evaluation import COCOEvaluator, evaluate_results_file
from pet.modeling import build_model
from pet.modeling.postprocess import paste_masks
from pet.utils.errors import ConfigError, DataError
from support.against_reference import INFERENCE_COMPARISONS, check_inference_parity, check_training_parity
from support.helpers import CFGS, assert_part_trains, detector_batch, register_split

COCO_CFG = os.path.join(CFGS, "coco", "mask_rcnn_R-50-FPN_1x.yaml")
MASK_DEMO_CFG = os.path.join(CFGS, "shapes", "mask_rcnn_R-18-FPN.yaml")
LOSSES = {"loss_objectness", "loss_rpn_box_reg", "loss_classifier", "loss_box_reg", "loss_mask"}


@pytest.mark.slow
@pytest.mark.parametrize("comparison", INFERENCE_COMPARISONS)
def test_mask_rcnn_inference_parity_with_torchvision(comparison):
    """torchvision's maskrcnn_resnet50_fpn weights give torchvision's detections and masks (IoU >= 0.99 each): the
    same as its model run channels-last, and torchvision's default run in float64 up to its memory format's rounding
    (tests/support/against_reference.py)."""
    check_inference_parity("mask_rcnn", comparison)


# Not in the numeric group (.ci/run's pass as on another CPU): float64, whose rounding stays far below the tolerance
# in any summation order.
@pytest.mark.slow
def test_mask_rcnn_training_parity_with_torchvision():
    """The same losses (loss_mask included) and gradients as torchvision's model for the same weights, batch and
    sampling (tests/support/against_reference.py)."""
    check_training_parity("mask_rcnn")


def test_coco_config_has_torchvisions_parameter_count():
    model = build_model(load_cfg(COCO_CFG))
    assert sum(p.numel() for p in model.parameters()) == 44_401_393  # MaskRCNN_ResNet50_FPN_Weights' num_params
    names = {n for n, _ in model.named_modules()}
    assert {"roi_heads.mask_roi_pool", "roi_heads.mask_head", "roi_heads.mask_predictor"} <= names


@pytest.fixture(scope="module")
def mask_demo_model():
    torch.manual_seed(0)
    return build_model(load_cfg(MASK_DEMO_CFG, ["MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.0"]))


def test_training_losses_include_a_finite_loss_mask_that_trains_the_mask_head(mask_demo_model):
    mask_demo_model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = mask_demo_model(*detector_batch(masks=True))
    assert set(losses) == LOSSES
    assert all(v.dim() == 0 and torch.isfinite(v) and v.dtype == torch.float32 for v in losses.values())
    mask_demo_model.zero_grad()
    sum(losses.values()).backward()
    for module in (mask_demo_model.roi_heads.mask_head, mask_demo_model.roi_heads.mask_predictor):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters())


def test_eval_masks_are_binary_uint8_in_the_original_image(mask_demo_model):
    mask_demo_model.eval()
    images, targets = detector_batch(masks=True)
    with torch.no_grad():
        outputs = mask_demo_model(images, targets)
    for out, target in zip(outputs, targets):
        assert set(out) == {"boxes", "scores", "labels", "masks"} and len(out["boxes"]) > 0
        assert out["masks"].dtype == torch.uint8 and out["masks"].shape == (len(out["boxes"]), *target["orig_size"])
        assert set(out["masks"].unique().tolist()) <= {0, 1}


def test_custom_mask_head_from_a_dotted_path_trains():
    model = build_model(load_cfg(MASK_DEMO_CFG, ["MODEL.ROI_MASK_HEAD.NAME", f"{__name__}.OneConvMaskHead"]))
    assert isinstance(model.roi_heads.mask_head, OneConvMaskHead)
    assert model.roi_heads.mask_predictor.conv5_mask.in_channels == OneConvMaskHead.out_channels
    assert_part_trains(model, model.roi_heads.mask_head, LOSSES, detector_batch(masks=True))


class OneConvMaskHead(torch.nn.Sequential):
    """A user's mask head: one 3x3 convolution + ReLU; ``out_channels`` tells the mask predictor its input width."""

    out_channels = 32

    def __init__(self, cfg, in_channels: int) -> None:
        super().__init__(torch.nn.Conv2d(in_channels, self.out_channels, 3, padding=1), torch.nn.ReLU())


def test_mask_rcnn_needs_mask_on():
    with pytest.raises(ConfigError, match="MaskRCNN needs MODEL.MASK_ON True"):
        build_model(load_cfg(MASK_DEMO_CFG, ["MODEL.MASK_ON", "False"]))


@pytest.fixture(scope="module")
def val_dataset(shapes_set):
    """6 validation images: the set test_evaluation scores (generated once per session)."""
    return get_dataset(register_split(shapes_set(num_train=2, num_val=6, seed=2), "val"))


def _ground_truth_outputs(dataset, shift: int = 0):
    """Each image's annotations as detections in original pixels, masks decoded from the polygons
    (optionally shifted right by ``shift`` pixels), score 1."""
    coco = dataset.coco
    targets, outputs = [], []
    for image_id in sorted(coco.getImgIds()):
        anns = coco.loadAnns(coco.getAnnIds(imgIds=image_id, iscrowd=False))
        masks = np.stack([coco.annToMask(a) for a in anns])
        masks = np.roll(masks, shift, axis=2)
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32)
        boxes[:, 2:] += boxes[:, :2]
        labels = torch.tensor([dataset.category_id_to_label[a["category_id"]] for a in anns])
        targets.append({"image_id": image_id})
        outputs.append({"boxes": boxes, "scores": torch.ones(len(anns)), "labels": labels,
                        "masks": torch.from_numpy(masks)})
    return targets, outputs


def test_perfect_masks_give_segm_ap_100_and_a_segm_json_that_rescores_the_same(val_dataset, tmp_path):
    evaluator = COCOEvaluator(val_dataset, output_dir=str(tmp_path))
    evaluator.process(*_ground_truth_outputs(val_dataset))
    metrics = evaluator.evaluate()
    assert set(metrics) == {"bbox", "segm"}
    for name in ("AP", "AP50", "AP75"):
        assert metrics["segm"][name] == pytest.approx(100.0), name
    assert {"AP-circle", "AP-rectangle", "AP-triangle"} <= metrics["segm"].keys()

    segm = json.loads((tmp_path / "segm.json").read_text())
    assert segm and set(segm[0]) == {"image_id", "category_id", "segmentation", "score"}
    assert set(json.loads((tmp_path / "bbox.json").read_text())[0]) == {"image_id", "category_id", "bbox", "score"}
    coco_dt = val_dataset.coco.loadRes(str(tmp_path / "segm.json"))
    assert len(coco_dt.getAnnIds()) == len(val_dataset.coco.getAnnIds(iscrowd=False))

    again = evaluate_results_file(val_dataset, str(tmp_path / "segm.json"))
    assert set(again) == {"segm"}
    assert again["segm"] == pytest.approx(metrics["segm"], nan_ok=True)


def test_shifted_masks_lower_segm_ap_but_not_bbox_ap(val_dataset):
    evaluator = COCOEvaluator(val_dataset)
    evaluator.process(*_ground_truth_outputs(val_dataset, shift=4))
    metrics = evaluator.evaluate()
    assert metrics["bbox"]["AP"] == pytest.approx(100.0)
    assert metrics["segm"]["AP"] < 90 and metrics["segm"]["AP75"] < metrics["segm"]["AP50"]


def test_masks_without_detections_still_report_segm(val_dataset):
    evaluator = COCOEvaluator(val_dataset)
    evaluator.process([{"image_id": 1}], [{"boxes": torch.zeros(0, 4), "scores": torch.zeros(0),
                                           "labels": torch.zeros(0, dtype=torch.int64),
                                           "masks": torch.zeros(0, 192, 256, dtype=torch.uint8)}])
    metrics = evaluator.evaluate()
    assert metrics["bbox"]["AP"] == 0.0 and metrics["segm"]["AP"] == 0.0


def test_a_mask_of_the_wrong_size_is_a_clear_error(val_dataset, tmp_path):
    image = val_dataset.coco.loadImgs(1)[0]
    wrong = tmp_path / "segm.json"
    wrong.write_text(json.dumps([{"image_id": 1, "category_id": val_dataset.label_to_category_id[1], "score": 1.0,
                                  "segmentation": {"size": [image["height"] + 1, image["width"]], "counts": "0"}}]))
    with pytest.raises(DataError, match=r"mask of size .* but image 1 is"):
        evaluate_results_file(val_dataset, str(wrong))


@pytest.mark.numeric
@pytest.mark.parametrize("count", [0, 1, 37])
def test_pasted_masks_are_torchvisions_pasted_masks_thresholded(count):
    """Pet pastes each mask only inside its box, straight into uint8; the pixels must be exactly those of
    torchvision's paste_masks_in_image (full-image float canvases) thresholded at 0.5, for boxes inside
    the image and across each of its edges, small and large."""
    from torchvision.models.detection.roi_heads import paste_masks_in_image

    gen = torch.Generator().manual_seed(count)
    height, width = 96, 130
    probs = torch.rand(count, 1, 28, 28, generator=gen)
    # Detections are clipped to the image before pasting (torchvision's own paste fails on a box wholly
    # outside); the mask expansion still carries boxes across every edge.
    xy = torch.rand(count, 2, generator=gen) * torch.tensor([width + 10.0, height + 10.0]) - 20
    wh = torch.rand(count, 2, generator=gen) * 90 + 25
    boxes = torch.cat([xy, xy + wh], dim=1)
    expected = (paste_masks_in_image(probs, boxes, (height, width))[:, 0] >= 0.5).to(torch.uint8)
    pasted = paste_masks(probs, boxes, (height, width))
    assert pasted.dtype == torch.uint8 and pasted.shape == (count, height, width)
    assert torch.equal(pasted, expected)
    if count:
        assert 0 < int(expected.sum()) < expected.numel()  # real masks, not all-empty or all-full
