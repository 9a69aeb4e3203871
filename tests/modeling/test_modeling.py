"""Faster R-CNN built from config: losses, eval outputs, weight loading, backbones, swappable parts, registry
errors."""
from __future__ import annotations

import logging
import os
from collections import OrderedDict

import pytest
import torch
import torchvision
from torchvision.models._utils import IntermediateLayerGetter
from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
from torchvision.ops import FrozenBatchNorm2d

from pet.checkpoint import load_weights
from pet.config import load_cfg
from pet.modeling import build_backbone, build_model
from pet.modeling.backbone import build_resnet, freeze_stages, resnet10
from pet.utils.errors import ConfigError
from support.against_reference import INFERENCE_COMPARISONS, check_inference_parity, check_training_parity
from support.helpers import CFGS, DEMO_CFG, assert_part_trains, detector_batch

LOSSES = {"loss_objectness", "loss_rpn_box_reg", "loss_classifier", "loss_box_reg"}


@pytest.fixture(scope="module")
def demo_model():
    torch.manual_seed(0)
    return build_model(load_cfg(DEMO_CFG))


def test_training_forward_returns_finite_losses_and_backpropagates(demo_model):
    demo_model.train()
    losses = demo_model(*detector_batch())
    assert set(losses) == LOSSES
    assert all(v.dim() == 0 and torch.isfinite(v) for v in losses.values())
    demo_model.zero_grad()
    sum(losses.values()).backward()
    trainable = [(n, p) for n, p in demo_model.named_parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None for _, p in trainable)
    assert demo_model.backbone.body.conv1.weight.grad.abs().sum() > 0  # FREEZE_AT 0: the stem learns too


def test_bfloat16_autocast_gives_float32_losses_and_boxes(demo_model):
    demo_model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = demo_model(*detector_batch())
    assert set(losses) == LOSSES and all(torch.isfinite(v) for v in losses.values())
    assert all(v.dtype == torch.float32 for v in losses.values())


def test_channels_last_reaches_every_backbone_feature(demo_model):
    demo_model.eval()
    images, targets = detector_batch()
    with torch.no_grad():
        features = demo_model.backbone(demo_model.normalizer(images, [t["image_size"] for t in targets]))
    assert all(f.is_contiguous(memory_format=torch.channels_last) for f in features.values() if f.shape[-1] > 1)


def test_normalizer_uses_pixel_mean_std_and_zeroes_the_padding(demo_model):
    images, targets = detector_batch()
    x = demo_model.normalizer(images, [t["image_size"] for t in targets])
    mean, std = torch.tensor([123.675, 116.28, 103.53]), torch.tensor([58.395, 57.12, 57.375])
    torch.testing.assert_close(x[0, :, :96, :128], (images[0, :, :96, :128].float() - mean[:, None, None])
                               / std[:, None, None])
    assert x[0, :, 96:].abs().sum() == 0 and x[1, :, :, 100:].abs().sum() == 0 and x[1, :, 80:].abs().sum() == 0


def test_eval_boxes_are_in_original_image_coordinates(demo_model):
    cfg = load_cfg(DEMO_CFG, ["MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.0"])
    model = build_model(cfg)
    model.load_state_dict(demo_model.state_dict())
    model.eval()
    images, targets = detector_batch()
    with torch.no_grad():
        outputs = model(images, targets)
    assert len(outputs) == 2
    for out, target in zip(outputs, targets):
        assert set(out) == {"boxes", "scores", "labels"} and len(out["boxes"]) > 0
        orig_h, orig_w = target["orig_size"]
        boxes = out["boxes"]
        assert boxes.min() >= 0 and boxes[:, 2].max() <= orig_w and boxes[:, 3].max() <= orig_h
        assert out["labels"].dtype == torch.int64 and 1 <= out["labels"].min() and out["labels"].max() <= 3
    # image 0 was shrunk 2x from 192x256: its boxes must reach beyond the 96x128 network input
    assert outputs[0]["boxes"][:, 2].max() > 128 or outputs[0]["boxes"][:, 3].max() > 96


