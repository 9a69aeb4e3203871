"""low-data: does a strong augmentation pipeline raise AP when the training images are few?

    python tools/benchmark.py low-data [--models faster_rcnn rtdetr] [--seeds 1 2 3] [--train-images 150]
        [--arms default strong] [--strong lsj|mixup] [--strong-max-iter N]

Generates the shapes set with ``--train-images`` training images and the demo's 200 validation images (image i of
a split depends only on the set's seed and i, so the validation images are the demo's), then trains each model
from scratch with its shipped shapes config (``--max-iter`` overrides its iterations), once per seed with the
config's own pipeline and once with a strong one (``--strong``, :data:`STRONG`) in ``INPUT.AUGMENTATIONS``: same
iterations, so the same number of images seen, in alternating order (default, strong, default, ...) so that the
machine's drift falls on both.
Each run ends with the validation of its last iteration (``val/bbox.json``); the table gives bbox AP and AP50 per
run, their mean and spread per arm, and each arm's training wall clock (whether the strong pipeline cost time).
``--strong-max-iter`` gives the strong arm fewer iterations than the default one, so that both train for the same
wall clock where a strong step costs more (the LSJ pipeline's images are all 256 x 256, its loader works more);
``--arms`` runs one arm only.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from pycocotools.coco import COCO

from pet.data import generate_shapes

from .common import format_fingerprint
from .strict_iou_ap import strict_ap

__all__ = ["STRONG", "add_arguments", "low_data"]

CONFIGS = {"faster_rcnn": "cfgs/shapes/faster_rcnn_R-10-FPN.yaml", "rtdetr": "cfgs/shapes/rtdetr_R-18.yaml"}

# The strong pipelines, for the shapes' 192-256 px images. "lsj": photometric distortion with hue, large-scale jitter
# to a 256 px square (scale 0.5-1.5: objects of 12-96 px become 6-144 px), flip. "mixup": every other image blended
# with another (both label sets kept), flip, the native sizes kept: a step costs what the default pipeline's does;
# "late-mixup": the same from iteration 400 on.
STRONG = {
    "lsj": [
        {"type": "RandomPhotometricDistort", "p": 0.5},
        {"type": "ScaleJitter", "target_size": [256, 256], "scale_range": [0.5, 1.5]},
        {"type": "RandomCrop", "size": [256, 256], "pad_if_needed": True},
        {"type": "SanitizeBoundingBoxes", "min_size": 2},
        {"type": "RandomHorizontalFlip"},
    ],
    "mixup": [
        {"type": "MixUp", "p": 0.5},
        {"type": "RandomHorizontalFlip"},
    ],
    # Mixup from iteration 400 on, once RT-DETR's box loss has left its early plateau (iterations 300-400 of its
    # 1000), where 150 images start to be memorised: DEIM's first stage without strong augmentation, in iterations.
    "late-mixup": [
        {"type": "MixUp", "p": 0.5, "from_iter": 400},
        {"type": "RandomHorizontalFlip"},
    ],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", choices=sorted(CONFIGS), default=["faster_rcnn", "rtdetr"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--train-images", type=int, default=150)
    parser.add_argument("--max-iter", type=int, default=0, help="iterations per run (0: the config's)")
    parser.add_argument("--strong-max-iter", type=int, default=0,
                        help="the strong arm's iterations (0: as the default arm's), for equal wall clock")
    parser.add_argument("--arms", nargs="+", choices=["default", "strong"], default=["default", "strong"])
    parser.add_argument("--strong", choices=sorted(STRONG), default="lsj", help="the strong arm's pipeline")
    parser.add_argument("--data", default="data/low_data", help="where the small set is generated")
    parser.add_argument("--ckpts", default="ckpts/low_data", help="where the runs write")
    parser.add_argument("--out", default="benchmarks/low_data.json")


def _train(cfg_file: str, ckpt: str, seed: int, root: str, max_iter: int, strong: list[dict] | None) -> float:
    """Train (and test) one run in its own process; its wall clock in seconds."""
    custom = [{"name": "low_train", "path": f"{root}/annotations/train.json", "images": f"{root}/train"},
              {"name": "low_val", "path": f"{root}/annotations/val.json", "images": f"{root}/val"}]
    opts = ["CKPT", ckpt, "SEED", str(seed), "DATA.CUSTOM", repr(custom),
            "TRAIN.DATASETS", "('low_train',)", "TEST.DATASETS", "('low_val',)", "TRAIN.AUTO_RESUME", "False"]
    if max_iter:
        opts += ["SOLVER.MAX_ITER", str(max_iter)]
    if strong:
        opts += ["INPUT.AUGMENTATIONS", repr(strong)]
    start = time.perf_counter()
    subprocess.run([sys.executable, "tools/train_net.py", "--cfg", cfg_file, *opts], check=True,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def low_data(args: argparse.Namespace, fingerprint: dict) -> dict:
    root = generate_shapes(os.path.join(args.data, f"shapes{args.train_images}"), num_train=args.train_images,
                           num_val=200, seed=0)
    gt = COCO(os.path.join(root, "annotations", "val.json"))
    pipeline = STRONG[args.strong]
    result: dict = {"train_images": args.train_images, "strong": args.strong, "pipeline": pipeline, "runs": []}
    for model in args.models:
        for seed in args.seeds:
            for strong in (False, True) if seed % 2 else (True, False):
                arm = "strong" if strong else "default"
                if arm not in args.arms:
                    continue
                ckpt = os.path.join(args.ckpts, f"{model}_{arm}_s{seed}")
                max_iter = (args.strong_max_iter or args.max_iter) if strong else args.max_iter
                seconds = _train(CONFIGS[model], ckpt, seed, root, max_iter, pipeline if strong else None)
                ap = strict_ap(gt, os.path.join(ckpt, "val", "bbox.json"))
                result["runs"].append({"model": model, "arm": arm, "seed": seed, "train_s": seconds,
                                       "max_iter": max_iter, **ap})
                print(f"{model} {arm} seed {seed}: AP {ap['AP']:.1f} AP50 {ap['AP50']:.1f} in {seconds:.0f} s",
                      flush=True)
    print(format_fingerprint(fingerprint))
    print(f"shapes with {args.train_images} training images, 200 validation images; seeds {args.seeds}; "
          f"strong pipeline {args.strong}")
    print("| model | pipeline | AP per seed | AP mean (spread) | AP50 mean | wall clock per run |")
    print("|---|---|---|---|---|---|")
    for model in args.models:
        for arm in args.arms:
            runs = [r for r in result["runs"] if r["model"] == model and r["arm"] == arm]
            aps = [r["AP"] for r in runs]
            print(f"| {model} | {arm} | {', '.join(f'{a:.1f}' for a in aps)} | {statistics.mean(aps):.1f} "
                  f"({min(aps):.1f}-{max(aps):.1f}) | {statistics.mean(r['AP50'] for r in runs):.1f} | "
                  f"{statistics.mean(r['train_s'] for r in runs):.0f} s |")
    return result
