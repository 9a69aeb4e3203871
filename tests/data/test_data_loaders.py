"""Samplers, batch collation, the train and test loaders, and tools/visualize_data.py on what they load."""
from __future__ import annotations

import itertools
import os

import cv2
import numpy as np
import pytest
import torch

from pet.data import build_test_loader, build_train_loader, collate_batch
from pet.data.samplers import EpochSampler, GroupedBatchSampler, InferenceSampler, TrainingSampler
from pet.utils import comm
from pet.utils.errors import ConfigError
from pet.utils.visualization import _class_color
from support.helpers import DEMO_CFG, data_cfg, register_split, run_tool_in_process, single_dataset_opts

# --------------------------------------------------------------------------- samplers


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("size", [1, 7, 10])
def test_inference_sampler_covers_every_index_once(world_size, size):
    shards = [list(InferenceSampler(size, rank, world_size)) for rank in range(world_size)]
    assert sorted(i for s in shards for i in s) == list(range(size))
    assert sum(shards, []) == list(range(size))  # contiguous, in rank order
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_training_sampler_is_seeded_and_sharded():
    def take(rank, world, seed=0):
        return list(itertools.islice(TrainingSampler(10, seed, rank=rank, world_size=world), 15))

    assert take(0, 1) == take(0, 1) and take(0, 1) != take(0, 1, seed=1)
    stream = take(0, 1)[:10]
    assert sorted(i for i, _ in stream) == list(range(10))
    assert take(0, 2)[:5] == stream[0::2] and take(1, 2)[:5] == stream[1::2]


def test_epoch_sampler_reshuffles_and_balances_ranks():
    samplers = [EpochSampler(7, seed=0, rank=r, world_size=2) for r in range(2)]
    first = [list(s) for s in samplers]
    assert [len(x) for x in first] == [4, 4] and {i for x in first for i, _ in x} == set(range(7))
    for s in samplers:
        s.set_epoch(1)
    assert [list(s) for s in samplers] != first
    samplers[0].set_epoch(0)
    assert list(samplers[0]) == first[0]


def test_grouped_batch_sampler_groups_by_aspect_ratio():
    group_ids = np.array([0, 1] * 10)
    sampler = EpochSampler(20, seed=0, rank=0, world_size=1)
    batches = list(GroupedBatchSampler(sampler, group_ids, batch_size=3))
    assert len(batches) == 20 // 3 == len(GroupedBatchSampler(sampler, group_ids, 3))
    mixed = [b for b in batches if len({group_ids[i] for i, _ in b}) > 1]
    assert len(mixed) <= 1 and (not mixed or mixed[0] is batches[-1])  # only the leftovers batch mixes


# --------------------------------------------------------------------------- loaders


def test_collate_pads_to_size_divisibility():
    samples = [{"image": torch.full((3, 50, 70), 7, dtype=torch.uint8), "image_id": 1},
               {"image": torch.full((3, 65, 40), 9, dtype=torch.uint8), "image_id": 2}]
    images, targets = collate_batch(samples, size_divisibility=32)
    assert images.shape == (2, 3, 96, 96) and images.dtype == torch.uint8
    assert images.is_contiguous(memory_format=torch.channels_last)  # no transpose of the HWC pixels
    assert images[0, :, :50, :70].eq(7).all() and images[0, :, 50:].eq(0).all() and images[0, :, :, 70:].eq(0).all()
    assert images[1, :, :65, :40].eq(9).all() and images[1, :, :, 40:].eq(0).all()
    assert [t["image_id"] for t in targets] == [1, 2] and "image" not in targets[0]


def test_train_batch_follows_the_contract(shapes_root):
    name = register_split(shapes_root, "train")
    loader = build_train_loader(data_cfg("TRAIN.DATASETS", (name,)))
    images, targets = next(iter(loader))
    assert images.dtype == torch.uint8 and images.shape[0] == 4 and images.shape[2] % 32 == images.shape[3] % 32 == 0
    coco = loader.dataset.coco
    for t in targets:
        h, w = t["image_size"]
        assert min(h, w) in (160, 192) and images.shape[2] >= h and images.shape[3] >= w
        assert (t["orig_size"][0], t["orig_size"][1]) == (coco.imgs[t["image_id"]]["height"],
                                                           coco.imgs[t["image_id"]]["width"])
        assert t["boxes"].dtype == torch.float32 and t["labels"].dtype == torch.int64
        assert len(t["boxes"]) == len(coco.getAnnIds(imgIds=t["image_id"])) and t["labels"].min() >= 1
        assert (t["boxes"][:, 2:] <= torch.tensor([w, h])).all()


