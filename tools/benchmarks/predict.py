"""predict: tools/predict.py's promises measured with a trained model (the demo's, CKPT/model_final.pth).

- ``stream``: N generated shapes images through ``Predictor.stream``: resident memory of the process and its
  DataLoader workers after image 200 and after image N, and images/s against test_net's loop
  (``evaluate_on_datasets``, the same images, batch size, precision and workers), in alternating runs.
- ``tiles``: generated 4000x3000 scenes (tools/make_scene.py: 20-100 px objects, a third on tile seams) predicted
  whole and by tiles with each merge (and the whole-image pass): recall at IoU 0.5 of the detections scoring
  0.5 or more, their precision, ground-truth objects matched twice, seconds per scene.
- ``sahi``: the same scenes through Pet's tiling (batch 8 and 1, with and without the whole-image pass) and through
  SAHI's ``get_sliced_prediction`` of the same model (tools/benchmarks/sahi_pet.py: same tiles, test transform,
  precision and batch sizes; SAHI's default merge, with and without its whole-image pass). Needs a python with
  sahi installed (a separate venv: sahi is not a dependency of Pet).
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
from collections.abc import Callable
from typing import Any

import cv2
import numpy as np
import torch
from make_scene import make_scene
from torchvision.ops import box_iou

from benchmarks.common import format_fingerprint, interleaved, process_tree_rss
from pet.config import load_cfg
from pet.data import generate_shapes
from pet.engine.build import build_test_hooks
from pet.engine.inference import evaluate_on_datasets
from pet.predict import Detections, PredictionWriter, Predictor, Source
from pet.predict.tiling import TileSpec

__all__ = ["add_arguments", "predict_benchmark", "match"]

DEMO = "cfgs/shapes/faster_rcnn_R-10-FPN.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--part", nargs="+", default=["stream", "tiles", "video"],
                        choices=["stream", "tiles", "sahi", "video"], help="sahi: run with a python that has sahi")
    parser.add_argument("--images", type=int, default=2000, help="stream: generated images")
    parser.add_argument("--batch", type=int, default=8, help="pictures (or tiles) per forward pass")
    parser.add_argument("--repeats", type=int, default=2, help="stream: alternating runs of test_net and predict")
    parser.add_argument("--scenes", type=int, default=3, help="tiles: generated scenes (seeds 0, 1, ...)")
    parser.add_argument("--tile", type=int, default=256)
    parser.add_argument("--tile-overlap", type=float, default=0.25)
    parser.add_argument("--sahi-conf", type=float, default=0.3,
                        help="sahi: SAHI's confidence_threshold (its default): detections above it enter its merge")
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


# --------------------------------------------------------------------------------------------- tiles
def _warm(predict: Callable[[str], Detections], data: str) -> None:
    """One untimed prediction of a small random picture: oneDNN builds its kernels on first use."""
    path = os.path.join(data, "warm.png")
    if not os.path.exists(path):
        os.makedirs(data, exist_ok=True)
        cv2.imwrite(path, np.random.default_rng(0).integers(0, 256, (600, 800, 3), dtype=np.uint8))
    predict(path)


def _on_scenes(args: argparse.Namespace, runs: dict[str, Callable[[str], Detections]]
               ) -> dict[str, list[dict[str, float]]]:
    """Every run (a scene file -> its detections) on each generated scene, timed and scored with :func:`match`;
    the order of the runs rotates from scene to scene, as the machine's load drifts."""
    for predict in runs.values():
        _warm(predict, args.data)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    for seed in range(args.scenes):
        image, _, objects = make_scene(os.path.join(args.data, f"scene{seed}"), tile=args.tile,
                                       overlap=args.tile_overlap, seed=seed)
        gt_boxes = np.array([o["box"] for o in objects], dtype=np.float32)
        gt_labels = np.array([o["label"] + 1 for o in objects])
        names = list(runs)[seed % len(runs):] + list(runs)[:seed % len(runs)]
        for name in names:
            start = time.perf_counter()
            det = runs[name](image)
            seconds = time.perf_counter() - start
            results[name].append({**match(det, gt_boxes, gt_labels), "seconds": seconds})
    return results


