"""Mosaic, MixUp and CopyPaste (pet.data.mixing) on hand-made samples, and through the training loader."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import torch
from torchvision import tv_tensors

from pet.config import load_cfg
from pet.data import build_train_loader
from pet.data.augmentations import ExtraSamples, build_pipeline
from pet.data.mixing import CopyPaste, MixUp, Mosaic
from pet.utils.errors import ConfigError
from support.helpers import CFGS, data_cfg, single_dataset_opts, write_coco

Box = tuple[float, float, float, float]


def make_sample(
    width: int, height: int, boxes: Sequence[Box], labels: Sequence[int], value: int = 50, *,
    masks: bool = True, keypoints: Sequence[Sequence[tuple[float, float]]] | None = None,
    visibility: Sequence[Sequence[float]] | None = None,
) -> dict:
    """A sample of a constant-``value`` image whose masks are exactly its (whole-pixel) boxes' rectangles.

    Keypoints (K=3) default to each box's top-left pixel, centre and bottom-right pixel, all visible (2).
    """
    box_tensor = torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4)
    if keypoints is None:
        keypoints = [[(x0 + 1, y0 + 1), ((x0 + x1) / 2, (y0 + y1) / 2), (x1 - 1, y1 - 1)] for x0, y0, x1, y1 in boxes]
    if visibility is None:
        visibility = [[2.0] * 3 for _ in boxes]
    sample = {
        "image": tv_tensors.Image(torch.full((3, height, width), value, dtype=torch.uint8)),
        "boxes": tv_tensors.BoundingBoxes(box_tensor, format="XYXY", canvas_size=(height, width)),
        "labels": torch.tensor(labels, dtype=torch.int64),
        "keypoints": tv_tensors.KeyPoints(torch.tensor(keypoints, dtype=torch.float32).reshape(-1, 3, 2),
                                          canvas_size=(height, width)),
        "keypoint_visibility": torch.tensor(visibility, dtype=torch.float32).reshape(-1, 3),
    }
    if masks:
        rectangles = torch.zeros((len(boxes), height, width), dtype=torch.uint8)
        for i, (x0, y0, x1, y1) in enumerate(box_tensor.long().tolist()):
            rectangles[i, y0:y1, x0:x1] = 1
        sample["masks"] = tv_tensors.Mask(rectangles)
    return sample


def in_order(*samples: dict) -> ExtraSamples:
    """Extra samples handed out in the given order, whatever index is drawn: which image lands where is known."""
    queue = iter(samples)
    return ExtraSamples(len(samples), lambda _index: next(queue))


def by_index(*samples: dict) -> ExtraSamples:
    """Extra samples drawn as the loader draws them: by a random index (fresh copies each time)."""
    return ExtraSamples(len(samples), lambda index: {k: v.clone() for k, v in samples[index].items()})


def mask_box(mask: torch.Tensor) -> list[float]:
    """The XYXY pixel-edge box around a non-empty mask [H, W]."""
    ys, xs = torch.nonzero(mask, as_tuple=True)
    return [float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1)]


def assert_consistent(out: dict) -> None:
    """One label, mask, keypoint row and visibility row per box, at the image's size."""
    n = len(out["boxes"])
    h, w = out["image"].shape[-2:]
    assert out["image"].dtype == torch.uint8
    assert out["labels"].shape == (n,) and out["keypoints"].shape == (n, 3, 2)
    assert out["keypoint_visibility"].shape == (n, 3) and out["boxes"].canvas_size == (h, w)
    if "masks" in out:
        assert out["masks"].shape == (n, h, w)


# --------------------------------------------------------------------------- Mosaic


def mosaic_inputs() -> tuple[dict, ExtraSamples]:
    """The sample and three others for a 128 mosaic centred at (128, 128), the canvas' middle.

    Every image doubles (its longer side 64 -> 128) and its top-left corner lands on the output at
    (-64, -32), (64, -32), (-64, 64) and (64, 64) (the 128x96 landscapes; (64, 64) for the 64x128 portrait).
    """
    current = make_sample(64, 48, [(40, 20, 60, 40), (2, 2, 12, 10)], [1, 2], value=10)
    top_right = make_sample(64, 48, [(4, 20, 30, 44)], [3], value=20)
    bottom_left = make_sample(64, 48, [(36, 4, 64, 30), (40, 30, 60, 47)], [4, 5], value=30)
    bottom_right = make_sample(32, 64, [(0, 0, 20, 20), (10, 40, 30, 60)], [6, 7], value=40)  # portrait
    return current, in_order(top_right, bottom_left, bottom_right)


