"""augmentations: milliseconds per training image of each transform, alone and in recipes, opencv against v2.

    python tools/benchmark.py augmentations [--cfg FILE] [--opts KEY VALUE ...] [--samples 300] [--warmup 20]

What a DataLoader worker spends on one image between its decode and the collator: the CPU time of the mapper's call
(transforms, boxes, masks with MODEL.MASK_ON, packing), on the training set of ``--cfg`` (the shapes demo by
default), with ``torch.set_num_threads(1)`` and ``cv2.setNumThreads(1)`` as in a worker. The thread's CPU time, not
the clock (which the table gives alongside): on a machine shared with other work the clock also counts the waits for
a core. Cases, all on the same images with the same per-image seeds:

- the loader's JPEG decode, which every other case leaves out: the scale to read them against;
- the two mappers with nothing to do, :class:`~pet.data.mapper.DatasetMapper` (opencv) and
  :class:`~pet.data.mapper.AugmentedMapper` (a v2 pipeline): each one's fixed cost, and the gap between them is
  what choosing ``INPUT.AUGMENTATIONS`` costs before any transform runs;
- the config's default mapper (INPUT.MIN_SIZE_TRAIN, FLIP_PROB, BRIGHTNESS...) and the same recipe written as a
  v2 pipeline; the config's own INPUT.AUGMENTATIONS, and the recipes of the shipped configs that have one;
- Pet's opencv flip and shorter-side resize against v2's, applied to every image;
- each transform alone in a v2 pipeline, forced to apply (``p`` 1) so the figure is its cost when it fires; a
  recipe's expected cost weighs it by its probability. The transforms that mix images (Mosaic, MixUp,
  CopyPaste) decode the images they draw: that decode is part of their cost in training too.

Each image goes through every case in one round, the case going first rotating; the first ``--warmup`` rounds
are dropped. "own" is a case's median less the median of its mapper with nothing to do; the mean is the figure that
sets a worker's images per second (RandomIoUCrop's retries make a long tail). The output says how much CPU other
processes used meanwhile: on a shared machine the figures are indicative (caches and memory bandwidth are shared too).
"""
from __future__ import annotations

import argparse
import copy
import logging
import os
import shutil
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from fvcore.common.config import CfgNode

from pet.config import load_cfg
from pet.data import build_train_loader, read_image
from pet.data.augmentations import AUGMENTATIONS, AugmentationPipeline, build_pipeline
from pet.data.mapper import AugmentedMapper, DatasetMapper
from pet.data.transforms import RandomFlip, ResizeShortestEdge

from .common import REPO, format_fingerprint, interleaved

DEMO_CFG = os.path.join("cfgs", "shapes", "faster_rcnn_R-10-FPN.yaml")
# Shipped configs whose INPUT.AUGMENTATIONS are measured as whole recipes, when they have one.
RECIPE_CFGS = (("RT-DETR recipe (cfgs/coco/rtdetr_R-50.yaml)", os.path.join("cfgs", "coco", "rtdetr_R-50.yaml")),
               ("LSJ recipe (cfgs/coco/mask_rcnn_R-50-FPN_lsj_100ep.yaml)",
                os.path.join("cfgs", "coco", "mask_rcnn_R-50-FPN_lsj_100ep.yaml")))
# The output size of the resizing cases: RT-DETR's and YOLO's training size.
SIZE = 640
# Each transform alone, as applied every time.
ALONE = (
    ("RandomPhotometricDistort", [{"type": "RandomPhotometricDistort", "p": 1.0}]),
    ("RandomZoomOut", [{"type": "RandomZoomOut", "fill": 0, "p": 1.0}]),
    ("RandomIoUCrop", [{"type": "RandomIoUCrop", "p": 1.0}]),
    ("SanitizeBoundingBoxes", [{"type": "SanitizeBoundingBoxes", "min_size": 1}]),
    (f"Resize {SIZE}x{SIZE}", [{"type": "Resize", "size": [SIZE, SIZE]}]),
    (f"ScaleJitter + RandomCrop {SIZE} (LSJ)", [
        {"type": "ScaleJitter", "target_size": [SIZE, SIZE], "scale_range": [0.1, 2.0]},
        {"type": "RandomCrop", "size": [SIZE, SIZE], "pad_if_needed": True, "fill": 0}]),
    (f"Mosaic {SIZE}", [{"type": "Mosaic", "size": SIZE}]),
    ("MixUp", [{"type": "MixUp"}]),
    ("CopyPaste", [{"type": "CopyPaste"}]),
)


