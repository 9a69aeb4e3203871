"""Cascade R-CNN and Cascade Mask R-CNN (pet/modeling/cascade_roi_heads.py): torchvision has no cascade, so the model
is checked against facts worked out by hand: one RoI through the three stages (each stage's box-coder weights,
class-agnostic deltas, the mean of the stages' scores, the last stage's box), the IoU each stage labels at, the
gradient stopped between stages and scaled on the shared features, the losses of every stage; then export (through
tools/export.py's parity gate) and tools/predict.py as for the other detectors.

Models are the shapes configs made tiny (ResNet-10 stages 1-3, a 32-channel FPN, 64-wide heads) with random weights.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from pet.config import load_cfg
from pet.deploy.onnxruntime_model import OnnxRuntimeModel
from pet.deploy.parity import check_parity, parity_batches
from pet.modeling import CascadeMaskRCNN, CascadeRCNN, build_export_graph, build_model
from pet.modeling.cascade_roi_heads import scale_gradient
from pet.utils.errors import ConfigError
from support.helpers import CFGS, custom_datasets, detector_batch, run_tool_captured, run_tool_here
from support.tiny_exports import assert_openvino_gives_the_pytorch_detections
from support.tiny_models import TINY_TWO_STAGE, randomize_norms, rescale_layer_output

CASCADE_CFG = os.path.join(CFGS, "shapes", "cascade_rcnn_R-10-FPN.yaml")
CASCADE_MASK_CFG = os.path.join(CFGS, "shapes", "cascade_mask_rcnn_R-10-FPN.yaml")
TINY_CASCADE = [*TINY_TWO_STAGE, "MODEL.ROI_MASK_HEAD.CONV_DIM", "32", "MODEL.ROI_MASK_HEAD.NUM_CONV", "1",
                "MODEL.FLOPS_INPUT_SIZE", "(64, 64)"]
RPN_LOSSES = {"loss_objectness", "loss_rpn_box_reg"}
STAGE_LOSSES = {f"loss_{name}_stage{k}" for name in ("classifier", "box_reg") for k in range(3)}


def tiny_cascade(cfg_file: str = CASCADE_CFG, *opts: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(load_cfg(cfg_file, [*TINY_CASCADE, *opts]))


def features_of(model: torch.nn.Module, size: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The backbone's feature maps of a random image of ``size`` (h, w)."""
    image = torch.randint(0, 255, (1, 3, *size), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    with torch.no_grad():
        return model.backbone(model.normalizer(image, [size]))


# ------------------------------------------------------------------------------------------------ building
def test_both_configs_build_three_stages_at_the_papers_ious_and_weights_under_per_stage_names():
    for cfg_file, cls in ((CASCADE_CFG, CascadeRCNN), (CASCADE_MASK_CFG, CascadeMaskRCNN)):
        model = tiny_cascade(cfg_file)
        heads = model.roi_heads
        assert type(model) is cls and heads.num_stages == 3 and heads.stage_ious == [0.5, 0.6, 0.7]
        assert [c.weights for c in heads.stage_coders] == [(10, 10, 5, 5), (20, 20, 10, 10), (30, 30, 15, 15)]
        # The first stage samples the RPN's proposals at IOUS[0] with the first stage's weights.
        assert heads.proposal_matcher.high_threshold == heads.proposal_matcher.low_threshold == 0.5
        assert heads.box_coder.weights == (10, 10, 5, 5)
        names = {n for n, _ in model.named_parameters()}
        for k in range(3):  # class-agnostic regression: 4 deltas per RoI
            assert {f"roi_heads.box_head.{k}.fc6.weight", f"roi_heads.box_predictor.{k}.cls_score.weight"} <= names
            assert heads.box_predictor[k].bbox_pred.out_features == 4
        assert heads.has_mask() == (cls is CascadeMaskRCNN)


def test_the_coco_configs_are_detectron2s_cascade_on_torchvisions_r50_fpn():
    for name, mask in (("cascade_rcnn_R-50-FPN_1x.yaml", False), ("cascade_mask_rcnn_R-50-FPN_1x.yaml", True)):
        cfg = load_cfg(os.path.join(CFGS, "coco", name))
        assert cfg.MODEL.META_ARCHITECTURE == ("CascadeMaskRCNN" if mask else "CascadeRCNN")
        assert list(cfg.MODEL.ROI_BOX_CASCADE_HEAD.IOUS) == [0.5, 0.6, 0.7] and cfg.MODEL.BACKBONE.NAME == "resnet50"
        assert cfg.MODEL.MASK_ON == mask and cfg.TRAIN.DATASETS == ("coco_2017_train",)


def test_stage_lists_of_different_lengths_and_a_mask_model_without_masks_are_one_error_each():
    with pytest.raises(ConfigError, match=r"MODEL.ROI_BOX_CASCADE_HEAD .*IOUS \[0.5, 0.6\]"):
        tiny_cascade(CASCADE_CFG, "MODEL.ROI_BOX_CASCADE_HEAD.IOUS", "(0.5, 0.6)")
    with pytest.raises(ConfigError, match="CascadeMaskRCNN needs MODEL.MASK_ON True"):
        tiny_cascade(CASCADE_MASK_CFG, "MODEL.MASK_ON", "False")


# ------------------------------------------------------------------------------------------------ the cascade
@pytest.mark.numeric
def test_one_roi_through_the_three_stages_gives_the_hand_computed_box_and_mean_score():
    """Every predictor's weights zero, its biases chosen: stage outputs no longer depend on the features.

    RoI (10, 10, 40, 30): width 30, height 20, centre (25, 20).
    stage 1, weights (10, 10, 5, 5), deltas (10, 0, 0, 0): dx = 1 moves the centre by one width -> (40, 10, 70, 30);
    stage 2, weights (20, 20, 10, 10), deltas (0, 20, 0, 0): dy = 1, one height down -> (40, 30, 70, 50);
    stage 3, weights (30, 30, 15, 15), deltas (0, 0, 15 ln 2, 0): dw = ln 2 doubles the width -> (25, 30, 85, 50).
    Class probabilities (background, object): softmax of (0, ln 3) = 0.75, (0, 0) = 0.5, (0, ln 4) = 0.8 for the
    object; their mean 2.05 / 3 = 0.68333. (Last stage only: 0.8; a mean of logits, MMDetection's: 0.6964.)
    """
    model = tiny_cascade(CASCADE_CFG, "MODEL.NUM_CLASSES", "1").eval()
    heads = model.roi_heads
    deltas = [(10.0, 0.0, 0.0, 0.0), (0.0, 20.0, 0.0, 0.0), (0.0, 0.0, 15 * math.log(2), 0.0)]
    logits = [(0.0, math.log(3)), (0.0, 0.0), (0.0, math.log(4))]
    with torch.no_grad():
        for predictor, d, c in zip(heads.box_predictor, deltas, logits):
            predictor.bbox_pred.weight.zero_(), predictor.cls_score.weight.zero_()
            predictor.bbox_pred.bias.copy_(torch.tensor(d)), predictor.cls_score.bias.copy_(torch.tensor(c))
        features = features_of(model, (128, 128))
        roi = torch.tensor([[10.0, 10.0, 40.0, 30.0]])
        (detection,), _ = heads(features, [roi], [(128, 128)])
        graph = build_export_graph(model, torch.zeros(1, 3, 128, 128, dtype=torch.uint8), [(128, 128)])
        graph_boxes, graph_scores = graph.box_predictions(features, torch.cat([torch.zeros(1, 1), roi], 1),
                                                          torch.tensor([[128, 128]]))
    expected_box = torch.tensor([[25.0, 30.0, 85.0, 50.0]])
    torch.testing.assert_close(detection["boxes"], expected_box, rtol=0, atol=1e-4)
    torch.testing.assert_close(detection["scores"], torch.tensor([2.05 / 3]), rtol=0, atol=1e-6)
    assert detection["labels"].tolist() == [1]
    # The exported graph's box branch computes the same: the box for every class, the mean probabilities.
    torch.testing.assert_close(graph_boxes, expected_box[:, None].expand(1, 2, 4), rtol=0, atol=1e-4)
    torch.testing.assert_close(graph_scores, torch.tensor([[0.95 / 3, 2.05 / 3]]), rtol=0, atol=1e-6)


@pytest.mark.numeric
def test_each_stage_labels_at_its_own_iou_and_encodes_with_its_own_weights():
    """Boxes of IoU 0.55 and 0.65 with a ground-truth box: foreground at 0.5, only the 0.65 one at 0.6, neither at
    0.7. The regression target of (0, 0, 100, 65) for (0, 0, 100, 100): dy = (50 - 32.5) / 65 and dh = ln(100 / 65),
    times the stage's weights."""
    heads = tiny_cascade().roi_heads
    boxes = [torch.tensor([[0.0, 0.0, 100.0, 55.0], [0.0, 0.0, 100.0, 65.0]])]
    target = [{"boxes": torch.tensor([[0.0, 0.0, 100.0, 100.0]]), "labels": torch.tensor([2])}]
    expected_labels = {0: [2, 2], 1: [0, 2], 2: [0, 0]}
    for stage, (wy, wh) in enumerate(((10, 5), (20, 10), (30, 15))):
        (labels,), (targets,) = heads.label_stage(stage, boxes, target)
        assert labels.tolist() == expected_labels[stage], stage
        expected = torch.tensor([0.0, wy * 17.5 / 65, 0.0, wh * math.log(100 / 65)])
        torch.testing.assert_close(targets[1], expected, rtol=1e-5, atol=1e-6)
    (labels,), _ = heads.label_stage(2, boxes, [{"boxes": torch.zeros(0, 4), "labels": torch.zeros(0)}])
    assert labels.tolist() == [0, 0]  # a background image: every box is background


def training_step(heads: torch.nn.Module, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The RoI heads' training losses for proposals around two ground-truth boxes of a 128 x 128 image."""
    torch.manual_seed(0)
    gt = torch.tensor([[10.0, 12.0, 50.0, 60.0], [60.0, 40.0, 110.0, 100.0]])
    proposals = (gt.repeat(20, 1) + 8 * torch.randn(40, 4)).clamp(0, 128)
    proposals[:, 2:] = torch.maximum(proposals[:, 2:], proposals[:, :2] + 4)
    heads.train()
    _, losses = heads(features, [proposals], [(128, 128)], [{"boxes": gt, "labels": torch.tensor([1, 3])}])
    return losses


def test_a_later_stages_loss_gives_no_gradient_to_earlier_stages_through_its_proposals():
    """Stage k's input boxes are stage k-1's outputs detached: its losses (whose targets are encoded against those
    boxes) train its own head, never an earlier head."""
    heads = tiny_cascade().roi_heads
    features = features_of(tiny_cascade(), (128, 128))
    for stage in (1, 2):
        heads.zero_grad(set_to_none=True)
        losses = training_step(heads, features)
        (losses[f"loss_classifier_stage{stage}"] + losses[f"loss_box_reg_stage{stage}"]).backward()
        for k in range(3):
            grads = [p.grad for p in [*heads.box_head[k].parameters(), *heads.box_predictor[k].parameters()]]
            if k < stage:
                assert all(g is None or not g.any() for g in grads), (stage, k)
            else:
                assert all(g is not None for g in grads) == (k == stage), (stage, k)


@pytest.mark.numeric
def test_each_stage_scales_its_gradient_into_the_shared_features_by_one_over_the_stages():
    heads = tiny_cascade().roi_heads
    base = features_of(tiny_cascade(), (128, 128))
    boxes = [torch.tensor([[10.0, 12.0, 50.0, 60.0], [60.0, 40.0, 110.0, 100.0]])]
    grads = {}
    for training in (True, False):
        heads.train(training)
        features = {name: f.clone().requires_grad_() for name, f in base.items()}
        logits, deltas = heads.run_stage(1, features, boxes, [(128, 128)])
        (logits.sum() + deltas.sum()).backward()
        # A level no box maps to gets no gradient.
        grads[training] = torch.cat([(torch.zeros_like(f) if f.grad is None else f.grad).flatten()
                                     for f in features.values()])
    assert grads[False].abs().sum() > 0
    torch.testing.assert_close(grads[True] * 3, grads[False], rtol=1e-4, atol=1e-6)
    x = torch.ones(3, requires_grad=True)
    scale_gradient(x, 0.25).sum().backward()
    assert x.grad.tolist() == [0.25] * 3


@pytest.mark.parametrize("cfg_file", [CASCADE_CFG, CASCADE_MASK_CFG])
def test_training_returns_every_stages_losses_and_trains_every_head(cfg_file):
    model = tiny_cascade(cfg_file).train()
    mask = cfg_file == CASCADE_MASK_CFG
    losses = model(*detector_batch(masks=mask))
    assert set(losses) == RPN_LOSSES | STAGE_LOSSES | ({"loss_mask"} if mask else set())
    assert all(v.dim() == 0 and torch.isfinite(v) for v in losses.values())
    sum(losses.values()).backward()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert all(p.grad is not None for _, p in trainable), [n for n, p in trainable if p.grad is None]
    model.eval()
    with torch.no_grad():
        detections = model(*detector_batch())
    assert [set(d) for d in detections] == [{"boxes", "scores", "labels", *(["masks"] if mask else [])}] * 2
    assert all(len(d["boxes"]) > 0 and d["labels"].min() >= 1 for d in detections)
    if mask:  # masks pasted into the original images (192 x 256 and 80 x 100)
        assert [tuple(d["masks"].shape[1:]) for d in detections] == [(192, 256), (80, 100)]


# ------------------------------------------------------------------------------------------------ export, predict
def random_weights(cfg_file: str, root, shapes_root: str) -> tuple[str, list[str]]:
    """A tiny model of ``cfg_file`` with random weights (varied normalisation, rescaled classifiers) saved under
    ``root``, and its opts: the session's 6 validation images as the test set, the score threshold just above the
    blank image's best."""
    opts = [*TINY_CASCADE, "DATA.CUSTOM", custom_datasets(("cascade_val", f"{shapes_root}/annotations/val.json",
                                                    f"{shapes_root}/val")),
            "TEST.DATASETS", "('cascade_val',)", "CKPT", str(root / "ckpt"), "DEVICE", "cpu",
            "TEST.DIAGNOSTICS.ENABLED", "False", "TEST.NUM_WARMUP", "1", "TEST.AMP.ENABLED", "False"]
    cfg = load_cfg(cfg_file, [*opts, "MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.0"])
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    randomize_norms(model)
    batches = parity_batches(cfg)
    for k in range(3):
        rescale_layer_output(model, f"roi_heads.box_predictor.{k}.cls_score", batches[0])
    with torch.no_grad():
        blank = model(*batches[-1])[0]["scores"].max().item()
    weights = str(root / "model.pth")
    torch.save(model.state_dict(), weights)
    return weights, [*opts, "MODEL.ROI_HEADS.SCORE_THRESH_TEST", f"{blank + 1e-3:.6f}"]


@pytest.fixture(scope="module")
def cascade_export(tmp_path_factory, shapes_root):
    """``(status, stderr, model, onnx file, cfg)``: a tiny Cascade R-CNN with random weights through tools/export.py.
    Cascade R-CNN only: Cascade Mask R-CNN's mask branch is Mask R-CNN's, whose export tests/deploy/test_export.py
    checks (exporting it here too would double these tests' minutes)."""
    root = tmp_path_factory.mktemp("cascade_export")
    weights, opts = random_weights(CASCADE_CFG, root, shapes_root)
    onnx_file = str(root / "cascade.onnx")
    run = run_tool_captured("export.py", "--cfg", CASCADE_CFG, "--weights", weights, "--output", onnx_file, *opts)
    cfg = load_cfg(CASCADE_CFG, opts)
    model = build_model(cfg).eval()
    model.load_state_dict(torch.load(weights, weights_only=True))
    return run, model, onnx_file, cfg


@pytest.mark.slow
def test_tools_export_passes_its_parity_gate_and_onnxruntime_gives_the_same_detections(cascade_export):
    run, model, onnx_file, cfg = cascade_export
    assert run.returncode == 0, run.stderr[-3000:]
    report = check_parity(model, OnnxRuntimeModel(onnx_file), parity_batches(cfg))
    assert report.detections > 0 and report.box_fraction <= 1e-3 and report.score <= 1e-4


@pytest.mark.slow
def test_openvino_ir_gives_the_pytorch_detections_within_the_gates_tolerances(cascade_export, shapes_root, tmp_path):
    run, model, onnx_file, cfg = cascade_export
    assert run.returncode == 0, run.stderr[-3000:]
    assert_openvino_gives_the_pytorch_detections(model, onnx_file, cfg, shapes_root, str(tmp_path))


@pytest.mark.slow
def test_predict_writes_test_nets_detections_with_masks(tmp_path, monkeypatch, capsys, shapes_root):
    root = tmp_path
    weights, opts = random_weights(CASCADE_MASK_CFG, root, shapes_root)
    status, stderr = run_tool_here(monkeypatch, capsys, "test_net.py", "--cfg", CASCADE_MASK_CFG,
                                   *opts, "TEST.WEIGHTS", weights)
    assert status == 0, stderr
    status, stderr = run_tool_here(monkeypatch, capsys, "predict.py", "--cfg", CASCADE_MASK_CFG, "--input",
                                   f"{shapes_root}/val", "--output", str(root / "predict"), "--save", "coco",
                                   "--ann", f"{shapes_root}/annotations/val.json", *opts, "TEST.WEIGHTS", weights)
    assert status == 0, stderr
    with open(root / "ckpt" / "test" / "bbox.json") as f:
        expected = json.load(f)
    with open(root / "predict" / "predictions.json") as f:
        predicted = json.load(f)
    assert len(expected) > 6 and len({d["image_id"] for d in expected}) == 6
    assert all("segmentation" in d for d in predicted)  # the masks, as RLE
    boxes = [{k: v for k, v in d.items() if k != "segmentation"} for d in predicted]
    assert sorted(boxes, key=json.dumps) == sorted(expected, key=json.dumps)
