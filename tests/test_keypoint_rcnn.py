"""Keypoint R-CNN: torchvision parity (boxes, scores, keypoints, losses, gradients), torchvision's module names and
parameter count, keypoint outputs in the original image, and the errors of a batch without usable keypoints."""
from __future__ import annotations

import os

import pytest
import torch
from helpers import CFGS, custom_datasets
from parity import check_inference_parity, check_training_parity
from test_export import randomize_norms, rescale_output

from pet.config import load_cfg
from pet.deploy.onnx import export_onnx
from pet.deploy.onnxruntime_model import OnnxRuntimeModel
from pet.deploy.parity import ParityError, check_parity, parity_batches
from pet.modeling import build_model

COCO_CFG = os.path.join(CFGS, "coco", "keypoint_rcnn_R-50-FPN_1x.yaml")


def test_keypoint_rcnn_inference_parity_with_torchvision():
    """torchvision's keypointrcnn_resnet50_fpn weights give torchvision's detections, keypoints and keypoint scores:
    the same as its model run channels-last, and torchvision's default run in float64 up to its memory format's
    rounding (tests/parity.py)."""
    measured = check_inference_parity("keypoint_rcnn")
    print(measured)


def test_keypoint_rcnn_training_parity_with_torchvision():
    """The same losses (loss_keypoint included) and gradients as torchvision's model for the same weights, batch,
    keypoints and sampling (tests/parity.py)."""
    print(check_training_parity("keypoint_rcnn"))


def test_coco_config_has_torchvisions_parameter_count_and_module_names():
    model = build_model(load_cfg(COCO_CFG))
    assert sum(p.numel() for p in model.parameters()) == 59_137_258  # KeypointRCNN_ResNet50_FPN_Weights' num_params
    names = {n for n, _ in model.named_modules()}
    assert {"roi_heads.keypoint_roi_pool", "roi_heads.keypoint_head", "roi_heads.keypoint_predictor"} <= names


# A tiny Keypoint R-CNN on the shapes demo's Faster R-CNN config: ResNet-10 stages 2-3, a 32-channel FPN, two
# 16-channel keypoint convolutions and 4 keypoints; few proposals.
TINY = ["MODEL.META_ARCHITECTURE", "KeypointRCNN", "MODEL.FPN.RETURNED_LAYERS", "[2, 3]",
        "MODEL.RPN.ANCHOR_SIZES", "[[32], [64], [128]]", "MODEL.FPN.OUT_CHANNELS", "32", "MODEL.ROI_BOX_HEAD.MLP_DIM",
        "64", "MODEL.RPN.PRE_NMS_TOPK_TEST", "200", "MODEL.RPN.POST_NMS_TOPK_TEST", "100",
        "MODEL.ROI_KEYPOINT_HEAD.NUM_KEYPOINTS", "4", "MODEL.ROI_KEYPOINT_HEAD.CONV_DIMS", "[16, 16]",
        "MODEL.ROI_KEYPOINT_HEAD.POOLER_RESOLUTION", "7"]


@pytest.fixture(scope="module")
def tiny_keypoint_export(shapes_root, tmp_path_factory):
    """``(model, onnx model, parity batches)``: the tiny model with random weights (non-trivial normalisation,
    classifier and heatmap logits rescaled to O(1)), its score threshold just above the blank image's best score,
    exported with its parity gate's first batch as the example."""
    root = tmp_path_factory.mktemp("keypoint_export")
    data = ["DATA.CUSTOM", custom_datasets(("kp_val", f"{shapes_root}/annotations/val.json", f"{shapes_root}/val")),
            "TEST.DATASETS", "('kp_val',)", "CKPT", str(root / "ckpt")]
    cfg = load_cfg(os.path.join(CFGS, "shapes", "faster_rcnn_R-10-FPN.yaml"),
                   [*TINY, *data, "MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.0"])
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    randomize_norms(model)
    batches = parity_batches(cfg)
    rescale_output(model, "roi_heads.box_predictor.cls_score", batches[0])
    rescale_output(model, "roi_heads.keypoint_predictor.kps_score_lowres", batches[0])
    with torch.no_grad():
        model.roi_heads.score_thresh = model(*batches[-1])[0]["scores"].max().item() + 1e-3
    path = export_onnx(model, batches[0], str(root / "keypoint_rcnn.onnx"))
    return model, OnnxRuntimeModel(path), batches


def test_keypoint_rcnn_exports_through_the_parity_gate_with_its_keypoints(tiny_keypoint_export):
    model, onnx_model, batches = tiny_keypoint_export
    assert onnx_model.output_names[-1] == "keypoint_heatmaps"
    report = check_parity(model, onnx_model, batches)
    assert report.detections > 0 and report.keypoint_px is not None, report.summary()
    print(report.summary())
    with torch.no_grad():
        detections = onnx_model(*batches[0])
    assert all(d["keypoints"].shape == (len(d["boxes"]), 4, 3) and d["keypoints_scores"].shape == (len(d["boxes"]), 4)
               for d in detections)
    assert sum(len(d["boxes"]) for d in detections) > 0


def test_the_gate_rejects_keypoints_moved_by_a_pixel(tiny_keypoint_export):
    """The gate compares the decoded keypoints: onnxruntime's moved by 1 px (boxes and scores unchanged) fail it."""
    model, onnx_model, batches = tiny_keypoint_export
    decode = onnx_model.network_detections

    def moved(images, targets):
        detections = decode(images, targets)
        for d in detections:
            d["keypoints"] = d["keypoints"] + torch.tensor([1.0, 0.0, 0.0])
        return detections

    onnx_model.network_detections = moved
    try:
        with pytest.raises(ParityError, match="keypoints"):
            check_parity(model, onnx_model, batches)
    finally:
        del onnx_model.network_detections
