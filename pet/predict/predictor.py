"""Run a trained detector on pictures that have no annotations: :class:`Predictor` and its result type.

``Predictor(cfg)`` loads the model as tools/test_net.py does (``TEST.WEIGHTS``, else
``CKPT/model_final.pth``; or an ONNX export run by onnxruntime) and runs it as tools/test_net.py does:
the same test transform, the same padded batches in the same order, the same precision (``TEST.AMP``),
so a folder of the test images gives exactly test_net's detections. Then it maps labels to the
training set's category ids and names, which the model carries (:mod:`pet.predict.labels`).

``predictor(image)`` predicts one picture, ``predictor.predict_many(images)`` a list of pictures in memory, in
batches; ``predictor.stream(source)`` any number, as a generator
that holds one batch at a time: pictures are decoded and transformed in worker processes while the
model runs, results are handed out as they come and nothing accumulates. With ``tile`` each picture is
cut into tiles at its own pixel scale (:mod:`pet.predict.tiling`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import cv2
import numpy as np
import torch
from fvcore.common.config import CfgNode

from pet.config import load_cfg
from pet.data import build_augmentations, read_image, register_custom_datasets
from pet.data.categories import LabelSpace
from pet.engine.inference import inference_precision
from pet.engine.inference_timer import InferenceTimer
from pet.engine.models import call_model, model_device
from pet.engine.precision import Precision
from pet.modeling.detector import score_thresh_key
from pet.predict.labels import model_label_space
from pet.predict.loading import BACKENDS, load_inference_model
from pet.predict.sources import Collate, Picture, Preparer, Source, Work, build_loader
from pet.predict.tiling import TileSpec, merge_tiles
from pet.utils.errors import ConfigError, DataError
from pet.utils.tensor import move_to_device
from pet.utils.timers import activate

__all__ = ["Detections", "Predictor", "PredictStats", "PREDICT_DEFAULTS", "predict_cfg", "model_score_thresh",
           "with_score_thresh"]

logger = logging.getLogger(__name__)

# Predicting's own defaults, under the config file and the command line: a folder of photos often holds a
# broken one, so an unreadable picture is skipped and counted (DATA.ON_BAD_IMAGE error stops instead).
PREDICT_DEFAULTS = ("DATA.ON_BAD_IMAGE", "skip")



@dataclass
class Detections:
    """The detections in one picture, in its original pixels, best first.

    - ``boxes``: float32 [N, 4] XYXY; ``scores``: float32 [N];
    - ``labels``: int64 [N], the training set's category ids; ``names``: their names;
    - ``masks``: uint8 [N, H, W] of 0/1 for a mask model, else None;
    - ``path``: the file (for a video frame, the video), as given or found; ``frame``: the frame's index in
      the video (from 0), None for an image; ``height``, ``width``: the picture's size;
    - ``image``: the picture (BGR uint8 [H, W, 3], as opencv reads) with ``stream(..., with_images=True)``;
    - ``keypoints``: float32 [N, K, 3] (x, y, score) for a keypoint model, else None; the score is the point's
      heatmap logit (torchvision's ``keypoints_scores``), not a probability. With tiles, each detection keeps the
      points of the tile detection it comes from (for an object joined from pieces, the most confident piece's).
    """

    boxes: np.ndarray
    scores: np.ndarray
    labels: np.ndarray
    names: list[str]
    path: str = ""
    frame: int | None = None
    height: int = 0
    width: int = 0
    masks: np.ndarray | None = None
    image: np.ndarray | None = field(default=None, repr=False)
    keypoints: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.scores)

    def select(self, keep: np.ndarray) -> Detections:
        """The detections where the boolean or index array ``keep`` says."""
        return Detections(self.boxes[keep], self.scores[keep], self.labels[keep],
                          [self.names[i] for i in np.arange(len(self))[keep]], self.path, self.frame, self.height,
                          self.width, None if self.masks is None else self.masks[keep], self.image,
                          None if self.keypoints is None else self.keypoints[keep])


@dataclass
class PredictStats:
    """What the last :meth:`Predictor.stream` did: pictures predicted, detections handed out, unreadable files
    skipped (the first few named), wall time, and the per-stage timer (``data`` = load, ``infer``, ``post``,
    and ``output``: the caller's time with each batch of results, e.g. writing them)."""

    timer: InferenceTimer
    pictures: int = 0
    detections: int = 0
    skipped: int = 0
    skipped_examples: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def pictures_per_second(self) -> float:
        return self.pictures / self.seconds if self.seconds else 0.0


def predict_cfg(cfg_file: str, opts: Sequence[str] = ()) -> CfgNode:
    """The config for predicting: ``cfg_file``, then :data:`PREDICT_DEFAULTS`, then ``opts`` (so
    ``DATA.ON_BAD_IMAGE error`` there stops at an unreadable picture)."""
    return load_cfg(cfg_file, [*PREDICT_DEFAULTS, *opts])


def model_score_thresh(cfg: CfgNode) -> tuple[str, float] | None:
    """The model's test score threshold: its config key (``MODEL.ROI_HEADS.SCORE_THRESH_TEST`` ...) and value;
    None for a detector without one (:attr:`pet.modeling.Detector.score_thresh_key`)."""
    key = score_thresh_key(cfg)
    if key is None:
        return None
    node: Any = cfg
    for part in key.split("."):
        node = node[part]
    return key, float(node)


def with_score_thresh(cfg: CfgNode, threshold: float | None) -> CfgNode:
    """``cfg``, or a copy whose model keeps detections down to ``threshold`` when that is below the model's own test
    threshold: a filter after the model cannot bring back what the model dropped. The caller's ``cfg`` is left as
    it is."""
    own = model_score_thresh(cfg)
    if threshold is None or own is None or threshold >= own[1]:
        return cfg
    key, value = own
    logger.info(f"Score threshold {threshold} is below {key} {value}: lowering that too")
    cfg = cfg.clone()
    cfg.defrost()
    cfg.merge_from_list([key, float(threshold)])
    cfg.freeze()
    return cfg


class Predictor:
    """A detector ready to predict, built from a config (a :class:`CfgNode` or a YAML path, with ``opts``).

    ``weights``: the checkpoint (default: :func:`pet.config.default_weights`), or with
    ``backend="onnxruntime"`` the ONNX file of tools/export.py, ``"openvino"`` its OpenVINO IR (both run in
    float32). ``score_thresh`` drops detections below it (default: none beyond the model's own
    ``SCORE_THRESH_TEST``); below that, a PyTorch model's threshold is lowered to it (:func:`with_score_thresh`,
    as tools/predict.py's ``--score-thresh``), while an export keeps the threshold it was exported with;
    ``max_det`` keeps the best N per picture. ``tile`` (px, 0: off), ``tile_overlap`` (a fraction of the tile),
    ``tile_whole_image`` and ``tile_merge`` set up tiling (:class:`pet.predict.tiling.TileSpec`); with tiles
    ``max_det`` defaults to 1000 and applies after the merge.

    ``model`` and ``label_space`` may be given instead of loading them (an ``nn.Module`` with Pet's batch
    contract).
    """

    def __init__(self, cfg: CfgNode | str, weights: str | None = None, *, opts: Sequence[str] = (),
                 backend: str = "pytorch", score_thresh: float | None = None, max_det: int | None = None,
                 tile: int = 0, tile_overlap: float = 0.2, tile_whole_image: bool = False, tile_merge: str = "seam",
                 unsafe_load: bool = False, model: torch.nn.Module | None = None,
                 label_space: LabelSpace | None = None) -> None:
        self.cfg = cfg if isinstance(cfg, CfgNode) else predict_cfg(cfg, opts)
        register_custom_datasets(self.cfg)
        if backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}.")
        if max_det is not None and max_det <= 0:
            raise ConfigError(f"--max-det must be positive, got {max_det}.")
        self.tiles = TileSpec(tile, tile_overlap, whole_image=tile_whole_image, merge=tile_merge,
                              max_det=max_det or 1000) if tile else None
        self.score_thresh = score_thresh
        self.max_det = max_det
        self.augmentations = build_augmentations(self.cfg, is_train=False)
        recorded, model_file = None, "the given model"
        if model is None:
            if backend == "pytorch":  # an export computes with the threshold it was exported with
                self.cfg = with_score_thresh(self.cfg, score_thresh)
            loaded = load_inference_model(self.cfg, backend, weights or "", unsafe=unsafe_load)
            model, model_file, recorded = loaded.model, loaded.path, loaded.recorded_labels
        self.model = model.eval()
        self.label_space = label_space or model_label_space(self.cfg, recorded, model_file)
        self._category_ids = np.array((0, *self.label_space.category_ids), dtype=np.int64)
        device = model_device(self.model)
        self.precision = (Precision(device.type, None, False, f"{backend} computes in float32")
                          if backend != "pytorch" else inference_precision(self.cfg, self.model))
        self.stats: PredictStats | None = None
        self._warned_masks = False
        logger.info(f"Predicting with {model_file} ({self.label_space.num_classes} classes: "
                    f"{', '.join(self.label_space.names[:10])}{' ...' if self.label_space.num_classes > 10 else ''}); "
                    f"precision {self.precision}" + (f"; {self.tiles}" if self.tiles else ""))

    # ----------------------------------------------------------------- pictures in memory
    def __call__(self, image: np.ndarray | str | os.PathLike) -> Detections:
        """The detections in one picture: an array (BGR or gray, as opencv reads) or an image file."""
        return self.predict_many([image])[0]

    def predict_many(self, images: Sequence[np.ndarray | str | os.PathLike],
                     batch_size: int | None = None) -> list[Detections]:
        """The detections in each of ``images`` (arrays, BGR or gray as opencv reads, or image files), in order.

        ``batch_size`` pictures (default ``TEST.IMS_PER_BATCH``) go through the model at a time, padded into
        one batch as the test loader pads them; with tiles, one picture at a time in batches of its tiles.
        For a folder, a video or more pictures than memory holds, :meth:`stream` decodes as it goes.
        """
        batch_size = batch_size or self.cfg.TEST.IMS_PER_BATCH
        if batch_size <= 0:
            raise ConfigError(f"The batch size must be positive, got {batch_size}.")
        prepare = Preparer(self.augmentations, self.tiles)
        collate = Collate(self.cfg.INPUT.SIZE_DIVISIBILITY, batch_size, self.tiles is not None)
        per_pass = 1 if self.tiles else batch_size
        results: list[Detections] = []
        for first in range(0, len(images), per_pass):
            work = collate([prepare(*_rgb_and_path(image)) for image in images[first:first + per_pass]])
            results += self._post(work, self._infer(work))
        return results

    # ----------------------------------------------------------------- many pictures
    def stream(self, source: str | Source, batch_size: int | None = None, *, vid_stride: int = 1,
               with_images: bool = False, num_workers: int | None = None) -> Iterator[Detections]:
        """:class:`Detections` for every picture of ``source`` (any SRC of :mod:`pet.predict.sources`), in order.

        ``batch_size`` pictures (default ``TEST.IMS_PER_BATCH``; tiles with ``tile``) go through the model
        at a time; ``vid_stride`` keeps every N-th video frame; ``with_images`` hands out each picture too;
        ``num_workers`` decoding processes (default ``DATA.NUM_WORKERS``). An unreadable file is skipped
        and logged (``DATA.ON_BAD_IMAGE skip``) or stops the stream with a :class:`DataError` (``error``).
        :attr:`stats` describes the run as it goes.
        """
        source = source if isinstance(source, Source) else Source(source)
        batch_size = batch_size or self.cfg.TEST.IMS_PER_BATCH
        if batch_size <= 0 or vid_stride <= 0:
            raise ConfigError(f"The batch size and --vid-stride must be positive, got {batch_size} and {vid_stride}.")
        workers = self.cfg.DATA.NUM_WORKERS if num_workers is None else num_workers
        timer = InferenceTimer(num_warmup=self.cfg.TEST.NUM_WARMUP)
        timer.configure(model_device(self.model), 1 if self.tiles else batch_size)
        stats = self.stats = PredictStats(timer)
        prepare = Preparer(self.augmentations, self.tiles, keep_original=with_images)
        start = time.perf_counter()
        timer.tic("iter")
        for segment in source.segments():
            batches = iter(build_loader(source, segment, prepare, batch_size=batch_size, num_workers=workers,
                                        size_divisibility=self.cfg.INPUT.SIZE_DIVISIBILITY, vid_stride=vid_stride))
            try:
                while True:
                    timer.tic("data")
                    work = next(batches, None)
                    if work is None:
                        break
                    timer.toc("data")
                    self._skip(work.unreadable, stats)
                    if not work.pictures:
                        continue
                    with timer.stage("infer", wait=True):
                        outputs = self._infer(work, timer)
                    with timer.stage("post"):
                        results = self._post(work, outputs)
                    with timer.stage("output"):
                        for detections in results:
                            stats.pictures += 1
                            stats.detections += len(detections)
                            stats.seconds = time.perf_counter() - start
                            yield detections
                        del results
                    timer.toc("iter")
                    timer.tic("iter")
            finally:
                del batches  # shuts its workers down, also when the caller stops early
        stats.seconds = time.perf_counter() - start

    # ----------------------------------------------------------------- stages
    def _skip(self, unreadable: Sequence[Any], stats: PredictStats) -> None:
        for item in unreadable:
            if self.cfg.DATA.ON_BAD_IMAGE == "error":
                raise DataError(item.message)
            stats.skipped += 1
            if len(stats.skipped_examples) < 5:
                stats.skipped_examples.append(item.path)
            reason = item.message.split(". ")[0].rstrip(".")
            logger.warning(f"Skipped {item.path}: {reason} ({stats.skipped} skipped so far; DATA.ON_BAD_IMAGE error "
                           "stops at such a file instead).")

    def _infer(self, work: Work, timer: InferenceTimer | None = None) -> list[dict[str, torch.Tensor]]:
        device = model_device(self.model)
        outputs: list[dict[str, torch.Tensor]] = []
        for batch in work.chunks:
            batch = move_to_device(batch, device)
            timing = activate(timer) if timer is not None else contextlib.nullcontext()  # for timed() in the model
            with torch.inference_mode(), self.precision.autocast(), timing:
                outputs += call_model(self.model, batch)
        return outputs

    def _post(self, work: Work, outputs: list[dict[str, torch.Tensor]]) -> list[Detections]:
        results, first = [], 0
        for picture, count in zip(work.pictures, work.samples_per_picture):
            mine = outputs[first:first + count]
            first += count
            keypoints = None
            if self.tiles is None:
                boxes, scores, labels = mine[0]["boxes"], mine[0]["scores"], mine[0]["labels"]
                masks = mine[0].get("masks")
                keypoints = _keypoints(mine[0])
            else:
                boxes, scores, labels, keypoints = self._merge(picture, mine)
                masks = None
            results.append(self._detections(picture, boxes, scores, labels, masks, keypoints))
        return results

    def _merge(self, picture: Picture, outputs: list[dict[str, torch.Tensor]]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray | None]:
        """Each tile's detections moved to the picture's pixels, above ``score_thresh``, merged; a keypoint model's
        points follow each detection from the tile detection it comes from."""
        assert self.tiles is not None
        if any("masks" in out for out in outputs) and not self._warned_masks:
            self._warned_masks = True
            logger.warning("Masks are not merged across tiles: tiled predictions have none.")
        tiles = self.tiles.grid(picture.height, picture.width)
        offsets = torch.zeros(len(outputs), 4)
        offsets[:len(tiles)] = torch.from_numpy(tiles[:, [0, 1, 0, 1]]).float()
        boxes = torch.cat([out["boxes"].float().cpu() + offset for out, offset in zip(outputs, offsets)])
        scores = torch.cat([out["scores"].float().cpu() for out in outputs])
        labels = torch.cat([out["labels"].cpu() for out in outputs])
        tile_ids = torch.cat([torch.full((len(out["scores"]),), i if i < len(tiles) else -1)
                              for i, out in enumerate(outputs)])
        points = _tile_keypoints(outputs, offsets)
        if self.score_thresh is not None:
            keep = scores >= self.score_thresh
            boxes, scores, labels, tile_ids = boxes[keep], scores[keep], labels[keep], tile_ids[keep]
            points = None if points is None else points[keep.numpy()]
        boxes, scores, labels, sources = merge_tiles(self.tiles, boxes, scores, labels, tile_ids, tiles,
                                                     (picture.height, picture.width))
        return boxes, scores, labels, None if points is None else points[sources.numpy()]

    def _detections(self, picture: Picture, boxes: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor,
                    masks: torch.Tensor | None, keypoints: np.ndarray | None = None) -> Detections:
        scores = scores.float().cpu().numpy()
        keep = np.arange(len(scores))
        if self.score_thresh is not None:
            keep = keep[scores[keep] >= self.score_thresh]
        if self.max_det is not None and len(keep) > self.max_det:
            keep = keep[np.argsort(-scores[keep], kind="stable")[:self.max_det]]
        labels = labels.cpu().numpy().astype(np.int64)[keep]
        if len(labels) and not 1 <= labels.min() <= labels.max() <= self.label_space.num_classes:
            raise ConfigError(f"The model predicted label {int(labels.max())}, but it has "
                              f"{self.label_space.num_classes} classes; check MODEL.NUM_CLASSES.")
        image = None
        if picture.original is not None:
            image = cv2.cvtColor(picture.original.numpy(), cv2.COLOR_RGB2BGR)
        return Detections(
            boxes=boxes.float().cpu().numpy()[keep].reshape(-1, 4), scores=scores[keep],
            labels=self._category_ids[labels], names=[self.label_space.names[i - 1] for i in labels.tolist()],
            path=picture.path, frame=picture.frame, height=picture.height, width=picture.width,
            masks=None if masks is None else masks.cpu().numpy().astype(np.uint8, copy=False)[keep], image=image,
            keypoints=None if keypoints is None else keypoints[keep])


def _keypoints(output: dict[str, torch.Tensor]) -> np.ndarray | None:
    """A keypoint model's points as float32 [N, K, 3] (x, y, score); None for other models."""
    if "keypoints" not in output:
        return None
    points = output["keypoints"].float().cpu().numpy().copy()
    if "keypoints_scores" in output:
        points[..., 2] = output["keypoints_scores"].float().cpu().numpy()
    return points


def _tile_keypoints(outputs: list[dict[str, torch.Tensor]], offsets: torch.Tensor) -> np.ndarray | None:
    """Every tile's keypoints (as :func:`_keypoints`) moved to the picture's pixels by its tile's offset; None for
    a model without keypoints."""
    points = [_keypoints(out) for out in outputs]
    if any(p is None for p in points):
        return None
    for p, offset in zip(points, offsets.numpy()):
        p[..., :2] += offset[:2]
    return np.concatenate(points)


def _rgb_and_path(image: np.ndarray | str | os.PathLike) -> tuple[np.ndarray, str]:
    """A picture given to :meth:`Predictor.predict_many` as the RGB array the transforms take, and its path."""
    if isinstance(image, (str, os.PathLike)):
        return read_image(str(image)), str(image)
    return _to_rgb(np.asarray(image)), ""


def _to_rgb(image: np.ndarray) -> np.ndarray:
    """An opencv picture (BGR, BGRA or gray; uint8) as the RGB array the model's transforms take."""
    if image.dtype != np.uint8:
        raise DataError(f"Expected a uint8 image (as opencv reads), got {image.dtype}.")
    if image.ndim == 2 or (image.ndim == 3 and image.shape[2] == 1):
        return cv2.cvtColor(image, cv2.COLOR_GRAY2RGB)
    if image.ndim == 3 and image.shape[2] in (3, 4):
        return cv2.cvtColor(image, cv2.COLOR_BGR2RGB if image.shape[2] == 3 else cv2.COLOR_BGRA2RGB)
    raise DataError(f"Expected an image of shape [H, W], [H, W, 3] or [H, W, 4], got {list(image.shape)}.")