@dataclass
class _Case:
    """One row: a mapper, the mapper with nothing to do it is compared with, and what it gave per image."""

    name: str
    group: str
    mapper: Callable[..., dict[str, Any]]
    baseline: str
    ms: list[float]
    sizes: Counter


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cfg", default=DEMO_CFG, help="config whose training set and default mapper are measured")
    parser.add_argument("--opts", nargs="*", default=[], help="KEY VALUE pairs for the config")
    parser.add_argument("--samples", type=int, default=300, help="timed images per case")
    parser.add_argument("--warmup", type=int, default=20, help="images per case before timing")
    parser.add_argument("--out", default="benchmarks/augmentations.json")


def _v2_default_recipe(cfg: CfgNode) -> list[dict[str, Any]] | None:
    """The config's INPUT.MIN_SIZE_TRAIN / FLIP_PROB / BRIGHTNESS... recipe as INPUT.AUGMENTATIONS entries; None when
    it crops (INPUT.CROP has no v2 twin: its crop around an object is Pet's)."""
    if cfg.INPUT.CROP.ENABLED:
        return None
    specs: list[dict[str, Any]] = []
    scales = [int(s) for s in cfg.INPUT.MIN_SIZE_TRAIN]
    if any(scales):
        specs.append({"type": "RandomShortestSize", "min_size": scales, "max_size": int(cfg.INPUT.MAX_SIZE_TRAIN)})
    if cfg.INPUT.FLIP_PROB > 0:
        specs.append({"type": "RandomHorizontalFlip", "p": float(cfg.INPUT.FLIP_PROB)})
    jitter = {k.lower(): float(cfg.INPUT[k]) for k in ("BRIGHTNESS", "CONTRAST", "SATURATION") if cfg.INPUT[k]}
    if jitter:
        specs.append({"type": "ColorJitter", **jitter})
    return specs