def _coco_cfg(*opts: str):
    return load_cfg(os.path.join(CFGS, "coco", "faster_rcnn_R-50-FPN_1x.yaml"), list(opts))


def test_torchvision_detection_state_dict_loads_without_leftovers(tmp_path, caplog):
    """Untrained, torchvision's builder uses trainable BatchNorm: its num_batches_tracked buffers, which Pet's
    FrozenBN lacks, are dropped on load without a warning."""
    torch.manual_seed(0)
    reference = torchvision.models.detection.fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None,
                                                                      num_classes=91)
    assert any(k.endswith("num_batches_tracked") for k in reference.state_dict())
    path = tmp_path / "frcnn.pth"
    torch.save(reference.state_dict(), path)
    model = build_model(_coco_cfg())
    with caplog.at_level(logging.WARNING, logger="pet.checkpoint.loading"):
        assert load_weights(model, str(path)) == {"missing": [], "unexpected": [], "mismatched": []}
    assert not caplog.records
    ours = model.state_dict()
    # torchvision's untrained model has BatchNorm (num_batches_tracked); Pet's COCO config has FrozenBN
    theirs = {k: v for k, v in reference.state_dict().items() if not k.endswith("num_batches_tracked")}
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_coco_config_has_torchvisions_parameter_count():
    model = build_model(_coco_cfg())
    assert sum(p.numel() for p in model.parameters()) == 41_755_286  # FasterRCNN_ResNet50_FPN_Weights' num_params


def test_r50_config_freezes_what_torchvision_freezes():
    model = build_model(_coco_cfg())
    reference = resnet_fpn_backbone(backbone_name="resnet50", weights=None, trainable_layers=3)
    expected = {f"backbone.{n}" for n, p in reference.named_parameters() if p.requires_grad}
    assert {n for n, p in model.backbone.named_parameters(prefix="backbone") if p.requires_grad} == expected
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert isinstance(model.backbone.body.layer4[0].bn1, FrozenBatchNorm2d)


@pytest.mark.slow
@pytest.mark.parametrize("comparison", INFERENCE_COMPARISONS)
def test_faster_rcnn_inference_parity_with_torchvision(comparison):
    """torchvision's fasterrcnn_resnet50_fpn weights give torchvision's detections: the same as its model run
    channels-last, and torchvision's default run in float64 up to its memory format's rounding
    (tests/support/against_reference.py)."""
    check_inference_parity("faster_rcnn", comparison)


# Not in the numeric group: float64, whose rounding stays 1e4x below the tolerance in any summation order.
@pytest.mark.slow
def test_faster_rcnn_training_parity_with_torchvision():
    """The same losses and gradients as torchvision's model for the same weights, batch and sampling
    (tests/support/against_reference.py)."""
    check_training_parity("faster_rcnn")


# Output channels of ResNet stages layer1..layer4: what the FPN's lateral convolutions take.
_STAGE_CHANNELS = {"resnet34": [64, 128, 256, 512], "resnet101": [256, 512, 1024, 2048]}


@pytest.mark.parametrize("name", _STAGE_CHANNELS)
def test_resnet34_and_resnet101_backbones_are_torchvisions_resnets_under_the_fpn(name):
    """Built only (a forward adds nothing here): the body holds the ImageNet classifier's tensors but ``fc``, under
    its names and shapes, so its weights load; the FPN takes the stage widths. Trainable BN everywhere, so that
    BN's affine weights are parameters as in the classifier (FrozenBN keeps them as buffers)."""
    backbone = build_backbone(load_cfg(None, ["MODEL.BACKBONE.NAME", name, "MODEL.BACKBONE.NORM", "BN",
                                              "MODEL.BACKBONE.FREEZE_AT", "0"]))
    classifier = getattr(torchvision.models, name)(weights=None)
    expected = {k: v.shape for k, v in classifier.state_dict().items() if not k.startswith("fc.")}
    assert {k: v.shape for k, v in backbone.body.state_dict().items()} == expected
    assert sum(p.numel() for p in backbone.body.parameters()) == sum(
        p.numel() for n, p in classifier.named_parameters() if not n.startswith("fc."))
    assert [block[0].in_channels for block in backbone.fpn.inner_blocks] == _STAGE_CHANNELS[name]


