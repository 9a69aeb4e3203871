"""data: images/s of Pet's training loader against PIL + torchvision.transforms.v2 doing the same work.

Pet's side is the demo config's loader (opencv decode of the shapes JPEGs, multi-scale
shorter-side resize, flip, boxes, batching); the reference decodes with PIL and transforms with
torchvision.transforms.v2, fed the index stream of Pet's own batch sampler; both single-threaded.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from functools import partial

import torch

from pet.config import load_cfg
from pet.data import build_train_loader

from .common import format_fingerprint, interleaved

DATA_SCALES = (320, 352, 384, 416, 448, 480)
DATA_MAX_SIZE = 800


class _ReferenceDataset(torch.utils.data.Dataset):
    """The reference pipeline: PIL decode, then torchvision.transforms.v2 on the image and its boxes.

    The transforms run on the uint8 tensor (ToImage first) without antialiasing: on this data
    that is ~2x faster than resizing the PIL image, and every resize here enlarges, where
    antialiasing changes nothing but costs ~15%. So the reference is torchvision's fastest option.
    """

    def __init__(self, records: list[dict], flip_prob: float) -> None:
        from torchvision.transforms import v2

        self.records = records
        self.transform = v2.Compose([
            v2.ToImage(), v2.RandomShortestSize(list(DATA_SCALES), DATA_MAX_SIZE, antialias=False),
            v2.RandomHorizontalFlip(flip_prob),
        ])

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        from PIL import Image
        from torchvision import tv_tensors

        record = self.records[key[0]]  # key: (index, seed) from Pet's sampler, so both see the same images
        with Image.open(record["file_name"]) as pil:
            image = pil.convert("RGB")
        boxes = tv_tensors.BoundingBoxes(torch.from_numpy(record["boxes"]), format="XYXY",
                                         canvas_size=(image.height, image.width))
        image, boxes = self.transform(image, boxes)
        return {"image": image.as_subclass(torch.Tensor), "image_id": record["image_id"],
                "image_size": tuple(image.shape[-2:]), "boxes": boxes.as_subclass(torch.Tensor),
                "labels": torch.from_numpy(record["labels"])}


def _pad_batch(samples: list[dict]) -> tuple[torch.Tensor, list[dict]]:
    """The reference's collate: zero-pad [3, h, w] images into a [B, 3, H, W] batch (H, W multiples of 32)."""
    height = -(-max(s["image"].shape[1] for s in samples) // 32) * 32
    width = -(-max(s["image"].shape[2] for s in samples) // 32) * 32
    images = torch.zeros((len(samples), 3, height, width), dtype=torch.uint8)
    for image, sample in zip(images, samples):
        image[:, :sample["image"].shape[1], :sample["image"].shape[2]].copy_(sample["image"])
    return images, [{k: v for k, v in s.items() if k != "image"} for s in samples]


def _data_loaders(workers: int) -> dict[str, torch.utils.data.DataLoader]:
    """Pet's loader from the demo config (resize changed to multi-scale 320-480, so batches group by aspect
    ratio instead of native size) and the reference on its batches."""
    cfg = load_cfg(os.path.join("cfgs", "shapes", "faster_rcnn_R-10-FPN.yaml"), [
        "DEVICE", "cpu", "DATA.NUM_WORKERS", str(workers), "INPUT.MIN_SIZE_TRAIN", str(DATA_SCALES),
        "INPUT.MAX_SIZE_TRAIN", str(DATA_MAX_SIZE), "DATA.SIZE_GROUPING", "False"])
    pet_loader = build_train_loader(cfg)
    dataset = pet_loader.dataset
    records = [dataset.record(i) for i in range(len(dataset))]
    reference = torch.utils.data.DataLoader(
        _ReferenceDataset(records, cfg.INPUT.FLIP_PROB), batch_sampler=pet_loader.batch_sampler,
        num_workers=workers, persistent_workers=workers > 0, collate_fn=_pad_batch,
    )
    return {"pet": pet_loader, "reference": reference}


def _images_per_second(iterator, batches: int, batch_size: int) -> float:
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * batch_size / (time.perf_counter() - start)


def data(args: argparse.Namespace, fingerprint: dict) -> dict:
    """Images per second of the two training pipelines, per number of workers."""
    import cv2

    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    logging.getLogger("pet").setLevel(logging.WARNING)
    result: dict = {"scales": DATA_SCALES, "max_size": DATA_MAX_SIZE, "batches": args.batches,
                    "repeats": args.repeats, "workers": {}}
    for workers in args.workers:
        loaders = _data_loaders(workers)
        iterators = {name: iter(loader) for name, loader in loaders.items()}
        batch_size = loaders["pet"].batch_sampler.batch_size
        for it in iterators.values():  # warm-up: worker start, first-use costs
            for _ in range(3):
                next(it)
        # Both consume the same batches in step, whichever runs first in a round.
        samples = interleaved({name: partial(_images_per_second, it, args.batches, batch_size)
                               for name, it in iterators.items()}, args.repeats)
        med = {name: statistics.median(v) for name, v in samples.items()}
        result["workers"][workers] = {**med, "ratio": med["pet"] / med["reference"], "samples_images_per_s": samples}
        del iterators, loaders
    print(format_fingerprint(fingerprint))
    print(f"training data pipeline, shapes train JPEGs (192-256 px) -> shorter side {DATA_SCALES[0]}-{DATA_SCALES[-1]} "
          f"(max {DATA_MAX_SIZE}), flip 0.5, boxes, batch {batch_size}; 1 thread per process; median of "
          f"{args.repeats} interleaved runs of {args.batches} batches")
    print(f"{'workers':<8} {'Pet img/s':>10} {'PIL+tv2 img/s':>14} {'Pet/ref':>8}")
    for workers, r in result["workers"].items():
        print(f"{workers:<8} {r['pet']:>10.0f} {r['reference']:>14.0f} {r['ratio']:>8.2f}")
    return result

