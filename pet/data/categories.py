"""What a detector's class outputs mean: :class:`LabelSpace` maps label ``L`` (row ``L`` of the class
head; 0 is background) to a dataset category id and a name.

Two layouts exist (``MODEL.LABEL_SPACE``):

- ``contiguous`` (default): the K categories of the training set, sorted by id, are labels 1..K, so the
  head has exactly one row per class (Detectron2's and MMDetection's layout).
- ``category_id``: label L *is* category id L, for L in 1..``MODEL.NUM_CLASSES``; ids the dataset lacks
  are rows that are never positives. This is the layout of torchvision's COCO models (91 rows: background
  plus ids 1..90, ten of them unused), so their weights load row for row and their scores stay theirs
  (dropping rows would change every softmax).

A label space travels with a model (checkpoints and ONNX exports record :meth:`LabelSpace.to_list`), so a
model can name its detections without the dataset it was trained on.

COCO's names come from torchvision (:func:`coco_names_by_id`, no download): a ``category_id`` label space
over a COCO dataset, or a subset of it, names its unused rows as torchvision's COCO models do.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torchvision.models.detection import FasterRCNN_ResNet50_FPN_Weights

from pet.utils.errors import ConfigError

__all__ = ["LabelSpace", "LabeledDataset", "LABEL_SPACES", "coco_names_by_id", "coco_categories", "dataset_label_space"]

LABEL_SPACES = ("contiguous", "category_id")


@functools.lru_cache(maxsize=1)
def coco_names_by_id() -> tuple[str, ...]:
    """torchvision's COCO category names indexed by category id: 91 entries, ``"__background__"`` at 0 and
    ``"N/A"`` at the ten ids COCO 2017 does not use (the names of its released COCO models' 91 rows)."""
    return tuple(FasterRCNN_ResNet50_FPN_Weights.DEFAULT.meta["categories"])


def coco_categories() -> dict[int, str]:
    """COCO 2017's 80 categories ``{id: name}`` (ids 1..90 with gaps), as in ``instances_val2017.json``."""
    return {i: name for i, name in enumerate(coco_names_by_id()) if i > 0 and name != "N/A"}


def _coco_fallback(categories: Mapping[int, str]) -> Sequence[str]:
    """COCO's names when every category of ``categories`` is COCO's (same id, same name), else none."""
    coco = coco_categories()
    return coco_names_by_id() if all(coco.get(i) == str(n) for i, n in categories.items()) else ()


@dataclass(frozen=True)
class LabelSpace:
    """Label ``L`` (1-based) is category ``category_ids[L - 1]`` named ``names[L - 1]``."""

    category_ids: tuple[int, ...]
    names: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.category_ids) != len(self.names):
            raise ValueError(f"{len(self.category_ids)} category ids but {len(self.names)} names")
        if len(set(self.category_ids)) != len(self.category_ids):
            raise ValueError(f"category ids repeat: {list(self.category_ids)}")

    @classmethod
    def contiguous(cls, categories: Mapping[int, str]) -> LabelSpace:
        """Categories ``{id: name}`` sorted by id become labels 1..K."""
        ids = sorted(categories)
        return cls(tuple(ids), tuple(str(categories[i]) for i in ids))

    @classmethod
    def by_category_id(cls, categories: Mapping[int, str], num_classes: int,
                       fallback_names: Sequence[str] | None = None) -> LabelSpace:
        """Label L is category id L for L in 1..``num_classes``; every id of ``categories`` must fit.

        Names come from ``categories``, else ``fallback_names[L]`` (a list indexed by id, such as
        :func:`coco_names_by_id`), else ``"class_<L>"``. ``fallback_names`` defaults to COCO's names when
        every category of ``categories`` is COCO's (same id and name; a subset is fine), else to none: so
        COCO, or part of it, names all 90 rows of torchvision's COCO models, and no other dataset gets
        COCO's names for rows it does not use.
        """
        too_large = sorted(i for i in categories if not 1 <= i <= num_classes)
        if too_large:
            raise ConfigError(f"Category ids {too_large[:5]} do not fit MODEL.LABEL_SPACE category_id with "
                              f"MODEL.NUM_CLASSES {num_classes} (label L is category id L, 1 <= L <= NUM_CLASSES). "
                              f"Raise MODEL.NUM_CLASSES to {max(too_large)}, or use MODEL.LABEL_SPACE contiguous.")
        if fallback_names is None:
            fallback_names = _coco_fallback(categories)
        names = tuple(
            str(categories[i]) if i in categories
            else (str(fallback_names[i]) if i < len(fallback_names) else f"class_{i}")
            for i in range(1, num_classes + 1)
        )
        return cls(tuple(range(1, num_classes + 1)), names)

    @classmethod
    def build(cls, mode: str, categories: Mapping[int, str], num_classes: int,
              fallback_names: Sequence[str] | None = None) -> LabelSpace:
        """The label space ``MODEL.LABEL_SPACE`` = ``mode`` gives for a dataset's ``categories`` (``{id: name}``)
        and ``MODEL.NUM_CLASSES`` = ``num_classes`` (used by ``category_id``; ``contiguous`` has one label per
        category, :func:`pet.data.build.build_label_space` checks the count)."""
        if mode == "contiguous":
            return cls.contiguous(categories)
        if mode == "category_id":
            return cls.by_category_id(categories, num_classes, fallback_names)
        raise ConfigError(f"MODEL.LABEL_SPACE must be one of {LABEL_SPACES}, got {mode!r}.")

    @property
    def num_classes(self) -> int:
        """The number of labels (rows of the class head besides background): ``MODEL.NUM_CLASSES``."""
        return len(self.category_ids)

    def category_id(self, label: int) -> int:
        """The category id of ``label`` (1..num_classes)."""
        return self.category_ids[label - 1]

    def name(self, label: int) -> str:
        """The name of ``label`` (1..num_classes)."""
        return self.names[label - 1]

    @functools.cached_property
    def label_to_category_id(self) -> dict[int, int]:
        """``{label: category id}`` for every label (do not modify: it is computed once)."""
        return {label: cid for label, cid in enumerate(self.category_ids, 1)}

    @functools.cached_property
    def category_id_to_label(self) -> dict[int, int]:
        """``{category id: label}`` for every label (do not modify: it is computed once)."""
        return {cid: label for label, cid in enumerate(self.category_ids, 1)}

    def to_list(self) -> list[dict[str, Any]]:
        """``[{"label": L, "id": category id, "name": name}, ...]``: what checkpoints and exports record."""
        return [{"label": label, "id": cid, "name": name}
                for label, (cid, name) in enumerate(zip(self.category_ids, self.names), 1)]

    @classmethod
    def from_list(cls, entries: Iterable[Mapping[str, Any]]) -> LabelSpace:
        """The inverse of :meth:`to_list` (entries in label order)."""
        entries = sorted(entries, key=lambda e: int(e["label"]))
        if [int(e["label"]) for e in entries] != list(range(1, len(entries) + 1)):
            raise ValueError("label space entries must have labels 1..K")
        return cls(tuple(int(e["id"]) for e in entries), tuple(str(e["name"]) for e in entries))


class LabeledDataset:
    """The label views a dataset with a ``label_space`` attribute offers (evaluation and the tools read them)."""

    label_space: LabelSpace

    @property
    def class_names(self) -> list[str]:
        """The name of each label: label ``L`` is ``class_names[L - 1]`` (prefer ``label_space.name(L)``)."""
        return list(self.label_space.names)

    @property
    def label_to_category_id(self) -> dict[int, int]:
        return self.label_space.label_to_category_id

    @property
    def category_id_to_label(self) -> dict[int, int]:
        return self.label_space.category_id_to_label


def dataset_label_space(dataset: Any) -> LabelSpace | None:
    """The label space of ``dataset`` (a loader's ``dataset``): its ``label_space``, or one made from its
    ``label_to_category_id`` and ``class_names``; None for data without labels (a toy loader)."""
    if getattr(dataset, "label_space", None) is not None:
        return dataset.label_space
    ids, names = getattr(dataset, "label_to_category_id", None), getattr(dataset, "class_names", None)
    if ids is None or names is None:
        return None
    return LabelSpace(tuple(int(ids[label]) for label in range(1, len(names) + 1)), tuple(names))