# The demo stops at ResNet-18's layer3; with all four stages every ImageNet tensor but fc has a place.
# The demo's backbone as ImageNet ResNet-18 weights fit it: resnet18, all four stages.
ALL_FOUR_STAGES = ["MODEL.BACKBONE.NAME", "resnet18", "MODEL.FPN.RETURNED_LAYERS", "[1, 2, 3, 4]",
                   "MODEL.RPN.ANCHOR_SIZES", "[[16], [32], [64], [128], [256]]"]


def test_imagenet_resnet_initialises_the_backbone(tmp_path, caplog):
    """Every tensor of the classifier but ``fc`` lands in ``backbone.body``: its BatchNorm statistics and affine
    parameters are drawn at random first, so that none equals what a freshly built model holds already."""
    classifier = torchvision.models.resnet18(weights=None)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for bn in (m for m in classifier.modules() if isinstance(m, torch.nn.BatchNorm2d)):
            for tensor in (bn.weight, bn.bias, bn.running_mean, bn.running_var):
                tensor.copy_(torch.rand(tensor.shape, generator=gen) + 0.5)
            bn.num_batches_tracked.fill_(1000)
    path = tmp_path / "resnet18.pth"
    torch.save(classifier.state_dict(), path)
    model = build_model(load_cfg(DEMO_CFG, ALL_FOUR_STAGES))
    with caplog.at_level(logging.WARNING, logger="pet.checkpoint.loading"):
        report = load_weights(model, str(path))
    expected = {k: v for k, v in classifier.state_dict().items() if not k.startswith("fc.")}
    loaded = model.backbone.body.state_dict()
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], v) for k, v in expected.items())
    assert not report["unexpected"] and not report["mismatched"]
    assert report["missing"] and all(not k.startswith("backbone.body.") for k in report["missing"])
    # one table row per module, not one line per tensor
    assert "backbone.fpn.*" in caplog.text and "inner_blocks" not in caplog.text


def test_mismatched_shapes_are_reported_and_skipped(tmp_path):
    source = build_model(load_cfg(DEMO_CFG, ["MODEL.NUM_CLASSES", "5"]))
    path = tmp_path / "pet.pth"
    torch.save({"model": source.state_dict(), "iteration": 10}, path)
    model = build_model(load_cfg(DEMO_CFG))
    before = model.roi_heads.box_predictor.cls_score.weight.clone()
    report = load_weights(model, str(path))
    assert sorted(report["mismatched"]) == [f"roi_heads.box_predictor.{layer}.{kind}"
                                            for layer in ("bbox_pred", "cls_score") for kind in ("bias", "weight")]
    assert report["missing"] == [] and report["unexpected"] == []
    torch.testing.assert_close(model.roi_heads.box_predictor.cls_score.weight, before)
    torch.testing.assert_close(model.rpn.head.cls_logits.weight, source.rpn.head.cls_logits.weight)


def test_missing_weights_file_is_a_config_error(tmp_path):
    model = build_model(load_cfg(DEMO_CFG))
    with pytest.raises(ConfigError, match="nowhere.pth"):
        load_weights(model, str(tmp_path / "nowhere.pth"))


def test_unknown_meta_architecture_is_a_clear_error():
    cfg = load_cfg(None, ["MODEL.META_ARCHITECTURE", "FasterRCN"])
    with pytest.raises(ConfigError, match="Unknown meta-architecture 'FasterRCN'.*Did you mean 'FasterRCNN'"):
        build_model(cfg)


