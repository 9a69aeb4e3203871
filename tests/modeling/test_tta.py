"""Test-time augmentation (pet/modeling/test_time_augmentation.py): the passes' batches, mapping detections back to
the original image, the merges, and a real detector loaded with TEST.AUG through load_inference_model."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pet.config import load_cfg
from pet.data import DatasetMapper, collate_batch
from pet.modeling.test_time_augmentation import DetectorWithTTA, TTAPass, merge_detections, weighted_box_fusion
from pet.predict.loading import load_inference_model
from pet.utils.errors import ConfigError
from support.helpers import DEMO_CFG
from support.tiny_models import TINY_TWO_STAGE

# The original image of the fake detector's tests: H x W, with one bright rectangle left of the middle.
ORIG_H, ORIG_W = 60, 80
RECT = (20, 12, 40, 36)  # XYXY in original pixels
# Corners of the rectangle a keypoint set of three names: top-left, top-right, centre; mirroring swaps the first two.
FLIP_MAP = [1, 0, 2]


class RectangleFinder(torch.nn.Module):
    """A fake detector in Pet's batch contract: one detection per image, the extent of its bright pixels (any channel
    > 127) mapped to the original image through ``image_size`` / ``orig_size``, with a mask of that box, three
    keypoints (top-left, top-right, centre) and ``keypoints_scores`` (0.1, 0.2, 0.3). Its score tells a mirrored
    view from a plain one: 0.9 when the rectangle lies right of the middle (only a mirrored view of :data:`RECT`),
    else 0.5."""

    detections_per_img = 100
    score_thresh = 0.05
    size_multiple = 1

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[tuple[int, ...], list[tuple[int, int]]]] = []  # each call's batch shape and sizes

    def forward(self, images: torch.Tensor, targets: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
        self.seen.append((tuple(images.shape), [tuple(t["image_size"]) for t in targets]))
        outputs = []
        for image, target in zip(images, targets):
            (h, w), (orig_h, orig_w) = target["image_size"], target["orig_size"]
            bright = image[:, :h, :w].amax(0) > 127
            cols, rows = bright.any(0).nonzero()[:, 0], bright.any(1).nonzero()[:, 0]
            x0, x1, y0, y1 = int(cols.min()), int(cols.max()) + 1, int(rows.min()), int(rows.max()) + 1
            scale = torch.tensor([orig_w / w, orig_h / h, orig_w / w, orig_h / h])
            box = torch.tensor([[x0, y0, x1, y1]], dtype=torch.float32) * scale
            bx0, by0, bx1, by1 = box[0].tolist()
            mask = torch.zeros(1, orig_h, orig_w, dtype=torch.uint8)
            mask[:, round(by0):round(by1), round(bx0):round(bx1)] = 1
            points = torch.tensor([[[bx0, by0, 1.0], [bx1, by0, 1.0], [(bx0 + bx1) / 2, (by0 + by1) / 2, 1.0]]])
            outputs.append({"boxes": box, "scores": torch.tensor([0.9 if x0 + x1 > w else 0.5]),
                            "labels": torch.tensor([2]), "masks": mask, "keypoints": points,
                            "keypoints_scores": torch.tensor([[0.1, 0.2, 0.3]])})
        return outputs


def delivered_batch() -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """The original image as the test loader delivers it with TTA scales up to 120: resized 2x up (to 120 x 160),
    padded to 32."""
    images = torch.zeros(1, 3, 128, 160, dtype=torch.uint8)
    x0, y0, x1, y1 = (2 * v for v in RECT)
    images[0, 1, y0:y1, x0:x1] = 200
    return images, [{"image_id": 7, "image_size": (2 * ORIG_H, 2 * ORIG_W), "orig_size": (ORIG_H, ORIG_W)}]


def tta(model: torch.nn.Module, **kwargs: Any) -> DetectorWithTTA:
    options = {"min_sizes": [30, 60, 120], "size_divisibility": 32, "keypoint_flip_map": FLIP_MAP, **kwargs}
    return DetectorWithTTA(model, **options).eval()


def test_every_pass_finds_the_rectangle_where_it_is_in_the_original():
    wrapper = tta(RectangleFinder())
    images, targets = delivered_batch()
    assert wrapper.passes == [TTAPass(s, f) for s in (30, 60, 120) for f in (False, True)]
    for tta_pass in wrapper.passes:
        (det,) = wrapper.pass_detections(images, targets, tta_pass)
        assert det["boxes"].tolist() == [list(map(float, RECT))], tta_pass
        # The fake saw the rectangle mirrored (right of the middle) exactly on the mirrored passes.
        assert det["scores"].item() == pytest.approx(0.9 if tta_pass.flip else 0.5)
        x0, y0, x1, y1 = RECT
        assert det["masks"][0, y0:y1, x0:x1].all() and det["masks"].sum() == (x1 - x0) * (y1 - y0), tta_pass


def test_pass_batches_keep_the_contract():
    model = RectangleFinder()
    wrapper = tta(model, size_divisibility=32)
    images, targets = delivered_batch()
    batch, pass_targets = wrapper.pass_batch(images, targets, TTAPass(30, flip=True))
    assert batch.dtype == torch.uint8 and tuple(batch.shape) == (1, 3, 32, 64)
    assert pass_targets == [{"image_id": 7, "image_size": (30, 40), "orig_size": (ORIG_H, ORIG_W)}]
    assert batch[0, :, :, 40:].eq(0).all() and batch[0, :, 30:].eq(0).all()  # zero padding bottom/right
    wrapper(images, targets)
    assert [shape for shape, _ in model.seen] == [(1, 3, 32, 64)] * 2 + [(1, 3, 64, 96)] * 2 + [(1, 3, 128, 160)] * 2
    assert [sizes for _, sizes in model.seen] == [[(30, 40)]] * 2 + [[(60, 80)]] * 2 + [[(120, 160)]] * 2


def test_input_sizes_cap_the_longer_side_or_are_squares():
    wrapper = tta(RectangleFinder(), max_size=500)
    assert wrapper.input_size((60, 600), 100) == (50, 500)
    assert wrapper.input_size((60, 80), 30) == (30, 40)
    square = tta(RectangleFinder(), fixed_size=True)
    assert square.input_size((60, 80), 48) == (48, 48)
    batch, pass_targets = square.pass_batch(*delivered_batch(), TTAPass(48, flip=False))
    assert tuple(batch.shape[-2:]) == (64, 64) and pass_targets[0]["image_size"] == (48, 48)


def test_merged_detection_is_the_best_pass_mapped_back_with_its_mask_and_renumbered_keypoints():
    for merge in ("nms", "wbf"):
        (det,) = tta(RectangleFinder(), merge=merge)(*delivered_batch())
        # Six passes, one object: one detection, the original rectangle, with a mirrored pass's (best) mask and points.
        assert det["boxes"].tolist() == [list(map(float, RECT))], merge
        x0, y0, x1, y1 = RECT
        assert det["masks"].shape == (1, ORIG_H, ORIG_W) and det["masks"][0, y0:y1, x0:x1].all(), merge
        assert det["masks"].sum() == (x1 - x0) * (y1 - y0), merge
        # A mirrored pass's best detection: its top-left point was the original's top-right one, renumbered back.
        assert det["keypoints"][0, :, :2].tolist() == [[x0, y0], [x1, y0], [(x0 + x1) / 2, (y0 + y1) / 2]], merge
        assert det["keypoints_scores"][0].tolist() == pytest.approx([0.2, 0.1, 0.3]), merge
    (nms,) = tta(RectangleFinder(), merge="nms")(*delivered_batch())
    (wbf,) = tta(RectangleFinder(), merge="wbf")(*delivered_batch())
    # NMS keeps the best score; WBF averages the six passes' 0.9 (mirrored) and 0.5 (plain).
    assert nms["scores"].item() == pytest.approx(0.9) and wbf["scores"].item() == pytest.approx(0.7)


def test_a_mirrored_keypoint_pass_needs_a_flip_map():
    with pytest.raises(ConfigError, match="flip map"):
        tta(RectangleFinder(), keypoint_flip_map=None)(*delivered_batch())
    (det,) = tta(RectangleFinder(), keypoint_flip_map=None, flip=False)(*delivered_batch())
    assert det["keypoints_scores"][0].tolist() == pytest.approx([0.1, 0.2, 0.3])


def detections(boxes: list[list[float]], scores: list[float], labels: list[int]) -> dict[str, torch.Tensor]:
    n = len(boxes)
    return {"boxes": torch.tensor(boxes, dtype=torch.float32).reshape(n, 4), "scores": torch.tensor(scores),
            "labels": torch.tensor(labels, dtype=torch.int64), "masks": torch.arange(n).view(n, 1, 1).expand(n, 2, 3),
            "keypoints": torch.tensor(scores).view(n, 1, 1).expand(n, 2, 3)}


def test_nms_removes_duplicates_of_one_class_only():
    a = detections([[0, 0, 10, 10], [50, 50, 60, 60]], [0.6, 0.3], [1, 1])
    b = detections([[1, 0, 11, 10], [0, 0, 10, 10]], [0.8, 0.7], [1, 2])
    merged = merge_detections([a, b], "nms", iou_thresh=0.5)
    assert merged["boxes"].tolist() == [[1, 0, 11, 10], [0, 0, 10, 10], [50, 50, 60, 60]]
    assert merged["labels"].tolist() == [1, 2, 1]
    # Masks and keypoints of the kept ones: b's 0 and 1, a's 1 (each mask is filled with its index in its pass).
    assert merged["masks"][:, 0, 0].tolist() == [0, 1, 1]
    assert merged["keypoints"][:, 0, 0].tolist() == pytest.approx([0.8, 0.7, 0.3])
    assert merge_detections([a, b], "nms", limit=2)["scores"].tolist() == pytest.approx([0.8, 0.7])


def test_wbf_averages_weighted_by_score():
    a = detections([[0, 0, 10, 10], [50, 50, 60, 60]], [0.25, 0.5], [1, 1])
    b = detections([[2, 0, 12, 10]], [0.75], [1])
    merged = merge_detections([a, b], "wbf", iou_thresh=0.5)
    # x0: (0.25 * 0 + 0.75 * 2) / 1.0; score: the mean 0.5 of two members over two passes.
    assert merged["boxes"].tolist() == [[1.5, 0, 11.5, 10], [50, 50, 60, 60]]
    assert merged["scores"].tolist() == pytest.approx([0.5, 0.25])  # the lone box: 0.5 * 1 / 2
    # Mask and keypoints of each cluster's best member: b's 0 (score 0.75), then a's 1.
    assert merged["masks"][:, 0, 0].tolist() == [0, 1]
    assert merged["keypoints"][:, 0, 0].tolist() == pytest.approx([0.75, 0.5])


def test_wbf_joins_the_closest_cluster_and_keeps_classes_apart():
    boxes = torch.tensor([[0, 0, 10, 10], [0, 0, 10, 10], [3, 0, 13, 10], [2, 0, 12, 10]], dtype=torch.float32)
    scores = torch.tensor([0.9, 0.8, 0.7, 0.6])
    labels = torch.tensor([1, 2, 1, 1])
    fused, fused_scores, members = weighted_box_fusion(boxes, scores, labels, 0.6, num_passes=2)
    # Class 1: box 2 overlaps box 0 by IoU 7/13 < 0.6 and starts a cluster; box 3 overlaps both (8/12 and 9/11) and
    # joins the closer, box 2's. Box 1, of class 2, overlaps box 0 wholly but fuses with nothing.
    expected = [[0, 0, 10, 10], [3.3 / 1.3, 0, 16.3 / 1.3, 10], [0, 0, 10, 10]]
    assert fused.flatten().tolist() == pytest.approx(np.ravel(expected))
    assert fused_scores.tolist() == pytest.approx([0.45, 0.65, 0.4])
    assert members.tolist() == [0, 2, 1]


def test_training_passes_through():
    model = RectangleFinder()
    wrapper = tta(model).train()
    images, targets = delivered_batch()
    out = wrapper(images, targets)
    assert len(model.seen) == 1 and model.seen[0][0] == tuple(images.shape) and len(out) == 1


def test_config_errors():
    with pytest.raises(ConfigError, match="TEST.AUG.MERGE"):
        DetectorWithTTA(RectangleFinder(), [32], merge="mean")
    with pytest.raises(ConfigError, match="TEST.AUG.MIN_SIZES"):
        DetectorWithTTA(RectangleFinder(), [])
    cfg = load_cfg(DEMO_CFG, ["TEST.AUG.ENABLED", "True"])
    with pytest.raises(ConfigError, match="PyTorch backend only"):
        load_inference_model(cfg, "onnxruntime", "no-such-model.onnx")


def test_a_keypoint_model_is_not_mirrored_without_its_test_sets_flip_map():
    keypoint_rcnn = ["MODEL.META_ARCHITECTURE", "KeypointRCNN", "MODEL.ROI_KEYPOINT_HEAD.NUM_KEYPOINTS", "4"]
    cfg = load_cfg(DEMO_CFG, [*keypoint_rcnn, "TEST.DATASETS", "('no_such_set',)", "TEST.AUG.ENABLED", "True"])
    with pytest.raises(ConfigError, match="TEST.AUG.FLIP False"):
        load_inference_model(cfg, "pytorch", "no-such-weights.pth")


@pytest.mark.slow
def test_a_real_detector_through_load_inference_model(tmp_path):
    weights = str(tmp_path / "empty.pth")
    torch.save({}, weights)  # every part at its random initial values, which TEST.ALLOW_RANDOM_WEIGHTS accepts
    cfg = load_cfg(DEMO_CFG, [*TINY_TWO_STAGE, "DEVICE", "cpu", "TEST.WEIGHTS", weights, "TEST.ALLOW_RANDOM_WEIGHTS",
                              "True", "MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.0", "TEST.AUG.ENABLED", "True",
                              "TEST.AUG.MIN_SIZES", "(48, 72)", "MODEL.ROI_HEADS.DETECTIONS_PER_IMAGE", "20"])
    model = load_inference_model(cfg).model.eval()
    assert isinstance(model, DetectorWithTTA) and len(model.passes) == 4 and model.detections_per_img == 20
    rng = np.random.default_rng(0)
    samples = []
    for i, (h, w) in enumerate([(40, 56), (36, 36)]):
        image = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
        record = {"image_id": i, "boxes": np.zeros((0, 4), dtype=np.float32), "labels": []}
        samples.append(DatasetMapper.from_config(cfg, is_train=False)(record, image, rng))
    # The test transform resizes to the largest scale, which every pass resizes down from.
    assert [s["image_size"] for s in samples] == [(72, 101), (72, 72)]
    with torch.inference_mode():
        outputs = model(*collate_batch(samples, cfg.INPUT.SIZE_DIVISIBILITY))
    for out, (h, w) in zip(outputs, [(40, 56), (36, 36)]):
        assert set(out) == {"boxes", "scores", "labels"}
        n = len(out["scores"])
        assert 0 < n <= 20 and out["boxes"].shape == (n, 4) and out["labels"].shape == (n,)
        assert (out["scores"][:-1] >= out["scores"][1:]).all()
        boxes = out["boxes"]
        assert (boxes >= 0).all() and (boxes[:, [0, 2]] <= w).all() and (boxes[:, [1, 3]] <= h).all()
        assert ((1 <= out["labels"]) & (out["labels"] <= 3)).all()
