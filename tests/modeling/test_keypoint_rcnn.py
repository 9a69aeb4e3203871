"""Keypoint R-CNN: torchvision parity (boxes, scores, keypoints, losses, gradients), torchvision's module names and
parameter count, keypoint outputs in the original image, and the errors of a batch without usable keypoints."""
from __future__ import annotations

import json
import os

import cv2
import numpy as np
import pytest
import torch
import torchvision

from pet.config import load_cfg
from pet.data.categories import LabelSpace
from pet.deploy.onnx import export_onnx
from pet.deploy.onnxruntime_model import OnnxRuntimeModel
from pet.deploy.parity import ParityError, check_parity, parity_batches
from pet.modeling import build_model
from pet.predict import Predictor
from pet.utils.errors import ConfigError, DataError
from support.against_reference import (
    ARCHS,
    Tolerance,
    assert_results_match_torchvision,
    assert_same_detections,
    cheap_calibration,
    check_inference_parity,
    check_training_parity,
    rescale_outputs,
    shapes_image,
)
from support.helpers import CFGS, SMALL_FLOPS, custom_datasets, run_tool_captured
from support.tiny_exports import assert_openvino_gives_the_pytorch_detections
from support.tiny_models import TINY_TWO_STAGE, randomize_norms, rescale_layer_output

COCO_CFG = os.path.join(CFGS, "coco", "keypoint_rcnn_R-50-FPN_1x.yaml")


# This and the next are not in the numeric group (.ci/run's pass as on another CPU): ~30 s of 2 cores each there,
# most of it the keypoint head's eight 512-channel convolutions; the other parity tests compare the rest. For the same
# reason only the float32 comparison runs here (the float64 one against torchvision's default memory format, ~40 s,
# checks the convolutions' memory format, which the other architectures' parity tests check).
@pytest.mark.slow
def test_keypoint_rcnn_inference_parity_with_torchvision():
    """torchvision's keypointrcnn_resnet50_fpn weights give torchvision's detections, keypoints and keypoint scores:
    the same as its model run channels-last (tests/support/against_reference.py)."""
    measured = check_inference_parity("keypoint_rcnn", "same_format")
    print(measured)


@pytest.mark.slow
def test_keypoint_rcnn_training_parity_with_torchvision():
    """The same losses (loss_keypoint included) and gradients as torchvision's model for the same weights, batch,
    keypoints and sampling (tests/support/against_reference.py)."""
    print(check_training_parity("keypoint_rcnn"))


def test_coco_config_has_torchvisions_parameter_count_and_module_names():
    model = build_model(load_cfg(COCO_CFG))
    assert sum(p.numel() for p in model.parameters()) == 59_137_258  # KeypointRCNN_ResNet50_FPN_Weights' num_params
    names = {n for n, _ in model.named_modules()}
    assert {"roi_heads.keypoint_roi_pool", "roi_heads.keypoint_head", "roi_heads.keypoint_predictor"} <= names


# A tiny Keypoint R-CNN on the shapes demo's Faster R-CNN config: ResNet-10 stages 2-3, a 32-channel FPN, two
# 16-channel keypoint convolutions and 4 keypoints; few proposals.
TINY_KEYPOINT_RCNN = ["MODEL.META_ARCHITECTURE", "KeypointRCNN", *TINY_TWO_STAGE,
                      "MODEL.ROI_KEYPOINT_HEAD.NUM_KEYPOINTS", "4", "MODEL.ROI_KEYPOINT_HEAD.CONV_DIMS", "[16, 16]",
                      "MODEL.ROI_KEYPOINT_HEAD.POOLER_RESOLUTION", "7"]


@pytest.fixture(scope="module")
def tiny_keypoint_export(shapes_root, tmp_path_factory):
    """``(model, onnx model, parity batches, cfg)``: the tiny model with random weights (non-trivial normalisation,
    classifier and heatmap logits rescaled to O(1)), its score threshold just above the blank image's best score,
    exported with its parity gate's first batch as the example."""
    root = tmp_path_factory.mktemp("keypoint_export")
    data = ["DATA.CUSTOM", custom_datasets(("kp_val", f"{shapes_root}/annotations/val.json", f"{shapes_root}/val")),
            "TEST.DATASETS", "('kp_val',)", "CKPT", str(root / "ckpt")]
    cfg = load_cfg(os.path.join(CFGS, "shapes", "faster_rcnn_R-10-FPN.yaml"),
                   [*TINY_KEYPOINT_RCNN, *data, "MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.0"])
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    randomize_norms(model)
    batches = parity_batches(cfg)
    rescale_layer_output(model, "roi_heads.box_predictor.cls_score", batches[0])
    rescale_layer_output(model, "roi_heads.keypoint_predictor.kps_score_lowres", batches[0])
    with torch.no_grad():
        model.roi_heads.score_thresh = model(*batches[-1])[0]["scores"].max().item() + 1e-3
    path = export_onnx(model, batches[0], str(root / "keypoint_rcnn.onnx"))
    return model, OnnxRuntimeModel(path), batches, cfg


