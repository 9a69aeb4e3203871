"""predict: tools/predict.py's promises measured with a trained model (the demo's, CKPT/model_final.pth).

- ``stream``: N generated shapes images through ``Predictor.stream``: resident memory of the process and its
  DataLoader workers after image 200 and after image N, and images/s against test_net's loop
  (``evaluate_on_datasets``, the same images, batch size, precision and workers), in alternating runs.
- ``video``: a generated mp4 (a 256x256 window panning over a scene) through tools/predict.py-equivalent code
  with ``--vid-stride``: frames/s, and the output mp4's frame count by decoding it.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from typing import Any

import cv2
import numpy as np
import torch
from torchvision.ops import box_iou

from pet.config import load_cfg
from pet.data import generate_shapes
from pet.engine.build import build_test_hooks
from pet.engine.inference import evaluate_on_datasets
from pet.predict import Detections, PredictionWriter, Predictor, Source

from .common import format_fingerprint, interleaved, test_support

if __package__ == "benchmarks":  # run by tools/benchmark.py: this package is top-level, tools/ on the path
    from make_scene import make_scene
else:  # imported as tools.benchmarks (the repository root on the path)
    from ..make_scene import make_scene

__all__ = ["add_arguments", "predict_benchmark", "match", "make_scene"]

DEMO = "cfgs/shapes/faster_rcnn_R-10-FPN.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--part", nargs="+", default=["stream", "video"], choices=["stream", "video"])
    parser.add_argument("--images", type=int, default=2000, help="stream: generated images")
    parser.add_argument("--batch", type=int, default=8, help="pictures (or tiles) per forward pass")
    parser.add_argument("--repeats", type=int, default=2, help="stream: alternating runs of test_net and predict")
    parser.add_argument("--tile", type=int, default=256)
    parser.add_argument("--tile-overlap", type=float, default=0.25)
    parser.add_argument("--frames", type=int, default=320, help="video: frames of the generated video")
    parser.add_argument("--vid-stride", type=int, default=2)
    parser.add_argument("--data", default="data/predict_benchmark", help="where the generated data is kept")
    parser.add_argument("--opts", nargs="*", default=[], help="config overrides (KEY VALUE ...)")
    parser.add_argument("--out", default="benchmarks/predict.json")


def match(det: Detections, gt_boxes: np.ndarray, gt_labels: np.ndarray, min_score: float = 0.5,
          iou: float = 0.5) -> dict[str, float]:
    """Recall and precision of the detections scoring ``min_score`` or more against the ground truth (same class,
    IoU >= ``iou``, greedy in score order), and how many of them hit an object another one already matched."""
    keep = np.flatnonzero(det.scores >= min_score)
    keep = keep[np.argsort(-det.scores[keep], kind="stable")]
    ious = box_iou(torch.from_numpy(det.boxes[keep]).float(), torch.from_numpy(gt_boxes).float()).numpy()
    matched = np.zeros(len(gt_boxes), dtype=bool)
    true_positives = duplicates = 0
    for row, index in enumerate(keep):
        hits = (ious[row] >= iou) & (gt_labels == det.labels[index])
        free = hits & ~matched
        if free.any():
            matched[np.flatnonzero(free)[np.argmax(ious[row][free])]] = True
            true_positives += 1
        elif hits.any():
            duplicates += 1
    return {"objects": len(gt_boxes), "detections": len(keep), "recall": float(matched.mean()),
            "precision": true_positives / max(len(keep), 1), "matched_twice": duplicates}


def _cfg(args: argparse.Namespace, *opts: str):
    return load_cfg(DEMO, ["TEST.IMS_PER_BATCH", str(args.batch), *args.opts, *opts])


# --------------------------------------------------------------------------------------------- stream
def _stream(args: argparse.Namespace) -> dict[str, Any]:
    root = generate_shapes(os.path.join(args.data, f"shapes{args.images}"), num_train=0, num_val=args.images, seed=7)
    data = ["DATA.CUSTOM", f"[{{'name': 'bench_val', 'json': '{root}/annotations/val.json', 'images': '{root}/val'}}]",
            "TEST.DATASETS", "('bench_val',)", "TEST.DIAGNOSTICS.ENABLED", "False"]
    cfg = _cfg(args, *data)
    predictor = Predictor(cfg)
    memory: list[dict[str, float]] = []

    def test_net() -> float:
        timer, hooks = build_test_hooks(cfg)
        with tempfile.TemporaryDirectory() as out:
            evaluate_on_datasets(cfg, predictor.model, out, timer, hooks)
        return timer.speed_summary()["images_per_second"]

    process_tree_rss = test_support("memory").process_tree_rss

    def predict() -> float:
        rss = {}
        for count, _ in enumerate(predictor.stream(f"{root}/val"), 1):
            if count in (200, args.images):
                rss[count] = process_tree_rss() / 2**20
        memory.append(rss)
        return predictor.stats.timer.speed_summary()["images_per_second"]

    speeds = interleaved({"test_net": test_net, "predict": predict}, args.repeats)
    print(f"stream: {args.images} images, batch {args.batch}, {cfg.DATA.NUM_WORKERS} worker(s), {predictor.precision}")
    for name, values in speeds.items():
        print(f"  {name:>8}: {statistics.median(values):7.2f} images/s (runs: {', '.join(f'{v:.2f}' for v in values)})")
    for rss in memory:
        print(f"  RSS of the process and its workers: {rss[200]:.1f} MB after image 200, {rss[args.images]:.1f} MB "
              f"after image {args.images} ({rss[args.images] - rss[200]:+.1f} MB)")
    return {"images": args.images, "batch": args.batch, "images_per_second": speeds, "rss_mb": memory}


# --------------------------------------------------------------------------------------------- video
def _video(args: argparse.Namespace) -> dict[str, Any]:
    scene, _, _ = make_scene(os.path.join(args.data, "scene0"), tile=args.tile, overlap=args.tile_overlap)
    picture = cv2.imread(scene)
    path = os.path.join(args.data, "pan.mp4")
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), 25.0, (256, 256))
    for k in range(args.frames):  # a 256x256 window panning right along a row of the scene
        writer.write(picture[400:656, 8 * k:8 * k + 256])
    writer.release()
    predictor = Predictor(_cfg(args))
    source = Source(path)
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        with PredictionWriter(out, ["vis", "csv"], predictor.label_space, source, vid_stride=args.vid_stride) as w:
            for det in predictor.stream(source, args.batch, vid_stride=args.vid_stride, with_images=True):
                w.write(det)
        seconds = time.perf_counter() - start
        capture = cv2.VideoCapture(os.path.join(out, "vis", "pan.mp4"))
        decoded = 0
        while capture.read()[0]:
            decoded += 1
    frames = predictor.stats.pictures
    print(f"video: {args.frames} frames, --vid-stride {args.vid_stride}: {frames} predicted and written "
          f"(expected {math.ceil(args.frames / args.vid_stride)}), {decoded} decoded from the output mp4, "
          f"{frames / seconds:.2f} frames/s with the mp4 written")
    return {"frames": args.frames, "vid_stride": args.vid_stride, "predicted": frames, "decoded": decoded,
            "frames_per_second": frames / seconds}


def predict_benchmark(args: argparse.Namespace, machine: dict[str, Any]) -> dict[str, Any]:
    print(format_fingerprint(machine))
    parts = {"stream": _stream, "video": _video}
    return {part: parts[part](args) for part in args.part}

