"""cfgs/coco/rtdetr_R-18.yaml (via rtdetr_R-50.yaml) trains and tests on the RT-DETR authors' input pipeline.

The reference is rebuilt here as the authors' code builds it (lyuwenyu/RT-DETR, rtdetrv2_pytorch): their training
list in ``configs/rtdetrv2/include/dataloader.yml`` made of torchvision.transforms.v2 classes, their RandomIoUCrop
being v2's with a probability drawn first, and their ``stop_epoch`` policy skipping the three strong transforms from
epoch 71 on. Pet's pipeline from the shipped config must hold the same transforms with the same arguments in the same
order, and, stronger, give the same pixels, boxes and labels as the reference under the same seed: a difference in
a default, an order or a random draw shows up as different pictures. The test-time resize must be ``v2.Resize``'s.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch
from torchvision import tv_tensors
from torchvision.transforms import v2

from pet.config import load_cfg
from pet.data.augmentations import AugmentationPipeline, Progress, build_pipeline
from pet.data.build import _progress_clock
from pet.data.mapper import build_mapper
from support.helpers import CFGS

CFG = os.path.join(CFGS, "coco", "rtdetr_R-18.yaml")
STOP_EPOCH = 71
STRONG_OPS = ("RandomPhotometricDistort", "RandomZoomOut", "RandomIoUCrop")
SEEDS = range(30)


class RandomIoUCrop(v2.RandomIoUCrop):
    """The authors' RandomIoUCrop: v2's, skipped when ``torch.rand(1) >= p`` (drawn before v2's own draws). It keeps
    their class name, which their stop_epoch policy goes by."""

    def __init__(self, min_scale: float = 0.3, max_scale: float = 1.0, min_aspect_ratio: float = 0.5,
                 max_aspect_ratio: float = 2.0, sampler_options: list[float] | None = None, trials: int = 40,
                 p: float = 1.0) -> None:
        super().__init__(min_scale, max_scale, min_aspect_ratio, max_aspect_ratio, sampler_options, trials)
        self.p = p

    def __call__(self, *inputs: Any) -> Any:
        if torch.rand(1) >= self.p:
            return inputs if len(inputs) > 1 else inputs[0]
        return super().forward(*inputs)


def reference_train_ops() -> list[v2.Transform]:
    """The authors' training ops in order (their ConvertPILImage and ConvertBoxes, float pixels and normalised
    cxcywh boxes, are the model's work in Pet)."""
    return [
        v2.RandomPhotometricDistort(p=0.5),
        v2.RandomZoomOut(fill=0),
        RandomIoUCrop(p=0.8),
        v2.SanitizeBoundingBoxes(min_size=1),
        v2.RandomHorizontalFlip(),
        v2.Resize(size=[640, 640]),
        v2.SanitizeBoundingBoxes(min_size=1),
    ]


def reference_forward(ops: list[v2.Transform], sample: dict[str, Any], epoch: int) -> dict[str, Any]:
    """The authors' ``Compose.stop_epoch_forward``: every op in order, but those named in the policy from its epoch."""
    for op in ops:
        if type(op).__name__ in STRONG_OPS and epoch >= STOP_EPOCH:
            continue
        sample = op(sample)
    return sample


@pytest.fixture(scope="module")
def cfg():
    return load_cfg(CFG)


@pytest.fixture(scope="module")
def pipeline(cfg) -> AugmentationPipeline:
    return build_pipeline(cfg.INPUT.AUGMENTATIONS)


def make_sample(seed: int, height: int = 120, width: int = 160) -> dict[str, Any]:
    """A picture with texture (smooth gradients plus noise, so resizes and colour changes show) and six boxes of
    various sizes, some small enough for a zoom-out and resize to make them vanish."""
    g = torch.Generator().manual_seed(1000 + seed)
    ys, xs = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    base = torch.stack([xs * 255 / width, ys * 255 / height, (xs + ys) * 127 / (width + height)])
    image = (base + torch.randint(0, 60, (3, height, width), generator=g)).clamp(0, 255).to(torch.uint8)
    xy = torch.rand(6, 2, generator=g) * torch.tensor([width * 0.8, height * 0.8])
    wh = torch.rand(6, 2, generator=g) * torch.tensor([width * 0.5, height * 0.5]) + 0.5
    boxes = torch.cat([xy, (xy + wh).minimum(torch.tensor([width, height]))], dim=1)
    return {"image": tv_tensors.Image(image),
            "boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(height, width)),
            "labels": torch.randint(1, 81, (6,), generator=g)}


def copy_sample(sample: dict[str, Any]) -> dict[str, Any]:
    return {k: tv_tensors.wrap(v.clone(), like=v) if isinstance(v, tv_tensors.TVTensor) else v.clone()
            for k, v in sample.items()}


def assert_same_sample(ours: dict[str, Any], theirs: dict[str, Any], seed: int) -> None:
    assert ours["image"].shape == theirs["image"].shape, seed
    assert ours["image"].dtype == theirs["image"].dtype == torch.uint8, seed
    assert torch.equal(ours["image"], theirs["image"]), f"seed {seed}: pixels differ"
    assert ours["boxes"].canvas_size == theirs["boxes"].canvas_size, seed
    assert torch.equal(ours["boxes"], theirs["boxes"]), f"seed {seed}: boxes differ"
    assert torch.equal(ours["labels"], theirs["labels"]), f"seed {seed}: labels differ"


def test_config_lists_the_authors_transforms_with_their_arguments(pipeline):
    """Same classes (Pet's may subclass v2's), same arguments, same order; the stop epoch on the three strong ops."""
    reference = reference_train_ops()
    ours = pipeline.transforms
    assert len(ours) == len(reference)
    attributes = ("p", "fill", "side_range", "min_scale", "max_scale", "min_aspect_ratio", "max_aspect_ratio",
                  "options", "trials", "size", "interpolation", "antialias", "max_size", "min_size", "min_area",
                  "brightness", "contrast", "saturation", "hue")
    for position, (mine, theirs) in enumerate(zip(ours, reference)):
        v2_class = type(theirs).__mro__[1] if isinstance(theirs, RandomIoUCrop) else type(theirs)
        assert isinstance(mine, v2_class), (position, type(mine), v2_class)
        for name in attributes:
            assert hasattr(mine, name) == hasattr(theirs, name), (position, name)
            if hasattr(theirs, name):
                assert getattr(mine, name) == getattr(theirs, name), (position, name)
    # The hue range and the IoU crop's probability are what the old keys-based approximation lacked.
    assert ours[0].hue == (-0.05, 0.05) and ours[2].p == 0.8 and ours[1].side_range == (1.0, 4.0)
    schedules = [(type(s.transform).__name__, s.until_epoch, s.until_iter) for s in pipeline.steps]
    assert schedules == [(type(t).__name__, STOP_EPOCH if type(t).__name__ in STRONG_OPS else None, None)
                         for t in reference]


def test_stop_epoch_is_the_last_of_72_on_pets_iteration_clock(cfg):
    """The config trains by iterations; Pet's epoch is COCO train2017's 117266 images over 16 per iteration, so
    epoch 71 starts at 71 x 7329 iterations and the strong transforms are off for the last epoch, as the authors'."""
    assert cfg.SOLVER.MAX_EPOCHS == 0 and cfg.SOLVER.ACCUM_STEPS == 1
    clock = _progress_clock(cfg, None, 117_266)
    last_strong = 71 * 7329 - 1
    assert clock(0, last_strong) == (last_strong, 70)
    assert clock(0, last_strong + 1) == (last_strong + 1, 71)
    plain = cfg.SOLVER.MAX_ITER - (last_strong + 1)
    assert clock.iters_per_epoch <= plain < 2 * clock.iters_per_epoch  # one epoch (and MAX_ITER's rounding)
    assert clock(0, cfg.SOLVER.MAX_ITER - 1)[1] >= STOP_EPOCH


@pytest.mark.parametrize("epoch", [0, STOP_EPOCH - 1], ids=["first-epoch", "epoch-70"])
def test_same_pictures_boxes_and_labels_as_the_reference(pipeline, epoch):
    """Under the same seed, Pet's pipeline and the authors' list give identical outputs, for 30 seeds; the seeds
    take every branch (no distortion, zoom-out, IoU crop, flip) several times, and boxes are dropped on the way."""
    reference = reference_train_ops()
    zoomed = cropped = dropped = 0
    for seed in SEEDS:
        sample = make_sample(seed)
        ours = pipeline(copy_sample(sample), seed, Progress(iteration=epoch * 7329, epoch=epoch))
        torch.manual_seed(seed)
        theirs = reference_forward(reference, copy_sample(sample), epoch)
        assert_same_sample(ours, theirs, seed)
        # Which branches this seed took, from the authors' side: the zoom-out and the crop change the aspect ratio.
        torch.manual_seed(seed)
        partial = reference_forward(reference[:3], copy_sample(sample), epoch)
        zoomed += partial["image"].shape[-1] > sample["image"].shape[-1]
        cropped += partial["image"].shape[-1] < sample["image"].shape[-1]
        dropped += len(theirs["labels"]) < len(sample["labels"])
    assert zoomed >= 5 and cropped >= 5 and dropped >= 5, (zoomed, cropped, dropped)


def test_after_the_stop_epoch_only_flip_and_resize_remain(pipeline):
    """From epoch 71 on, the output is the reference list without the three strong transforms; before, it is not."""
    plain = [t for t in reference_train_ops() if type(t).__name__ not in STRONG_OPS]
    assert len(plain) == 4
    changed = 0
    for seed in SEEDS:
        sample = make_sample(seed)
        ours = pipeline(copy_sample(sample), seed, Progress(iteration=STOP_EPOCH * 7329, epoch=STOP_EPOCH))
        torch.manual_seed(seed)
        theirs = reference_forward(plain, copy_sample(sample), epoch=0)
        assert_same_sample(ours, theirs, seed)
        before = pipeline(copy_sample(sample), seed, Progress(iteration=STOP_EPOCH * 7329 - 1, epoch=STOP_EPOCH - 1))
        changed += not torch.equal(before["image"], ours["image"])
    assert changed == len(SEEDS)  # the photometric draw alone changes every picture


def test_training_mapper_gives_the_reference_sample(cfg):
    """The loader's path (record -> AugmentedMapper -> packed sample) keeps the pipeline's pixels and boxes."""
    mapper = build_mapper(cfg, is_train=True)
    reference = reference_train_ops()
    for k in range(5):
        sample = make_sample(k)
        record = {"image_id": k, "boxes": sample["boxes"].as_subclass(torch.Tensor).numpy(),
                  "labels": sample["labels"].numpy()}
        image = np.ascontiguousarray(sample["image"].permute(1, 2, 0).numpy())
        packed = mapper(record, image, np.random.default_rng(k), progress=Progress(epoch=3))
        torch.manual_seed(int(np.random.default_rng(k).integers(2**63 - 1)))  # the seed the mapper draws
        theirs = reference_forward(reference, copy_sample(sample), epoch=3)
        assert packed["image_size"] == (640, 640) and packed["orig_size"] == (120, 160)
        assert torch.equal(packed["image"], theirs["image"].as_subclass(torch.Tensor))
        assert torch.equal(packed["boxes"], theirs["boxes"].as_subclass(torch.Tensor))
        assert torch.equal(packed["labels"], theirs["labels"])


@pytest.mark.parametrize("size", [(240, 320), (300, 200), (700, 1000)])
def test_test_mapper_stretches_as_v2_resize(cfg, size):
    """Evaluation input: every picture stretched to 640 x 640 with v2.Resize's pixels (up and down)."""
    height, width = size
    image = torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    boxes = np.array([[10.0, 20.0, width / 2, height / 2]], dtype=np.float32)
    record = {"image_id": 1, "boxes": boxes, "labels": np.array([1])}
    sample = build_mapper(cfg, is_train=False)(record, image.permute(1, 2, 0).numpy(), np.random.default_rng(0))
    expected = v2.Resize([640, 640])(tv_tensors.Image(image))
    assert sample["image_size"] == (640, 640) and sample["orig_size"] == size
    assert torch.equal(sample["image"], expected.as_subclass(torch.Tensor))
    scale = np.array([640 / width, 640 / height] * 2, dtype=np.float32)
    np.testing.assert_allclose(sample["boxes"].numpy(), boxes * scale, rtol=1e-6)
