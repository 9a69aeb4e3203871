"""Pictures a researcher looks at: training curves from metrics.json, detections over images, evaluation diagnostics."""
from __future__ import annotations

import functools
import os
import zlib
from collections.abc import Sequence
from typing import Any

import cv2
import numpy as np

__all__ = ["plot_training_curves", "draw_detections", "keypoint_colors", "letterbox", "tile_pictures", "plot_pr_curves",
           "plot_confusion_matrix", "plot_error_breakdown", "CAPTION_HEIGHT", "TILE_GAP"]

_LINESTYLES = ("-", "--", ":", "-.")
# tile_pictures' layout: a caption strip of this height above each tile, this many pixels between tiles.
CAPTION_HEIGHT = 18
TILE_GAP = 2
# What a tile shows outside its letterboxed picture: mid grey, unlike the black a zoom-out or crop pads with, so
# a tile tells the pipeline's own padding from the grid's.
_LETTERBOX_FILL = (96, 96, 96)


@functools.cache
def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, imported at the first picture: matplotlib takes ~0.4 s to
    import, which every tool process would pay, most of them never drawing a curve."""
    import matplotlib  # here, not at the top: see above

    matplotlib.use("Agg")
    import matplotlib.pyplot  # after choosing the backend

    return matplotlib.pyplot


def _series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    points = [(r["iteration"], r[key]) for r in records if key in r]
    return [p[0] for p in points], [p[1] for p in points]


def plot_training_curves(runs: Sequence[list[dict]], out_png: str, labels: Sequence[str]) -> str:
    """Draw total loss, each loss term, learning rate and validation AP against iteration.

    ``runs`` holds the records of one or more ``metrics.json`` files
    (:func:`pet.engine.events.read_metrics`), overlaid with one colour per run.
    Returns ``out_png``.
    """
    keys = sorted({k for records in runs for r in records for k in r})
    panels = [
        ("total loss", ["total_loss"]),
        ("loss terms", [k for k in keys if k.startswith("loss")]),
        ("learning rate", ["lr"]),
        ("validation", [k for k in keys if "/AP" in k and k.rsplit("/", 1)[-1] in ("AP", "AP50", "AP75")]),
    ]
    panels = [(title, ks) for title, ks in panels if any(_series(r, k)[0] for r in runs for k in ks)]
    fig, axes = _pyplot().subplots(1, max(len(panels), 1), figsize=(4.2 * max(len(panels), 1), 3.4), squeeze=False)
    colors = _pyplot().rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, panel_keys) in zip(axes[0], panels):
        for run_idx, (records, label) in enumerate(zip(runs, labels)):
            for key_idx, key in enumerate(panel_keys):
                xs, ys = _series(records, key)
                if not xs:
                    continue
                name = key if len(runs) == 1 else f"{label}: {key}"
                ax.plot(xs, ys, color=colors[(run_idx if len(runs) > 1 else key_idx) % len(colors)],
                        linestyle=_LINESTYLES[key_idx % len(_LINESTYLES)] if len(runs) > 1 else "-",
                        marker="o" if title == "validation" else None, markersize=3, label=name)
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        if title in ("total loss", "loss terms"):
            ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=100)
    _pyplot().close(fig)
    return out_png


def draw_detections(
    image_rgb: np.ndarray,
    boxes: np.ndarray,
    labels: Sequence[str],
    scores: Sequence[float] | None = None,
    gt_boxes: np.ndarray | None = None,
    masks: np.ndarray | None = None,
    keypoints: np.ndarray | None = None,
    skeleton: Sequence[Sequence[int]] = (),
    point_colors: Sequence[tuple[int, int, int]] | None = None,
) -> np.ndarray:
    """An RGB copy of ``image_rgb`` with ground truth (thin white) and detections (class, score) drawn.

    Each box gets a colour per class name and a ``name score`` tag (just ``name`` when
    ``scores`` is None, e.g. for ground truth). ``masks`` (bool or 0/1 [N, H, W], one per
    box) are blended in under the boxes in the same colour, so overlapping instances stay visible.
    ``keypoints`` ([N, K, 3], one row per box) are drawn as dots in the box's colour, joined by the
    ``skeleton``'s lines (1-based pairs of points, COCO's convention); a point whose third value is 0
    (unlabelled ground truth) is not drawn. Dots take the box's colour unless ``point_colors`` gives one per
    point index (:func:`keypoint_colors`): then a left point mislabelled as a right one shows.
    """
    canvas = np.ascontiguousarray(image_rgb.copy())
    colors = [_class_color(label) for label in labels]
    for mask, color in zip([] if masks is None else masks, colors):
        region = np.asarray(mask).astype(bool)
        canvas[region] = (0.55 * canvas[region] + 0.45 * np.array(color, np.float32)).astype(np.uint8)
    for box in [] if gt_boxes is None else gt_boxes:
        x0, y0, x1, y1 = (int(round(v)) for v in box)
        cv2.rectangle(canvas, (x0, y0), (x1, y1), (255, 255, 255), 1, cv2.LINE_AA)
    for i, (box, label, color) in enumerate(zip(boxes, labels, colors)):
        x0, y0, x1, y1 = (int(round(v)) for v in box)
        cv2.rectangle(canvas, (x0, y0), (x1, y1), color, 2, cv2.LINE_AA)
        text = label if scores is None else f"{label} {scores[i]:.2f}"
        (tw, th), _ = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, 0.4, 1)
        y_text = max(y0, th + 2)
        cv2.rectangle(canvas, (x0, y_text - th - 2), (x0 + tw + 2, y_text), color, -1)
        cv2.putText(canvas, text, (x0 + 1, y_text - 2), cv2.FONT_HERSHEY_SIMPLEX, 0.4, (0, 0, 0), 1, cv2.LINE_AA)
    for points, color in zip([] if keypoints is None else keypoints, colors):
        xy = [(int(round(x)), int(round(y))) for x, y in np.asarray(points)[:, :2]]
        drawn = np.asarray(points)[:, 2] != 0
        for a, b in skeleton:
            if drawn[a - 1] and drawn[b - 1]:
                cv2.line(canvas, xy[a - 1], xy[b - 1], color, 1, cv2.LINE_AA)
        for k, ((x, y), shown) in enumerate(zip(xy, drawn)):
            if shown:
                cv2.circle(canvas, (x, y), 3, color if point_colors is None else point_colors[k], -1, cv2.LINE_AA)
                cv2.circle(canvas, (x, y), 3, (0, 0, 0), 1, cv2.LINE_AA)
    return canvas


def _class_color(label: str) -> tuple[int, int, int]:
    """A tab10 colour fixed by the class name, so a class looks the same in every picture."""
    return tuple(int(255 * c) for c in _pyplot().get_cmap("tab10")(zlib.crc32(label.encode()) % 10)[:3])


def keypoint_colors(num_keypoints: int) -> list[tuple[int, int, int]]:
    """One fully saturated RGB colour per point index, hues evenly spread: point k looks the same in every picture
    and on every object, so a flip that forgot to renumber left and right shows as swapped colours. None of them is
    a tab10 class colour (those are muted), so a dot stands out from its box."""
    hues = np.arange(num_keypoints) * 180 // max(num_keypoints, 1)  # opencv's hue runs over 0-179
    hsv = np.stack([hues, np.full_like(hues, 255), np.full_like(hues, 255)], axis=-1).astype(np.uint8)[None]
    return [tuple(int(c) for c in rgb) for rgb in cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB)[0]]


def letterbox(picture: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """``picture`` (HWC) scaled to fit ``size`` (height, width) with its aspect ratio kept, centred on grey.

    Kept pixel for pixel when it already has that size, so what a grid shows of a sample is what was drawn.
    """
    height, width = size
    h, w = picture.shape[:2]
    scale = min(height / h, width / w)
    new_h, new_w = max(1, round(h * scale)), max(1, round(w * scale))
    if (new_h, new_w) != (h, w):  # area averaging when shrinking keeps thin box outlines visible
        picture = cv2.resize(picture, (new_w, new_h), interpolation=cv2.INTER_AREA if scale < 1 else cv2.INTER_LINEAR)
    tile = np.empty((height, width, picture.shape[2]), np.uint8)
    tile[:] = _LETTERBOX_FILL
    top, left = (height - new_h) // 2, (width - new_w) // 2
    tile[top:top + new_h, left:left + new_w] = picture
    return tile


def tile_pictures(pictures: Sequence[np.ndarray], captions: Sequence[str], size: tuple[int, int],
                  cols: int) -> np.ndarray:
    """One RGB picture of ``pictures`` in rows of ``cols``, each letterboxed to ``size`` (height, width) under a
    strip with its caption, so samples of any size compare at a glance.

    The result is ``rows * (height + CAPTION_HEIGHT) + (rows - 1) * TILE_GAP`` high and ``cols * width +
    (cols - 1) * TILE_GAP`` wide; cells past the last picture stay empty. A caption too long for its tile is cut
    with ``...`` (opencv's fonts have no ellipsis character).
    """
    if not pictures:
        raise ValueError("tile_pictures needs at least one picture")
    height, width = size
    rows = -(-len(pictures) // cols)
    cell_h, cell_w = height + CAPTION_HEIGHT, width
    grid = np.zeros((rows * cell_h + (rows - 1) * TILE_GAP, cols * cell_w + (cols - 1) * TILE_GAP, 3), np.uint8)
    for i, (picture, caption) in enumerate(zip(pictures, captions)):
        top, left = (i // cols) * (cell_h + TILE_GAP), (i % cols) * (cell_w + TILE_GAP)
        grid[top + CAPTION_HEIGHT:top + cell_h, left:left + cell_w] = letterbox(picture, size)
        text = _fitted(caption, width - 4)
        cv2.putText(grid, text, (left + 2, top + CAPTION_HEIGHT - 5), cv2.FONT_HERSHEY_SIMPLEX, 0.4,
                    (255, 255, 255), 1, cv2.LINE_AA)
    return grid


def _fitted(text: str, width: int) -> str:
    """``text`` shortened with ``...`` until it is at most ``width`` pixels wide in the caption font."""
    def fits(t: str) -> bool:
        return cv2.getTextSize(t, cv2.FONT_HERSHEY_SIMPLEX, 0.4, 1)[0][0] <= width

    if fits(text):
        return text
    while text and not fits(text + "..."):
        text = text[:-1]
    return text + "..."


def plot_pr_curves(classes: Sequence[dict], recall: Sequence[float], out_png: str, title: str = "") -> str:
    """Precision against recall at IoU 0.5 (left) and averaged over IoU 0.5:0.95 (right): one thin line per
    class and the mean over classes in black.

    ``classes`` are the entries of :func:`pet.evaluation.diagnostics.pr_curves` (``name``, ``AP50``,
    ``AP``, ``precision_iou50``, ``precision_iou50_95``; ``None`` curves for a class without ground
    truth, which is left out). The legend names each class with its AP while there are at most 20;
    past that the JSON next to the picture holds the per-class numbers. Returns ``out_png``.
    """
    scored = [c for c in classes if c["precision_iou50"] is not None]
    fig, axes = _pyplot().subplots(1, 2, figsize=(11, 4.6), sharey=True)
    colors = _pyplot().get_cmap("tab20" if len(scored) > 10 else "tab10").colors
    for ax, key, ap_key, name in ((axes[0], "precision_iou50", "AP50", "IoU 0.5"),
                                  (axes[1], "precision_iou50_95", "AP", "IoU 0.5:0.95")):
        for i, c in enumerate(scored):
            ax.plot(recall, c[key], color=colors[i % len(colors)], linewidth=1.0, alpha=0.8,
                    label=f"{c['name']} {c[ap_key]:.1f}")
        if scored:
            mean = np.mean([c[key] for c in scored], axis=0)
            ax.plot(recall, mean, color="black", linewidth=2.2, label=f"mean {mean.mean() * 100:.1f}")
        ax.set_title(f"{title} {name} ({ap_key} per class in the legend)".strip(), fontsize=9)
        ax.set_xlabel("recall")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if len(scored) <= 20:
            ax.legend(fontsize=7, loc="lower left")
    axes[0].set_ylabel("precision (interpolated, as COCO)")
    return _save(fig, out_png)


def plot_confusion_matrix(matrix: np.ndarray, labels: Sequence[str], out_png: str, title: str = "") -> str:
    """Ground truth (rows) against prediction (columns), coloured by the share of each row, counts written in.

    ``labels`` name the rows and columns (the last is background). Counts are written in the cells
    while there are at most 30 labels; the picture stays under 1600 pixels a side. Returns ``out_png``.
    """
    matrix = np.asarray(matrix)
    shares = matrix / np.maximum(matrix.sum(axis=1, keepdims=True), 1)
    size = min(15.0, max(4.0, 0.42 * len(labels) + 2.0))
    fontsize = 8 if len(labels) <= 30 else 5
    fig, ax = _pyplot().subplots(figsize=(size + 1.0, size))
    image = ax.imshow(shares, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="share of the row")
    ticks = np.arange(len(labels))
    ax.set_xticks(ticks, labels, rotation=90 if len(labels) > 8 else 45, ha="center" if len(labels) > 8 else "right",
                  fontsize=fontsize)
    ax.set_yticks(ticks, labels, fontsize=fontsize)
    ax.set_xlabel("prediction (background: missed ground truth)")
    ax.set_ylabel("ground truth (background: false positives)")
    if len(labels) <= 30:
        for (row, col), count in np.ndenumerate(matrix):
            if count:
                ax.text(col, row, str(count), ha="center", va="center", fontsize=7,
                        color="white" if shares[row, col] > 0.5 else "black")
    ax.set_title(title, fontsize=10)
    return _save(fig, out_png)


def plot_error_breakdown(delta_ap: dict[str, float], counts: dict[str, int], out_png: str, title: str = "") -> str:
    """Two bar charts: AP points gained by fixing each error type, and how many detections (and missed
    ground truth) fall in each outcome. Returns ``out_png``."""
    fig, (left, right) = _pyplot().subplots(1, 2, figsize=(10, 3.4))
    names = list(delta_ap)
    left.barh(names, [delta_ap[n] for n in names], color="C3")
    left.invert_yaxis()
    left.set_xlabel("AP gained by fixing it (dAP, points)")
    for y, name in enumerate(names):
        left.text(delta_ap[name], y, f" {delta_ap[name]:.2f}", va="center", fontsize=8)
    outcomes = list(counts)
    right.barh(outcomes, [counts[n] for n in outcomes],
               color=["C2" if n == "true_positive" else "C7" if n == "missed" else "C3" for n in outcomes])
    right.invert_yaxis()
    right.set_xlabel("count")
    for y, name in enumerate(outcomes):
        right.text(counts[name], y, f" {counts[name]}", va="center", fontsize=8)
    for ax in (left, right):
        ax.grid(axis="x", alpha=0.3)
        ax.margins(x=0.15)
    fig.suptitle(title, fontsize=10)
    return _save(fig, out_png)


def _save(fig: Any, out_png: str) -> str:
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=100)
    _pyplot().close(fig)
    return out_png