def _cases(cfg: CfgNode, mask_on: bool, flip_map: Sequence[int] | None) -> tuple[list[_Case], dict[str, str]]:
    """The rows, and the cases left out with the reason."""
    cases: list[_Case] = []
    skipped: dict[str, str] = {}

    def add(name: str, group: str, mapper: Callable[..., dict[str, Any]], baseline: str) -> None:
        cases.append(_Case(name, group, mapper, baseline, [], Counter()))

    def pipeline(name: str, group: str, specs: Sequence[dict[str, Any]]) -> None:
        try:
            add(name, group, AugmentedMapper(build_pipeline(specs, keypoint_flip_map=flip_map), mask_on=mask_on),
                "v2 pipeline, no transform")
        except Exception as error:  # noqa: BLE001 - a transform another version lacks: say so, measure the rest
            skipped[name] = f"{type(error).__name__}: {error}"

    add("JPEG decode (for scale, not a mapper)", "fixed cost", _decode, "JPEG decode (for scale, not a mapper)")
    add("opencv mapper, no transform", "fixed cost", DatasetMapper([], mask_on=mask_on), "opencv mapper, no transform")
    add("v2 pipeline, no transform", "fixed cost", AugmentedMapper(AugmentationPipeline([]), mask_on=mask_on),
        "v2 pipeline, no transform")
    add("default mapper (opencv)", "recipe",
        DatasetMapper.from_config(cfg, True, mask_on=mask_on, keypoint_flip_map=flip_map),
        "opencv mapper, no transform")
    v2_default = _v2_default_recipe(cfg)
    if v2_default is None:
        skipped["default recipe in v2"] = "INPUT.CROP is on: Pet's crop around an object has no v2 twin"
    else:
        pipeline("default recipe in v2", "recipe", v2_default)
    if cfg.INPUT.AUGMENTATIONS:
        pipeline("the config's INPUT.AUGMENTATIONS", "recipe", cfg.INPUT.AUGMENTATIONS)
    for name, path in RECIPE_CFGS:
        specs = load_cfg(os.path.join(REPO, path)).INPUT.AUGMENTATIONS
        if specs:
            pipeline(name, "recipe", specs)
        else:
            skipped[name] = f"{path} has no INPUT.AUGMENTATIONS"
    add("opencv RandomFlip", "opencv vs v2, every image", DatasetMapper([RandomFlip(1.0)], mask_on=mask_on),
        "opencv mapper, no transform")
    pipeline("v2 RandomHorizontalFlip", "opencv vs v2, every image", [{"type": "RandomHorizontalFlip", "p": 1.0}])
    add(f"opencv ResizeShortestEdge {SIZE}", "opencv vs v2, every image",
        DatasetMapper([ResizeShortestEdge(SIZE, SIZE)], mask_on=mask_on), "opencv mapper, no transform")
    pipeline(f"v2 RandomShortestSize {SIZE}", "opencv vs v2, every image",
             [{"type": "RandomShortestSize", "min_size": SIZE, "max_size": SIZE}])
    for name, specs in ALONE:
        if specs[0]["type"] not in AUGMENTATIONS:
            skipped[name] = f"{specs[0]['type']} is not registered in this version of Pet"
            continue
        if specs[0]["type"] == "CopyPaste" and not mask_on:  # box-only labels: it pastes box rectangles
            specs, name = [{**specs[0], "rectangles": True}], "CopyPaste (rectangles: no masks)"
        pipeline(name, "alone, every image", specs)
    return cases, skipped


def _decode(record: dict[str, Any], image: np.ndarray, rng: np.random.Generator) -> dict[str, Any]:
    """What every case leaves out, the loader's decode of the image file: the scale the other rows compare with."""
    decoded = read_image(record["file_name"], record["image_id"])
    return {"image_size": decoded.shape[:2]}


def _timed(case: _Case, inputs: list[tuple[dict, np.ndarray, int]], dataset: Any) -> Callable[[], tuple[float, float]]:
    """A call that maps the case's next image and returns its (CPU, wall) milliseconds. The copies it is given are
    made outside the clock (a mapper may change its record). CPU time is this thread's: with one torch and one opencv
    thread all the work runs on it, and time spent waiting for a core another process holds does not count."""
    position = iter(range(len(inputs)))

    def run() -> tuple[float, float]:
        record, image, seed = inputs[next(position)]
        record, image, rng = copy.deepcopy(record), image.copy(), np.random.default_rng(seed)
        kwargs = {"dataset": dataset} if isinstance(case.mapper, AugmentedMapper) else {}
        wall, cpu = time.perf_counter(), time.thread_time()
        sample = case.mapper(record, image, rng, **kwargs)
        cpu, wall = (time.thread_time() - cpu) * 1e3, (time.perf_counter() - wall) * 1e3
        case.sizes[tuple(sample["image_size"])] += 1
        return cpu, wall

    return run


def _cpu_busy_seconds() -> float | None:
    """Seconds all CPUs spent busy since boot (/proc/stat), None where there is no /proc."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    user, nice, system, idle, iowait, irq, softirq = (fields + [0] * 7)[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")  # not the hypervisor's steal


def _lscpu_model() -> str:
    """``lscpu``'s Model name ('' where there is no lscpu)."""
    if not shutil.which("lscpu"):
        return ""
    lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout.splitlines()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "")


