"""What tools/predict.py and :meth:`Predictor.stream` read: SRC resolved to files, and the loaders that
decode them while the model runs.

SRC is an image, a folder (searched recursively), a glob, a text file with one path per line (relative
paths are taken from the text file's folder), or a video. Files are listed in sorted order (stable from
run to run); hidden files and folders (a leading ``.``) are left out, and so is the output folder when it
lies inside the input (the input folder itself as output is refused). Everything a user can get wrong
about SRC (a missing path, an empty folder, a video opencv cannot open) is a :class:`DataError` raised
here, before any work.

Decoding and the test transform run in DataLoader worker processes (``DATA.NUM_WORKERS``) while the
model runs, with at most ``prefetch_factor`` batches per worker waiting, so memory stays bounded however
long the source is. Images are a map-style dataset batched in file order, so a folder is batched exactly
as tools/test_net.py batches the same images. A video is read in one worker, frame after frame (seeking
is slow and inexact in compressed video, and the frames must stay in order); the DataLoader's queue
bounds how far it reads ahead.
"""
from __future__ import annotations

import glob
import math
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from pet.data import collate_batch, read_image
from pet.data.build import seed_worker
from pet.data.transforms import Augmentation, apply_augmentations
from pet.predict.tiling import TileSpec
from pet.utils.errors import ConfigError, DataError

__all__ = ["IMAGE_EXTENSIONS", "VIDEO_EXTENSIONS", "Source", "Picture", "Unreadable", "Work", "Preparer",
           "build_loader"]

# FFmpeg prints its own complaints about a broken video ("moov atom not found") before opencv returns; the
# error raised here says it in one line. Read when opencv first opens a video; a user's setting wins.
os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", "-8")

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")
VIDEO_EXTENSIONS = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v", ".mpg", ".mpeg", ".wmv")
_GLOB_CHARS = "*?["


def _kind(path: str) -> str | None:
    ext = os.path.splitext(path)[1].lower()
    return "image" if ext in IMAGE_EXTENSIONS else "video" if ext in VIDEO_EXTENSIONS else None


class PathTable:
    """Many paths in one numpy buffer: small to hold, cheap to send to workers, and read there without
    touching Python objects (whose reference counts would make forked workers copy memory pages)."""

    def __init__(self, paths: Iterable[str]) -> None:
        encoded = [p.encode("utf-8", "surrogateescape") for p in paths]
        self._offsets = np.cumsum([0] + [len(e) for e in encoded], dtype=np.int64)
        self._buffer = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index: int) -> str:
        return self._buffer[self._offsets[index]:self._offsets[index + 1]].tobytes().decode("utf-8", "surrogateescape")