@pytest.mark.slow
@pytest.mark.numeric
def test_keypoint_rcnn_exports_through_the_parity_gate_with_its_keypoints(tiny_keypoint_export):
    model, onnx_model, batches, _ = tiny_keypoint_export
    assert onnx_model.output_names[-1] == "keypoint_heatmaps"
    report = check_parity(model, onnx_model, batches)
    assert report.detections > 0 and report.keypoint_px is not None, report.summary()
    print(report.summary())
    with torch.no_grad():
        detections = onnx_model(*batches[0])
    assert all(d["keypoints"].shape == (len(d["boxes"]), 4, 3) and d["keypoints_scores"].shape == (len(d["boxes"]), 4)
               for d in detections)
    assert sum(len(d["boxes"]) for d in detections) > 0


@pytest.mark.slow
def test_openvino_ir_gives_the_pytorch_detections_and_keypoints(tiny_keypoint_export, shapes_root, tmp_path):
    model, onnx_model, _, cfg = tiny_keypoint_export
    assert_openvino_gives_the_pytorch_detections(model, onnx_model.path, cfg, shapes_root, str(tmp_path),
                                                 keypoints=True)


@pytest.mark.slow
def test_the_gate_rejects_keypoints_moved_by_a_pixel(tiny_keypoint_export):
    """The gate compares the decoded keypoints: onnxruntime's moved by 1 px (boxes and scores unchanged) fail it."""
    model, onnx_model, batches, _ = tiny_keypoint_export
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


SIZE = 800  # INPUT.MIN_SIZE_TEST of the COCO config and torchvision's test size: neither side resizes


def torchvision_keypoint_model() -> torch.nn.Module:
    """torchvision's ``keypointrcnn_resnet50_fpn(weights=None, weights_backbone=None)`` (person + 17 keypoints), its
    output layers rescaled to O(1) outputs (tests/support/against_reference.py) and the person logit biased to a mean of
    -4 on calibration images (background 0), so that the best ~20 detections pass the score threshold (each costs the
    keypoint head's eight 512-channel convolutions). Eval mode, channels-last as Pet runs."""
    torch.manual_seed(0)
    model = ARCHS["keypoint_rcnn"].builder(weights=None, weights_backbone=None).eval()
    layer, logits = model.roi_heads.box_predictor.cls_score, []
    with cheap_calibration(model) as calibration, torch.no_grad():
        rescale_outputs(model, ARCHS["keypoint_rcnn"].outputs, calibration)
        handle = layer.register_forward_hook(lambda module, args, out: logits.append(out))
        model(calibration)
        handle.remove()
        layer.bias.add_(torch.tensor([0.0, -4.0]) - torch.cat(logits).mean(0))
    return model.to(memory_format=torch.channels_last)


