"""The files tools/predict.py writes (``--save``), several at once, each one complete or absent.

Under the output folder (docs/predict.md):

- ``csv``: ``predictions.csv``, one row per detection: ``image,xmin,ymin,xmax,ymax,score,label,name``
  (``image``: the path as given or found, ``<video>#<frame>`` for a frame; ``label``: the category id);
  a keypoint model adds ``<point>_x,<point>_y,<point>_score`` per point, in the set's order.
- ``coco``: ``predictions.json`` in COCO results format. Image ids come from ``--ann`` (matched by the
  file's path under the input folder, else by its base name; pictures it lacks are left out, with a
  warning), else are numbered 1, 2, ... in order, with ``predictions_images.json`` beside it (a COCO
  ``images`` list: id, file_name under the input folder, path, width, height, and frame).
- ``json``: ``json/<name>.json`` per picture: its path, size, and detections (box, score, label, name; a
  keypoint model adds ``keypoints``, ``[[x, y, score], ...]`` per detection, and the file ``keypoint_names``).
- ``yolo``: ``labels/<name>.txt`` per picture in Ultralytics' convention (``cls cx cy w h conf``, class
  index from 0, coordinates normalised by the picture's size; a keypoint model's line is Ultralytics' pose
  line ``cls cx cy w h x1 y1 s1 ... conf``, each point normalised, ``s`` its score, and ``data.yaml`` gains
  ``kpt_shape`` [K, 3] and ``flip_idx``) and ``data.yaml`` with the names, each once:
  a name the label space repeats (``N/A`` at the ten unused rows of a COCO-layout model) gets its category
  id appended (``N/A_12``), as YOLO readers refuse a repeated name.
- ``vis``: ``vis/<file>`` the picture with the detections scoring ``vis_thresh`` or more drawn (keypoints as
  dots joined by the set's skeleton); a video
  becomes ``vis/<video name>.mp4`` (mp4v, the codec opencv-python-headless has) of the frames predicted.
- ``crops``: ``crops/<class name>/<name>_<k>.jpg``, the k-th detection of the picture cut out. The class
  folder is always one level under ``crops/``: ``/`` (and ``\\`` on Windows) become ``_`` (``N/A`` -> ``N_A``),
  and a name of dots only (``.``, ``..``) becomes as many ``_``.

``<name>`` is the picture's path under the input folder without its extension (``<video name>_<frame>``
for a frame), so sub-folders are mirrored and two ``a.jpg`` in different folders never collide; files whose
names would be the same (``a.jpg`` and ``a.png``, ``a.mp4`` and ``a.mov``, ``clip_3.jpg`` beside
``clip.mp4``) keep their extension in it (``a.jpg``, ``a.png``): :meth:`Source.name`. Files
written once per picture are staged and renamed into place (:mod:`pet.utils.files`); files that grow
over the run (the CSV, the COCO JSON, an mp4) are renamed into place when the run completes, so a run
killed half-way leaves only complete files.
"""
from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import os
import tempfile
from collections.abc import Sequence
from typing import IO, Any

import cv2
import numpy as np
import yaml

from pet.data.categories import LabelSpace
from pet.data.keypoints import KeypointMeta
from pet.evaluation.coco import detections_to_coco, masks_to_rle
from pet.predict.predictor import Detections
from pet.predict.sources import Source
from pet.utils.errors import ConfigError, DataError
from pet.utils.files import atomic_open, atomic_path, write_bytes_atomic
from pet.utils.visualization import draw_detections

__all__ = ["FORMATS", "PredictionWriter", "check_writable", "csv_keypoint_columns", "parse_formats"]

logger = logging.getLogger(__name__)

FORMATS = ("csv", "coco", "json", "yolo", "vis", "crops")
CSV_COLUMNS = ("image", "xmin", "ymin", "xmax", "ymax", "score", "label", "name")


