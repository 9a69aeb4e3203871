"""DATA.SIZE_GROUPING: training batches hold images of one padded size, so no batch pads to a larger one."""
from __future__ import annotations

import itertools

import pytest

from pet.config import load_cfg
from pet.data import build_train_loader
from pet.data.augmentations import build_pipeline, keeps_size
from support.helpers import register_split


@pytest.fixture(scope="module")
def shapes_train(shapes_set):
    return register_split(shapes_set(num_train=48, num_val=2, seed=3), "train")


def _batches(dataset_name: str, *opts, count: int = 12):
    cfg = load_cfg(None, ["DEVICE", "cpu", "MODEL.NUM_CLASSES", "3", "DATA.NUM_WORKERS", "0", "SOLVER.IMS_PER_BATCH",
                          "4", "SOLVER.MAX_ITER", "10", "TRAIN.DATASETS", f"('{dataset_name}',)", *opts])
    loader = build_train_loader(cfg)
    return loader, list(itertools.islice(iter(loader), count))


def _padded(sizes, divisor=32):
    return {(-(-h // divisor) * divisor, -(-w // divisor) * divisor) for h, w in sizes}


def test_native_size_batches_hold_one_padded_size_and_pad_no_further(shapes_train):
    loader, batches = _batches(shapes_train, "INPUT.MIN_SIZE_TRAIN", "(0,)", "DATA.SIZE_GROUPING", "True")
    assert len(_padded(map(tuple, loader.dataset.image_sizes))) > 1  # a mixed set, so grouping has work to do
    for images, targets in batches:
        sizes = [t["image_size"] for t in targets]
        assert len(_padded(sizes)) == 1, sizes
        assert tuple(images.shape[-2:]) == next(iter(_padded(sizes)))


def test_without_size_grouping_the_same_set_mixes_sizes(shapes_train):
    """The control: plain aspect-ratio grouping does pad some batches beyond some of their images."""
    _, batches = _batches(shapes_train, "INPUT.MIN_SIZE_TRAIN", "(0,)", "DATA.SIZE_GROUPING", "False")
    assert any(len(_padded(t["image_size"] for t in targets)) > 1 for _, targets in batches)


def test_one_training_scale_groups_by_the_resized_size(shapes_train):
    _, batches = _batches(shapes_train, "INPUT.MIN_SIZE_TRAIN", "(160,)", "INPUT.MAX_SIZE_TRAIN", "200",
                          "DATA.SIZE_GROUPING", "True")
    for _, targets in batches:
        assert len(_padded(t["image_size"] for t in targets)) == 1


def test_several_training_scales_fall_back_to_aspect_ratio_groups(shapes_train, caplog):
    with caplog.at_level("INFO", logger="pet.data.build"):
        _, batches = _batches(shapes_train, "INPUT.MIN_SIZE_TRAIN", "(160, 192)", "DATA.SIZE_GROUPING", "True")
    assert "batches group by aspect ratio instead" in caplog.text
    for _, targets in batches:
        assert len({t["orig_size"][1] >= t["orig_size"][0] for t in targets}) == 1  # all landscape or all portrait


def test_a_pipeline_that_keeps_sizes_groups_by_them(shapes_train):
    """INPUT.AUGMENTATIONS of flips, colour and mixup leave each image at its stored size, so batches still hold one
    padded size (mixup stretches the drawn image to the sample's)."""
    pipeline = "[{type: MixUp, p: 1.0}, {type: RandomPhotometricDistort}, {type: RandomHorizontalFlip}]"
    loader, batches = _batches(shapes_train, "INPUT.AUGMENTATIONS", pipeline, "DATA.SIZE_GROUPING", "True")
    assert loader.dataset.mapper.pipeline.keeps_size
    for images, targets in batches:
        sizes = [t["image_size"] for t in targets]
        assert len(_padded(sizes)) == 1, sizes
        assert tuple(images.shape[-2:]) == next(iter(_padded(sizes)))


def test_which_pipelines_keep_sizes():
    class Plugin:  # a user's transform that says it keeps the size
        keeps_size = True

        def __call__(self, sample):
            return sample

    assert build_pipeline([{"type": "RandomHorizontalFlip"}, {"type": "SanitizeBoundingBoxes"},
                           {"type": "CopyPaste"}, {"type": "ColorJitter", "brightness": 0.2}]).keeps_size
    assert not build_pipeline([{"type": "RandomHorizontalFlip"}, {"type": "Resize", "size": [64, 64]}]).keeps_size
    assert not build_pipeline([{"type": "Mosaic", "size": 64}]).keeps_size
    assert keeps_size(Plugin()) and not keeps_size(lambda sample: sample)