class Source:
    """The files SRC names, in order, and the folder their relative names (mirrored in the outputs) start from.

    ``exclude``: a folder to leave out (the output folder). Videos are opened once here, so one that
    opencv cannot read fails before any work.
    """

    def __init__(self, spec: str, *, exclude: str | None = None) -> None:
        self.spec = str(spec)
        self._exclude = os.path.realpath(exclude) if exclude else None
        paths, self.root = self._resolve(self.spec)
        paths = [p for p in paths if _kind(p)]
        if not paths:
            raise DataError(f"No image or video in {self.spec} (looked for {', '.join(IMAGE_EXTENSIONS)} and "
                            f"{', '.join(VIDEO_EXTENSIONS)}).")
        self.paths = PathTable(paths)
        self.is_video = np.array([_kind(p) == "video" for p in paths], dtype=bool)
        self.frame_counts = {i: _check_video(paths[i]) for i in np.flatnonzero(self.is_video).tolist()}
        self._keep_extension = _shared_stems([self.relpath(p) for p in paths], self.is_video.tolist())

    def __len__(self) -> int:
        return len(self.paths)

    def relpath(self, path: str) -> str:
        """``path`` relative to the source's root, with ``/`` separators (how outputs mirror sub-folders)."""
        rel = os.path.relpath(os.path.abspath(path), self.root)
        return rel.replace(os.sep, "/")

    def name(self, path: str, frame: int | None = None) -> str:
        """What the outputs call a picture of the source: its :meth:`relpath` without extension, ``<that>_<frame>``
        for a video frame; with the extension kept (``a.jpg``, ``a.png``) where the short names of two files
        would be the same, so no output overwrites another."""
        rel = self.relpath(path)
        base = rel if rel in self._keep_extension else os.path.splitext(rel)[0]
        return base if frame is None else f"{base}_{frame}"

    def num_pictures(self, vid_stride: int = 1) -> int:
        """Images plus the video frames a stride of ``vid_stride`` keeps (as far as the videos' headers tell)."""
        frames = sum(math.ceil(count / vid_stride) for count in self.frame_counts.values())
        return len(self) - len(self.frame_counts) + frames

    def segments(self) -> Iterator[tuple[str, int, int]]:
        """``("images", start, end)`` for each run of images, ``("video", i, i + 1)`` for each video, in order."""
        start = 0
        for i, video in enumerate(self.is_video.tolist()):
            if video:
                if i > start:
                    yield "images", start, i
                yield "video", i, i + 1
                start = i + 1
        if start < len(self):
            yield "images", start, len(self)

    # ----------------------------------------------------------------- resolving SRC
    def _resolve(self, spec: str) -> tuple[list[str], str]:
        if os.path.isdir(spec):
            self._output_inside(spec)
            return self._walk(spec), os.path.abspath(spec)
        if os.path.isfile(spec):
            if _kind(spec):
                return [spec], os.path.dirname(os.path.abspath(spec))
            return self._read_list(spec)
        if any(c in spec for c in _GLOB_CHARS):
            output_inside = self._output_inside(_glob_folder(spec))
            paths = sorted(p for p in glob.glob(spec, recursive=True)
                           if os.path.isfile(p) and not self._hidden(p, output_inside))
            if not paths:
                raise DataError(f"The pattern {spec} matches no file.")
            return paths, _common_folder(paths)
        raise DataError(f"Input {spec} does not exist: give an image, a folder, a glob, a text file of paths or a "
                        "video.")

    def _walk(self, folder: str) -> list[str]:
        """Files under ``folder``, following links to folders; a folder reached again (a link to a folder
        already searched, or a loop of links) is searched once, at the first path found (a real folder
        before a link beside it)."""
        found = []
        seen = {os.path.realpath(folder)}
        for directory, subdirs, files in os.walk(folder, followlinks=True):
            kept = []
            for d in sorted(subdirs, key=lambda d: (os.path.islink(os.path.join(directory, d)), d)):
                real = os.path.realpath(os.path.join(directory, d))
                if not d.startswith(".") and real != self._exclude and real not in seen:
                    seen.add(real)
                    kept.append(d)
            subdirs[:] = kept
            found += [os.path.join(directory, f) for f in files if not f.startswith(".")]
        if not found:
            raise DataError(f"Input folder {folder} is empty.")
        return sorted(found, key=lambda p: os.path.relpath(p, folder).split(os.sep))

    def _read_list(self, list_file: str) -> tuple[list[str], str]:
        try:
            with open(list_file, encoding="utf-8-sig") as f:  # a BOM (Windows editors write one) is not a path
                lines = [line.strip() for line in f]
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"Input {list_file} is neither an image, a video nor a text file of paths "
                            f"({type(exc).__name__}).") from exc
        base = os.path.dirname(os.path.abspath(list_file))
        paths = [line if os.path.isabs(line) else os.path.join(base, line) for line in lines if line]
        if not paths:
            raise DataError(f"The list {list_file} names no file.")
        return paths, _common_folder(paths)

    def _output_inside(self, folder: str) -> bool:
        """Whether the output folder lies inside the input ``folder`` (then it is left out of the input). The input
        folder itself as output is refused: the next run would read its outputs (vis/, crops/) as pictures."""
        folder = os.path.realpath(folder)
        if self._exclude == folder:
            raise ConfigError(f"--output {self._exclude} is the input folder of {self.spec}: the next run would read "
                              f"its outputs (vis/, crops/) as pictures. Write elsewhere, e.g. --output "
                              f"{os.path.join(folder, 'predict')} (an output folder inside the input is left out).")
        return self._exclude is not None and self._exclude.startswith(folder + os.sep)

    def _hidden(self, path: str, output_inside: bool) -> bool:
        inside_output = output_inside and os.path.realpath(path).startswith(self._exclude + os.sep)
        return inside_output or os.path.basename(path).startswith(".")


