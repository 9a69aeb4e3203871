"""Background-only images (DATA.FILTER_EMPTY False) only add negatives: every detector's losses stay finite on a
batch without a single box, and the gradients too."""
from __future__ import annotations

import os

import pytest
import torch

from pet.config import load_cfg
from pet.modeling import build_model
from support.helpers import CFGS

# Each detector's shapes config (the Faster R-CNN demo trains a ResNet-10, its siblings a ResNet-18).
DETECTORS = ["faster_rcnn_R-10-FPN", "mask_rcnn_R-18-FPN", "retinanet_R-18-FPN", "fcos_R-18-FPN"]


def _background_batch(masks: bool) -> tuple[torch.Tensor, list[dict]]:
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 255, (2, 3, 64, 96), generator=gen, dtype=torch.uint8)
    targets = []
    for i, (h, w) in enumerate([(64, 96), (60, 80)]):
        target = {"image_id": i + 1, "image_size": (h, w), "orig_size": (h, w), "boxes": torch.zeros(0, 4),
                  "labels": torch.zeros(0, dtype=torch.int64)}
        if masks:
            target["masks"] = torch.zeros(0, h, w, dtype=torch.uint8)
        targets.append(target)
    return images, targets


@pytest.mark.parametrize("detector", DETECTORS)
def test_a_batch_of_only_background_images_gives_finite_losses_and_gradients(detector):
    cfg = load_cfg(os.path.join(CFGS, "shapes", f"{detector}.yaml"), ["DEVICE", "cpu"])
    torch.manual_seed(0)
    model = build_model(cfg)
    model.train()
    losses = model(*_background_batch(masks=cfg.MODEL.MASK_ON))
    assert losses and all(torch.isfinite(v) for v in losses.values()), losses
    classification = [v for k, v in losses.items() if "class" in k or "objectness" in k]
    assert classification and all(v > 0 for v in classification)  # the negatives are learnt from
    sum(losses.values()).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
