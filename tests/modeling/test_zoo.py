"""RetinaNet and FCOS: torchvision parity, parameter counts, losses, eval outputs in Pet's batch contract, swappable
dense heads; the training recipe of every COCO config."""
from __future__ import annotations

import os
from typing import NamedTuple

import pytest
import torch
from torchvision.models.detection import fcos as tv_fcos
from torchvision.models.detection import retinanet as tv_retinanet
from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
from torchvision.ops.feature_pyramid_network import LastLevelP6P7

from pet.config import load_cfg
from pet.modeling import build_model
from pet.utils.errors import ConfigError
from support.against_reference import INFERENCE_COMPARISONS, check_inference_parity, check_training_parity
from support.helpers import CFGS, assert_part_trains, detector_batch


class Zoo(NamedTuple):
    cfg_node: str  # Pet's config section of the head
    num_params: int  # of torchvision's COCO weights (their meta["num_params"])
    losses: set[str]


# Keyed by config file name prefix: cfgs/coco/<name>_R-50-FPN_1x.yaml, cfgs/shapes/<name>_R-18-FPN.yaml.
MODELS = {
    "retinanet": Zoo("MODEL.RETINANET", 34_014_999, {"loss_classification", "loss_bbox_regression"}),
    "fcos": Zoo("MODEL.FCOS", 32_269_600, {"loss_classification", "loss_bbox_regression", "loss_bbox_ctrness"}),
}
TV_MODULES = {"backbone.body", "backbone.fpn", "anchor_generator", "head.classification_head", "head.regression_head"}


def _coco_cfg(name: str, *opts: str):
    return load_cfg(os.path.join(CFGS, "coco", f"{name}_R-50-FPN_1x.yaml"), list(opts))


def _demo_cfg(name: str, *opts: str):
    return load_cfg(os.path.join(CFGS, "shapes", f"{name}_R-18-FPN.yaml"), list(opts))


@pytest.mark.slow
@pytest.mark.parametrize("comparison", INFERENCE_COMPARISONS)
@pytest.mark.parametrize("name", MODELS)
def test_one_stage_inference_parity_with_torchvision(name, comparison):
    """torchvision's retinanet / fcos_resnet50_fpn weights give torchvision's detections (its label 0, COCO's unused
    category, dropped as Pet drops it): the same as its model run channels-last, and torchvision's default run in
    float64 up to its memory format's rounding (tests/support/against_reference.py)."""
    check_inference_parity(name, comparison)


# Not in the numeric group: float64, whose rounding stays 1e4x below the tolerance in any summation order.
@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_one_stage_training_parity_with_torchvision(name):
    """The same losses and gradients as torchvision's model for the same weights and batch
    (tests/support/against_reference.py)."""
    check_training_parity(name)


@pytest.mark.parametrize("name", MODELS)
def test_coco_config_has_torchvisions_parameter_count_module_names_and_frozen_stages(name):
    model = build_model(_coco_cfg(name))
    assert sum(p.numel() for p in model.parameters()) == MODELS[name].num_params
    assert TV_MODULES <= {n for n, _ in model.named_modules()}
    # what torchvision's builder trains when given weights: trainable_backbone_layers=3 on P3-P7
    reference = resnet_fpn_backbone(backbone_name="resnet50", weights=None, trainable_layers=3,
                                    returned_layers=[2, 3, 4], extra_blocks=LastLevelP6P7(256, 256))
    expected = {f"backbone.{n}" for n, p in reference.named_parameters() if p.requires_grad}
    assert {n for n, p in model.backbone.named_parameters(prefix="backbone") if p.requires_grad} == expected


def test_fcos_points_are_sized_by_their_levels_stride():
    """FCOS's losses assign boxes to levels by multiples of these sizes: they must be P3-P7's strides."""
    model = build_model(_coco_cfg("fcos"))
    assert model.anchor_generator.sizes == ((8,), (16,), (32,), (64,), (128,))


# The XYXY boxes of both images: a 40x48 and a 14x14 one.
BOXES = ((10.0, 12.0, 50.0, 60.0), (30.0, 5.0, 44.0, 19.0))


@pytest.mark.parametrize("name", MODELS)
def test_training_losses_are_finite_float32_under_autocast_and_train_every_parameter(name):
    torch.manual_seed(0)
    model = build_model(_demo_cfg(name))
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as the demo trains
        losses = model(*detector_batch(BOXES))
    assert set(losses) == MODELS[name].losses
    assert all(v.dim() == 0 and torch.isfinite(v) and v.dtype == torch.float32 for v in losses.values())
    sum(losses.values()).backward()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in trainable)


