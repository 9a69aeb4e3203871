"""Named datasets: the built-in ones, user registrations and ``DATA.CUSTOM`` entries.

Configs name datasets (``TRAIN.DATASETS``, ``TEST.DATASETS``); this module maps a name to
its annotations (a COCO file, a YOLO data.yaml, a VOC root or a CSV file; see
:mod:`pet.data.formats`) and an image folder. Built-in datasets live under the data root:
the ``PET_DATA_ROOT`` environment variable, or ``data/`` next to the ``pet`` package.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from fvcore.common.config import CfgNode

from pet.data.categories import coco_categories
from pet.data.coco_json import COCODataset, build_coco_dataset, load_coco_json, read_categories
from pet.data.formats import FORMATS, read_annotations
from pet.data.formats.common import check_class_names
from pet.data.shapes import SHAPE_CLASSES, generate_shapes
from pet.data.shapes_keypoints import SHAPES_OKS_SIGMAS, prepare_shapes_keypoints
from pet.utils.errors import ConfigError, DataError

__all__ = [
    "DatasetSpec", "data_root", "register_coco_dataset", "register_dataset", "register_custom_datasets",
    "get_dataset_spec", "get_dataset", "dataset_categories", "list_datasets",
]

logger = logging.getLogger(__name__)

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class DatasetSpec:
    """Where a named dataset lives and how to read it; ``prepare`` (if any) creates it on first use.

    ``path`` is the annotation source of ``format`` (a COCO JSON, a YOLO data.yaml, a VOC root or
    a CSV file), ``image_root`` the folder image paths are relative to (COCO and CSV), ``split``
    the YOLO / VOC split, ``classes`` the fixed class list (empty: the format's own), ``columns``
    the CSV column names. ``categories`` (if any) gives the categories ``{id: name}`` without
    reading ``path`` (the built-in datasets' are known). ``oks_sigmas`` replaces a keypoint set's OKS
    sigmas (:mod:`pet.data.keypoints`).
    """

    name: str
    path: str
    image_root: str = ""
    prepare: Callable[[], object] | None = None
    format: str = "coco"
    split: str = ""
    classes: tuple[str, ...] = ()
    columns: tuple[tuple[str, str], ...] = ()
    categories: Callable[[], dict[int, str]] | None = None
    oks_sigmas: tuple[float, ...] = ()


def data_root() -> str:
    """``$PET_DATA_ROOT``, or ``<repo>/data``."""
    return os.path.abspath(os.path.expanduser(os.environ.get("PET_DATA_ROOT") or os.path.join(_REPO_ROOT, "data")))


def _shapes(split: str) -> Callable[[str], DatasetSpec]:
    def spec(root: str) -> DatasetSpec:
        shapes_root = os.path.join(root, "shapes")
        return DatasetSpec(
            f"shapes_{split}", os.path.join(shapes_root, "annotations", f"{split}.json"),
            os.path.join(shapes_root, split), prepare=functools.partial(generate_shapes, shapes_root),
            categories=lambda: {i + 1: name for i, name in enumerate(SHAPE_CLASSES)},
        )

    return spec


def _shapes_keypoints(split: str) -> Callable[[str], DatasetSpec]:
    """The demo set's images with the corners of its shapes as keypoints (:mod:`pet.data.shapes_keypoints`)."""
    def spec(root: str) -> DatasetSpec:
        shapes_root, kp_root = os.path.join(root, "shapes"), os.path.join(root, "shapes_kp")
        return DatasetSpec(
            f"shapes_kp_{split}", os.path.join(kp_root, "annotations", f"{split}.json"),
            os.path.join(shapes_root, split),
            prepare=functools.partial(prepare_shapes_keypoints, kp_root, shapes_root),
            categories=lambda: {i + 1: name for i, name in enumerate(SHAPE_CLASSES)}, oks_sigmas=SHAPES_OKS_SIGMAS,
        )

    return spec


def _coco(split: str) -> Callable[[str], DatasetSpec]:
    def spec(root: str) -> DatasetSpec:
        coco_root = os.path.join(root, "coco")
        return DatasetSpec(
            f"coco_2017_{split}", os.path.join(coco_root, "annotations", f"instances_{split}2017.json"),
            os.path.join(coco_root, f"{split}2017"), categories=coco_categories,
        )

    return spec


def _coco_keypoints(split: str) -> Callable[[str], DatasetSpec]:
    def spec(root: str) -> DatasetSpec:
        coco_root = os.path.join(root, "coco")
        annotations = os.path.join(coco_root, "annotations", f"person_keypoints_{split}2017.json")
        return DatasetSpec(
            f"keypoints_coco_2017_{split}", annotations, os.path.join(coco_root, f"{split}2017"),
            categories=lambda: {1: "person"},
        )

    return spec


# Built-ins resolve their paths at look-up time, so PET_DATA_ROOT can be set after import.
_BUILTIN: dict[str, Callable[[str], DatasetSpec]] = {
    "shapes_train": _shapes("train"),
    "shapes_val": _shapes("val"),
    "shapes_kp_train": _shapes_keypoints("train"),
    "shapes_kp_val": _shapes_keypoints("val"),
    "coco_2017_train": _coco("train"),
    "coco_2017_val": _coco("val"),
    "keypoints_coco_2017_train": _coco_keypoints("train"),
    "keypoints_coco_2017_val": _coco_keypoints("val"),
}
_REGISTERED: dict[str, DatasetSpec] = {}
# (spec, strict) -> (dataset, the files it was read from, their stamp then): see get_dataset.
_CACHE: dict[tuple, tuple[COCODataset, tuple[str, ...], tuple]] = {}


def register_coco_dataset(name: str, json_file: str, image_root: str) -> None:
    """Make a COCO-format dataset available by ``name`` in ``TRAIN.DATASETS`` / ``TEST.DATASETS``.

    Relative paths are taken from the current directory when they exist there, else from
    the data root. Registering the same name again with the same paths is a no-op.
    """
    register_dataset(name, json_file, image_root)


def register_dataset(
    name: str,
    path: str,
    images: str = "",
    *,
    format: str = "coco",
    split: str = "",
    classes: Sequence[str] = (),
    columns: Mapping[str, str] | None = None,
    oks_sigmas: Sequence[float] = (),
) -> None:
    """Make a dataset of any format available by ``name``: the Python form of a ``DATA.CUSTOM`` entry.

    ``format`` is ``coco`` (``path``: the JSON, ``images``: the image folder), ``yolo``
    (``path``: the data.yaml, ``split``: its ``train`` / ``val`` / ``test`` key), ``voc``
    (``path``: the root holding Annotations/, JPEGImages/, ImageSets/Main/; ``split``: the
    ImageSets name) or ``csv`` (``path``: the CSV file, ``images``: the folder its image paths are
    relative to, default the CSV's folder; ``columns``: header names per role). ``classes`` fixes
    the class list and its order (ids 1..K); ``oks_sigmas`` (one per keypoint) scores a keypoint set's
    points. Paths resolve as in :func:`register_coco_dataset`; registering the same name again with the same
    arguments is a no-op.
    """
    if format not in FORMATS:
        raise ConfigError(f"Dataset '{name}': unknown format '{format}'; use one of {list(FORMATS)}.")
    needs = {"coco": ("path", "images"), "yolo": ("path", "split"), "voc": ("path", "split"), "csv": ("path",)}
    given = {"path": path, "images": images, "split": split}
    missing = [k for k in needs[format] if not given[k]]
    if missing:
        raise ConfigError(f"Dataset '{name}' (format {format}) lacks {' and '.join(missing)}; an entry is "
                          f"{_ENTRY_HELP[format]}.")
    if columns and format != "csv":
        raise ConfigError(f"Dataset '{name}': `columns` names CSV columns, but the format is {format}.")
    spec = DatasetSpec(
        name, _resolve(path), _resolve(images) if images else "", format=format, split=str(split),
        classes=tuple(check_class_names(classes, f"dataset '{name}'")) if classes else (),
        columns=tuple(sorted((str(k), str(v)) for k, v in (columns or {}).items())),
        oks_sigmas=_sigmas(oks_sigmas, name),
    )
    if name in _BUILTIN:
        raise ConfigError(f"'{name}' is a built-in dataset name; register your dataset under another name "
                          "(or point PET_DATA_ROOT at a folder with the built-in layout).")
    old = _REGISTERED.get(name)
    if old is not None and old != spec:
        raise ConfigError(f"Dataset '{name}' is already registered with {old.path} ({old.format}); "
                          "use another name.")
    _REGISTERED[name] = spec


# What each format's DATA.CUSTOM entry holds, for messages.
_ENTRY_HELP = {
    "coco": "{name: ..., path: instances.json, images: image folder}",
    "yolo": "{name: ..., format: yolo, path: data.yaml, split: train|val|test}",
    "voc": "{name: ..., format: voc, path: VOC root, split: train|val|trainval|test}",
    "csv": "{name: ..., format: csv, path: boxes.csv, images: image folder}",
}
_ENTRY_KEYS = {"name", "format", "path", "json", "images", "split", "classes", "columns", "oks_sigmas"}


def _sigmas(values: Sequence[float], name: str) -> tuple[float, ...]:
    if isinstance(values, str) or not isinstance(values, Sequence) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"Dataset '{name}': `oks_sigmas` must be a list of numbers, one per keypoint, got "
                          f"{values!r}.")
    return tuple(float(v) for v in values)


def register_custom_datasets(cfg: CfgNode) -> None:
    """Register every ``DATA.CUSTOM`` entry ``{name, format, path, images, split, classes, oks_sigmas}`` (see
    :func:`register_dataset`; ``json``, the old name of a COCO entry's ``path``, loads with a warning until 0.3.0)."""
    for i, entry in enumerate(cfg.DATA.CUSTOM):
        if not isinstance(entry, Mapping):
            raise ConfigError(f"DATA.CUSTOM[{i}] must be a mapping such as {_ENTRY_HELP['coco']}, got {entry!r}")
        fields = {str(k).lower(): v for k, v in entry.items()}
        fmt = str(fields.get("format") or "coco").lower()
        shape = _ENTRY_HELP.get(fmt, _ENTRY_HELP["coco"])
        unknown = sorted(set(fields) - _ENTRY_KEYS)
        if unknown or "json" in fields and ("path" in fields or fmt != "coco"):
            problem = f"has unknown keys {unknown}" if unknown else "gives `json`, which only a coco entry may " \
                "use instead of `path`"
            raise ConfigError(f"DATA.CUSTOM[{i}] {problem}; an entry is {shape}, got {dict(entry)}")
        if not fields.get("name"):
            raise ConfigError(f"DATA.CUSTOM[{i}] lacks a name; an entry is {shape}, got {dict(entry)}")
        if "json" in fields:
            logger.warning(f"DATA.CUSTOM[{i}] ('{fields['name']}') gives `json`, which is now called `path`; "
                           "please rename it (`json` goes in Pet 0.3.0).")
        classes = fields.get("classes") or ()
        if isinstance(classes, str) or not isinstance(classes, Sequence):
            raise ConfigError(f"DATA.CUSTOM[{i}] `classes` must be a list of class names, got {classes!r}")
        columns = fields.get("columns") or None
        if columns is not None and not isinstance(columns, Mapping):
            raise ConfigError(f"DATA.CUSTOM[{i}] `columns` must map roles to CSV header names, e.g. "
                              f"{{image_path: filename, label: class}}, got {columns!r}")
        try:
            register_dataset(str(fields["name"]), str(fields.get("path") or fields.get("json") or ""),
                             str(fields.get("images") or ""), format=fmt, split=str(fields.get("split") or ""),
                             classes=list(classes), columns=columns, oks_sigmas=fields.get("oks_sigmas") or ())
        except (ConfigError, DataError) as exc:
            raise ConfigError(f"DATA.CUSTOM[{i}]: {exc}") from None


def list_datasets() -> list[str]:
    """Names of all built-in and registered datasets."""
    return sorted({*_BUILTIN, *_REGISTERED})


def get_dataset_spec(name: str) -> DatasetSpec:
    """The :class:`DatasetSpec` registered as ``name``; a :class:`ConfigError` with suggestions otherwise."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in _BUILTIN:
        return _BUILTIN[name](data_root())
    close = difflib.get_close_matches(name, list_datasets(), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ConfigError(
        f"Unknown dataset '{name}'.{hint} Registered datasets: {', '.join(list_datasets())}. "
        "Add your own with DATA.CUSTOM [{name: ..., format: ..., path: ...}] or pet.data.register_dataset()."
    )


def get_dataset(name: str, *, strict: bool = False) -> COCODataset:
    """Load the dataset registered as ``name``, generating the demo set if needed.

    Training, evaluation and the tools ask for a dataset many times in one process, so it is read once and
    kept until a file it was read from changes: the annotation file (or data.yaml, VOC root) and, for YOLO
    and VOC, every label file read or looked for, and YOLO's split folders and list files (an image added or
    removed). A long-lived process (a notebook, a test session) then sees an edited label; checking costs a
    ``stat`` per file (10 ms for 1,000 YOLO labels, where reading them again takes 300 ms).
    """
    spec = get_dataset_spec(name)
    if spec.prepare is not None:
        spec.prepare()
    key = (dataclasses.replace(spec, prepare=None), strict)
    cached = _CACHE.get(key)
    if cached is None or _stamp(cached[1]) != cached[2]:
        dataset, files = _load(spec, strict)
        _CACHE[key] = cached = (dataset, files, _stamp(files))
        logger.info(f"Loaded dataset '{name}' ({spec.format}): {len(dataset)} images from {spec.path}")
    return cached[0]


def _load(spec: DatasetSpec, strict: bool) -> tuple[COCODataset, tuple[str, ...]]:
    """The dataset and the files it was read from."""
    if spec.format == "coco":
        dataset = load_coco_json(spec.path, spec.image_root, spec.name, strict=strict, classes=spec.classes,
                                 oks_sigmas=spec.oks_sigmas)
        return dataset, (spec.path,)
    read = read_annotations(spec.format, spec.path, images=spec.image_root, split=spec.split,
                            classes=spec.classes, columns=dict(spec.columns))
    dataset = build_coco_dataset(read.coco, spec.path, read.image_root, spec.name, strict=strict,
                                 origins=read.origins, format=spec.format, keypoint_meta=read.keypoint_meta,
                                 oks_sigmas=spec.oks_sigmas)
    return dataset, tuple(dict.fromkeys((spec.path, *read.label_files)))


def _stamp(files: Sequence[str]) -> tuple:
    """What changes when one of ``files`` is edited, created or removed: each one's mtime and size (or None)."""
    stamp = []
    for path in files:
        try:
            st = os.stat(path)
        except OSError:
            stamp.append(None)
        else:
            stamp.append((st.st_mtime_ns, st.st_size))
    return tuple(stamp)


def dataset_categories(name: str) -> dict[int, str]:
    """The categories ``{id: name}`` (by increasing id) of the dataset registered as ``name``, without
    decoding images: what a model trained or evaluated on it calls its classes.

    The built-in datasets' are known without any file (``coco_2017_train`` / ``coco_2017_val``: COCO's 80,
    from torchvision's list; ``shapes_*``: the demo's 3); a fixed ``classes`` list gives ids 1..K; a COCO
    file's are read from its ``categories``; YOLO, VOC and CSV sets are read (annotations and image headers).
    ``DATA.CUSTOM`` entries must be registered first (:func:`register_custom_datasets`).
    """
    spec = get_dataset_spec(name)
    if spec.categories is not None:
        return dict(sorted(spec.categories().items()))
    if spec.classes:
        return {i + 1: c for i, c in enumerate(spec.classes)}
    if spec.format == "coco":
        return read_categories(spec.path, name)
    return dict(sorted(get_dataset(name).categories.items()))


def _resolve(path: str) -> str:
    path = os.path.expanduser(str(path))
    if os.path.isabs(path) or os.path.exists(path):
        return os.path.abspath(path)
    return os.path.join(data_root(), path)