@pytest.fixture(scope="module")
def coco_person(tmp_path_factory):
    """A COCO person-keypoint set (the category's 17 keypoint names and skeleton, each annotation's keypoints) with
    one 800x800 image of shapes, every shape a person: ``(json file, image folder, RGB image)``."""
    root = tmp_path_factory.mktemp("coco_person")
    (root / "images").mkdir()
    rgb, objects = shapes_image(1, SIZE, SIZE)
    cv2.imwrite(str(root / "images" / "1.png"), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    annotations = []
    for obj in objects:
        ys, xs = np.nonzero(obj["mask"])
        x0, y0, x1, y1 = int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1
        keypoints = [v for k in range(17) for v in (x0 + (x1 - x0) * k / 17, y0 + (y1 - y0) * k / 17, 2)]
        annotations.append({"id": len(annotations) + 1, "image_id": 1, "category_id": 1, "iscrowd": 0,
                            "bbox": [x0, y0, x1 - x0, y1 - y0], "area": float(obj["mask"].sum()),
                            "keypoints": keypoints, "num_keypoints": 17})
    names = list(torchvision.models.detection.KeypointRCNN_ResNet50_FPN_Weights.COCO_V1.meta["keypoint_names"])
    skeleton = [[16, 14], [14, 12], [17, 15], [15, 13], [12, 13], [6, 12], [7, 13], [6, 7], [6, 8], [7, 9], [8, 10],
                [9, 11], [2, 3], [1, 2], [1, 3], [2, 4], [3, 5], [4, 6], [5, 7]]  # COCO's, 1-based
    categories = [{"id": 1, "name": "person", "supercategory": "person", "keypoints": names, "skeleton": skeleton}]
    json_file = root / "person_keypoints_mini.json"
    json_file.write_text(json.dumps({"images": [{"id": 1, "file_name": "1.png", "width": SIZE, "height": SIZE}],
                                     "annotations": annotations, "categories": categories}))
    return str(json_file), str(root / "images"), rgb


@pytest.mark.slow
def test_shipped_coco_config_evaluates_torchvision_keypoint_weights_as_torchvision(coco_person, tmp_path):
    """tools/test_net.py with cfgs/coco/keypoint_rcnn_R-50-FPN_1x.yaml and a torchvision-format state_dict: bbox.json
    is torchvision's detections, and the model's outputs (saved by a TEST.HOOKS callback) carry torchvision's
    keypoints and keypoint scores, detection for detection."""
    json_file, image_dir, rgb = coco_person
    reference = torchvision_keypoint_model()
    weights = tmp_path / "keypoint_rcnn_coco.pth"
    torch.save(reference.state_dict(), weights)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # as many as test_net gets below: the same kernels' order
    with torch.no_grad():
        theirs = reference([torch.from_numpy(rgb).permute(2, 0, 1).float() / 255])[0]
    torch.set_num_threads(threads)
    assert len(theirs["boxes"]) > 0  # the case the weights make
    boxes = theirs["boxes"].double().numpy()
    boxes[:, 2:] -= boxes[:, :2]
    expected = {1: {"boxes": boxes, "scores": theirs["scores"].double().numpy(), "labels": theirs["labels"].numpy()}}
    ckpt = tmp_path / "run"
    run = run_tool_captured("test_net.py", "--cfg", COCO_CFG, "CKPT", ckpt, "DATA.CUSTOM",
                            custom_datasets(("coco_person", json_file, image_dir)), "TEST.DATASETS", "('coco_person',)",
                            "TEST.WEIGHTS", weights, "TEST.AMP.ENABLED", "False", *SMALL_FLOPS,
                            "TEST.HOOKS", "[{'type': 'support.output_plugins.SaveOutputs'}]", threads=2)
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    worst = assert_results_match_torchvision(json.loads((ckpt / "test" / "bbox.json").read_text()), expected)
    ours = torch.load(ckpt / "outputs.pth", weights_only=True)[1]
    # The model's outputs paired with torchvision's one to one, as bbox.json was (an order that differs on a
    # near-tie does not matter): the same label, box within 1e-3 px and score within 1e-5, and then each pair's
    # keypoints within 1e-3 px and keypoint scores within 1e-5.
    assert ours["keypoints"].shape[1:] == theirs["keypoints"].shape[1:] == (17, 3)
    heads = reference.roi_heads
    outputs = assert_same_detections([ours], [theirs], Tolerance(box=1e-3, score=1e-5), heads.score_thresh,
                                     [len(theirs["boxes"]) == heads.detections_per_img])
    assert outputs["unmatched"] == 0
    print(f"largest differences from torchvision's: {worst}; of the outputs: {outputs}")


@pytest.fixture(scope="module")
def tiny_keypoint_rcnn():
    """The tiny Keypoint R-CNN (:data:`TINY_KEYPOINT_RCNN`), random weights, float32 and channels-last as shipped."""
    torch.manual_seed(0)
    return build_model(load_cfg(os.path.join(CFGS, "shapes", "faster_rcnn_R-10-FPN.yaml"), TINY_KEYPOINT_RCNN))


def tiny_batch(keypoints: torch.Tensor | None = None):
    """Two 96x128 images with one box each; ``keypoints`` [1, K, 3] for both when given."""
    images = torch.randint(0, 256, (2, 3, 96, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    targets = [{"image_id": i + 1, "image_size": (96, 128), "orig_size": (96, 128),
                "boxes": torch.tensor([[10.0, 20.0, 70.0, 90.0]]), "labels": torch.tensor([1])} for i in range(2)]
    if keypoints is not None:
        for target in targets:
            target["keypoints"] = keypoints
    return images, targets


def test_training_learns_keypoints_from_the_keypoint_loss(tiny_keypoint_rcnn):
    keypoints = torch.tensor([[[20.0, 30.0, 2.0], [60.0, 80.0, 1.0], [40.0, 50.0, 0.0], [69.0, 89.0, 2.0]]])
    tiny_keypoint_rcnn.train()
    tiny_keypoint_rcnn.zero_grad()
    losses = tiny_keypoint_rcnn(*tiny_batch(keypoints))
    assert set(losses) == {"loss_objectness", "loss_rpn_box_reg", "loss_classifier", "loss_box_reg", "loss_keypoint"}
    assert losses["loss_keypoint"] > 0 and torch.isfinite(losses["loss_keypoint"])
    losses["loss_keypoint"].backward()
    grads = {name: p.grad for name, p in tiny_keypoint_rcnn.named_parameters()
             if name.startswith("roi_heads.keypoint_")}
    assert grads and all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if not n.endswith("lowres.bias"))
    # every keypoint invisible: nothing to learn, a zero loss (torchvision's rule)
    hidden = keypoints.clone()
    hidden[..., 2] = 0
    assert tiny_keypoint_rcnn(*tiny_batch(hidden))["loss_keypoint"] == 0


def test_eval_keypoints_are_scaled_to_the_original_image(tiny_keypoint_rcnn):
    tiny_keypoint_rcnn.eval()
    images, targets = tiny_batch()
    with torch.no_grad():
        same = tiny_keypoint_rcnn(images, targets)[0]
        for target in targets:
            target["orig_size"] = (192, 384)  # 2x the height, 3x the width
        scaled = tiny_keypoint_rcnn(images, targets)[0]
    n = len(same["boxes"])
    assert n > 0 and same["keypoints"].shape == (n, 4, 3) and same["keypoints_scores"].shape == (n, 4)
    assert same["keypoints"].dtype == same["keypoints_scores"].dtype == torch.float32
    assert torch.equal(scaled["keypoints"], same["keypoints"] * torch.tensor([3.0, 2.0, 1.0]))
    assert torch.equal(scaled["keypoints_scores"], same["keypoints_scores"])
    assert (same["keypoints"][..., 2] == 1).all()


@pytest.mark.parametrize("keypoints, message", [
    (None, r"KeypointRCNN trains on target\['keypoints'\], which image 1's target lacks"),
    (torch.zeros(1, 17, 3), r"image 1: target\['keypoints'\] has shape \(1, 17, 3\), expected \[1, 4, 3\].*"
                            "NUM_KEYPOINTS"),
])
def test_a_batch_without_usable_keypoints_is_one_error_naming_the_image(tiny_keypoint_rcnn, keypoints, message):
    tiny_keypoint_rcnn.train()
    with pytest.raises(DataError, match=message):
        tiny_keypoint_rcnn(*tiny_batch(keypoints))


def test_a_keypoint_model_without_keypoints_is_a_config_error_naming_the_key():
    cfg = load_cfg(os.path.join(CFGS, "shapes", "faster_rcnn_R-10-FPN.yaml"),
                   [*TINY_KEYPOINT_RCNN, "MODEL.ROI_KEYPOINT_HEAD.NUM_KEYPOINTS", "0"])
    with pytest.raises(ConfigError, match=r"MODEL.ROI_KEYPOINT_HEAD.NUM_KEYPOINTS must be >= 1, got 0"):
        build_model(cfg)


def test_tiled_prediction_keeps_each_detections_keypoints_from_its_tile():
    """A 256x448 picture in two 256 px tiles overlapping by 64 px, a random tiny model scoring everything: each
    merged detection that is one tile's detection carries that tile's keypoints for it (predicted here on the
    tile alone), moved into the picture."""
    cfg = load_cfg(os.path.join(CFGS, "shapes", "faster_rcnn_R-10-FPN.yaml"),
                   [*TINY_KEYPOINT_RCNN, "MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.0", "TEST.AMP.ENABLED", "False"])
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    picture = np.ascontiguousarray(shapes_image(3, 256, 448)[0][:, :, ::-1])  # BGR, as opencv reads
    space = LabelSpace((1, 2, 3), ("circle", "rectangle", "triangle"))
    tiled = Predictor(cfg, model=model, label_space=space, tile=256, tile_overlap=0.25)(picture)
    alone = Predictor(cfg, model=model, label_space=space)
    per_tile = [(alone(np.ascontiguousarray(picture[:, x0:x0 + 256])), x0) for x0 in (0, 192)]
    assert tiled.keypoints is not None and tiled.keypoints.shape == (len(tiled), 4, 3)
    matched = 0
    for box, score, points in zip(tiled.boxes, tiled.scores, tiled.keypoints):
        for found, x0 in per_tile:
            same = np.flatnonzero((np.abs(found.boxes + [x0, 0, x0, 0] - box).max(axis=1) < 1e-3)
                                  & (np.abs(found.scores - score) < 1e-4))
            if len(same):
                np.testing.assert_allclose(points, found.keypoints[same[0]] + [x0, 0, 0], atol=1e-3)
                matched += 1
                break
    assert matched >= len(tiled) / 2 > 0, (matched, len(tiled))
