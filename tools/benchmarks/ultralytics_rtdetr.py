"""Ultralytics' own RT-DETR trainer on the shapes set, for a wall-clock budget: the same-budget rival of
``cfgs/shapes/rtdetr_R-18.yaml`` (docs/benchmarks/rtdetr.md#rt-detr-on-the-shapes-set).

Run it with a Python that has ultralytics (a venv of its own: ultralytics is the yardstick, not a dependency of
Pet, and it pulls opencv-python, which would replace the project's opencv-python-headless; it is imported only
when this benchmark runs)::

    python -m venv --system-site-packages /tmp/ulvenv && /tmp/ulvenv/bin/pip install ultralytics
    /tmp/ulvenv/bin/python tools/benchmark.py ultralytics-rtdetr --minutes 10 --work-dir /tmp/ul_rtdetr

Steps: Pet's COCO files of the shapes set are converted to YOLO labels by Ultralytics' own ``convert_coco``
(category id c -> class c - 1, the pictures linked one by one, not copied); ``RTDETR(--model)`` is built from
its yaml (random weights: no pretrained backbone exists here, as for Pet) and trained with Ultralytics' defaults
but for ``--imgsz``, ``--batch``, ``--workers``, ``--threads``, the CPU and ``time`` (its wall-clock limit, which
overrides epochs); the last weights predict shapes_val and the detections are scored by pycocotools against Pet's
own val.json, as test_net scores Pet's. Prints one JSON line: the budget, the iterations reached, the time per
iteration and the AP (``--out`` keeps it with the machine and the command).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from typing import Any

from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from .common import format_fingerprint, reference_package

__all__ = ["add_arguments", "ultralytics_rtdetr"]


def to_yolo(data_root: str, out: str) -> str:
    """YOLO layout of ``data_root`` (Pet's shapes set) under ``out``; returns the data.yaml path."""
    from ultralytics.data.converter import convert_coco

    shutil.rmtree(os.path.join(out, "yolo"), ignore_errors=True)  # convert_coco would write to yolo2, yolo3, ...
    convert_coco(labels_dir=os.path.join(data_root, "annotations"), save_dir=os.path.join(out, "yolo"),
                 use_segments=False, use_keypoints=False, cls91to80=False)
    root = os.path.join(out, "yolo")
    os.makedirs(os.path.join(root, "images"), exist_ok=True)
    for split in ("train", "val"):
        # One link per picture: Ultralytics resolves a linked folder and then finds no labels beside it.
        os.makedirs(os.path.join(root, "images", split))
        for name in os.listdir(os.path.join(data_root, split)):
            os.symlink(os.path.abspath(os.path.join(data_root, split, name)), os.path.join(root, "images", split, name))
    with open(os.path.join(data_root, "annotations", "train.json")) as f:
        names = [c["name"] for c in sorted(json.load(f)["categories"], key=lambda c: c["id"])]
    data_yaml = os.path.join(root, "data.yaml")
    with open(data_yaml, "w") as f:
        f.write(f"path: {os.path.abspath(root)}\ntrain: images/train\nval: images/val\nnames:\n")
        f.writelines(f"  {i}: {name}\n" for i, name in enumerate(names))
    return data_yaml


def score(weights: str, data_root: str, imgsz: int, out: str) -> dict[str, float]:
    """pycocotools' bbox AP of ``weights`` on shapes_val (class c -> category id c + 1)."""
    from ultralytics import RTDETR

    gt = COCO(os.path.join(data_root, "annotations", "val.json"))
    model = RTDETR(weights)
    results = []
    for image in gt.dataset["images"]:
        pred = model.predict(os.path.join(data_root, "val", image["file_name"]), imgsz=imgsz, conf=0.001,
                             max_det=100, device="cpu", verbose=False)[0].boxes
        for (x0, y0, x1, y1), s, c in zip(pred.xyxy.tolist(), pred.conf.tolist(), pred.cls.tolist()):
            results.append({"image_id": image["id"], "category_id": int(c) + 1, "score": s,
                            "bbox": [x0, y0, x1 - x0, y1 - y0]})
    with open(os.path.join(out, "bbox.json"), "w") as f:
        json.dump(results, f)
    if not results:
        return {"AP": 0.0, "AP50": 0.0, "AP75": 0.0}
    evaluator = COCOeval(gt, gt.loadRes(results), "bbox")
    evaluator.evaluate()
    evaluator.accumulate()
    evaluator.summarize()
    return {"AP": 100 * evaluator.stats[0], "AP50": 100 * evaluator.stats[1], "AP75": 100 * evaluator.stats[2]}


def seconds_per_step(ends: list[float]) -> float:
    """Mean time between the last half of the step ends (the first steps include the loader's start)."""
    half = ends[len(ends) // 2:]
    return (half[-1] - half[0]) / (len(half) - 1) if len(half) > 1 else float("nan")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-root", default="data/shapes", help="Pet's generated shapes set")
    parser.add_argument("--model", default="rtdetr-resnet50.yaml", help="Ultralytics' model yaml (rtdetr-l.yaml, ...)")
    parser.add_argument("--minutes", type=float, default=10.0, help="training wall clock (Ultralytics' `time`)")
    parser.add_argument("--imgsz", type=int, default=256, help="the shapes pictures are 192-256 px")
    parser.add_argument("--batch", type=int, default=8, help="Pet's shapes config trains at 8 images per step")
    parser.add_argument("--workers", type=int, default=1, help="loader processes, as Pet's shapes config")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads; 0 keeps Ultralytics' own choice, CPU count - 1 (1 on a 2-core machine)")
    parser.add_argument("--work-dir", default="/tmp/ultralytics_rtdetr",
                        help="the YOLO copy of the set, Ultralytics' run and the detections")
    parser.add_argument("--out", default="benchmarks/ultralytics_rtdetr.json")


def ultralytics_rtdetr(args: argparse.Namespace, fingerprint: dict) -> dict[str, Any]:
    """Train for ``--minutes``, then score the last weights; the JSON line it prints, as a dict."""
    with reference_package("ultralytics", "ultralytics-rtdetr",
                           "run it with a venv that has it (docs/benchmarks/rtdetr.md says how)."):
        from ultralytics import RTDETR
        from ultralytics.utils import SETTINGS, torch_utils
    print(format_fingerprint(fingerprint))
    if args.threads:
        torch_utils.NUM_THREADS = args.threads  # what its select_device() sets torch to on a CPU
    os.makedirs(args.work_dir, exist_ok=True)
    data_yaml = to_yolo(args.data_root, args.work_dir)
    model = RTDETR(args.model)
    steps = []
    model.add_callback("on_train_batch_end", lambda trainer: steps.append(time.perf_counter()))
    start = time.perf_counter()
    # MLflow off (in Ultralytics' settings file): it would otherwise log into the working directory.
    SETTINGS.update(mlflow=False)
    model.train(data=data_yaml, epochs=1000, time=args.minutes / 60, imgsz=args.imgsz, batch=args.batch,
                workers=args.workers, device="cpu", project=args.work_dir, name="train", exist_ok=True, val=False,
                plots=False, amp=False, pretrained=False)
    trained = time.perf_counter() - start
    weights = os.path.join(args.work_dir, "train", "weights", "last.pt")
    ap = score(weights, args.data_root, args.imgsz, args.work_dir)
    result = {"model": args.model, "minutes": args.minutes, "train_s": round(trained, 1),
              "iterations": len(steps), "s_per_iter_last_half": round(seconds_per_step(steps), 3),
              "threads": torch_utils.NUM_THREADS, "imgsz": args.imgsz, "batch": args.batch,
              **{k: round(v, 2) for k, v in ap.items()}}
    print(json.dumps(result))
    return result
