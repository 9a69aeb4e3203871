"""resume-skip: how long a resumed run waits for its first batch, by the iteration it resumes from.

    python tools/benchmark.py resume-skip [--iters 10 90000 900000] [--world-size 2] [--repeats 3]

The time from ``set_start_iter(n)`` to the first batch of the demo's batch sampler: the demo config's
(cfgs/shapes/faster_rcnn_R-10-FPN.yaml) 1500 training images, their size groups as
``pet.data.build_train_loader`` makes them, its seed, and its SOLVER.IMS_PER_BATCH shared over
``--world-size`` processes (here built in one process, rank by rank). Two ways per rank, in alternating
rounds: Pet's skip by pass arithmetic (the training sampler's ``shard_passes``), and the item-by-item skip
that Pet used before and still uses for a sampler without ``shard_passes`` (the same sampler, seen only
through iteration). Both must give the same batch, which the benchmark checks. Each number is the median
over the repeats of the slower rank: what a restarted run waits for. No image is loaded either way.
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
from pet.data.samplers import GroupedBatchSampler, TrainingSampler

from .common import format_fingerprint, interleaved


class _ItemByItem(torch.utils.data.Sampler):
    """A sampler seen only through iteration: the batch sampler then skips by drawing every skipped item."""

    def __init__(self, sampler: torch.utils.data.Sampler) -> None:
        self.sampler = sampler

    def __iter__(self):
        return iter(self.sampler)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iters", type=int, nargs="+", default=[10, 90_000, 900_000],
                        help="iterations to resume from")
    parser.add_argument("--world-size", type=int, default=2, help="processes the demo's batch is shared by")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/resume_skip.json")


def _first_batch_after(batcher: GroupedBatchSampler, start_iter: int) -> tuple[float, list]:
    batcher.set_start_iter(start_iter)
    start = time.perf_counter()
    batch = next(iter(batcher))
    return time.perf_counter() - start, batch


def resume_skip(args: argparse.Namespace, fingerprint: dict) -> dict:
    """Seconds to the first batch after ``set_start_iter(n)``, per n, with each way of skipping."""
    torch.set_num_threads(1)
    logging.getLogger("pet").setLevel(logging.WARNING)
    cfg = load_cfg(os.path.join("cfgs", "shapes", "faster_rcnn_R-10-FPN.yaml"), ["DEVICE", "cpu",
                                                                                  "DATA.NUM_WORKERS", "0"])
    demo = build_train_loader(cfg).batch_sampler
    if not isinstance(demo, GroupedBatchSampler):
        raise SystemExit(f"the demo config no longer groups its batches ({type(demo).__name__}); update this benchmark")
    size, group_ids, world_size = len(demo.group_ids), demo.group_ids, args.world_size
    batch_size = cfg.SOLVER.IMS_PER_BATCH // world_size

    def batcher(rank: int, item_by_item: bool):
        sampler = TrainingSampler(size, demo.sampler.seed, rank=rank, world_size=world_size)
        return GroupedBatchSampler(_ItemByItem(sampler) if item_by_item else sampler, group_ids, batch_size)

    result: dict = {"images": size, "groups": int(len(set(group_ids.tolist()))), "batch_per_process": batch_size,
                    "world_size": world_size, "repeats": args.repeats, "iters": {}}
    def slower_rank(start_iter: int, item_by_item: bool) -> tuple[float, list]:
        runs = [_first_batch_after(batcher(rank, item_by_item), start_iter) for rank in range(world_size)]
        return max(seconds for seconds, _ in runs), [batch for _, batch in runs]

    for n in args.iters:
        samples = interleaved({"arithmetic": partial(slower_rank, n, False),
                               "item_by_item": partial(slower_rank, n, True)}, args.repeats)
        if any(a[1] != b[1] for a, b in zip(samples["arithmetic"], samples["item_by_item"])):
            raise SystemExit(f"the two skips disagree on the first batch after iteration {n}")
        seconds = {way: [s for s, _ in runs] for way, runs in samples.items()}
        result["iters"][n] = {**{way: statistics.median(s) for way, s in seconds.items()}, "samples_s": seconds}
    print(format_fingerprint(fingerprint))
    print(f"first batch after set_start_iter(n): demo sampler, {size} images in {result['groups']} size groups, "
          f"{batch_size} per process x {world_size} processes; slower rank, median of {args.repeats}")
    print(f"{'n':>9} {'arithmetic ms':>14} {'item by item ms':>16} {'ratio':>7}")
    for n, r in result["iters"].items():
        print(f"{n:>9} {r['arithmetic'] * 1e3:>14.2f} {r['item_by_item'] * 1e3:>16.2f} "
              f"{r['item_by_item'] / r['arithmetic']:>7.1f}")
    return result
