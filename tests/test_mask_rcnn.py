"""Mask R-CNN: torchvision parity, parameter count, mask losses and outputs, a swappable mask head, segm
evaluation."""
from __future__ import annotations

import json
import os
import uuid

import numpy as np
import pytest
import torch
import torchvision
from conftest import random_padded_batch

from pet.config import load_cfg
from pet.data import generate_shapes, get_dataset, register_coco_dataset
from pet.evaluation import COCOEvaluator, evaluate_results_file
from pet.modeling import build_model
from pet.utils.errors import ConfigError, DataError
from pet.utils.weights import load_weights

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COCO_CFG = os.path.join(ROOT, "cfgs", "coco", "mask_rcnn_R-50-FPN_1x.yaml")
DEMO_CFG = os.path.join(ROOT, "cfgs", "shapes", "mask_rcnn_R-18-FPN.yaml")
LOSSES = {"loss_objectness", "loss_rpn_box_reg", "loss_classifier", "loss_box_reg", "loss_mask"}


def _mask_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of each pair of boolean masks [N, H, W]; two empty masks count as identical."""
    inter = (a & b).flatten(1).sum(1).float()
    union = (a | b).flatten(1).sum(1).float()
    return torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(union))


def test_detections_and_masks_match_torchvision_for_the_same_weights(tmp_path):
    """torchvision's maskrcnn_resnet50_fpn state_dict loads as is and gives the same boxes, scores,
    labels and pasted masks, including for an image resized from a larger original."""
    detections = 20  # both models keep the top 20 per image: the 256-channel mask head is the costly part
    torch.manual_seed(0)
    reference = torchvision.models.detection.maskrcnn_resnet50_fpn(
        weights=None, weights_backbone=None, num_classes=91, min_size=320, box_score_thresh=0.0,
        box_detections_per_img=detections).eval()
    path = tmp_path / "maskrcnn.pth"
    torch.save(reference.state_dict(), path)
    # torchvision's memory format too: channels-last convolutions sum in another order (~1e-3 px on boxes)
    model = build_model(load_cfg(COCO_CFG, ["MODEL.NUM_CLASSES", "90", "MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.0",
                                            "MODEL.ROI_HEADS.DETECTIONS_PER_IMAGE", str(detections),
                                            "MODEL.CHANNELS_LAST", "False"]))
    assert load_weights(model, str(path)) == {"missing": [], "unexpected": [], "mismatched": []}
    model.eval()

    sizes, originals = [(320, 416), (320, 320)], [(480, 624), (320, 320)]  # image 0 stands for a 1.5x larger one
    images, batch = random_padded_batch(sizes)
    targets = [{"image_size": s, "orig_size": o} for s, o in zip(sizes, originals)]
    with torch.no_grad():
        # torchvision's GeneralizedRCNN.forward, step by step, to paste into the larger original size
        image_list, _ = reference.transform([im.float() / 255 for im in images])  # 320 short side: no resize
        assert image_list.image_sizes == sizes
        features = reference.backbone(image_list.tensors)
        proposals, _ = reference.rpn(image_list, features)
        raw, _ = reference.roi_heads(features, proposals, image_list.image_sizes)
        expected = reference.transform.postprocess(raw, image_list.image_sizes, originals)
        outputs = model(batch, targets)

    for ours, theirs, (orig_h, orig_w) in zip(outputs, expected, originals):
        assert len(ours["boxes"]) == len(theirs["boxes"]) == detections
        assert torch.equal(ours["labels"], theirs["labels"])
        assert (ours["boxes"] - theirs["boxes"]).abs().max() <= 1e-4
        assert (ours["scores"] - theirs["scores"]).abs().max() <= 1e-4
        assert ours["masks"].dtype == torch.uint8 and ours["masks"].shape == (detections, orig_h, orig_w)
        assert ours["masks"].max() == 1 and set(ours["masks"].unique().tolist()) <= {0, 1}
        assert _mask_iou(ours["masks"].bool(), theirs["masks"][:, 0] >= 0.5).min() >= 0.99


def test_coco_config_has_torchvisions_parameter_count():
    model = build_model(load_cfg(COCO_CFG, ["MODEL.NUM_CLASSES", "90"]))
    assert sum(p.numel() for p in model.parameters()) == 44_401_393  # MaskRCNN_ResNet50_FPN_Weights' num_params
    names = {n for n, _ in model.named_modules()}
    assert {"roi_heads.mask_roi_pool", "roi_heads.mask_head", "roi_heads.mask_predictor"} <= names


def _batch():
    """Two padded uint8 images (image 0 resized 2x down from 192x256) with boxes, labels and their masks."""
    gen = torch.Generator().manual_seed(0)
    images = torch.zeros(2, 3, 128, 128, dtype=torch.uint8)
    targets = []
    for i, ((h, w), orig) in enumerate([((96, 128), (192, 256)), ((80, 100), (80, 100))]):
        images[i, :, :h, :w] = torch.randint(0, 255, (3, h, w), generator=gen, dtype=torch.uint8)
        boxes = torch.tensor([[10.0, 12.0, 50.0, 60.0], [30.0, 5.0, 70.0, 40.0]])
        masks = torch.zeros(len(boxes), h, w, dtype=torch.uint8)
        for mask, (x0, y0, x1, y1) in zip(masks, boxes.int().tolist()):
            mask[y0:y1, x0:x1] = 1
        targets.append({"image_id": i + 1, "image_size": (h, w), "orig_size": orig, "boxes": boxes,
                        "labels": torch.tensor([1, 3]), "masks": masks})
    return images, targets


@pytest.fixture(scope="module")
def demo_model():
    torch.manual_seed(0)
    return build_model(load_cfg(DEMO_CFG, ["MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.0"]))


def test_training_losses_include_a_finite_loss_mask_that_trains_the_mask_head(demo_model):
    demo_model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = demo_model(*_batch())
    assert set(losses) == LOSSES
    assert all(v.dim() == 0 and torch.isfinite(v) and v.dtype == torch.float32 for v in losses.values())
    demo_model.zero_grad()
    sum(losses.values()).backward()
    for module in (demo_model.roi_heads.mask_head, demo_model.roi_heads.mask_predictor):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters())


def test_eval_masks_are_binary_uint8_in_the_original_image(demo_model):
    demo_model.eval()
    images, targets = _batch()
    with torch.no_grad():
        outputs = demo_model(images, targets)
    for out, target in zip(outputs, targets):
        assert set(out) == {"boxes", "scores", "labels", "masks"} and len(out["boxes"]) > 0
        assert out["masks"].dtype == torch.uint8 and out["masks"].shape == (len(out["boxes"]), *target["orig_size"])
        assert set(out["masks"].unique().tolist()) <= {0, 1}


def test_custom_mask_head_from_a_dotted_path_trains():
    model = build_model(load_cfg(DEMO_CFG, ["MODEL.ROI_MASK_HEAD.NAME", f"{__name__}.OneConvMaskHead"]))
    assert isinstance(model.roi_heads.mask_head, OneConvMaskHead)
    assert model.roi_heads.mask_predictor.conv5_mask.in_channels == OneConvMaskHead.out_channels
    model.train()
    losses = model(*_batch())
    assert set(losses) == LOSSES
    sum(losses.values()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.roi_heads.mask_head.parameters())


class OneConvMaskHead(torch.nn.Sequential):
    """A user's mask head: one 3x3 convolution + ReLU; ``out_channels`` tells the mask predictor its input width."""

    out_channels = 32

    def __init__(self, cfg, in_channels: int) -> None:
        super().__init__(torch.nn.Conv2d(in_channels, self.out_channels, 3, padding=1), torch.nn.ReLU())


def test_mask_rcnn_needs_mask_on():
    with pytest.raises(ConfigError, match="MaskRCNN needs MODEL.MASK_ON True"):
        build_model(load_cfg(DEMO_CFG, ["MODEL.MASK_ON", "False"]))


@pytest.fixture(scope="module")
def val_dataset(tmp_path_factory):
    root = generate_shapes(str(tmp_path_factory.mktemp("data") / "shapes"), num_train=2, num_val=6, seed=2)
    name = f"shapes_val_{uuid.uuid4().hex[:8]}"
    register_coco_dataset(name, os.path.join(root, "annotations", "val.json"), os.path.join(root, "val"))
    return get_dataset(name)


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
