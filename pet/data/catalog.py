"""Named datasets: the built-in ones, user registrations and ``DATA.CUSTOM`` entries.

Configs name datasets (``TRAIN.DATASETS``, ``TEST.DATASETS``); this module maps a name to
a COCO annotation file and an image folder. Built-in datasets live under the data root:
the ``PET_DATA_ROOT`` environment variable, or ``data/`` next to the ``pet`` package.
"""
from __future__ import annotations

import difflib
import functools
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from fvcore.common.config import CfgNode

from pet.data.categories import coco_categories
from pet.data.coco_json import COCODataset, load_coco_json, read_categories
from pet.data.shapes import SHAPE_CLASSES, generate_shapes
from pet.utils.errors import ConfigError

__all__ = [
    "DatasetSpec", "data_root", "register_coco_dataset", "register_custom_datasets", "get_dataset_spec",
    "get_dataset", "dataset_categories", "list_datasets",
]

logger = logging.getLogger(__name__)

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class DatasetSpec:
    """Where a named dataset lives; ``prepare`` (if any) creates it on first use; ``categories`` (if any)
    gives its categories ``{id: name}`` without reading ``json_file`` (the built-in datasets' are known)."""

    name: str
    json_file: str
    image_root: str
    prepare: Callable[[], object] | None = None
    categories: Callable[[], dict[int, str]] | None = None


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


def _coco(split: str) -> Callable[[str], DatasetSpec]:
    def spec(root: str) -> DatasetSpec:
        coco_root = os.path.join(root, "coco")
        return DatasetSpec(
            f"coco_2017_{split}", os.path.join(coco_root, "annotations", f"instances_{split}2017.json"),
            os.path.join(coco_root, f"{split}2017"), categories=coco_categories,
        )

    return spec


# Built-ins resolve their paths at look-up time, so PET_DATA_ROOT can be set after import.
_BUILTIN: dict[str, Callable[[str], DatasetSpec]] = {
    "shapes_train": _shapes("train"),
    "shapes_val": _shapes("val"),
    "coco_2017_train": _coco("train"),
    "coco_2017_val": _coco("val"),
}
_REGISTERED: dict[str, DatasetSpec] = {}
_CACHE: dict[tuple, COCODataset] = {}


def register_coco_dataset(name: str, json_file: str, image_root: str) -> None:
    """Make a COCO-format dataset available by ``name`` in ``TRAIN.DATASETS`` / ``TEST.DATASETS``.

    Relative paths are taken from the current directory when they exist there, else from
    the data root. Registering the same name again with the same paths is a no-op.
    """
    spec = DatasetSpec(name, _resolve(json_file), _resolve(image_root))
    if name in _BUILTIN:
        raise ConfigError(f"'{name}' is a built-in dataset name; register your dataset under another name "
                          "(or point PET_DATA_ROOT at a folder with the built-in layout).")
    old = _REGISTERED.get(name)
    if old is not None and (old.json_file, old.image_root) != (spec.json_file, spec.image_root):
        raise ConfigError(f"Dataset '{name}' is already registered with {old.json_file} and {old.image_root}; "
                          "use another name.")
    _REGISTERED[name] = spec


def register_custom_datasets(cfg: CfgNode) -> None:
    """Register every ``DATA.CUSTOM`` entry ``{name: ..., json: ..., images: ...}``."""
    for i, entry in enumerate(cfg.DATA.CUSTOM):
        if not isinstance(entry, Mapping):
            raise ConfigError(f"DATA.CUSTOM[{i}] must be a mapping {{name: ..., json: ..., images: ...}}, "
                              f"got {entry!r}")
        fields = {str(k).lower(): v for k, v in entry.items()}
        missing = [k for k in ("name", "json", "images") if not fields.get(k)]
        unknown = sorted(set(fields) - {"name", "json", "images"})
        if missing or unknown:
            problem = f"lacks {missing}" if missing else f"has unknown keys {unknown}"
            raise ConfigError(f"DATA.CUSTOM[{i}] {problem}; each entry is {{name: ..., json: ..., images: ...}}, "
                              f"got {dict(entry)}")
        register_coco_dataset(str(fields["name"]), str(fields["json"]), str(fields["images"]))


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
        "Add your own with DATA.CUSTOM [{name: ..., json: ..., images: ...}] or pet.data.register_coco_dataset()."
    )


def get_dataset(name: str, *, strict: bool = False) -> COCODataset:
    """Load (once per process) the dataset registered as ``name``, generating the demo set if needed."""
    spec = get_dataset_spec(name)
    if spec.prepare is not None:
        spec.prepare()
    mtime = os.path.getmtime(spec.json_file) if os.path.isfile(spec.json_file) else None
    key = (name, spec.json_file, spec.image_root, strict, mtime)
    if key not in _CACHE:
        _CACHE[key] = load_coco_json(spec.json_file, spec.image_root, name, strict=strict)
        logger.info(f"Loaded dataset '{name}': {len(_CACHE[key])} images from {spec.json_file}")
    return _CACHE[key]


def dataset_categories(name: str) -> dict[int, str]:
    """The categories ``{id: name}`` (by increasing id) of the dataset registered as ``name``, without loading
    images or annotations: what a model trained or evaluated on it calls its classes.

    The built-in datasets' are known without any file (``coco_2017_train`` / ``coco_2017_val``: COCO's 80,
    from torchvision's list; ``shapes_*``: the demo's 3); any other dataset's are read from the
    ``categories`` of its annotation file. ``DATA.CUSTOM`` entries must be registered first
    (:func:`register_custom_datasets`).
    """
    spec = get_dataset_spec(name)
    if spec.categories is not None:
        return dict(sorted(spec.categories().items()))
    return read_categories(spec.json_file, name)


def _resolve(path: str) -> str:
    path = os.path.expanduser(str(path))
    if os.path.isabs(path) or os.path.exists(path):
        return os.path.abspath(path)
    return os.path.join(data_root(), path)
