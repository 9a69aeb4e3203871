"""Training and test data loaders built from the config.

A loader yields ``(images, targets)`` per the batch contract: ``images`` is a uint8
[B, 3, H, W] RGB tensor (channels-last in memory) zero-padded at the bottom/right to multiples of
INPUT.SIZE_DIVISIBILITY, ``targets`` a list of per-image dicts (image_id, image_size,
orig_size, boxes, labels, masks in training with MODEL.MASK_ON, keypoints in a keypoint set; see
:class:`DatasetMapper`).
``loader.dataset`` is the :class:`DetectionDataset` (name, coco, categories, label_space, class_names,
label_to_category_id, ...). Its label space (:func:`build_label_space`) follows ``MODEL.LABEL_SPACE``
and ``MODEL.NUM_CLASSES``, so ``labels`` are the model's.
"""
from __future__ import annotations

import logging
import math
import os
import random
import signal
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from fvcore.common.config import CfgNode
from torch.utils.data import DataLoader

from pet.data.augmentations import AugmentationPipeline
from pet.data.balance import log_repeat_factors, repeat_factors
from pet.data.catalog import get_dataset, register_custom_datasets
from pet.data.categories import LabelSpace
from pet.data.coco_json import COCODataset, require_masks
from pet.data.dataset import DetectionDataset, LoadFailure, check_same_categories
from pet.data.mapper import AugmentedMapper, DatasetMapper, build_mapper, crop_size
from pet.data.samplers import (
    BatchSampler,
    EpochSampler,
    GroupedBatchSampler,
    InferenceSampler,
    ProgressClock,
    RepeatFactorEpochSampler,
    RepeatFactorTrainingSampler,
    TrainingSampler,
)
from pet.data.transforms import resized_shape
from pet.utils import comm
from pet.utils.errors import ConfigError, DataError
from pet.utils.table import format_table

__all__ = [
    "PetDataLoader", "BatchCollator", "build_train_loader", "build_test_loader", "build_label_space", "collate_batch",
    "per_process_batch_size",
]

logger = logging.getLogger(__name__)


class PetDataLoader(DataLoader):
    """A DataLoader that re-raises a :class:`DataError` from a worker with its own one-line message.

    Without this, PyTorch would re-raise it in the main process wrapped in the worker's
    traceback text. It also unwraps the small target tensors :class:`BatchCollator` sends
    from workers as numpy arrays.
    """

    def set_start_iter(self, start_iter: int) -> None:
        """Make the next pass start at batch ``start_iter`` (used when training resumes)."""
        if hasattr(self.batch_sampler, "set_start_iter"):
            self.batch_sampler.set_start_iter(start_iter)

    def __iter__(self) -> Iterator[Any]:
        for batch in super().__iter__():
            if isinstance(batch, LoadFailure):
                raise DataError(batch.message)
            images, targets = batch
            yield images, [{k: v.tensor() if isinstance(v, _SmallTensor) else v for k, v in t.items()}
                           for t in targets]


class _SmallTensor:
    """A small tensor travelling from a worker as a numpy array, pickled by value.

    Sent as a tensor, each would get its own shared-memory segment and a file-descriptor
    hand-over, ~0.4 ms apiece: with boxes and labels per image, that cost more than
    decoding the images. Large tensors (images, masks) still go through shared memory.
    """

    __slots__ = ("array",)
    max_bytes = 1 << 16

    def __init__(self, tensor: torch.Tensor) -> None:
        self.array = tensor.numpy()

    def tensor(self) -> torch.Tensor:
        return torch.from_numpy(self.array)


class BatchCollator:
    """Pads samples into one batch (see :func:`collate_batch`); passes a :class:`LoadFailure` through.

    In a worker, small target tensors are wrapped in :class:`_SmallTensor` for the trip to
    the main process, where :class:`PetDataLoader` unwraps them.
    """

    def __init__(self, size_divisibility: int) -> None:
        self.size_divisibility = size_divisibility

    def __call__(self, samples: Sequence[Any]) -> Any:
        for sample in samples:
            if isinstance(sample, LoadFailure):
                return sample
        images, targets = collate_batch(samples, self.size_divisibility)
        if torch.utils.data.get_worker_info() is not None:
            targets = [{k: _SmallTensor(v) if _is_small_tensor(v) else v for k, v in t.items()} for t in targets]
        return images, targets


