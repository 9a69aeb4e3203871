"""Plugins: a new head with its own config key, without touching pet/config (tests/support/plugin_head.py), and an
evaluator chosen by TEST.EVALUATOR."""
from __future__ import annotations

import os

import pytest
import torch

from pet.config import load_cfg
from pet.engine.inference import evaluate_on_datasets
from pet.modeling import build_model
from pet.modeling.roi_heads import TwoMLPHead
from pet.utils.errors import ConfigError
from support.helpers import DEMO_CFG, custom_datasets
from support.plugin_head import ScaledBoxHead


def test_a_plugin_head_adds_its_key_and_is_built_with_it(tmp_path):
    yaml_file = tmp_path / "plugin.yaml"
    yaml_file.write_text(
        f"_BASE_: {os.path.abspath(DEMO_CFG)}\n"
        "MODEL:\n"
        "  ROI_BOX_HEAD:\n"
        "    NAME: support.plugin_head.ScaledBoxHead\n"
        "  SCALED_BOX_HEAD:\n"
        "    SCALE: 0.5\n"
    )
    cfg = load_cfg(str(yaml_file), ["DEVICE", "cpu", "MODEL.SCALED_BOX_HEAD.SCALE", "0.25"])
    assert cfg.MODEL.SCALED_BOX_HEAD.SCALE == 0.25  # the command line overrides the plugin's key too

    model = build_model(cfg)
    head = model.roi_heads.box_head
    assert isinstance(head, ScaledBoxHead) and head.scale == 0.25
    plain = TwoMLPHead(cfg, model.backbone.out_channels)
    plain.load_state_dict(head.state_dict())
    pooled = torch.randn(3, model.backbone.out_channels, 7, 7)
    assert torch.allclose(head(pooled), plain(pooled) * 0.25)


def test_the_plugin_key_is_unknown_without_the_plugin():
    with pytest.raises(ConfigError, match="Unknown config key 'MODEL.SCALED_BOX_HEAD'"):
        load_cfg(DEMO_CFG, ["MODEL.SCALED_BOX_HEAD.SCALE", "0.5"])


def test_a_plugin_path_that_does_not_import_is_one_clear_error():
    with pytest.raises(ConfigError, match="MODEL.ROI_BOX_HEAD.NAME names 'no_such_pkg.Head'.*cannot be imported"):
        load_cfg(DEMO_CFG, ["MODEL.ROI_BOX_HEAD.NAME", "no_such_pkg.Head"])


class ImageCounter:
    """A minimal evaluator named by dotted path in TEST.EVALUATOR: counts images and detections."""

    def __init__(self, dataset, output_dir):
        self.dataset, self.output_dir = dataset, output_dir

    def reset(self):
        self.images = self.detections = 0

    def process(self, inputs, outputs):
        self.images += len(outputs)
        self.detections += sum(len(o["boxes"]) for o in outputs)

    def evaluate(self):
        return {"count": {"images": self.images, "detections": self.detections}}


@pytest.mark.slow
def test_test_evaluator_selects_the_evaluator_by_dotted_path(shapes_set, tmp_path):
    root = shapes_set(num_train=2, num_val=2)
    cfg = load_cfg(DEMO_CFG, [
        "DEVICE", "cpu", "CKPT", str(tmp_path), "TEST.EVALUATOR", f"{__name__}.ImageCounter",
        "DATA.CUSTOM", custom_datasets(("ev_val", f"{root}/annotations/val.json", f"{root}/val")),
        "TEST.DATASETS", "('ev_val',)", "INPUT.MIN_SIZE_TEST", "128", "INPUT.MAX_SIZE_TEST", "160",
        "DATA.NUM_WORKERS", "0", "TEST.NUM_WARMUP", "0", "MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.0"])
    metrics = evaluate_on_datasets(cfg, build_model(cfg), str(tmp_path / "val"))
    assert metrics["count/images"] == 2 and metrics["count/detections"] > 0
    assert set(metrics) == {"count/images", "count/detections"}  # COCOEvaluator did not run
