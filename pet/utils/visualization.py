"""Pictures a researcher looks at: training curves from metrics.json, detections over images."""
from __future__ import annotations

import os
import zlib
from collections.abc import Sequence

import cv2
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

__all__ = ["plot_training_curves", "draw_detections"]

_LINESTYLES = ("-", "--", ":", "-.")


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
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(4.2 * max(len(panels), 1), 3.4), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
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
    plt.close(fig)
    return out_png


def draw_detections(
    image_rgb: np.ndarray,
    boxes: np.ndarray,
    labels: Sequence[str],
    scores: Sequence[float] | None = None,
    gt_boxes: np.ndarray | None = None,
    masks: np.ndarray | None = None,
) -> np.ndarray:
    """An RGB copy of ``image_rgb`` with ground truth (thin white) and detections (class, score) drawn.

    Each box gets a colour per class name and a ``name score`` tag (just ``name`` when
    ``scores`` is None, e.g. for ground truth). ``masks`` (bool or 0/1 [N, H, W], one per
    box) are blended in under the boxes in the same colour, so overlapping instances stay visible.
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
    return canvas


def _class_color(label: str) -> tuple[int, int, int]:
    """A tab10 colour fixed by the class name, so a class looks the same in every picture."""
    return tuple(int(255 * c) for c in plt.get_cmap("tab10")(zlib.crc32(label.encode()) % 10)[:3])
