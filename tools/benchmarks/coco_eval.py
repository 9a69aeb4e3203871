"""coco-eval: seconds of one COCO evaluation with pycocotools against faster-coco-eval, bbox and segm.

The data is tests/support/synthetic_coco.py's COCO-like set (default 5,000 images, 80 classes,
~7.3 objects per image, polygon masks, ~1 % crowd regions) and detections made from it the way a
trained detector errs (jittered boxes and masks, wrong classes, duplicates, misses, background;
at most 100 per image). A timed run is what COCOEvaluator.evaluate() does in tools/test_net.py:
:func:`pet.evaluation.backends.run_cocoeval` on a fresh copy of the ground truth (pycocotools
rewrites its polygons in place, so a second run on the same object would be cheaper), including
faster-coco-eval's copy of the ground truth, which periodic validation makes once per dataset (its
time is printed apart). The two backends alternate (tools/benchmarks/common.py); every run's 12
summary numbers are compared. The diagnostics (:mod:`pet.evaluation.diagnostics`) are timed once.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import logging
import statistics
import tempfile
import time
from functools import partial
from typing import Any

import numpy as np
from pycocotools.coco import COCO

from pet.evaluation import backends
from pet.evaluation.diagnostics import write_diagnostics

from .common import format_fingerprint, interleaved, test_support

BACKENDS = ("pycocotools", "faster")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--images", type=int, default=5000, help="images in the synthetic set")
    parser.add_argument("--classes", type=int, default=80)
    parser.add_argument("--tasks", nargs="+", default=["bbox", "segm"], choices=["bbox", "segm"])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per backend and task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/coco_eval.json")


def _fresh_coco(ground_truth: dict[str, Any]) -> COCO:
    """A new pycocotools object on a copy of the ground truth, as a dataset loads it."""
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO()
        coco.dataset = copy.deepcopy(ground_truth)
        coco.createIndex()
    return coco


def _timed_run(backend: str, ground_truth: dict, results: list[dict], task: str, stats: list) -> float:
    coco = _fresh_coco(ground_truth)  # not timed: the dataset is loaded before evaluation
    image_ids = [image["id"] for image in ground_truth["images"]]
    start = time.perf_counter()
    result = backends.run_cocoeval(coco, results, task, image_ids, backend)
    seconds = time.perf_counter() - start
    stats.append(result.stats)
    return seconds


def _ground_truth_copy_seconds(ground_truth: dict) -> float:
    """faster-coco-eval's one-off copy of a dataset's ground truth (cached for later evaluations)."""
    coco = _fresh_coco(ground_truth)
    start = time.perf_counter()
    backends._faster_ground_truth(coco)
    return time.perf_counter() - start


def _diagnostics_seconds(ground_truth: dict, results: list[dict], task: str, class_names: list[str]) -> float:
    coco = _fresh_coco(ground_truth)
    image_ids = [image["id"] for image in ground_truth["images"]]
    result = backends.run_cocoeval(coco, results, task, image_ids, "faster")
    category_ids = [c["id"] for c in ground_truth["categories"]]
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        write_diagnostics(out, task, result, coco, results, image_ids, class_names, category_ids)
        return time.perf_counter() - start


def _time_task(ground_truth: dict, results: list[dict], task: str, repeats: int) -> dict:
    stats: dict[str, list] = {backend: [] for backend in BACKENDS}
    samples = interleaved({backend: partial(_timed_run, backend, ground_truth, results, task, stats[backend])
                           for backend in BACKENDS}, repeats)
    median = {backend: statistics.median(samples[backend]) for backend in BACKENDS}
    difference = max(np.abs(a - b).max() for a in stats["pycocotools"] for b in stats["faster"])
    return {**median, "speedup": median["pycocotools"] / median["faster"], "max_abs_difference": float(difference),
            "stats": stats["pycocotools"][0].tolist(), "samples_seconds": samples}


def coco_eval(args: argparse.Namespace, fingerprint: dict) -> dict:
    """Median seconds per evaluation of each backend, per task, with the largest difference of the 12 numbers."""
    import faster_coco_eval  # a clear ImportError when the extra is missing: pip install faster-coco-eval

    logging.getLogger("pet").setLevel(logging.WARNING)
    start = time.perf_counter()
    synthetic = test_support("synthetic_coco")  # the tests' generator, one copy
    ground_truth = synthetic.synthetic_ground_truth(args.images, args.classes, seed=args.seed)
    detections = synthetic.synthetic_detections(ground_truth, seed=args.seed, masks="segm" in args.tasks)
    setup = time.perf_counter() - start
    class_names = [c["name"] for c in ground_truth["categories"]]
    annotations = ground_truth["annotations"]
    result: dict = {
        "images": args.images, "classes": args.classes, "objects": len(annotations),
        "crowd": sum(a["iscrowd"] for a in annotations), "detections": len(detections), "repeats": args.repeats,
        "faster_coco_eval": faster_coco_eval.__version__, "setup_seconds": setup,
        "ground_truth_copy_seconds": _ground_truth_copy_seconds(ground_truth), "tasks": {},
    }
    for task in args.tasks:
        other = "segmentation" if task == "bbox" else "bbox"
        results = [{k: v for k, v in d.items() if k != other} for d in detections]
        result["tasks"][task] = {**_time_task(ground_truth, results, task, args.repeats),
                                 "diagnostics_seconds": _diagnostics_seconds(ground_truth, results, task, class_names)}
    _print(result, fingerprint)
    return result


def _print(result: dict, fingerprint: dict) -> None:
    print(format_fingerprint(fingerprint))
    print(f"COCO evaluation, synthetic COCO-like set: {result['images']} images, {result['objects']} objects "
          f"({result['crowd']} crowd), {result['classes']} classes, {result['detections']} detections; "
          f"faster-coco-eval {result['faster_coco_eval']}; median of {result['repeats']} interleaved runs")
    print(f"{'task':<6} {'pycocotools s':>14} {'faster s':>9} {'speed-up':>9} {'max |diff| of 12':>17} "
          f"{'AP':>6} {'diagnostics s':>14}")
    for task, r in result["tasks"].items():
        print(f"{task:<6} {r['pycocotools']:>14.2f} {r['faster']:>9.2f} {r['speedup']:>8.2f}x "
              f"{r['max_abs_difference']:>17.1e} {r['stats'][0] * 100:>6.1f} {r['diagnostics_seconds']:>14.2f}")
    print(f"faster includes its copy of the ground truth, {result['ground_truth_copy_seconds']:.2f} s, made once per "
          "dataset (periodic validation reuses it)")
