"""Training pipelines from ``INPUT.AUGMENTATIONS``: named transforms on torchvision.transforms.v2.

A pipeline works on a *sample*, a dict whose entries ride together through every transform:

- ``image``: ``tv_tensors.Image`` uint8 [3, H, W] RGB;
- ``boxes``: ``tv_tensors.BoundingBoxes`` XYXY float32 in the image's pixels;
- ``labels``: int64 [N], one per box;
- ``masks`` (with masks on): ``tv_tensors.Mask`` uint8 [N, H, W], mask i belongs to box i;
- ``keypoints`` (a keypoint set): ``tv_tensors.KeyPoints`` [N, K, 2] with ``keypoint_visibility`` float32 [N, K].

torchvision's v2 transforms move boxes, masks and keypoints with the pixels, so the registry holds v2's own
classes wherever they do the job (:data:`TORCHVISION_TRANSFORMS`). Pet subclasses four of them where a detection
set needs more: the flips mirror keypoints as continuous coordinates, like boxes, and :class:`RandomHorizontalFlip`
renumbers them by the set's flip map (a left wrist stays a left wrist); :class:`RandomIoUCrop` takes a
probability as the RT-DETR authors' does, and :class:`SanitizeBoundingBoxes` drops keypoints with their boxes.
What v2 lacks, mixing several images (mosaic, mixup, copy-paste), is in :mod:`pet.data.mixing`.

An entry of ``INPUT.AUGMENTATIONS`` is ``{type: NAME, <arguments>}``; NAME is a registered class or a dotted
import path, so a plugin adds its own transform without editing Pet (``@AUGMENTATIONS.register()`` or the path).
Four keys belong to Pet, not to the transform: ``until_iter: N`` / ``until_epoch: E`` switch it off from
iteration N / epoch E on (RT-DETR's ``stop_epoch``, YOLO's "close mosaic"), ``from_iter`` / ``from_epoch`` switch it
on there (DEIM's first stage without strong augmentation: its policy epochs ``[4, 78, 148]`` are ``from_epoch: 4``
with ``until_epoch: 78`` or ``148``). The iteration and epoch come with each sample's key from the batch sampler, so a
resumed run switches at the same batch as an uninterrupted one.

Random draws come from torch's generator, seeded per sample from the sample's own seed inside
``torch.random.fork_rng``: a sample depends on its (index, seed) alone, never on the worker that loads it, and the
process's own torch stream is left as it was.
"""
from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from pet.utils.errors import ConfigError
from pet.utils.registry import Registry, resolve_spec

__all__ = [
    "AUGMENTATIONS", "TORCHVISION_TRANSFORMS", "AugmentationPipeline", "ScheduledTransform", "Progress",
    "ExtraSamples", "RandomHorizontalFlip", "RandomVerticalFlip", "RandomIoUCrop", "SanitizeBoundingBoxes",
    "build_pipeline", "keeps_size",
]

AUGMENTATIONS = Registry("augmentation")

# v2's own classes, registered under their own names: they already move boxes, masks and keypoints.
TORCHVISION_TRANSFORMS = (
    "RandomPhotometricDistort", "ColorJitter", "RandomGrayscale", "RandomZoomOut",
    "Resize", "RandomShortestSize", "RandomResize", "ScaleJitter", "RandomCrop", "CenterCrop", "Pad",
    "RandomAffine", "ClampBoundingBoxes", "GaussianBlur", "RandomEqualize",
)
for _name in TORCHVISION_TRANSFORMS:
    AUGMENTATIONS.register(getattr(v2, _name))

# v2's transforms that never change the image's size: colour, blur, flips, box clean-up.
_SIZE_KEEPING_TORCHVISION = (v2.RandomPhotometricDistort, v2.ColorJitter, v2.RandomGrayscale, v2.GaussianBlur,
                             v2.RandomEqualize, v2.RandomHorizontalFlip, v2.RandomVerticalFlip,
                             v2.ClampBoundingBoxes, v2.SanitizeBoundingBoxes)