def test_anchor_levels_must_match_the_fpn():
    cfg = load_cfg(DEMO_CFG, ["MODEL.RPN.ANCHOR_SIZES", "[[16], [32]]"])
    with pytest.raises(ConfigError, match="ANCHOR_SIZES has 2 entries.*4 feature levels"):
        build_model(cfg)


def test_frozen_stages_get_no_gradient_and_frozen_batchnorm():
    model = build_model(load_cfg(DEMO_CFG, ["MODEL.BACKBONE.FREEZE_AT", "2"]))
    body = model.backbone.body
    assert not any(p.requires_grad for p in body.conv1.parameters())
    assert not any(p.requires_grad for p in body.layer1.parameters())
    assert all(p.requires_grad for p in body.layer2.parameters())
    assert isinstance(body.bn1, torchvision.ops.FrozenBatchNorm2d)
    assert isinstance(body.layer1[0].bn1, torchvision.ops.FrozenBatchNorm2d)
    assert isinstance(body.layer2[0].bn1, torch.nn.BatchNorm2d)


def test_custom_box_head_from_a_dotted_path():
    cfg = load_cfg(DEMO_CFG, ["MODEL.ROI_BOX_HEAD.NAME", f"{__name__}.TinyBoxHead"])
    model = build_model(cfg)
    assert isinstance(model.roi_heads.box_head, TinyBoxHead)
    model.train()
    assert set(model(*detector_batch())) == LOSSES


class TinyBoxHead(torch.nn.Sequential):
    """A user's box head: average-pool then one linear layer to MLP_DIM."""

    def __init__(self, cfg, in_channels: int) -> None:
        super().__init__(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                         torch.nn.Linear(in_channels, cfg.MODEL.ROI_BOX_HEAD.MLP_DIM), torch.nn.ReLU())


def test_custom_rpn_head_from_a_dotted_path_trains():
    model = build_model(load_cfg(DEMO_CFG, ["MODEL.RPN.HEAD_NAME", f"{__name__}.SharedConvRPNHead"]))
    assert isinstance(model.rpn.head, SharedConvRPNHead)
    assert_part_trains(model, model.rpn.head, LOSSES, detector_batch())


class SharedConvRPNHead(torch.nn.Module):
    """A user's RPN head: objectness and box deltas of every anchor from one shared 1x1 convolution."""

    def __init__(self, cfg, in_channels: int, num_anchors: int) -> None:
        super().__init__()
        self.num_anchors = num_anchors
        self.conv = torch.nn.Conv2d(in_channels, 5 * num_anchors, 1)

    def forward(self, features: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        outputs = [self.conv(f).float() for f in features]
        return [o[:, :self.num_anchors] for o in outputs], [o[:, self.num_anchors:] for o in outputs]


def test_a_new_neck_is_a_backbone_entry_from_a_dotted_path(tmp_path):
    """The route pet/modeling/registry.py documents: the model trains through the new neck, and ImageNet ResNet
    weights still initialise backbone.body."""
    cfg = load_cfg(DEMO_CFG, ["MODEL.BACKBONE.TYPE", f"{__name__}.resnet_lateral_neck", *ALL_FOUR_STAGES])
    model = build_model(cfg)
    assert isinstance(model.backbone, ResNetWithLateralNeck)
    assert_part_trains(model, model.backbone.neck, LOSSES, detector_batch())
    path = tmp_path / "resnet18.pth"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), path)
    report = load_weights(model, str(path))
    assert not report["unexpected"] and not report["mismatched"]
    assert report["missing"] and not any(k.startswith("backbone.body.") for k in report["missing"])


