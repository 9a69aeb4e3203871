"""tiles: tiled prediction against the same model on pictures small enough to need no tiles, and against SAHI.

Two kinds of picture, with the trained demo model (CKPT/model_final.pth, or ``--opts TEST.WEIGHTS FILE``):

- a mosaic of real demo pictures: the first ``--mosaic`` shapes_val pictures, each centred in its own 256 px cell
  on a grey canvas (16 cells a row), made here from data/shapes, never written to git. Its aligned baseline
  predicts each cell alone: no object is cut, the grey borders are the same.
- the generated scenes of tools/make_scene.py (seeds 0, 1, ...; a third of the objects on the tile seams). Their
  aligned baseline predicts the whole scene in one pass at its own scale (the demo config does not resize),
  with the proposal and detection caps raised so that they do not bind: nothing is cut.

Pet's tiles run the model once per picture; every merge (``pet.predict.tiling.MERGES``) is applied to those
same tile detections, its time the tiles' inference plus its own merge. SAHI (``--sahi``, sahi installed: it
is not a dependency of Pet) runs ``get_sliced_prediction`` on the same model (tools/benchmarks/sahi_pet.py)
with its defaults, then with every ``postprocess_type`` x ``match_metric`` x ``class_agnostic`` on the same
slice predictions (cached), its time SAHI's own slice and prediction seconds plus that setting's postprocess.
Scores: recall and precision of the detections scoring >= 0.5 at IoU 0.5, class-wise, and detections on an
object another same-class detection already matched ("duplicates").
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import time
from collections.abc import Callable
from typing import Any

import cv2
import numpy as np
import torch

from pet.config import load_cfg
from pet.predict import Detections, Predictor
from pet.predict.predictor import Picture
from pet.predict.tiling import MERGES, TileSpec, merge_tiles

from .common import format_fingerprint, reference_package
from .predict import make_scene, match

__all__ = ["add_arguments", "tiles_benchmark"]

DEMO = "cfgs/shapes/faster_rcnn_R-10-FPN.yaml"
CELL = 256
# The aligned baseline of a scene: one pass over 4000x3000 px is ~183 times a 256 px picture, so the per-image
# caps of the demo config (500 / 300 proposals, 100 detections) are raised beyond what the scene can use.
UNCAPPED = ["MODEL.RPN.PRE_NMS_TOPK_TEST", "100000", "MODEL.RPN.POST_NMS_TOPK_TEST", "60000",
            "MODEL.ROI_HEADS.DETECTIONS_PER_IMAGE", "20000"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mosaic", type=int, default=192,
                        help="shapes_val pictures in the mosaic (16 a row; 0: no mosaic)")
    parser.add_argument("--scenes", type=int, default=3, help="generated scenes (seeds 0, 1, ...)")
    parser.add_argument("--tile", type=int, default=256)
    parser.add_argument("--tile-overlap", type=float, default=0.25)
    parser.add_argument("--batch", type=int, default=8, help="tiles (or cells) per forward pass")
    parser.add_argument("--max-det", type=int, default=5000,
                        help="detections kept per picture after the merge (tools/predict.py's --max-det): above "
                             "what the pictures hold, so that the cap does not decide")
    parser.add_argument("--sahi", action="store_true",
                        help="also SAHI (needs sahi importable, see docs/benchmarks/tiles.md)")
    parser.add_argument("--sahi-conf", type=float, default=0.3, help="SAHI's confidence_threshold (its default)")
    parser.add_argument("--shapes", default="data/shapes", help="the demo set (the quick start generates it)")
    parser.add_argument("--data", default="data/tiles_benchmark", help="where the generated scenes are kept")
    parser.add_argument("--opts", nargs="*", default=[], help="config overrides (KEY VALUE ...)")
    parser.add_argument("--out", default="benchmarks/tiles.json")


# ------------------------------------------------------------------------------------------ pictures
class Scored:
    """A picture with its ground truth and the way its aligned baseline is predicted."""

    def __init__(self, name: str, image: np.ndarray, gt_boxes: np.ndarray, gt_labels: np.ndarray,
                 aligned: Callable[[np.ndarray], Detections]) -> None:
        self.name, self.image, self.gt_boxes, self.gt_labels, self.aligned = name, image, gt_boxes, gt_labels, aligned

    def score(self, det: Detections) -> dict[str, float]:
        return match(det, self.gt_boxes, self.gt_labels)


def mosaic(shapes: str, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The first ``count`` pictures of ``shapes``/val (by image id), each centred in a CELL px cell of a grey
    canvas, 16 a row; the ground truth moved with them (category ids)."""
    with open(os.path.join(shapes, "annotations", "val.json"), encoding="utf-8") as f:
        coco = json.load(f)
    images = sorted(coco["images"], key=lambda image: image["id"])[:count]
    rows = -(-len(images) // 16)
    canvas = np.full((rows * CELL, 16 * CELL, 3), 128, np.uint8)
    boxes, labels = [], []
    for k, info in enumerate(images):
        picture = cv2.imread(os.path.join(shapes, "val", info["file_name"]))
        height, width = picture.shape[:2]
        y0, x0 = (k // 16) * CELL + (CELL - height) // 2, (k % 16) * CELL + (CELL - width) // 2
        canvas[y0:y0 + height, x0:x0 + width] = picture
        for ann in (a for a in coco["annotations"] if a["image_id"] == info["id"]):
            x, y, w, h = ann["bbox"]
            boxes.append([x + x0, y + y0, x + x0 + w, y + y0 + h])
            labels.append(ann["category_id"])
    return canvas, np.array(boxes, np.float32).reshape(-1, 4), np.array(labels, np.int64)


def cells_alone(predictor: Predictor, batch: int) -> Callable[[np.ndarray], Detections]:
    """The mosaic's aligned baseline: each CELL px cell predicted on its own, moved back into the mosaic."""
    def predict(image: np.ndarray) -> Detections:
        origins = [(x, y) for y in range(0, image.shape[0], CELL) for x in range(0, image.shape[1], CELL)]
        cells = [np.ascontiguousarray(image[y:y + CELL, x:x + CELL]) for x, y in origins]
        found = predictor.predict_many(cells, batch_size=batch)
        shift = [np.array([x, y, x, y], np.float32) for x, y in origins]
        return Detections(boxes=np.concatenate([d.boxes + s for d, s in zip(found, shift)]).reshape(-1, 4),
                          scores=np.concatenate([d.scores for d in found]),
                          labels=np.concatenate([d.labels for d in found]),
                          names=[n for d in found for n in d.names], path="")
    return predict


# ------------------------------------------------------------------------------------------ Pet's tiles
class RecordingPredictor(Predictor):
    """A tiled :class:`Predictor` that keeps each picture's tile detections before the merge, so that every
    merge is scored on the same model outputs (the model is the cost; the merges take milliseconds)."""

    recorded: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray, tuple[int, int]]

    def _merge(self, picture: Picture, outputs: list[dict[str, torch.Tensor]]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert self.tiles is not None
        tiles = self.tiles.grid(picture.height, picture.width)
        offsets = torch.from_numpy(tiles[:, [0, 1, 0, 1]]).float()
        self.recorded = (torch.cat([out["boxes"].float().cpu() + offset for out, offset in zip(outputs, offsets)]),
                         torch.cat([out["scores"].float().cpu() for out in outputs]),
                         torch.cat([out["labels"].cpu() for out in outputs]),
                         torch.cat([torch.full((len(out["scores"]),), i) for i, out in enumerate(outputs)]),
                         tiles, (picture.height, picture.width))
        return super()._merge(picture, outputs)


def pet_tiles(recorder: RecordingPredictor, picture: Scored) -> dict[str, tuple[dict[str, float], float]]:
    """Each merge's score and seconds (the tiles' inference, measured once, plus the merge)."""
    start = time.perf_counter()
    recorder(picture.image)
    total = time.perf_counter() - start
    spec = recorder.tiles
    assert spec is not None
    merged, seconds = {}, {}
    for merge in MERGES:
        start = time.perf_counter()
        boxes, scores, labels, _ = merge_tiles(
            TileSpec(spec.size, spec.overlap, merge=merge, max_det=spec.max_det), *recorder.recorded)
        seconds[merge] = time.perf_counter() - start
        merged[merge] = Detections(boxes=boxes.numpy(), scores=scores.numpy(), labels=labels.numpy(),
                                   names=[""] * len(scores), path="")
    inference = total - seconds[spec.merge]
    return {f"Pet tiles, merge {m}": (picture.score(merged[m]), inference + seconds[m]) for m in MERGES}


# ------------------------------------------------------------------------------------------ SAHI
SAHI_DEFAULT = ("GREEDYNMM", "IOS", False)
SAHI_SETTINGS = list(itertools.product(("GREEDYNMM", "NMM", "NMS", "LSNMS"), ("IOS", "IOU"), (False, True)))


def sahi_runs(model: Any, picture: Scored, tile: int, overlap: float, batch: int,
              settings: list[tuple[str, str, bool]]) -> dict[tuple[str, str, bool], tuple[dict[str, float], float]]:
    """SAHI's default (its whole-image pass included) timed as it runs, then every setting on the cached slice
    predictions: each one's score and seconds (the default's slicing and inference, plus its postprocess)."""
    from .sahi_pet import sahi_predict  # sahi is optional: imported only when asked for
    model.cache = {}
    det, durations = sahi_predict(model, picture.image, tile, overlap, batch=batch, standard_pred=True,
                                  setting=SAHI_DEFAULT)
    inference = durations["slice"] + durations["prediction"]
    results = {SAHI_DEFAULT: (picture.score(det), inference + durations["postprocess"])}
    for setting in settings:
        if setting != SAHI_DEFAULT:
            det, durations = sahi_predict(model, picture.image, tile, overlap, batch=batch, standard_pred=True,
                                          setting=setting)
            results[setting] = (picture.score(det), inference + durations["postprocess"])
    model.cache = None
    return results


# ------------------------------------------------------------------------------------------ table
def _pooled(runs: list[dict[str, float]]) -> dict[str, float]:
    objects = sum(r["objects"] for r in runs)
    detections = sum(r["detections"] for r in runs)
    return {"recall": sum(r["recall"] * r["objects"] for r in runs) / objects,
            "precision": sum(r["precision"] * r["detections"] for r in runs) / max(detections, 1),
            "duplicates": sum(r["matched_twice"] for r in runs), "detections": detections}


def _f1(runs: list[tuple[dict[str, float], float]]) -> float:
    """What picks SAHI's best setting: the harmonic mean of pooled recall and precision."""
    pooled = _pooled([r for r, _ in runs])
    return 2 * pooled["recall"] * pooled["precision"] / max(pooled["recall"] + pooled["precision"], 1e-9)


def _print(kind: str, rows: dict[str, list[tuple[dict[str, float], float]]]) -> dict[str, Any]:
    width = max(len(name) for name in rows)
    print(f"  {kind}: {'':{width - len(kind) - 2}} {'recall':>7} {'precision':>9} {'dups':>5} {'dets':>6} "
          f"{'s/picture':>9}")
    table = {}
    for name, runs in rows.items():
        row = {**_pooled([r for r, _ in runs]), "seconds": float(np.median([s for _, s in runs]))}
        table[name] = row
        print(f"  {name:{width}} {row['recall']:7.3f} {row['precision']:9.3f} {row['duplicates']:5d} "
              f"{row['detections']:6d} {row['seconds']:9.2f}")
    return table


def tiles_benchmark(args: argparse.Namespace, machine: dict[str, Any]) -> dict[str, Any]:
    print(format_fingerprint(machine))
    cfg = load_cfg(DEMO, ["TEST.IMS_PER_BATCH", str(args.batch), *args.opts])
    recorder = RecordingPredictor(cfg, tile=args.tile, tile_overlap=args.tile_overlap, max_det=args.max_det)
    shared = {"model": recorder.model, "label_space": recorder.label_space}
    whole = Predictor(cfg, **shared)
    uncapped = Predictor(load_cfg(DEMO, ["TEST.IMS_PER_BATCH", str(args.batch), *args.opts, *UNCAPPED]))
    sahi_model, settings = None, SAHI_SETTINGS
    if args.sahi:
        with reference_package("sahi", "--sahi", "pip install --target DIR sahi (or a venv), then run with "
                                                 "PYTHONPATH=DIR."):
            from .sahi_pet import PetDetectionModel, sahi_grid
        sahi_model = PetDetectionModel(whole, confidence_threshold=args.sahi_conf)
        if importlib.util.find_spec("lsnms") is None:  # SAHI's LSNMS needs lsnms (and numba)
            print("sahi: lsnms is not installed, so SAHI's LSNMS is left out")
            settings = [setting for setting in settings if setting[0] != "LSNMS"]
    pictures: dict[str, list[Scored]] = {"mosaic": [], "scenes": []}
    if args.mosaic:
        canvas, boxes, labels = mosaic(args.shapes, args.mosaic)
        pictures["mosaic"].append(Scored("mosaic", canvas, boxes, labels, cells_alone(whole, args.batch)))
    for seed in range(args.scenes):
        path, _, objects = make_scene(os.path.join(args.data, f"scene{seed}"), tile=args.tile,
                                      overlap=args.tile_overlap, seed=seed)
        pictures["scenes"].append(Scored(f"scene{seed}", cv2.imread(path),
                                         np.array([o["box"] for o in objects], np.float32),
                                         np.array([o["label"] + 1 for o in objects]), uncapped))
    for picture in (p for group in pictures.values() for p in group):
        height, width = picture.image.shape[:2]
        if args.sahi and sorted(recorder.tiles.grid(height, width).tolist()) != sorted(
                sahi_grid(height, width, args.tile, args.tile_overlap).tolist()):
            raise SystemExit(f"SAHI cuts other tiles than Pet on {picture.name}: the comparison would not be fair.")
    first = next(p for group in pictures.values() for p in group)
    whole(first.image[:CELL, :CELL])  # oneDNN builds its kernels on first use: not timed
    print(f"tiles: {args.tile} px, overlap {args.tile_overlap}, batch {args.batch}, {recorder.precision}; "
          "detections scoring >= 0.5 against the ground truth at IoU 0.5, class-wise")
    result: dict[str, Any] = {}
    for kind, group in ((kind, group) for kind, group in pictures.items() if group):
        rows: dict[str, list[tuple[dict[str, float], float]]] = {}
        sahi: dict[tuple[str, str, bool], list[tuple[dict[str, float], float]]] = {}
        for picture in group:
            start = time.perf_counter()
            aligned = picture.aligned(picture.image)
            rows.setdefault("aligned baseline (nothing cut)", []).append(
                (picture.score(aligned), time.perf_counter() - start))
            for name, run in pet_tiles(recorder, picture).items():
                rows.setdefault(name, []).append(run)
            if sahi_model is not None:
                for setting, run in sahi_runs(sahi_model, picture, args.tile, args.tile_overlap, args.batch,
                                                settings).items():
                    sahi.setdefault(setting, []).append(run)
        if sahi:
            best = max(settings, key=lambda setting: _f1(sahi[setting]))
            for setting in settings:
                label = "default" if setting == SAHI_DEFAULT else ("best F1" if setting == best else "")
                rows[f"SAHI {setting[0]} {setting[1]} {'agnostic' if setting[2] else 'class-wise'} {label}"] = \
                    sahi[setting]
        print(f"{kind}: {len(group)} picture(s) of {group[0].image.shape[1]}x{group[0].image.shape[0]}, "
              f"{sum(len(p.gt_boxes) for p in group)} objects")
        result[kind] = _print(kind, rows)
    return result