def keeps_size(transform: Callable) -> bool:
    """Whether ``transform`` always returns the image at its input's size: v2's colour, blur, flip and box clean-up
    transforms (Pet's subclasses included), and any transform with ``keeps_size = True`` (Pet's mixup and
    copy-paste; a plugin's may say so too)."""
    return bool(getattr(transform, "keeps_size", False)) or isinstance(transform, _SIZE_KEEPING_TORCHVISION)


# Keys of an INPUT.AUGMENTATIONS entry that are Pet's schedule, not the transform's arguments.
SCHEDULE_KEYS = ("from_iter", "until_iter", "from_epoch", "until_epoch")


def _visibility(sample: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
    """The per-box tensors v2 does not know as such: labels, and the keypoints' visibility."""
    extra = (sample["keypoint_visibility"],) if "keypoint_visibility" in sample else ()
    return (sample["labels"], *extra)


def _flipped(sample: dict[str, Any], horizontal: bool) -> dict[str, Any]:
    """The sample mirrored by v2's functional flips, except keypoints: v2 puts a point at ``W - 1 - x`` (pixel
    indices) while it scales points as continuous coordinates in a resize; COCO's coordinates are continuous, and
    torchvision's detection references, detectron2 and Pet's default pipeline mirror them to ``W - x``, as boxes."""
    flip = F.horizontal_flip if horizontal else F.vertical_flip
    out = {k: flip(v) if isinstance(v, tv_tensors.TVTensor) and not isinstance(v, tv_tensors.KeyPoints) else v
           for k, v in sample.items()}
    if "keypoints" in sample:
        points = sample["keypoints"]
        axis, extent = (0, points.canvas_size[1]) if horizontal else (1, points.canvas_size[0])
        mirrored = points.as_subclass(torch.Tensor).clone()
        mirrored[..., axis] = extent - mirrored[..., axis]
        out["keypoints"] = tv_tensors.wrap(mirrored, like=points)
    return out


@AUGMENTATIONS.register()
class RandomHorizontalFlip(v2.RandomHorizontalFlip):
    """v2's horizontal flip (the same draw: ``torch.rand(1) < p``) that also renumbers keypoints.

    Point i of a mirrored person is point ``flip_map[i]`` of the original (torchvision's and detectron2's rule
    for COCO's person); ``flip_map`` comes from the set's :class:`~pet.data.keypoints.KeypointMeta`.
    """

    def __init__(self, p: float = 0.5, keypoint_flip_map: Sequence[int] | None = None) -> None:
        super().__init__(p)
        self.keypoint_flip_map = list(keypoint_flip_map) if keypoint_flip_map is not None else None

    def forward(self, sample: dict[str, Any]) -> dict[str, Any]:
        if torch.rand(1) >= self.p:
            return sample
        flipped = _flipped(sample, horizontal=True)
        if "keypoints" in flipped and flipped["keypoints"].shape[1]:
            if self.keypoint_flip_map is None:
                raise ConfigError("RandomHorizontalFlip on keypoints needs the set's flip map (KeypointMeta.flip_map):"
                                  " without it a left point would turn into a left point on the right side.")
            order = self.keypoint_flip_map
            flipped["keypoints"] = tv_tensors.wrap(flipped["keypoints"][:, order], like=flipped["keypoints"])
            flipped["keypoint_visibility"] = flipped["keypoint_visibility"][:, order]
        return flipped


@AUGMENTATIONS.register()
class RandomVerticalFlip(v2.RandomVerticalFlip):
    """v2's vertical flip (same draw) with keypoints mirrored to ``H - y`` like boxes; no renumbering (up and down
    are not named sides in keypoint sets)."""

    def forward(self, sample: dict[str, Any]) -> dict[str, Any]:
        if torch.rand(1) >= self.p:
            return sample
        return _flipped(sample, horizontal=False)


@AUGMENTATIONS.register()
class RandomIoUCrop(v2.RandomIoUCrop):
    """v2's SSD crop (a window keeping at least one box above a drawn IoU), applied with probability ``p``.

    The draw comes first (``torch.rand(1) >= p`` skips), as in the RT-DETR authors' transform. Boxes whose centre
    falls outside the window are zeroed; a :class:`SanitizeBoundingBoxes` after it removes them.
    """

    def __init__(self, min_scale: float = 0.3, max_scale: float = 1.0, min_aspect_ratio: float = 0.5,
                 max_aspect_ratio: float = 2.0, sampler_options: Sequence[float] | None = None, trials: int = 40,
                 p: float = 1.0) -> None:
        super().__init__(min_scale, max_scale, min_aspect_ratio, max_aspect_ratio,
                         list(sampler_options) if sampler_options is not None else None, trials)
        self.p = p

    def forward(self, *inputs: Any) -> Any:
        if torch.rand(1) >= self.p:
            return inputs if len(inputs) > 1 else inputs[0]
        return super().forward(*inputs)


@AUGMENTATIONS.register()
class SanitizeBoundingBoxes(v2.SanitizeBoundingBoxes):
    """v2's removal of boxes smaller than ``min_size`` / ``min_area`` or outside the image, with their labels and
    masks, and here also their keypoints and the keypoints' visibility."""

    def __init__(self, min_size: float = 1.0, min_area: float = 1.0) -> None:
        super().__init__(min_size, min_area, labels_getter=_visibility)

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        if isinstance(inpt, tv_tensors.KeyPoints) and inpt.ndim == 3:
            return tv_tensors.wrap(inpt[params["valid"]], like=inpt)
        return super().transform(inpt, params)


@dataclass(frozen=True)
class Progress:
    """Where training is when a sample is drawn: its iteration and epoch (both 0 outside training)."""

    iteration: int = 0
    epoch: int = 0


class ExtraSamples:
    """Other training samples, for the transforms that mix images (:mod:`pet.data.mixing`).

    ``draw()`` picks an image uniformly with torch's (per-sample seeded) generator and returns it as a sample,
    before any transform: which images a mosaic takes is fixed by the sample's seed, so by the run's seed and
    rank, and a resumed run takes the same ones.
    """

    def __init__(self, size: int, load: Callable[[int], dict[str, Any]]) -> None:
        self.size = size
        self._load = load

    def draw(self) -> dict[str, Any]:
        return self._load(int(torch.randint(self.size, (1,))))


class ScheduledTransform:
    """A transform on while ``from_iter <= iteration < until_iter`` and ``from_epoch <= epoch < until_epoch`` (each
    bound when set)."""

    def __init__(self, transform: Callable, from_iter: int | None = None, until_iter: int | None = None,
                 from_epoch: int | None = None, until_epoch: int | None = None) -> None:
        self.transform = transform
        self.from_iter, self.until_iter = from_iter, until_iter
        self.from_epoch, self.until_epoch = from_epoch, until_epoch

    def active(self, progress: Progress) -> bool:
        return (_within(progress.iteration, self.from_iter, self.until_iter)
                and _within(progress.epoch, self.from_epoch, self.until_epoch))

    @property
    def scheduled(self) -> bool:
        return any(bound is not None for bound in (self.from_iter, self.until_iter, self.from_epoch, self.until_epoch))


def _within(count: int, start: int | None, stop: int | None) -> bool:
    return (start is None or count >= start) and (stop is None or count < stop)


class AugmentationPipeline:
    """The transforms of ``INPUT.AUGMENTATIONS`` in order, each skipped once its schedule switches it off.

    A transform that mixes in other images sets ``mixes_images = True`` and is called as
    ``transform(sample, extra)`` with an :class:`ExtraSamples`; any other is called as ``transform(sample)``.
    """

    def __init__(self, steps: Sequence[ScheduledTransform]) -> None:
        self.steps = list(steps)

    @property
    def transforms(self) -> list[Callable]:
        return [s.transform for s in self.steps]

    @property
    def scheduled(self) -> bool:
        """Whether a transform switches on or off during training (the loader then stamps progress on each key)."""
        return any(s.scheduled for s in self.steps)

    @property
    def keeps_size(self) -> bool:
        """Whether every image leaves the pipeline at its stored size (so ``DATA.SIZE_GROUPING`` can group by it)."""
        return all(keeps_size(s.transform) for s in self.steps)

    @property
    def min_images(self) -> int:
        """How many images a sample may need at least in the dataset (1 when nothing mixes images)."""
        return max([getattr(s.transform, "min_images", 1) for s in self.steps], default=1)

    def __call__(self, sample: dict[str, Any], seed: int, progress: Progress | None = None,
                 extra: ExtraSamples | None = None) -> dict[str, Any]:
        progress = progress or Progress()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for step in self.steps:
                if not step.active(progress):
                    continue
                if getattr(step.transform, "mixes_images", False):
                    if extra is None:
                        raise ConfigError(f"{type(step.transform).__name__} mixes images and needs a dataset to "
                                          "draw them from; it only works in a training loader.")
                    sample = step.transform(sample, extra)
                else:
                    sample = step.transform(sample)
        return sample


def build_pipeline(specs: Sequence[Mapping[str, Any]], *,
                   keypoint_flip_map: Sequence[int] | None = None) -> AugmentationPipeline:
    """The pipeline of ``INPUT.AUGMENTATIONS`` entries ``{type: NAME, <arguments>, [from_|until_ iter|epoch]}``.

    A wrong name or argument is a :class:`ConfigError` naming the entry (with a did-you-mean for names and
    arguments); ``keypoint_flip_map`` goes to transforms that accept it.
    """
    steps = []
    for position, spec in enumerate(specs):
        if not isinstance(spec, Mapping):
            raise ConfigError(f"INPUT.AUGMENTATIONS[{position}] must be a mapping {{type: NAME, ...}}, got {spec!r}.")
        cls = resolve_spec(AUGMENTATIONS, spec)
        kwargs = {str(k).lower(): v for k, v in spec.items() if str(k).lower() != "type"}
        schedule = {k: _count(kwargs.pop(k), f"INPUT.AUGMENTATIONS[{position}].{k}") for k in SCHEDULE_KEYS
                    if k in kwargs}
        for unit in ("iter", "epoch"):
            start, stop = schedule.get(f"from_{unit}"), schedule.get(f"until_{unit}")
            if start is not None and stop is not None and start >= stop:
                raise ConfigError(f"INPUT.AUGMENTATIONS[{position}] ({cls.__name__}) is never on: from_{unit} "
                                  f"{start} is not before until_{unit} {stop}.")
        accepted = _accepted(cls)
        if "keypoint_flip_map" in accepted and "keypoint_flip_map" not in kwargs:
            kwargs["keypoint_flip_map"] = keypoint_flip_map
        unknown = [k for k in kwargs if accepted and k not in accepted]
        if unknown:
            close = difflib.get_close_matches(unknown[0], accepted, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"INPUT.AUGMENTATIONS[{position}] ({cls.__name__}) has no argument '{unknown[0]}'.{hint}"
                              f" It takes: {', '.join(sorted(accepted))}.")
        try:
            transform = cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"INPUT.AUGMENTATIONS[{position}] ({cls.__name__}): {exc}") from exc
        steps.append(ScheduledTransform(transform, **schedule))
    return AugmentationPipeline(steps)


def _accepted(cls: type) -> list[str]:
    """The keyword arguments ``cls(...)`` names (empty when it takes ``**kwargs``)."""
    params = inspect.signature(cls).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _count(value: Any, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{key} must be a whole number >= 0, got {value!r}.")
    return value