def test_mosaic_places_each_image_in_its_quadrant():
    current, extra = mosaic_inputs()
    torch.manual_seed(0)
    out = Mosaic(size=128, center_range=(1.0, 1.0))(current, extra)
    assert out["image"].shape == (3, 128, 128) and out["image"].dtype == torch.uint8
    image = out["image"][0]
    assert image[:64, :64].eq(10).all() and image[:64, 64:].eq(20).all()
    assert image[64:, :64].eq(30).all() and image[64:, 64:].eq(40).all()
    # By hand: box x 2 + the corner; 2 (top-left, off the output) and 7 (portrait's lower box, below it)
    # are dropped, 5 is cut at the bottom edge.
    assert out["labels"].tolist() == [1, 3, 4, 5, 6]
    assert out["boxes"].tolist() == [[16, 8, 56, 48], [72, 8, 124, 56], [8, 72, 64, 124], [16, 124, 56, 128],
                                     [64, 64, 104, 104]]
    assert_consistent(out)


def test_mosaic_masks_follow_their_boxes():
    current, extra = mosaic_inputs()
    torch.manual_seed(0)
    out = Mosaic(size=128, center_range=(1.0, 1.0))(current, extra)
    for box, mask in zip(out["boxes"].tolist(), out["masks"]):
        x0, y0, x1, y1 = (int(v) for v in box)
        assert mask_box(mask) == box and int(mask.sum()) == (x1 - x0) * (y1 - y0)  # the rectangle, nothing else


def test_mosaic_moves_keypoints_and_hides_those_outside():
    current, extra = mosaic_inputs()
    torch.manual_seed(0)
    out = Mosaic(size=128, center_range=(1.0, 1.0))(current, extra)
    # Box 1 (40, 20, 60, 40): points (41, 21), (50, 30), (59, 39) x 2 + (-64, -32).
    assert out["keypoints"][0].tolist() == [[18, 10], [36, 28], [54, 46]]
    assert out["keypoint_visibility"][0].tolist() == [2, 2, 2]
    # Box 5 (40, 30, 60, 47) x 2 + (-64, 64): (18, 126) inside, (36, 141) and (54, 156) below the output.
    assert out["keypoints"][3].tolist() == [[18, 126], [36, 141], [54, 156]]
    assert out["keypoint_visibility"][3].tolist() == [2, 0, 0]


def test_mosaic_fills_what_no_image_covers():
    # Centre (64, 64): the sample falls off the output; the landscape bottom-right (128x96 at (0, 0)) leaves 32 rows.
    current, _ = mosaic_inputs()
    others = [make_sample(64, 48, [(0, 0, 64, 48)], [9], value=40) for _ in range(3)]
    torch.manual_seed(0)
    out = Mosaic(size=128, center_range=(0.5, 0.5), fill=7)(current, in_order(*others))
    assert out["image"][:, :96].eq(40).all() and out["image"][:, 96:].eq(7).all()
    assert out["boxes"].tolist() == [[0, 0, 128, 96]] and out["labels"].tolist() == [9]
    assert_consistent(out)


def test_mosaic_is_deterministic_per_seed():
    current, _ = mosaic_inputs()
    pool = [make_sample(64, 48, [(8 * i, 4, 8 * i + 20, 30)], [i], value=20 * i) for i in range(1, 6)]

    def run(seed: int) -> dict:
        torch.manual_seed(seed)
        return Mosaic(size=96)(current, by_index(*pool))

    first, again, other = run(3), run(3), run(4)
    assert torch.equal(first["image"], again["image"]) and torch.equal(first["boxes"], again["boxes"])
    assert torch.equal(first["labels"], again["labels"]) and torch.equal(first["masks"], again["masks"])
    assert not torch.equal(first["image"], other["image"])


def test_mosaic_with_probability_zero_returns_the_sample():
    current, extra = mosaic_inputs()
    assert Mosaic(size=128, p=0.0)(current, extra) is current