def _shared_stems(rels: Sequence[str], is_video: Sequence[bool]) -> set[str]:
    """The relative paths whose output names must keep their extension: files whose stems are the same (``a.jpg``,
    ``a.png``; ``a.mp4``, ``a.mov``), and an image whose stem is a frame's name (``clip_3.jpg`` beside
    ``clip.mp4``). Compared without case, as a case-insensitive file system would; repeated until no name
    is shared, since a kept extension can itself be another file's stem (``a.jpg`` beside ``a.jpg.png``)."""
    keep: set[str] = set()
    while True:
        images: dict[str, set[str]] = {}
        videos: dict[str, set[str]] = {}
        for rel, video in zip(rels, is_video):
            base = (rel if rel in keep else os.path.splitext(rel)[0]).casefold()
            (videos if video else images).setdefault(base, set()).add(rel)
        shared = {rel for group in (*images.values(), *videos.values()) if len(group) > 1 for rel in group}
        for base, group in images.items() if videos else ():
            frame = re.fullmatch(r"(.*)_\d+", base)
            if frame and frame.group(1) in videos:
                shared |= group | videos[frame.group(1)]
        if shared <= keep:
            return keep
        keep |= shared


def _glob_folder(pattern: str) -> str:
    """The folder a glob searches from: its leading path components without a glob character."""
    parts = pattern.split(os.sep)
    fixed = next(i for i, part in enumerate(parts) if any(c in part for c in _GLOB_CHARS))
    return os.sep.join(parts[:fixed]) or ("/" if pattern.startswith(os.sep) else ".")


def _common_folder(paths: Sequence[str]) -> str:
    return os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])


def _check_video(path: str) -> int:
    """The frame count in ``path``'s header; a :class:`DataError` when opencv cannot open or read it."""
    capture = cv2.VideoCapture(path)
    try:
        if not capture.isOpened() or not capture.grab():
            raise DataError(f"Cannot read video {path}: opencv cannot open it or decode its first frame (missing, "
                            "corrupt, or a codec this opencv build lacks).")
        return max(int(capture.get(cv2.CAP_PROP_FRAME_COUNT)), 1)
    finally:
        capture.release()


# --------------------------------------------------------------------------------------------- loading
@dataclass
class Picture:
    """One picture of a source, a file or a video frame (``frame``: its index in the video, from 0), with
    ``original`` (RGB uint8 [H, W, 3]) when the caller keeps the pixels."""

    path: str
    frame: int | None
    height: int
    width: int
    original: torch.Tensor | None = None


@dataclass
class Unreadable:
    """A file that could not be read or decoded, and why."""

    path: str
    message: str


@dataclass
class Work:
    """A unit of work for the model: ``chunks`` of ``(images, targets)`` batches whose samples belong, in order,
    ``samples_per_picture[k]`` of them to ``pictures[k]``; and the files that could not be read on the way."""

    chunks: list[tuple[torch.Tensor, list[dict[str, Any]]]]
    pictures: list[Picture]
    samples_per_picture: list[int]
    unreadable: list[Unreadable]


class Preparer:
    """Turns a decoded RGB image into model samples: the image through the test transform, or (with ``tiles``)
    each tile cut at the image's own scale through the same transform (then, with ``tiles.whole_image``, the
    whole image too). Each sample is ``{"image", "image_size", "orig_size"}`` as the test mapper makes them."""

    def __init__(self, augmentations: Sequence[Augmentation], tiles: TileSpec | None = None,
                 keep_original: bool = False) -> None:
        self.augmentations = list(augmentations)
        self.tiles = tiles
        self.keep_original = keep_original

    def sample(self, image: np.ndarray) -> dict[str, Any]:
        orig_size = (int(image.shape[0]), int(image.shape[1]))
        image, _ = apply_augmentations(self.augmentations, image, np.random.default_rng(0))
        return {"image": torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1),  # as DatasetMapper does
                "image_size": (int(image.shape[0]), int(image.shape[1])), "orig_size": orig_size}

    def __call__(self, image: np.ndarray, path: str, frame: int | None = None) -> tuple[Picture, list[dict]]:
        height, width = image.shape[:2]
        if self.tiles is None:
            samples = [self.sample(image)]
        else:
            samples = [self.sample(image[y0:y1, x0:x1]) for x0, y0, x1, y1 in self.tiles.grid(height, width)]
            if self.tiles.whole_image:
                samples.append(self.sample(image))
        original = torch.from_numpy(np.ascontiguousarray(image)) if self.keep_original else None
        return Picture(path, frame, int(height), int(width), original), samples