@pytest.mark.parametrize("name", MODELS)
def test_eval_detections_are_in_the_original_image_and_never_label_0(name):
    torch.manual_seed(0)
    detections = 1000  # room for more than the label-0 detections, which are dropped after the per-image cap
    key = MODELS[name].cfg_node
    model = build_model(_demo_cfg(name, f"{key}.SCORE_THRESH_TEST", "0.0",
                                  f"{key}.DETECTIONS_PER_IMAGE", str(detections)))
    # make torchvision's extra output (COCO's unused category 0) the most confident for every anchor
    head = model.head.classification_head
    with torch.no_grad():
        head.cls_logits.bias.view(-1, head.num_classes)[:, 0] = 10.0
    model.eval()
    images, targets = detector_batch(BOXES)
    with torch.no_grad():
        outputs = model(images, targets)
    for out, target in zip(outputs, targets):
        assert set(out) == {"boxes", "scores", "labels"} and len(out["boxes"]) > 0
        assert out["boxes"].dtype == torch.float32 and out["labels"].dtype == torch.int64
        assert 1 <= out["labels"].min() and out["labels"].max() <= 3
        orig_h, orig_w = target["orig_size"]
        assert out["boxes"].min() >= 0 and out["boxes"][:, 2].max() <= orig_w and out["boxes"][:, 3].max() <= orig_h
        assert torch.all(out["scores"][:-1] >= out["scores"][1:])


@pytest.mark.parametrize("name", MODELS)
def test_anchors_and_boxes_stay_float32_under_bfloat16_autocast(name):
    """bfloat16 anchors would put every decoded box on a 1-2 px grid at 128-511 px."""
    model = build_model(_demo_cfg(name)).eval()
    dtypes = []
    model.anchor_generator.register_forward_hook(lambda module, args, anchors: dtypes.extend(a.dtype for a in anchors))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = model(*detector_batch(BOXES))
    assert dtypes == [torch.float32] * 2
    assert all(out["boxes"].dtype == out["scores"].dtype == torch.float32 for out in outputs)


class OneConvRetinaNetHead(tv_retinanet.RetinaNetHead):
    """A user's RetinaNet head: one 3x3 convolution per tower instead of four; torchvision's outputs and losses."""

    def __init__(self, cfg, in_channels: int, num_anchors: int, num_classes: int) -> None:
        super().__init__(in_channels, num_anchors, num_classes)
        for tower in (self.classification_head, self.regression_head):
            tower.conv = torch.nn.Sequential(torch.nn.Conv2d(in_channels, in_channels, 3, padding=1), torch.nn.ReLU())


class OneConvFCOSHead(tv_fcos.FCOSHead):
    """A user's FCOS head: towers of one conv + GroupNorm + ReLU instead of ``MODEL.FCOS.NUM_CONVS``."""

    def __init__(self, cfg, in_channels: int, num_anchors: int, num_classes: int) -> None:
        super().__init__(in_channels, num_anchors, num_classes, num_convs=1)


CUSTOM_HEADS = {"retinanet": OneConvRetinaNetHead, "fcos": OneConvFCOSHead}


@pytest.mark.parametrize("name", MODELS)
def test_custom_dense_head_from_a_dotted_path_trains(name):
    head = CUSTOM_HEADS[name]
    model = build_model(_demo_cfg(name, f"{MODELS[name].cfg_node}.HEAD_NAME", f"{__name__}.{head.__name__}"))
    assert type(model.head) is head
    assert_part_trains(model, model.head, MODELS[name].losses, detector_batch(BOXES))


# BASE_LR for batch 16 in each COCO config: torchvision's reference recipes (0.02 two-stage, 0.01 one-stage).
COCO_BASE_LR = {"faster_rcnn": 0.02, "mask_rcnn": 0.02, "retinanet": 0.01, "fcos": 0.01}


@pytest.mark.parametrize("name", COCO_BASE_LR)
def test_coco_configs_train_with_the_1x_recipe(name):
    solver = _coco_cfg(name).SOLVER
    assert solver.IMS_PER_BATCH == 16 and solver.MAX_ITER == 90_000 and solver.MAX_EPOCHS == 0
    assert solver.LR_POLICY == "step" and tuple(solver.STEPS) == (60_000, 80_000) and solver.GAMMA == 0.1
    assert solver.BASE_LR == COCO_BASE_LR[name]


def test_retinanet_anchor_levels_must_match_the_fpn():
    with pytest.raises(ConfigError, match=r"MODEL.RETINANET.ANCHOR_SIZES has 2 entries.*5 feature levels"):
        build_model(_demo_cfg("retinanet", "MODEL.RETINANET.ANCHOR_SIZES", "[[16], [32]]"))


def test_retinanet_head_norm_is_torchvisions_v1_by_default_and_groupnorm_on_request():
    """The COCO config keeps torchvision's plain head (weight parity); the demo normalises it to train from scratch."""
    plain = build_model(_coco_cfg("retinanet"))
    assert not any(isinstance(m, torch.nn.GroupNorm) for m in plain.head.modules())
    demo = build_model(_demo_cfg("retinanet"))
    norms = [m for m in demo.head.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert len(norms) == 8 and all(m.num_groups == 32 for m in norms)  # 4 classification + 4 regression convs
    with pytest.raises(ConfigError, match="MODEL.RETINANET.HEAD_NORM must be '' or 'GN', got 'BN'"):
        build_model(_demo_cfg("retinanet", "MODEL.RETINANET.HEAD_NORM", "BN"))