def resnet_lateral_neck(cfg) -> torch.nn.Module:
    """A user's backbone entry: the config's ResNet with a neck of its own instead of the FPN."""
    resnet, channels = build_resnet(cfg.MODEL.BACKBONE.NAME, cfg.MODEL.BACKBONE.NORM)
    freeze_stages(resnet, cfg.MODEL.BACKBONE.FREEZE_AT)
    return ResNetWithLateralNeck(resnet, channels, cfg.MODEL.FPN.RETURNED_LAYERS, cfg.MODEL.FPN.OUT_CHANNELS)


class ResNetWithLateralNeck(torch.nn.Module):
    """ResNet stages ``layers`` through one 1x1 convolution each (no top-down path), plus a max-pooled coarsest
    level: the levels MODEL.FPN.RETURNED_LAYERS and TOP_BLOCK "maxpool" describe, so the anchors fit."""

    def __init__(self, resnet: torch.nn.Module, channels: list[int], layers: list[int], out_channels: int) -> None:
        super().__init__()
        self.body = IntermediateLayerGetter(resnet, {f"layer{k}": str(i) for i, k in enumerate(layers)})
        self.neck = torch.nn.ModuleList(torch.nn.Conv2d(channels[k - 1], out_channels, 1) for k in layers)
        self.out_channels = out_channels

    def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        levels = [conv(f) for conv, f in zip(self.neck, self.body(x).values())]
        levels.append(torch.nn.functional.max_pool2d(levels[-1], 1, 2))
        return OrderedDict((str(i), f) for i, f in enumerate(levels))


def test_model_summary_counts_parameters_and_flops_without_touching_the_rng(demo_model):
    from pet.utils.model_summary import model_summary

    demo_model.train()
    rng = torch.get_rng_state()
    small, large = model_summary(demo_model, (64, 64)), model_summary(demo_model, (128, 128))
    assert torch.equal(torch.get_rng_state(), rng)  # counting FLOPs must not change what training draws
    assert demo_model.training  # the mode is restored
    assert small["params"] == sum(p.numel() for p in demo_model.parameters())
    assert small["trainable_params"] == sum(p.numel() for p in demo_model.parameters() if p.requires_grad)
    # Backbone and RPN scale with the pixel count, the box head (a fixed number of RoIs) does not.
    assert 0 < small["gflops"] and 1.5 < large["gflops"] / small["gflops"] < 4.0


def test_model_summary_without_a_size_or_with_an_untraceable_model_still_logs(caplog):
    from pet.utils.model_summary import log_model_summary

    class NotADetector(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 2)

        def forward(self, images, targets):
            raise RuntimeError("needs real targets")

    cfg = load_cfg(None, ["INPUT.MIN_SIZE_TEST", "0"])
    with caplog.at_level(logging.INFO, logger="pet.utils.model_summary"):
        assert log_model_summary(NotADetector(), cfg)["gflops"] is None
    assert "0.00 M parameters" in caplog.text and "set MODEL.FLOPS_INPUT_SIZE" in caplog.text
    caplog.clear()
    cfg = load_cfg(None, ["MODEL.FLOPS_INPUT_SIZE", "(32, 32)"])
    with caplog.at_level(logging.INFO, logger="pet.utils.model_summary"):
        assert log_model_summary(NotADetector(), cfg)["params"] == 8
    assert "Could not count FLOPs of NotADetector: RuntimeError: needs real targets" in caplog.text


def test_resnet10_is_resnet18_with_one_block_per_stage():
    """The demo's backbone: ResNet-18's stem and stage widths, one BasicBlock per stage, no pre-trained weights."""
    ten, channels = build_resnet("resnet10", "BN")
    eighteen, _ = build_resnet("resnet18", "BN")
    assert channels == [64, 128, 256, 512]
    for stage in ("layer1", "layer2", "layer3", "layer4"):
        assert len(getattr(ten, stage)) == 1
        assert getattr(ten, stage)[0].state_dict().keys() == getattr(eighteen, stage)[0].state_dict().keys()
    with pytest.raises(ConfigError, match="no pre-trained weights for resnet10"):
        resnet10(weights="IMAGENET1K_V1")
