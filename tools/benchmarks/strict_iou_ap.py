"""AP at strict IoU of finished runs: AP, AP50, AP75 and AP at IoU 0.9 of each run's ``test/bbox.json``, and its
seconds per training iteration, as one Markdown table with the mean and spread per group.

COCO's summary has no AP at IoU 0.9; it is read from COCOeval's precision array (IoU thresholds 0.50:0.05:0.95,
index 8 is 0.90; all areas, 100 detections, the mean over recall points and classes of the entries that exist),
as COCOeval's own summary reads AP75 at index 5. Seconds per iteration are the median of the ``time`` values
``metrics.json`` logged (each a window mean of the iteration timer), so a slow first window counts little.

    python tools/benchmark.py strict-iou-ap --gt data/shapes/annotations/val.json \\
        faster=ckpts/bench/faster_s1 faster=ckpts/bench/faster_s2 cascade=ckpts/bench/cascade_s1 ...

docs/benchmarks/cascade.md (Cascade R-CNN against Faster R-CNN at strict IoU) has the runs it was written for.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import statistics
from typing import Any

import numpy as np
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from .common import format_fingerprint

__all__ = ["add_arguments", "strict_iou_ap"]


def strict_ap(gt: COCO, results: str) -> dict[str, float]:
    """AP, AP50, AP75 and AP90 (in percent) of the COCO results file ``results``."""
    with contextlib.redirect_stdout(io.StringIO()):
        evaluation = COCOeval(gt, gt.loadRes(results), "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    # precision: [IoU thresholds, recall points, classes, areas (all first), max detections (100 last)]
    iou = int(np.argmin(np.abs(evaluation.params.iouThrs - 0.9)))
    precision = evaluation.eval["precision"][iou, :, :, 0, -1]
    ap90 = float(np.mean(precision[precision > -1])) if (precision > -1).any() else float("nan")
    stats = evaluation.stats
    return {"AP": 100 * stats[0], "AP50": 100 * stats[1], "AP75": 100 * stats[2], "AP90": 100 * ap90}


def seconds_per_iter(run: str) -> float:
    """The median logged ``time`` of ``run``'s metrics.json (NaN without one)."""
    path = os.path.join(run, "metrics.json")
    if not os.path.isfile(path):
        return float("nan")
    with open(path) as f:
        times = [json.loads(line)["time"] for line in f if line.strip() and '"time"' in line]
    return statistics.median(times) if times else float("nan")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gt", default="data/shapes/annotations/val.json", help="the test set's COCO JSON")
    parser.add_argument("runs", nargs="+", metavar="GROUP=RUN_DIR",
                        help="a run folder (holding test/bbox.json) and its group")
    parser.add_argument("--out", default="benchmarks/strict_iou_ap.json")


def strict_iou_ap(args: argparse.Namespace, fingerprint: dict) -> dict[str, Any]:
    """The Markdown table of every run and each group's mean and spread; the same figures as a dict."""
    print(format_fingerprint(fingerprint))
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(args.gt)
    rows: dict[str, list[dict[str, float]]] = {}
    runs = []
    print("| group | run | AP | AP50 | AP75 | AP90 | s/iter |\n|---|---|---|---|---|---|---|")
    for entry in args.runs:
        group, run = entry.split("=", 1)
        row = {**strict_ap(gt, os.path.join(run, "test", "bbox.json")), "s/iter": seconds_per_iter(run)}
        rows.setdefault(group, []).append(row)
        runs.append({"group": group, "run": run, **row})
        print(f"| {group} | {run} | " + " | ".join(f"{row[k]:.1f}" for k in ("AP", "AP50", "AP75", "AP90"))
              + f" | {row['s/iter']:.2f} |")
    groups: dict[str, dict[str, dict[str, float]]] = {}
    for group, group_rows in rows.items():
        cells = []
        for key in ("AP", "AP50", "AP75", "AP90", "s/iter"):
            values = [r[key] for r in group_rows if math.isfinite(r[key])]  # a run without metrics.json: no s/iter
            digits = 2 if key == "s/iter" else 1
            spread = f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else ""
            cells.append(f"{statistics.mean(values):.{digits}f}{spread}" if values else "n/a")
            if values:
                groups.setdefault(group, {})[key] = {
                    "mean": statistics.mean(values), "stdev": statistics.stdev(values) if len(values) > 1 else 0.0}
        print(f"| {group} | mean of {len(group_rows)} | " + " | ".join(cells) + " |")
    return {"gt": args.gt, "runs": runs, "groups": groups}
