"""What a trained model's labels mean when it is used without its dataset.

Checkpoints record the training set's :class:`~pet.data.categories.LabelSpace` under ``"label_space"``
(:meth:`pet.checkpoint.Checkpointer.state`) and ONNX exports under the metadata key
``pet.label_space`` (tools/export.py). A file from before that has none: the label space is then taken
from the config's first test dataset when its categories can be read, else the labels are numbered
``class_<label>``; either way one warning says so.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from fvcore.common.config import CfgNode

from pet.data.catalog import dataset_categories, get_dataset, get_dataset_spec, register_custom_datasets
from pet.data.categories import LabelSpace
from pet.data.keypoints import KeypointMeta
from pet.modeling.detector import keypoint_count
from pet.utils.errors import ConfigError, PetError

__all__ = ["CHECKPOINT_KEY", "ONNX_METADATA_KEY", "model_label_space", "label_space_from_checkpoint",
           "model_keypoint_meta"]

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "label_space"
ONNX_METADATA_KEY = "pet.label_space"


def label_space_from_checkpoint(checkpoint: Any) -> list[dict[str, Any]] | None:
    """The label space a loaded checkpoint records (:meth:`LabelSpace.to_list` entries), or None."""
    return checkpoint.get(CHECKPOINT_KEY) if isinstance(checkpoint, Mapping) else None


def model_label_space(cfg: CfgNode, recorded: Sequence[Mapping[str, Any]] | None, model_file: str) -> LabelSpace:
    """The label space of the model in ``model_file``: the one it ``recorded``, else the fallback above.

    A recorded label space must have ``MODEL.NUM_CLASSES`` labels (the rows of the class head).
    """
    num_classes = int(cfg.MODEL.NUM_CLASSES)
    if recorded:
        space = LabelSpace.from_list(recorded)
        if space.num_classes != num_classes:
            raise ConfigError(f"{model_file} was trained with {space.num_classes} classes but MODEL.NUM_CLASSES is "
                              f"{num_classes}; set MODEL.NUM_CLASSES {space.num_classes} (the config it was trained "
                              "with).")
        return space
    register_custom_datasets(cfg)
    name = cfg.TEST.DATASETS[0] if cfg.TEST.DATASETS else None
    space = _dataset_label_space(cfg, name) if name else None
    if space is not None:
        logger.warning(f"{model_file} records no class names (saved before models carried them): naming its "
                       f"labels after the categories of TEST.DATASETS[0] '{name}'.")
        return space
    logger.warning(f"{model_file} records no class names (saved before models carried them), and no registered "
                   f"TEST.DATASETS[0] with {num_classes} categories is there to name them: labels are numbered "
                   f"class_1 .. class_{num_classes}.")
    return LabelSpace(tuple(range(1, num_classes + 1)), tuple(f"class_{i}" for i in range(1, num_classes + 1)))


def _dataset_label_space(cfg: CfgNode, name: str) -> LabelSpace | None:
    """The label space (``MODEL.LABEL_SPACE``) of the registered dataset ``name``'s categories, or None when they
    cannot be read without generating or downloading anything, or do not fit ``MODEL.NUM_CLASSES``."""
    try:
        categories = dataset_categories(name)
        if cfg.MODEL.LABEL_SPACE == "contiguous" and len(categories) != cfg.MODEL.NUM_CLASSES:
            return None
        return LabelSpace.build(cfg.MODEL.LABEL_SPACE, categories, cfg.MODEL.NUM_CLASSES)
    except (PetError, OSError):
        return None


def model_keypoint_meta(cfg: CfgNode) -> KeypointMeta | None:
    """What a keypoint model's points are called and how they join (the outputs' CSV columns, JSON names and
    drawn skeleton): the points of TEST.DATASETS[0] when its annotation file is there and has as many points as
    the model predicts (:meth:`pet.modeling.Detector.keypoint_count`), else ``kp_0``, ``kp_1``, ... without a
    skeleton; None for a model without keypoints. Checkpoints do not record the points, so the test set names
    them."""
    k = keypoint_count(cfg)
    if not k:
        return None
    register_custom_datasets(cfg)
    meta = None
    try:
        if cfg.TEST.DATASETS and os.path.exists(get_dataset_spec(cfg.TEST.DATASETS[0]).path):
            meta = get_dataset(cfg.TEST.DATASETS[0]).keypoint_meta
    except (PetError, OSError):
        meta = None
    if meta is not None and meta.num_keypoints == k:
        return meta
    logger.warning(f"The keypoint model's {k} points are named kp_0 .. kp_{k - 1}: TEST.DATASETS[0] is not there to "
                   "name them.")
    return KeypointMeta.build([f"kp_{i}" for i in range(k)], flip_map=list(range(k)))