def augmentations(args: argparse.Namespace, fingerprint: dict) -> dict:
    """Median and mean milliseconds per image of every case; the share of the cores other processes took."""
    import cv2

    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    logging.getLogger("pet").setLevel(logging.WARNING)
    cfg = load_cfg(args.cfg, [*args.opts, "DEVICE", "cpu", "DATA.NUM_WORKERS", "0"])
    dataset = build_train_loader(cfg).dataset
    mask_on = bool(cfg.MODEL.MASK_ON)
    flip_map = dataset.keypoint_meta.flip_map if dataset.keypoint_meta else None
    cases, skipped = _cases(cfg, mask_on, flip_map)
    rounds = args.warmup + args.samples
    order = np.random.default_rng(0).permutation(len(dataset))[:rounds]
    inputs = [(*dataset.load(int(i)), int(i)) for i in np.resize(order, rounds)]  # decoded before the clock
    busy_start, cpu_start, wall_start = _cpu_busy_seconds(), time.process_time(), time.perf_counter()
    samples = interleaved({c.name: _timed(c, inputs, dataset) for c in cases}, rounds)
    wall = time.perf_counter() - wall_start
    own_cpu, busy_end = time.process_time() - cpu_start, _cpu_busy_seconds()
    others = None if busy_start is None else max(0.0, (busy_end - busy_start - own_cpu) / wall)
    cpu = {name: [c for c, _ in runs[args.warmup:]] for name, runs in samples.items()}
    medians = {name: statistics.median(ms) for name, ms in cpu.items()}
    rows = []
    for case in cases:
        wall_ms = [w for _, w in samples[case.name][args.warmup:]]
        size = case.sizes.most_common(1)[0][0]
        rows.append({"case": case.name, "group": case.group, "median_ms": medians[case.name],
                     "mean_ms": statistics.fmean(cpu[case.name]), "median_wall_ms": statistics.median(wall_ms),
                     "own_ms": medians[case.name] - medians[case.baseline], "baseline": case.baseline,
                     "typical_size": list(size), "samples_cpu_ms": cpu[case.name], "samples_wall_ms": wall_ms})
    cores = os.cpu_count() or 1
    result = {"cfg": args.cfg, "opts": args.opts, "mask_on": mask_on, "images": len(dataset),
              "samples": args.samples, "warmup": args.warmup, "lscpu_model_name": _lscpu_model(),
              "other_processes_cores": others, "load_average": list(os.getloadavg()), "wall_s": wall,
              "rows": rows, "skipped": skipped}
    _print_table(result, fingerprint, cores)
    return result


def _print_table(result: dict, fingerprint: dict, cores: int) -> None:
    print(format_fingerprint(fingerprint))
    print(f"lscpu Model name: {result['lscpu_model_name'] or 'n/a'}")
    others = result["other_processes_cores"]
    if others is None:
        print(f"load average {result['load_average'][0]:.2f} on {cores} cores (no /proc/stat to tell others' share)")
    elif others >= 0.1:
        print(f"shared machine: other processes used {others:.2f} of the {cores} cores on average while this ran "
              f"(load average {result['load_average'][0]:.2f}); the figures are indicative")
    else:
        print(f"quiet machine: other processes used {others:.2f} of the {cores} cores while this ran")
    print(f"\nCPU ms per training image (the mapper's call; the decode is not in it), {result['cfg']} training set, "
          f"masks {'on' if result['mask_on'] else 'off'}; median and mean of {result['samples']} images after "
          f"{result['warmup']}, 1 thread; wall: the median by the clock. own: the median less that of the same "
          "mapper with no transform.\n")
    print("| case | group | output (h x w, most often) | median ms | mean ms | wall ms | own ms |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in result["rows"]:
        h, w = r["typical_size"]
        print(f"| {r['case']} | {r['group']} | {h} x {w} | {r['median_ms']:.2f} | {r['mean_ms']:.2f} "
              f"| {r['median_wall_ms']:.2f} | {r['own_ms']:+.2f} |")
    for name, why in result["skipped"].items():
        print(f"\nnot measured: {name}: {why}")
