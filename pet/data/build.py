"""Training and test data loaders built from the config.

A loader yields ``(images, targets)`` per the batch contract: ``images`` is a uint8
[B, 3, H, W] RGB tensor zero-padded at the bottom/right to multiples of
INPUT.SIZE_DIVISIBILITY, ``targets`` a list of per-image dicts (image_id, image_size,
orig_size, boxes, labels). ``loader.dataset`` is the :class:`DetectionDataset` (name,
coco, class_names, label_to_category_id, ...).
"""
from __future__ import annotations

import logging
import os
import random
import signal
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from fvcore.common.config import CfgNode
from torch.utils.data import DataLoader

from pet.data.catalog import get_dataset, register_custom_datasets
from pet.data.dataset import COCODataset, DetectionDataset, LoadFailure
from pet.data.mapper import DatasetMapper, build_augmentations
from pet.data.samplers import BatchSampler, EpochSampler, GroupedBatchSampler, InferenceSampler, TrainingSampler
from pet.utils import comm
from pet.utils.errors import ConfigError, DataError
from pet.utils.table import format_table

__all__ = [
    "PetDataLoader", "BatchCollator", "build_train_loader", "build_test_loader", "collate_batch",
    "per_process_batch_size",
]

logger = logging.getLogger(__name__)


class PetDataLoader(DataLoader):
    """A DataLoader that re-raises a :class:`DataError` from a worker with its own one-line message.

    Without this, PyTorch would re-raise it in the main process wrapped in the worker's
    traceback text.
    """

    def set_start_iter(self, start_iter: int) -> None:
        """Make the next pass start at batch ``start_iter`` (used when training resumes)."""
        if hasattr(self.batch_sampler, "set_start_iter"):
            self.batch_sampler.set_start_iter(start_iter)

    def __iter__(self) -> Iterator[Any]:
        for batch in super().__iter__():
            if isinstance(batch, LoadFailure):
                raise DataError(batch.message)
            yield batch


class BatchCollator:
    """Pads samples into one batch (see :func:`collate_batch`); passes a :class:`LoadFailure` through."""

    def __init__(self, size_divisibility: int) -> None:
        self.size_divisibility = size_divisibility

    def __call__(self, samples: Sequence[Any]) -> Any:
        for sample in samples:
            if isinstance(sample, LoadFailure):
                return sample
        return collate_batch(samples, self.size_divisibility)