def test_loader_reproducible_with_and_without_workers(shapes_root):
    name = register_split(shapes_root, "train")

    def batches(workers):
        loader = build_train_loader(data_cfg("TRAIN.DATASETS", (name,), "DATA.NUM_WORKERS", workers))
        return list(itertools.islice(loader, 4))

    for (img_a, tgt_a), (img_b, tgt_b) in zip(batches(0), batches(2)):
        assert torch.equal(img_a, img_b)
        assert [t["image_id"] for t in tgt_a] == [t["image_id"] for t in tgt_b]
        assert all(torch.equal(a["boxes"], b["boxes"]) for a, b in zip(tgt_a, tgt_b))


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_a_resumed_loader_starts_at_the_batch_an_uninterrupted_one_would_reach(shapes_root, workers):
    """set_start_iter(3): the first batch drawn is the 4th of a fresh pass, with or without workers
    (a DataLoader with workers calls iter() on its batch sampler twice before drawing from it)."""
    name = register_split(shapes_root, "train")
    cfg = data_cfg("TRAIN.DATASETS", (name,), "DATA.NUM_WORKERS", workers, "SOLVER.IMS_PER_BATCH", 2)
    uninterrupted = [[t["image_id"] for t in targets] for _, targets in itertools.islice(build_train_loader(cfg), 6)]
    resumed = build_train_loader(cfg)
    resumed.set_start_iter(3)
    assert [[t["image_id"] for t in targets] for _, targets in itertools.islice(resumed, 3)] == uninterrupted[3:]


def test_epoch_mode_loader_has_a_length_and_reshuffles(shapes_root):
    name = register_split(shapes_root, "train")
    loader = build_train_loader(data_cfg("TRAIN.DATASETS", (name,), "SOLVER.MAX_ITER", 0, "SOLVER.MAX_EPOCHS", 2,
                                     "DATA.ASPECT_RATIO_GROUPING", False))
    assert len(loader) == 3
    order = [[t["image_id"] for t in targets] for _, targets in loader]
    assert sorted(sum(order, [])) == sorted(loader.dataset.coco.getImgIds())
    loader.batch_sampler.set_epoch(1)
    assert [[t["image_id"] for t in targets] for _, targets in loader] != order


def test_per_process_batch_must_divide(shapes_root, monkeypatch):
    monkeypatch.setattr(comm, "get_world_size", lambda: 3)
    with pytest.raises(ConfigError, match=r"SOLVER.IMS_PER_BATCH \(4\) must be a positive multiple .* \(3\)"):
        build_train_loader(data_cfg("TRAIN.DATASETS", (register_split(shapes_root, "train"),)))


def test_test_loader_keeps_order_and_sizes(shapes_root):
    name = register_split(shapes_root, "val")
    loader = build_test_loader(data_cfg("TEST.IMS_PER_BATCH", 4), name)
    targets = [t for _, batch in loader for t in batch]
    assert [t["image_id"] for t in targets] == sorted(loader.dataset.coco.getImgIds())
    assert all(min(t["image_size"]) == 192 for t in targets)
    assert loader.sampler.start == 0 and loader.sampler.end == 6 and loader.batch_size == 4


# --------------------------------------------------------------------------- tools/visualize_data.py


@pytest.mark.parametrize("split, short_side", [("train", 320), ("test", 160)])
def test_visualize_data_writes_transformed_images_with_ground_truth(shapes_root, tmp_path, split, short_side,
                                                                     monkeypatch, capsys):
    out = tmp_path / "vis"
    proc = run_tool_in_process(  # the pictures are the point, not a fresh interpreter's start-up
        monkeypatch, capsys, "visualize_data.py", "--cfg", DEMO_CFG, "--split", split, "--num", 3, "--out", out,
        *single_dataset_opts(f"{shapes_root}/annotations/val.json", f"{shapes_root}/val"),
        "MODEL.MASK_ON", True, "INPUT.MIN_SIZE_TRAIN", "(320,)", "INPUT.MIN_SIZE_TEST", 160)
    assert proc.returncode == 0, proc.stderr
    files = sorted(os.listdir(out))
    assert len(files) == 3 and all(f.startswith(f"{split}_") and f.endswith(".png") for f in files)
    class_colors = [np.array(_class_color(n)[::-1]) for n in ("circle", "rectangle", "triangle")]  # BGR on disk
    for f in files:
        picture = cv2.imread(str(out / f))
        assert picture is not None and min(picture.shape[:2]) == short_side  # after the resize
        assert os.path.getsize(out / f) > 5_000
        drawn = sum(int(np.all(picture == c, axis=-1).sum()) for c in class_colors)
        assert drawn > 100  # box outlines and name tags in the class colours