def parse_formats(text: str) -> list[str]:
    """``"csv,vis"`` -> ``["csv", "vis"]``; an unknown name is a :class:`ConfigError` listing the known ones."""
    formats = [f.strip().lower() for f in text.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise ConfigError(f"--save takes a comma-separated list of {', '.join(FORMATS)}; got {text!r}.")
    return list(dict.fromkeys(formats))


def check_writable(folder: str) -> None:
    """Create ``folder`` and write a file in it, or fail with a :class:`ConfigError` naming it (before any work)."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ConfigError(f"Cannot write to the output folder {folder}: {exc.strerror or exc}. Choose another "
                          "--output, or make it writable.") from exc


def _display(det: Detections) -> str:
    return det.path if det.frame is None else f"{det.path}#{det.frame}"


def _number(value: float, digits: int) -> float:
    return round(float(value), digits)


class PredictionWriter:
    """Writes every chosen format for each :class:`Detections` given to :meth:`write` (which need
    ``det.image`` for ``vis`` and ``crops``: see :attr:`needs_images`). Use it as a context manager: the files
    that grow over the run are completed when the block ends normally, and discarded when it raises.
    ``keypoints`` (a keypoint model's :class:`~pet.data.keypoints.KeypointMeta`) names the points in the CSV
    header, the JSON files and data.yaml, and gives ``vis`` its skeleton."""

    def __init__(self, output_dir: str, formats: Sequence[str], label_space: LabelSpace, source: Source, *,
                 vis_thresh: float = 0.5, ann: str | None = None, vid_stride: int = 1,
                 keypoints: KeypointMeta | None = None) -> None:
        self.output_dir = output_dir
        self.keypoints = keypoints
        self.formats = list(formats)
        self.label_space = label_space
        self.source = source
        self.vis_thresh = vis_thresh
        self.vid_stride = vid_stride
        self._class_index = {cid: i for i, cid in enumerate(label_space.category_ids)}
        self._ann_ids = _ann_image_ids(ann) if ann and "coco" in self.formats else None
        self._not_in_ann = 0
        self._stack = contextlib.ExitStack()
        self._csv: Any = None
        self._coco: IO | None = None
        self._table: IO | None = None
        self._coco_count = 0
        self._next_id = 1
        self._video: tuple[str, cv2.VideoWriter] | None = None
        self._video_stack: contextlib.ExitStack | None = None

    @property
    def needs_images(self) -> bool:
        return "vis" in self.formats or "crops" in self.formats

    def path(self, *parts: str) -> str:
        return os.path.join(self.output_dir, *parts)

    # ----------------------------------------------------------------- the run
    def __enter__(self) -> PredictionWriter:
        if "csv" in self.formats:
            # A file name that is not UTF-8 (kept as surrogates, as the source found it) is written back as its bytes.
            f = self._stack.enter_context(atomic_open(self.path("predictions.csv"), "w", newline="", encoding="utf-8",
                                                      errors="surrogateescape"))
            self._csv = csv.writer(f)
            self._csv.writerow(CSV_COLUMNS + csv_keypoint_columns(self.keypoints))
        if "coco" in self.formats:
            self._coco = self._stack.enter_context(atomic_open(self.path("predictions.json"), "w"))
            self._coco.write("[")
            if self._ann_ids is None:
                self._table = self._stack.enter_context(atomic_open(self.path("predictions_images.json"), "w"))
                categories = [{"id": cid, "name": name} for cid, name in
                              zip(self.label_space.category_ids, self.label_space.names)]
                self._table.write('{"categories": ' + json.dumps(categories) + ', "images": [')
        if "yolo" in self.formats:
            names = _yolo_names(self.label_space)
            content: dict[str, Any] = {"nc": len(names), "names": names}
            line = "cls cx cy w h conf"
            if self.keypoints is not None:
                content.update(kpt_shape=[self.keypoints.num_keypoints, 3], flip_idx=list(self.keypoints.flip_map),
                               kpt_names=list(self.keypoints.names))
                line = "cls cx cy w h x1 y1 s1 ... conf"
            text = (f"# Class index -> name of the YOLO label files in labels/ ({line}, normalised).\n"
                    + yaml.safe_dump(content, sort_keys=False, allow_unicode=True))
            write_bytes_atomic(self.path("data.yaml"), text.encode("utf-8"))
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is None:
            self._end_video()
            if self._coco is not None:
                self._coco.write("]\n")
            if self._table is not None:
                self._table.write("]}\n")
            if self._not_in_ann:
                logger.warning(f"{self._not_in_ann} pictures are not in the --ann file; their detections are not in "
                               "predictions.json.")
        elif self._video_stack is not None:
            self._video_stack.__exit__(exc_type, exc, tb)
        return bool(self._stack.__exit__(exc_type, exc, tb))

    def write(self, det: Detections) -> None:
        name = self.name(det)
        if self._csv is not None:
            self._write_csv(det)
        if self._coco is not None:
            self._write_coco(det, name)
        if "json" in self.formats:
            self._write_json(det, name)
        if "yolo" in self.formats:
            self._write_yolo(det, name)
        if "vis" in self.formats:
            self._write_vis(det)
        if "crops" in self.formats:
            self._write_crops(det, name)

    def name(self, det: Detections) -> str:
        """The picture's name in the outputs (:meth:`Source.name`)."""
        return self.source.name(det.path, det.frame)

    # ----------------------------------------------------------------- formats
    def _write_csv(self, det: Detections) -> None:
        image = _display(det)
        points = _points(det)
        for box, score, label, name, p in zip(det.boxes, det.scores, det.labels, det.names, points):
            row = [image, *(_number(v, 3) for v in box), _number(score, 6), int(label), name]
            self._csv.writerow(row + [_number(v, 3) for v in p.reshape(-1)])

    def _write_coco(self, det: Detections, name: str) -> None:
        if self._ann_ids is not None:
            rel = self.source.relpath(det.path) if det.frame is None else f"{name}.jpg"
            image_id = self._ann_ids.get(rel, self._ann_ids.get(os.path.basename(rel)))
            if image_id is None:
                self._not_in_ann += 1
                return
        else:
            image_id = self._next_id
            self._next_id += 1
            entry = {"id": image_id, "file_name": self.source.relpath(det.path), "path": det.path,
                     "width": det.width, "height": det.height}
            if det.frame is not None:
                entry["frame"] = det.frame
            self._table.write(("," if image_id > 1 else "") + "\n" + json.dumps(entry))
        output = {"boxes": det.boxes, "scores": det.scores, "labels": det.labels}
        if det.masks is not None:
            output["masks"] = det.masks
        if det.keypoints is not None:
            output["keypoints"] = det.keypoints  # (x, y, score): the score becomes the third value
        identity = {int(cid): int(cid) for cid in self.label_space.category_ids}  # labels are category ids already
        for result in detections_to_coco(output, int(image_id), identity):
            self._coco.write(("," if self._coco_count else "") + "\n" + json.dumps(result))
            self._coco_count += 1

    def _write_json(self, det: Detections, name: str) -> None:
        detections = [{"box": [_number(v, 3) for v in box], "score": float(score), "label": int(label), "name": n}
                      for box, score, label, n in zip(det.boxes, det.scores, det.labels, det.names)]
        if det.masks is not None:
            for entry, rle in zip(detections, masks_to_rle(det.masks)):
                entry["segmentation"] = rle
        if det.keypoints is not None:
            for entry, points in zip(detections, det.keypoints):
                entry["keypoints"] = [[_number(v, 3) for v in p] for p in points]
        record: dict[str, Any] = {"image": det.path, "width": det.width, "height": det.height}
        if det.frame is not None:
            record["frame"] = det.frame
        if self.keypoints is not None:
            record["keypoint_names"] = list(self.keypoints.names)
        record["detections"] = detections
        write_bytes_atomic(self.path("json", f"{name}.json"), json.dumps(record).encode("utf-8"))

    def _write_yolo(self, det: Detections, name: str) -> None:
        lines = []
        scale = np.array([det.width, det.height, 1.0])
        for (x0, y0, x1, y1), score, label, points in zip(det.boxes.tolist(), det.scores.tolist(), det.labels.tolist(),
                                                          _points(det)):
            cx, cy = (x0 + x1) / 2 / det.width, (y0 + y1) / 2 / det.height
            w, h = (x1 - x0) / det.width, (y1 - y0) / det.height
            pose = "".join(f" {v:.6g}" for v in (points / scale).reshape(-1))  # Ultralytics' pose line: x y s
            lines.append(f"{self._class_index[label]} {cx:.6g} {cy:.6g} {w:.6g} {h:.6g}{pose} {score:.6g}\n")
        write_bytes_atomic(self.path("labels", f"{name}.txt"), "".join(lines).encode("utf-8"))

    def _write_vis(self, det: Detections) -> None:
        shown = det.select(det.scores >= self.vis_thresh)
        rgb = cv2.cvtColor(_require_image(det), cv2.COLOR_BGR2RGB)
        skeleton = self.keypoints.skeleton if self.keypoints is not None else ()
        drawn = cv2.cvtColor(draw_detections(rgb, shown.boxes, shown.names, shown.scores, masks=shown.masks,
                                             keypoints=shown.keypoints, skeleton=skeleton), cv2.COLOR_RGB2BGR)
        rel = self.source.relpath(det.path)
        if det.frame is None:
            self._end_video()
            write_bytes_atomic(self.path("vis", rel), _encode(drawn, os.path.splitext(rel)[1]))
            return
        target = self.path("vis", f"{self.source.name(det.path)}.mp4")
        if self._video is None or self._video[0] != target:
            self._end_video()
            self._start_video(target, det)
        self._video[1].write(drawn)

    def _start_video(self, target: str, det: Detections) -> None:
        capture = cv2.VideoCapture(det.path)
        fps = capture.get(cv2.CAP_PROP_FPS) or 25.0
        capture.release()
        self._video_stack = contextlib.ExitStack()
        tmp = self._video_stack.enter_context(atomic_path(target, keep_extension=True))  # VideoWriter picks mp4 by it
        writer = cv2.VideoWriter(tmp, cv2.VideoWriter_fourcc(*"mp4v"), max(fps / self.vid_stride, 1.0),
                                 (det.width, det.height))
        if not writer.isOpened():
            self._video_stack.close()
            raise DataError(f"opencv cannot write the video {target} (codec mp4v).")
        self._video = (target, writer)

    def _end_video(self) -> None:
        if self._video is not None:
            self._video[1].release()
            self._video = None
            self._video_stack.close()  # renames the complete file into place
            self._video_stack = None

    def _write_crops(self, det: Detections, name: str) -> None:
        image = _require_image(det)
        ext = ".jpg" if det.frame is not None else os.path.splitext(det.path)[1].lower() or ".jpg"
        for k, (box, class_name) in enumerate(zip(det.boxes, det.names)):
            x0, y0 = max(int(math.floor(box[0])), 0), max(int(math.floor(box[1])), 0)
            x1, y1 = min(int(math.ceil(box[2])), det.width), min(int(math.ceil(box[3])), det.height)
            if x1 <= x0 or y1 <= y0:
                continue
            write_bytes_atomic(self.path("crops", _class_folder(class_name), f"{name}_{k}{ext}"),
                               _encode(image[y0:y1, x0:x1], ext))


def csv_keypoint_columns(keypoints: KeypointMeta | None) -> tuple[str, ...]:
    """The CSV columns a keypoint model adds after :data:`CSV_COLUMNS`: ``<point>_x, <point>_y, <point>_score``."""
    if keypoints is None:
        return ()
    return tuple(f"{name}_{part}" for name in keypoints.names for part in ("x", "y", "score"))


def _points(det: Detections) -> np.ndarray:
    """The detections' keypoints [N, K, 3], or [N, 0, 3] for a model without them (no columns, no values)."""
    return det.keypoints if det.keypoints is not None else np.zeros((len(det), 0, 3), np.float32)


def _class_folder(class_name: str) -> str:
    """The folder under ``crops/`` for ``class_name``, one level deep whatever the name: a path separator (or NUL)
    becomes ``_`` (``N/A`` -> ``N_A``) and a name of dots only (``.``, ``..``) or none becomes as many ``_``, since it
    would name ``crops/`` itself or the folder above it. Other names are kept as they are."""
    folder = class_name.replace("/", "_").replace(os.sep, "_").replace("\0", "_")
    return folder if folder.strip(".") else folder.replace(".", "_") or "_"


def _yolo_names(label_space: LabelSpace) -> dict[int, str]:
    """Class index -> name for data.yaml, every name once: Ultralytics and Pet's YOLO reader refuse a repeated
    name, and a ``category_id`` label space names all its unused rows alike (COCO's ``N/A``), so a repeated name
    becomes ``<name>_<category id>``; the indices stay the model's rows, as in the label files."""
    names = label_space.names
    return {i: f"{name}_{cid}" if names.count(name) > 1 else name
            for i, (cid, name) in enumerate(zip(label_space.category_ids, names))}


def _require_image(det: Detections) -> np.ndarray:
    if det.image is None:
        raise ValueError("vis and crops need the pictures: stream(..., with_images=True)")
    return det.image


def _encode(image: np.ndarray, ext: str) -> bytes:
    ok, buffer = cv2.imencode(ext if ext else ".png", image)
    if not ok:
        ok, buffer = cv2.imencode(".png", image)
    return buffer.tobytes()


def _ann_image_ids(ann: str) -> dict[str, int]:
    """``{file_name: id, base name: id}`` of a COCO annotation file's images (base names only when unique)."""
    try:
        with open(ann, encoding="utf-8") as f:
            images = json.load(f)["images"]
        ids = {str(image["file_name"]).replace(os.sep, "/"): int(image["id"]) for image in images}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"Cannot read image ids from --ann {ann}: {exc} (a COCO annotation file with 'images', each "
                        "with 'id' and 'file_name').") from exc
    bases: dict[str, list[int]] = {}
    for file_name, image_id in ids.items():
        bases.setdefault(os.path.basename(file_name), []).append(image_id)
    return {**{b: v[0] for b, v in bases.items() if len(v) == 1}, **ids}