def collate_batch(samples: Sequence[dict[str, Any]], size_divisibility: int = 0) -> tuple[torch.Tensor, list[dict]]:
    """``(images uint8 [B, 3, H, W] zero-padded bottom/right, targets)``; H and W are multiples of
    ``size_divisibility`` (when > 0)."""
    height = max(s["image"].shape[1] for s in samples)
    width = max(s["image"].shape[2] for s in samples)
    if size_divisibility > 0:
        height = -(-height // size_divisibility) * size_divisibility
        width = -(-width // size_divisibility) * size_divisibility
    images = torch.zeros((len(samples), 3, height, width), dtype=torch.uint8)
    for i, sample in enumerate(samples):
        _, h, w = sample["image"].shape
        images[i, :, :h, :w].copy_(sample["image"])
    targets = [{k: v for k, v in s.items() if k != "image"} for s in samples]
    return images, targets


def build_train_loader(cfg: CfgNode) -> PetDataLoader:
    """The training loader over the concatenation of ``TRAIN.DATASETS``.

    Iteration mode (SOLVER.MAX_EPOCHS == 0) uses an infinite sampler; epoch mode a
    finite one whose order changes with ``loader.batch_sampler.set_epoch(epoch)``. Each
    process loads SOLVER.IMS_PER_BATCH / world_size images per batch.
    """
    register_custom_datasets(cfg)
    names = list(cfg.TRAIN.DATASETS)
    if not names:
        raise ConfigError("TRAIN.DATASETS is empty; name at least one registered dataset.")
    sources = [get_dataset(name, strict=cfg.DATA.STRICT) for name in names]
    _check_num_classes(cfg, sources[0])
    for source in sources:
        log_instances_table(source)
    dataset = DetectionDataset(
        sources, DatasetMapper(build_augmentations(cfg, is_train=True)), is_train=True,
        filter_empty=cfg.DATA.FILTER_EMPTY, on_bad_image=cfg.DATA.ON_BAD_IMAGE,
    )
    batch_size = per_process_batch_size(cfg.SOLVER.IMS_PER_BATCH, "SOLVER.IMS_PER_BATCH")
    seed = _shared_seed(cfg.SEED)
    if cfg.SOLVER.MAX_EPOCHS > 0:
        sampler: torch.utils.data.Sampler = EpochSampler(len(dataset), seed)
        if len(sampler) < batch_size:
            raise ConfigError(f"Dataset '{dataset.name}' gives {len(sampler)} images per process and epoch, fewer "
                              f"than the per-process batch of {batch_size}; lower SOLVER.IMS_PER_BATCH.")
    else:
        sampler = TrainingSampler(len(dataset), seed)
    if cfg.DATA.ASPECT_RATIO_GROUPING:
        batch_sampler: torch.utils.data.Sampler = GroupedBatchSampler(
            sampler, (dataset.aspect_ratios >= 1).astype(np.int64), batch_size
        )
    else:
        batch_sampler = BatchSampler(sampler, batch_size, drop_last=True)
    return _make_loader(cfg, dataset, seed, batch_sampler=batch_sampler)


def build_test_loader(cfg: CfgNode, dataset_name: str) -> PetDataLoader:
    """The loader of one test dataset: every image once over all processes, in order, no random transforms."""
    register_custom_datasets(cfg)
    source = get_dataset(dataset_name, strict=cfg.DATA.STRICT)
    _check_num_classes(cfg, source)
    dataset = DetectionDataset(
        [source], DatasetMapper(build_augmentations(cfg, is_train=False)), is_train=False,
        on_bad_image=cfg.DATA.ON_BAD_IMAGE,
    )
    batch_size = per_process_batch_size(cfg.TEST.IMS_PER_BATCH, "TEST.IMS_PER_BATCH")
    # A plain sampler + batch_size (not a batch sampler) so loader.sampler / loader.batch_size describe the shard.
    return _make_loader(cfg, dataset, _shared_seed(cfg.SEED), sampler=InferenceSampler(len(dataset)),
                        batch_size=batch_size)


def per_process_batch_size(total: int, key: str) -> int:
    """``total / world_size``; a :class:`ConfigError` naming ``key`` when it does not divide evenly."""
    world_size = comm.get_world_size()
    if total <= 0 or total % world_size:
        raise ConfigError(f"{key} ({total}) must be a positive multiple of the number of processes ({world_size}).")
    return total // world_size


def log_instances_table(dataset: COCODataset) -> None:
    """Log how many usable boxes each class has, three classes per row (as detectron2 does)."""
    counts = dataset.instances_per_class()
    cells = [(name, int(n)) for name, n in zip(dataset.class_names, counts)]
    cells.append(("total", int(counts.sum())))
    per_row = 3
    cells += [("", "")] * (-len(cells) % per_row)
    rows = [sum((list(c) for c in cells[i:i + per_row]), []) for i in range(0, len(cells), per_row)]
    header = ["category", "#instances"] * per_row
    logger.info(f"Distribution of instances among the {len(counts)} categories of '{dataset.name}':\n"
                f"{format_table(header, rows)}")


def seed_worker(worker_id: int) -> None:
    """Seed Python and NumPy in a worker from the torch seed the DataLoader gave it (itself seeded per run).

    Workers ignore SIGINT: Ctrl-C reaches the whole process group, and the main process
    must survive it to save a checkpoint before it shuts its workers down. (SIGTERM is
    left alone: that is how the main process stops its workers at exit.)
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


def _make_loader(cfg: CfgNode, dataset: DetectionDataset, seed: int, **sampling: Any) -> PetDataLoader:
    num_workers = cfg.DATA.NUM_WORKERS
    return PetDataLoader(
        dataset,
        **sampling,
        num_workers=num_workers,
        collate_fn=BatchCollator(cfg.INPUT.SIZE_DIVISIBILITY),
        pin_memory=torch.cuda.is_available() and cfg.DEVICE != "cpu",
        persistent_workers=num_workers > 0,
        worker_init_fn=seed_worker,
        generator=torch.Generator().manual_seed(seed + comm.get_rank()),
    )


def _shared_seed(seed: int) -> int:
    """``seed``, or (when negative) a random one that all processes agree on."""
    if seed >= 0:
        return int(seed)
    drawn = int.from_bytes(os.urandom(4), "little") % 2**31
    return int(comm.all_gather_object(drawn)[0])


def _check_num_classes(cfg: CfgNode, dataset: COCODataset) -> None:
    num = len(dataset.class_names)
    if cfg.MODEL.NUM_CLASSES != num:
        raise ConfigError(f"Dataset '{dataset.name}' has {num} categories but MODEL.NUM_CLASSES is "
                          f"{cfg.MODEL.NUM_CLASSES}; set MODEL.NUM_CLASSES {num}.")