def _is_small_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.nbytes <= _SmallTensor.max_bytes


def collate_batch(samples: Sequence[dict[str, Any]], size_divisibility: int = 0) -> tuple[torch.Tensor, list[dict]]:
    """``(images uint8 [B, 3, H, W] zero-padded bottom/right, targets)``; H and W are multiples of
    ``size_divisibility`` (when > 0).

    The batch is channels-last in memory: the mapper's images are views of opencv's HWC
    pixels, so copying them in is a plain row copy instead of a transpose (the most
    expensive step of the pipeline otherwise), and the models run channels-last anyway.
    """
    height = max(s["image"].shape[1] for s in samples)
    width = max(s["image"].shape[2] for s in samples)
    if size_divisibility > 0:
        height = -(-height // size_divisibility) * size_divisibility
        width = -(-width // size_divisibility) * size_divisibility
    images = _zeros_for_batch((len(samples), height, width, 3)).permute(0, 3, 1, 2)
    for i, sample in enumerate(samples):
        _, h, w = sample["image"].shape
        images[i, :, :h, :w].copy_(sample["image"])
    targets = [{k: v for k, v in s.items() if k != "image"} for s in samples]
    return images, targets


def _zeros_for_batch(shape: tuple[int, ...]) -> torch.Tensor:
    """A zero uint8 tensor; in a DataLoader worker, in shared memory (as torch's default collate does), so
    that handing the batch to the main process copies nothing."""
    if torch.utils.data.get_worker_info() is None:
        return torch.zeros(shape, dtype=torch.uint8)
    storage = torch.UntypedStorage._new_shared(math.prod(shape))
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(shape).zero_()


def build_train_loader(cfg: CfgNode, mapper: DatasetMapper | AugmentedMapper | None = None) -> PetDataLoader:
    """The training loader over the concatenation of ``TRAIN.DATASETS``.

    Iteration mode (SOLVER.MAX_EPOCHS == 0) uses an infinite sampler; epoch mode a
    finite one whose order changes with ``loader.batch_sampler.set_epoch(epoch)``; either
    repeats images of rare classes with ``DATA.SAMPLER RepeatFactorTrainingSampler``. Each
    process loads SOLVER.IMS_PER_BATCH / world_size images per batch. ``mapper`` defaults
    to :func:`~pet.data.mapper.build_mapper` (``INPUT.AUGMENTATIONS`` when set; a scheduled transform makes the
    batch sampler stamp each key with its iteration and epoch). When the run validates
    (``HOOKS.EVAL.PERIOD`` > 0), the test sets must have the training sets' class list.
    """
    register_custom_datasets(cfg)
    names = list(cfg.TRAIN.DATASETS)
    if not names:
        raise ConfigError("TRAIN.DATASETS is empty; name at least one registered dataset.")
    if cfg.DATA.SAMPLER not in _SAMPLERS:
        raise ConfigError(f"DATA.SAMPLER must be one of {list(_SAMPLERS)}, got {cfg.DATA.SAMPLER!r}.")
    sources = [get_dataset(name, strict=cfg.DATA.STRICT) for name in names]
    label_space = build_label_space(cfg, sources[0])
    if cfg.HOOKS.EVAL.PERIOD > 0 and cfg.MODEL.LABEL_SPACE == "contiguous":
        # Validation would stop on a mismatch later: say so before training. (In the category_id layout a
        # test set may hold any subset of the ids.)
        check_same_categories([*sources, *(get_dataset(n, strict=cfg.DATA.STRICT) for n in cfg.TEST.DATASETS)])
    for source in sources:
        log_instances_table(source)
    keypoints = sources[0].keypoint_meta
    mapper = mapper or build_mapper(cfg, is_train=True, keypoint_flip_map=keypoints.flip_map if keypoints else None)
    if mapper.mask_on:
        require_masks(sources)
    dataset = DetectionDataset(
        sources, mapper, is_train=True, filter_empty=cfg.DATA.FILTER_EMPTY, on_bad_image=cfg.DATA.ON_BAD_IMAGE,
        label_space=label_space,
    )
    batch_size = per_process_batch_size(cfg.SOLVER.IMS_PER_BATCH, "SOLVER.IMS_PER_BATCH")
    seed = _shared_seed(cfg.SEED)
    sampler = _training_sampler(cfg, dataset, seed)
    if cfg.SOLVER.MAX_EPOCHS > 0 and len(sampler) < batch_size:
        raise ConfigError(f"Dataset '{dataset.name}' gives {len(sampler)} images per process and epoch, fewer "
                          f"than the per-process batch of {batch_size}; lower SOLVER.IMS_PER_BATCH.")
    if cfg.DATA.SIZE_GROUPING or cfg.DATA.ASPECT_RATIO_GROUPING:
        pipeline = mapper.pipeline if isinstance(mapper, AugmentedMapper) else None
        batch_sampler: torch.utils.data.Sampler = GroupedBatchSampler(sampler, _group_ids(cfg, dataset, pipeline),
                                                                      batch_size)
    else:
        batch_sampler = BatchSampler(sampler, batch_size, drop_last=True)
    if isinstance(mapper, AugmentedMapper):
        _check_mixing(mapper, dataset)
        if mapper.pipeline.scheduled:
            batch_sampler.stamp_progress(_progress_clock(cfg, batch_sampler, len(dataset)))
    return _make_loader(cfg, dataset, seed, batch_sampler=batch_sampler)


def _check_mixing(mapper: AugmentedMapper, dataset: DetectionDataset) -> None:
    """Transforms that mix images need that many in the set."""
    needed = mapper.pipeline.min_images
    if len(dataset) < needed:
        names = [type(t).__name__ for t in mapper.pipeline.transforms if getattr(t, "min_images", 1) > len(dataset)]
        raise ConfigError(f"INPUT.AUGMENTATIONS: {', '.join(names)} mixes {needed} different images, but dataset "
                          f"'{dataset.name}' has {len(dataset)} usable ones. Add images or remove the transform.")


def _progress_clock(cfg: CfgNode, batch_sampler: Any, num_images: int) -> ProgressClock:
    """The clock of the progress stamp: an epoch is the loader's pass in epoch mode; in iteration mode, the
    dataset's images over SOLVER.IMS_PER_BATCH x SOLVER.ACCUM_STEPS (at least one iteration)."""
    accum = cfg.SOLVER.ACCUM_STEPS
    if cfg.SOLVER.MAX_EPOCHS > 0:
        return ProgressClock(len(batch_sampler) // accum, accum)
    return ProgressClock(max(1, num_images // (cfg.SOLVER.IMS_PER_BATCH * accum)), accum)


# DATA.SAMPLER -> (iteration-mode sampler, epoch-mode sampler).
_SAMPLERS = {
    "TrainingSampler": (TrainingSampler, EpochSampler),
    "RepeatFactorTrainingSampler": (RepeatFactorTrainingSampler, RepeatFactorEpochSampler),
}


def _training_sampler(cfg: CfgNode, dataset: DetectionDataset, seed: int) -> torch.utils.data.Sampler:
    iteration_mode, epoch_mode = _SAMPLERS[cfg.DATA.SAMPLER]
    sampler_class = epoch_mode if cfg.SOLVER.MAX_EPOCHS > 0 else iteration_mode
    if cfg.DATA.SAMPLER == "TrainingSampler":
        return sampler_class(len(dataset), seed)
    threshold = cfg.DATA.REPEAT_THRESHOLD
    if not threshold >= 0:
        raise ConfigError(f"DATA.REPEAT_THRESHOLD must be a fraction >= 0 of the training images, got {threshold}.")
    image_labels = [dataset.record(i)["labels"] for i in range(len(dataset))]
    factors = repeat_factors(image_labels, len(dataset.class_names), threshold)
    log_repeat_factors(image_labels, factors, dataset.class_names, threshold)
    return sampler_class(factors, seed)


def _group_ids(cfg: CfgNode, dataset: DetectionDataset, pipeline: AugmentationPipeline | None = None) -> np.ndarray:
    """Per image: the index of its padded training size (``DATA.SIZE_GROUPING`` with one training scale, or an
    ``INPUT.AUGMENTATIONS`` ``pipeline`` that keeps every image's size), else landscape (1) or portrait (0); both
    after the INPUT.CROP, when enabled."""
    scales = tuple(cfg.INPUT.MIN_SIZE_TRAIN)
    sizes = dataset.image_sizes
    divisor = max(cfg.INPUT.SIZE_DIVISIBILITY, 1)
    if pipeline is not None or cfg.INPUT.AUGMENTATIONS:
        # The pipeline decides the sizes: its stored ones when it keeps them (flips, colour, mixup), else unknown in
        # advance, and batches group by the source's orientation only.
        if cfg.DATA.SIZE_GROUPING and pipeline is not None and pipeline.keeps_size:
            return _padded_size_groups(sizes, divisor)
        return (sizes[:, 1] >= sizes[:, 0]).astype(np.int64)
    if cfg.INPUT.CROP.ENABLED:
        sizes = np.minimum(sizes, np.array(crop_size(cfg)))
    if cfg.DATA.SIZE_GROUPING and len(scales) == 1:
        if scales[0] > 0:
            max_size = cfg.INPUT.MAX_SIZE_TRAIN
            sizes = np.array([resized_shape(h, w, scales[0], max_size) for h, w in sizes]).reshape(-1, 2)
        return _padded_size_groups(sizes, divisor)
    if cfg.DATA.SIZE_GROUPING:
        logger.info(f"DATA.SIZE_GROUPING: sizes vary with the {len(scales)} INPUT.MIN_SIZE_TRAIN scales, "
                    "so batches group by aspect ratio instead")
    return (sizes[:, 1] >= sizes[:, 0]).astype(np.int64)


def _padded_size_groups(sizes: np.ndarray, divisor: int) -> np.ndarray:
    """Per image of ``sizes`` ``[N, 2]``: the index of its size rounded up to ``divisor``."""
    return np.unique(-(-sizes // divisor), axis=0, return_inverse=True)[1].reshape(-1)


def build_test_loader(cfg: CfgNode, dataset_name: str, mapper: DatasetMapper | None = None) -> PetDataLoader:
    """The loader of one test dataset: every image once over all processes, in order, no random transforms.

    ``mapper`` defaults to ``DatasetMapper.from_config(cfg, is_train=False)`` (no masks).
    """
    register_custom_datasets(cfg)
    source = get_dataset(dataset_name, strict=cfg.DATA.STRICT)
    label_space = build_label_space(cfg, source)
    mapper = mapper or build_mapper(cfg, is_train=False)
    if mapper.mask_on:
        require_masks([source])
    dataset = DetectionDataset([source], mapper, is_train=False, on_bad_image=cfg.DATA.ON_BAD_IMAGE,
                               label_space=label_space)
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
    """Log how many usable boxes each class has, three classes per row (as detectron2 does), and how many
    images have none (background images)."""
    counts = dataset.instances_per_class()
    cells = [(name, int(n)) for name, n in zip(dataset.class_names, counts)]
    cells.append(("total", int(counts.sum())))
    per_row = 3
    cells += [("", "")] * (-len(cells) % per_row)
    rows = [sum((list(c) for c in cells[i:i + per_row]), []) for i in range(0, len(cells), per_row)]
    header = ["category", "#instances"] * per_row
    background = sum(1 for r in dataset.records if not len(r["labels"]))
    logger.info(f"Distribution of instances among the {len(counts)} categories of '{dataset.name}':\n"
                f"{format_table(header, rows)}\n"
                f"background images (no usable box): {background} of {len(dataset)}")


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


def build_label_space(cfg: CfgNode, dataset: COCODataset) -> LabelSpace:
    """The model's label space for ``dataset``'s categories: ``MODEL.LABEL_SPACE`` with ``MODEL.NUM_CLASSES``.

    ``contiguous`` needs NUM_CLASSES to be the number of categories; ``category_id`` needs every category
    id to be at most NUM_CLASSES (label L is category id L). Otherwise a :class:`ConfigError` names the
    dataset and the setting to change.
    """
    mode, num_classes, categories = cfg.MODEL.LABEL_SPACE, cfg.MODEL.NUM_CLASSES, dataset.categories
    if mode == "contiguous" and len(categories) != num_classes:
        hint = ""
        if max(categories) <= num_classes:  # e.g. COCO's 80 categories (ids up to 90) and NUM_CLASSES 90
            hint = (f", or MODEL.LABEL_SPACE category_id to keep its category ids as labels (ids 1..{num_classes}, "
                    "as torchvision's COCO models)")
        raise ConfigError(f"Dataset '{dataset.name}' has {len(categories)} categories but MODEL.NUM_CLASSES is "
                          f"{num_classes}; set MODEL.NUM_CLASSES {len(categories)}{hint}.")
    try:
        return LabelSpace.build(mode, categories, num_classes)
    except ConfigError as exc:
        raise ConfigError(f"Dataset '{dataset.name}': {exc}") from None