def _scene_table(args: argparse.Namespace, results: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Print and return each run's recall and precision over all scenes, its matched-twice count and its median
    seconds per scene, then the same per scene."""
    print(f"  {args.scenes} scenes of 4000x3000, {args.tile} px tiles overlapping {args.tile_overlap}; detections "
          "scoring >= 0.5 against the ground truth at IoU 0.5, class-wise")
    width = max(len(name) for name in results)
    print(f"  {'':{width}} {'recall':>7} {'precision':>9} {'matched twice':>13} {'s/scene':>8}")
    summary = {}
    for name, runs in results.items():
        objects = sum(r["objects"] for r in runs)
        found = sum(r["recall"] * r["objects"] for r in runs)
        detections = sum(r["detections"] for r in runs)
        hits = sum(r["precision"] * r["detections"] for r in runs)
        summary[name] = {"recall": found / objects, "precision": hits / max(detections, 1),
                         "matched_twice": sum(r["matched_twice"] for r in runs),
                         "seconds": statistics.median(r["seconds"] for r in runs), "scenes": runs}
        s = summary[name]
        print(f"  {name:{width}} {s['recall']:7.3f} {s['precision']:9.3f} {s['matched_twice']:13d} {s['seconds']:8.2f}")
    print("  per scene (seed 0 / 1 / 2 ...):")
    for name, runs in results.items():
        def per(key: str, fmt: str, runs: list[dict[str, float]] = runs) -> str:
            return " / ".join(format(r[key], fmt) for r in runs)
        print(f"  {name:{width}} recall {per('recall', '.3f')}, precision {per('precision', '.3f')}, matched twice "
              f"{per('matched_twice', 'd')}, seconds {per('seconds', '.2f')}")
    return summary


def _tiles(args: argparse.Namespace) -> dict[str, Any]:
    cfg = _cfg(args)
    tiles = {"tile": args.tile, "tile_overlap": args.tile_overlap}
    runs = {
        "whole image (no tiles)": Predictor(cfg),
        "tiles, seam merge": Predictor(cfg, **tiles),
        "tiles, seam merge + whole-image pass": Predictor(cfg, **tiles, tile_whole_image=True),
        "tiles, greedy NMM (IOS 0.5)": Predictor(cfg, **tiles, tile_merge="greedy_nmm"),
        "tiles, NMS": Predictor(cfg, **tiles, tile_merge="nms"),
    }
    print(f"tiles: batch {args.batch}")
    return _scene_table(args, _on_scenes(args, runs))


# --------------------------------------------------------------------------------------------- sahi
def _sahi(args: argparse.Namespace) -> dict[str, Any]:
    """Pet's tiling against SAHI's sliced prediction of the same model object, with the same tiles, overlap,
    test transform, precision and batch sizes: they differ only in slicing code and merge."""
    try:  # sahi is the reference, not a dependency of Pet: it lives in its own venv (it pulls opencv-python)
        from benchmarks.sahi_pet import PetDetectionModel, sahi_grid, sahi_predict
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != "sahi":
            raise
        raise SystemExit("--part sahi needs sahi, which Pet does not install: python -m venv --system-site-packages "
                         "VENV && VENV/bin/pip install sahi, then run this command with VENV/bin/python.") from None
    pet = Predictor(_cfg(args))
    shared = {"model": pet.model, "label_space": pet.label_space}
    tiles = {"tile": args.tile, "tile_overlap": args.tile_overlap, **shared}
    sahi_model = PetDetectionModel(pet, confidence_threshold=args.sahi_conf)
    grid = TileSpec(args.tile, args.tile_overlap).grid(3000, 4000)  # make_scene's size
    if sorted(grid.tolist()) != sorted(sahi_grid(3000, 4000, args.tile, args.tile_overlap).tolist()):
        raise SystemExit(f"SAHI cuts other tiles than Pet with --tile {args.tile} --tile-overlap {args.tile_overlap}: "
                         "the comparison would not be like for like.")

    def sahi(batch: int, standard_pred: bool) -> Callable[[str], Detections]:
        return lambda image: sahi_predict(sahi_model, image, args.tile, args.tile_overlap, batch=batch,
                                          standard_pred=standard_pred)

    runs: dict[str, Callable[[str], Detections]] = {
        f"Pet: seam merge, batch {args.batch}": Predictor(_cfg(args), **tiles),
        "Pet: seam merge, batch 1": Predictor(_cfg(args, "TEST.IMS_PER_BATCH", "1"), **tiles),
        f"Pet: seam merge + whole image, batch {args.batch}": Predictor(_cfg(args), **tiles, tile_whole_image=True),
        f"SAHI: default, batch {args.batch}": sahi(args.batch, True),
        "SAHI: default, batch 1": sahi(1, True),
        f"SAHI: no standard pred, batch {args.batch}": sahi(args.batch, False),
        "SAHI: no standard pred, batch 1": sahi(1, False),
    }
    print(f"sahi: {pet.precision}; the same {len(grid)} tiles per scene for Pet and SAHI; SAHI's default merge "
          f"(GREEDYNMM, IOS 0.5, class-wise) on its detections scoring > {args.sahi_conf}, with and without its "
          "standard (whole-image) pass")
    return _scene_table(args, _on_scenes(args, runs))


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
    parts = {"stream": _stream, "tiles": _tiles, "sahi": _sahi, "video": _video}
    return {part: parts[part](args) for part in args.part}