@pytest.mark.parametrize("kwargs, words", [
    ({"size": 0}, "size"), ({"size": 64.5}, "size"), ({"center_range": (1.5, 0.5)}, "center_range"),
    ({"center_range": (0.5, 2.5)}, "center_range"), ({"fill": 300}, "fill"), ({"p": 1.5}, "p must"),
])
def test_mosaic_rejects_bad_arguments(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Mosaic(**kwargs)
    with pytest.raises(ConfigError, match=r"INPUT.AUGMENTATIONS\[0\] \(Mosaic\)"):
        build_pipeline([{"type": "Mosaic", **kwargs}])


# --------------------------------------------------------------------------- MixUp


def test_mixup_blends_with_the_ratio_and_keeps_both_label_sets(monkeypatch):
    current = make_sample(64, 48, [(4, 4, 20, 20), (30, 10, 60, 40)], [1, 2], value=200)
    other = make_sample(32, 24, [(2, 2, 10, 12)], [3], value=40)  # stretched x 2 to the sample's size
    mixup = MixUp()
    monkeypatch.setattr(mixup, "sample_ratio", lambda: 0.25)
    torch.manual_seed(0)
    out = mixup(current, in_order(other))
    assert out["image"].shape == (3, 48, 64) and out["image"].eq(80).all()  # 0.25 * 200 + 0.75 * 40
    assert out["labels"].tolist() == [1, 2, 3]
    assert out["boxes"].tolist() == [[4, 4, 20, 20], [30, 10, 60, 40], [4, 4, 20, 24]]
    assert [mask_box(m) for m in out["masks"]] == out["boxes"].tolist()
    assert out["keypoints"][2].tolist() == [[6, 6], [12, 14], [18, 22]]  # (3, 3), (6, 7), (9, 11) x 2
    assert_consistent(out)


def test_mixup_draws_its_ratio_from_beta_per_seed(monkeypatch):
    current = make_sample(64, 48, [(4, 4, 20, 20)], [1], value=200)
    current["image"][:, :, 32:] = 100  # not constant: the blend is per pixel
    other = make_sample(64, 48, [(30, 10, 60, 40)], [2], value=0)
    mixup = MixUp(alpha=32.0, beta=32.0)
    drawn, draw = [], mixup.sample_ratio
    monkeypatch.setattr(mixup, "sample_ratio", lambda: drawn.append(draw()) or drawn[-1])
    outputs = []
    for seed in (0, 1, 0):
        torch.manual_seed(seed)
        outputs.append(mixup(current, by_index(other, other)))
    expected = (current["image"].float() * drawn[0]).round()
    assert (outputs[0]["image"].float() - expected).abs().max() <= 1  # r * a + (1 - r) * 0, within rounding
    assert drawn[0] == drawn[2] and drawn[0] != drawn[1] and all(0.2 < r < 0.8 for r in drawn)
    assert torch.equal(outputs[0]["image"], outputs[2]["image"]) and not torch.equal(outputs[0]["image"],
                                                                                     outputs[1]["image"])


@pytest.mark.parametrize("kwargs", [{"alpha": 0}, {"beta": -1.0}, {"p": -0.1}])
def test_mixup_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        MixUp(**kwargs)


# --------------------------------------------------------------------------- CopyPaste


def copy_paste_inputs(masks: bool = True) -> tuple[dict, dict]:
    """A sample with three objects and a drawn image with one object over x [20, 64), y [0, 30), whose mask
    has a hole at x [56, 64), y [22, 30): object 1 loses its right half, object 2 disappears, object 3 is left
    alone."""
    current = make_sample(64, 48, [(10, 10, 30, 30), (40, 10, 50, 20), (0, 40, 10, 48)], [1, 2, 3], value=50,
                          masks=masks,
                          keypoints=[[(25, 25), (12, 12), (28, 28)], [(45, 15)] * 3, [(5, 45)] * 3],
                          visibility=[[2, 2, 0], [2, 2, 2], [2, 2, 2]])
    other = make_sample(64, 48, [(20, 0, 64, 30)], [9], value=200, masks=masks)
    if masks:
        other["masks"][0, 22:30, 56:64] = 0
    return current, other


def test_copy_paste_occludes_the_sample_objects():
    current, other = copy_paste_inputs()
    torch.manual_seed(0)
    out = CopyPaste()(current, in_order(other))  # one object to paste: it always goes
    assert out["labels"].tolist() == [1, 3, 9]  # object 2 was under it entirely
    assert out["boxes"].tolist() == [[10, 10, 20, 30], [0, 40, 10, 48], [20, 0, 64, 30]]
    for box, mask in zip(out["boxes"].tolist(), out["masks"]):
        assert mask_box(mask) == box
    assert int(out["masks"][0].sum()) == 10 * 20  # the visible half of object 1 only
    image = out["image"][0]
    assert image[5, 60] == 200 and image[25, 25] == 200 and image[15, 15] == 50
    assert image[25, 60] == 50  # the hole in the pasted mask shows the sample: masks paste, not boxes
    assert out["keypoint_visibility"][0].tolist() == [1, 2, 0]  # under the paste: labelled, not visible
    assert out["keypoint_visibility"][1].tolist() == [2, 2, 2] and out["keypoint_visibility"][2].tolist() == [2] * 3
    assert_consistent(out)


def test_copy_paste_drops_objects_left_mostly_hidden():
    current, other = copy_paste_inputs()
    torch.manual_seed(0)
    out = CopyPaste(min_visible=0.6)(current, in_order(other))  # object 1 keeps half its area
    assert out["labels"].tolist() == [3, 9]
    assert_consistent(out)


def test_copy_paste_pastes_a_random_subset():
    current, _ = copy_paste_inputs()
    boxes = [(8 * i, 0, 8 * i + 6, 6) for i in range(8)]
    many = make_sample(64, 48, boxes, list(range(10, 18)), value=200)
    counts = {}
    for kwargs in ({}, {"max_fraction": 0.25}, {"paste_prob": 0.0}):
        counts[str(kwargs)] = []
        for seed in range(6):
            torch.manual_seed(seed)
            out = CopyPaste(**kwargs)(current, by_index(many))
            pasted = [label for label in out["labels"].tolist() if label >= 10]
            assert pasted == sorted(set(pasted)) and len(out["labels"]) == 3 + len(pasted)
            counts[str(kwargs)].append(len(pasted))
    assert all(1 <= n <= 8 for n in counts["{}"]) and len(set(counts["{}"])) > 1
    assert all(1 <= n <= 2 for n in counts["{'max_fraction': 0.25}"])
    assert counts["{'paste_prob': 0.0}"] == [1] * 6


def test_copy_paste_on_boxes_alone_asks_for_masks_or_rectangles():
    current, other = copy_paste_inputs(masks=False)
    with pytest.raises(ConfigError) as error:
        CopyPaste()(current, in_order(other))
    message = str(error.value)
    assert "\n" not in message and "MODEL.MASK_ON" in message and "rectangles: true" in message


def test_copy_paste_pastes_box_rectangles_when_asked():
    current, other = copy_paste_inputs(masks=False)
    torch.manual_seed(0)
    out = CopyPaste(rectangles=True)(current, in_order(other))
    assert "masks" not in out
    assert out["labels"].tolist() == [1, 3, 9]
    assert out["boxes"].tolist() == [[10, 10, 20, 30], [0, 40, 10, 48], [20, 0, 64, 30]]
    assert out["image"][0, 20:30, 56:64].eq(200).all()  # the whole rectangle
    assert out["keypoint_visibility"][0].tolist() == [1, 2, 0]
    assert_consistent(out)


@pytest.mark.parametrize("kwargs", [{"max_fraction": 0.0}, {"min_visible": 1.5}, {"paste_prob": 2.0},
                                    {"rectangles": "yes"}])
def test_copy_paste_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        CopyPaste(**kwargs)


# --------------------------------------------------------------------------- the training loader


def test_mixing_pipeline_through_the_train_loader(shapes_root):
    cfg = load_cfg(f"{CFGS}/shapes/mask_rcnn_R-18-FPN.yaml", [
        "DATA.NUM_WORKERS", "0", "SOLVER.IMS_PER_BATCH", "2", "DEVICE", "cpu",
        *single_dataset_opts(f"{shapes_root}/annotations/train.json", f"{shapes_root}/train")])
    cfg.defrost()
    cfg.INPUT.AUGMENTATIONS = [{"type": "Mosaic", "size": 128}, {"type": "MixUp"}, {"type": "CopyPaste"}]
    cfg.freeze()
    loader = build_train_loader(cfg)
    for images, targets in itertools.islice(loader, 2):
        assert images.dtype == torch.uint8 and tuple(images.shape) == (2, 3, 128, 128)
        for target in targets:
            n = len(target["boxes"])
            assert n > 0 and target["labels"].shape == (n,) and target["masks"].shape == (n, 128, 128)
            assert target["masks"].dtype == torch.uint8 and target["image_size"] == (128, 128)


@pytest.mark.parametrize("augmentations, error", [
    ([{"type": "Mosaic", "size": 64}], "Mosaic mixes 4 different images"),
    ([{"type": "MixUp"}], None),
])
def test_loader_refuses_a_set_smaller_than_the_mixing_needs(tmp_path, augmentations, error):
    name, _, _ = write_coco(tmp_path, images=((1, 40, 30), (2, 40, 30), (3, 40, 30)))
    cfg = data_cfg("TRAIN.DATASETS", (name,), num_classes=1)
    cfg.INPUT.AUGMENTATIONS = augmentations
    if error is None:
        build_train_loader(cfg)
        return
    with pytest.raises(ConfigError, match=f"{error}.*has 3 usable"):
        build_train_loader(cfg)