class ImageFiles(Dataset):
    """Images ``start`` .. ``end`` of a :class:`PathTable`, decoded (RGB) and prepared; an unreadable file
    becomes an :class:`Unreadable` item (the caller decides whether to skip it or stop)."""

    def __init__(self, paths: PathTable, start: int, end: int, prepare: Preparer) -> None:
        self.paths, self.start, self.end, self.prepare = paths, start, end, prepare

    def __len__(self) -> int:
        return self.end - self.start

    def __getitem__(self, index: int) -> Any:
        path = self.paths[self.start + index]
        try:
            image = read_image(path)
        except DataError as exc:
            return Unreadable(path, str(exc))
        return self.prepare(image, path)


class VideoFrames(IterableDataset):
    """Every ``stride``-th frame of a video, from frame 0, decoded (RGB) and prepared, in order."""

    def __init__(self, path: str, stride: int, prepare: Preparer) -> None:
        self.path, self.stride, self.prepare = path, stride, prepare

    def __iter__(self) -> Iterator[Any]:
        capture = cv2.VideoCapture(self.path)
        try:
            index = 0
            while capture.grab():  # skipped frames are grabbed, not converted
                if index % self.stride == 0:
                    ok, frame = capture.retrieve()
                    if not ok:
                        yield Unreadable(f"{self.path}#{index}", f"Cannot decode frame {index} of video {self.path}.")
                    else:
                        yield self.prepare(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB), self.path, index)
                index += 1
        finally:
            capture.release()


class Collate:
    """Items -> one :class:`Work`: without tiles, one batch of every picture (padded as the test loader
    pads); with tiles (one picture per item), its samples in batches of ``batch_size``, each batch of one
    size (the whole-image sample, larger than the tiles, goes alone)."""

    def __init__(self, size_divisibility: int, batch_size: int, tiled: bool) -> None:
        self.size_divisibility, self.batch_size, self.tiled = size_divisibility, batch_size, tiled

    def __call__(self, items: Sequence[Any]) -> Work:
        unreadable = [item for item in items if isinstance(item, Unreadable)]
        prepared = [item for item in items if not isinstance(item, Unreadable)]
        samples = [s for _, group in prepared for s in group]
        if not self.tiled:
            groups = [samples] if samples else []
        else:
            runs: list[list[dict[str, Any]]] = []
            for sample in samples:
                if runs and runs[-1][-1]["image_size"] == sample["image_size"]:
                    runs[-1].append(sample)
                else:
                    runs.append([sample])
            groups = [run[i:i + self.batch_size] for run in runs for i in range(0, len(run), self.batch_size)]
        chunks = [collate_batch(group, self.size_divisibility) for group in groups]
        return Work(chunks, [picture for picture, _ in prepared], [len(group) for _, group in prepared], unreadable)


def build_loader(source: Source, segment: tuple[str, int, int], prepare: Preparer, *, batch_size: int,
                 num_workers: int, size_divisibility: int, vid_stride: int = 1) -> DataLoader:
    """The loader of one :meth:`Source.segments` entry, yielding :class:`Work` in source order."""
    kind, start, end = segment
    tiled = prepare.tiles is not None
    per_step = 1 if tiled else batch_size
    collate = Collate(size_divisibility, batch_size, tiled)
    if kind == "images":
        dataset: Dataset = ImageFiles(source.paths, start, end, prepare)
    else:
        dataset = VideoFrames(source.paths[start], vid_stride, prepare)
        num_workers = min(num_workers, 1)  # one reader keeps the frames in order
    return DataLoader(dataset, batch_size=per_step, shuffle=False, num_workers=num_workers, collate_fn=collate,
                      worker_init_fn=seed_worker if num_workers else None)
