"""Reading checkpoint files: the one place Pet calls ``torch.load``, and weights into a model to fine-tune or test.

:func:`load_checkpoint` reads any ``.pth`` file (a resume, initial weights, a test) with
``torch.load(weights_only=True)`` unless ``unsafe``: a file that holds pickled objects
other than tensors and plain containers, which could run code while loading, is refused
with a message that names it and the ``--unsafe-load`` opt-in. It also reads the Hugging Face hub's
``model.safetensors`` (or a model directory holding it), which transformers' detectors ship as.

:func:`load_weights` loads initial weights into a model (not a resume). It accepts a Pet
checkpoint (a dict with ``"model"``) or a plain ``state_dict``. A model translates foreign names
(torchvision classification or detection weights) by defining
``convert_state_dict(state_dict) -> state_dict``.

What it does with weights that do not fit depends on what the model is loaded for:

- training (the default): a class head of another number of classes (fine-tuning torchvision's COCO
  weights on your own classes) is re-initialised with one info line; the model says which of its
  parameters depend on the classes with a class attribute ``class_dependent_prefixes`` (state_dict key
  prefixes). Any other key that does not fit is a warning, one table grouped by module.
- ``for_inference`` (evaluation, export, prediction): a model evaluated with random parts gives
  meaningless detections without any sign of failure, so any part left at its initial values (class
  head included) is a :class:`ConfigError` naming it, unless ``allow_random`` (then the warning).
"""
from __future__ import annotations

import logging
import os
import pickle
import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from pet.utils.comm import unwrap_model
from pet.utils.errors import ConfigError
from pet.utils.table import format_table

__all__ = ["load_checkpoint", "load_weights"]

logger = logging.getLogger(__name__)

# Buffers whose absence or presence says nothing about the weights (BN vs FrozenBN).
_IGNORED_SUFFIXES = ("num_batches_tracked",)


# What a Hugging Face model directory holds its weights in, preferred first.
HUB_WEIGHTS_FILES = ("model.safetensors", "pytorch_model.bin")


def load_checkpoint(path: str, *, unsafe: bool = False) -> Any:
    """``torch.load(path)`` on the CPU, ``weights_only=True`` unless ``unsafe``; errors say what to do.

    A ``.safetensors`` file (the Hugging Face hub's format: tensors only, nothing to unpickle) is read with
    safetensors, and a directory as the hub lays one out, through its ``model.safetensors`` (or
    ``pytorch_model.bin``)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        found = [os.path.join(path, name) for name in HUB_WEIGHTS_FILES if os.path.isfile(os.path.join(path, name))]
        if not found:
            raise ConfigError(f"{path} is a directory without weights: expected one of {', '.join(HUB_WEIGHTS_FILES)} "
                              "in it (a Hugging Face model directory), or point at a weights file")
        path = found[0]
    if not os.path.isfile(path):
        raise ConfigError(
            f"Weights file not found: {path} (train first, or point TEST.WEIGHTS / TRAIN.WEIGHTS at a file)"
        )
    if path.endswith(".safetensors"):
        return _load_safetensors(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=not unsafe)
    except pickle.UnpicklingError as exc:
        # torch's weights-only refusal is many lines; "... GLOBAL module.name ..." in it names the culprit. Without
        # one, the bytes were no pickle it reads at all (an HTML page, a git-lfs pointer): not a matter of trust.
        culprit = re.search(r"GLOBAL ([\w.]+)", str(exc))
        if culprit and not unsafe:
            raise ConfigError(
                f"Refusing to load {path}: it holds pickled objects other than tensors (global {culprit.group(1)}), "
                "and loading those can run arbitrary code. If you trust its source, load it with --unsafe-load."
            ) from exc
        raise _unreadable(path, exc) from exc
    except Exception as exc:  # noqa: BLE001 - torch raises many types for unreadable files
        raise _unreadable(path, exc) from exc


def _load_safetensors(path: str) -> dict[str, Any]:
    """A safetensors file's tensors, as a ``state_dict``."""
    try:
        from safetensors import SafetensorError  # optional: only hub-format weights need it (the hub extra)
        from safetensors.torch import load_file  # optional, as above
    except ImportError as exc:
        raise ConfigError(f"Reading {path} needs safetensors: pip install safetensors "
                          "(or pip install -e \".[hub]\")") from exc
    try:
        return load_file(path, device="cpu")
    except SafetensorError as exc:
        raise ConfigError(f"Cannot load {path}: {exc} (not a safetensors file, or a truncated one: download it "
                          "again)") from exc


def _unreadable(path: str, exc: BaseException) -> ConfigError:
    """The file is not one torch reads; its first bytes often say what it is (``<!DOCTYPE html>``, a git-lfs
    pointer's ``version https://git-lfs...``), where torch's own message does not."""
    first_sentence = str(exc).strip().splitlines()[0].split(". ")[0] if str(exc).strip() else ""
    operand = re.search(r"Unsupported operand \d+", str(exc))  # the weights-only unpickler's own first words mislead
    first_sentence = operand.group(0) if operand else first_sentence
    with open(path, "rb") as f:
        start = f.read(24)
    return ConfigError(f"Cannot load {path}: {type(exc).__name__}: {first_sentence} (not a PyTorch file, or a "
                       f"truncated one: it starts with {start!r}; train again or download it again)")


def load_weights(model: torch.nn.Module, path: str, *, unsafe: bool = False, for_inference: bool = False,
                 allow_random: bool = False, checkpoint: Any = None) -> dict[str, list[str]]:
    """Load the weights file ``path`` into ``model`` (initialisation, not a resume).

    ``checkpoint``: the file's contents when the caller has read them already (:func:`load_checkpoint`;
    Predictor also reads the label space from them), so the file is read once; ``path`` then only names it.

    Returns ``{"missing": [...], "unexpected": [...], "mismatched": [...]}``: keys of the
    model the file lacks, keys of the file the model lacks, and keys whose shapes differ
    (left at the model's values). ``num_batches_tracked`` buffers are never reported.
    ``for_inference``: raise a :class:`ConfigError` naming the parts left at their initial values
    (missing or mismatched keys), unless ``allow_random`` (module docstring).
    """
    if checkpoint is None:
        checkpoint = load_checkpoint(path, unsafe=unsafe)
    state = checkpoint.get("model", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"{path} holds no state_dict: expected a dict of tensors or a Pet checkpoint with 'model'")
    model = unwrap_model(model)
    convert = getattr(model, "convert_state_dict", None)
    state = convert(state) if callable(convert) else dict(state)

    own = model.state_dict()
    mismatched = {k: (tuple(v.shape), tuple(own[k].shape)) for k, v in state.items()
                  if k in own and v.shape != own[k].shape}
    result = model.load_state_dict({k: v for k, v in state.items() if k not in mismatched}, strict=False)
    filled = _tied_to_loaded(model, {k for k in state if k in own and k not in mismatched})
    report = {
        "missing": [k for k in result.missing_keys if k not in mismatched and k not in filled
                    and not k.endswith(_IGNORED_SUFFIXES)],
        "unexpected": [k for k in result.unexpected_keys if not k.endswith(_IGNORED_SUFFIXES)],
        "mismatched": list(mismatched),
    }
    loaded = sum(1 for k in state if k in own and k not in mismatched)
    logger.info(f"Loaded {loaded} of the model's {len(own)} tensors from {path}")
    prefixes = tuple(getattr(model, "class_dependent_prefixes", ()))
    class_head = [k for k in report["mismatched"] if prefixes and k.startswith(prefixes)]
    num_classes = getattr(model, "num_classes", None)
    if for_inference and (report["missing"] or report["mismatched"]) and not allow_random:
        raise ConfigError(_random_parts_error(path, report, mismatched, class_head, num_classes))
    to_warn = report
    if class_head and not for_inference:
        example = class_head[0]
        logger.info(f"The class head ({', '.join(_modules(class_head))}) is re-initialised for "
                    f"{f'{num_classes} classes' if num_classes is not None else 'this model'}: {path} holds it for "
                    f"another number of classes ({example}: file {list(mismatched[example][0])}, model "
                    f"{list(mismatched[example][1])}).")
        to_warn = {**report, "mismatched": [k for k in report["mismatched"] if k not in class_head]}
    if any(to_warn.values()):
        logger.warning(f"Weights in {path} that did not load:\n{_report_table(to_warn, mismatched)}")
    return report


def _tied_to_loaded(model: torch.nn.Module, loaded: set[str]) -> set[str]:
    """Keys of ``model`` whose tensor is one of the ``loaded`` keys' (one module under several names, as a box head
    shared by every decoder layer): loading one name fills them all, and a file may hold only one (transformers'
    save_pretrained keeps one name per tied tensor)."""
    names: dict[int, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(key)
    return {key for aliases in names.values() if loaded.intersection(aliases) for key in aliases}


def _random_parts_error(path: str, report: dict[str, list[str]], shapes: dict[str, tuple[tuple, tuple]],
                        class_head: list[str], num_classes: int | None) -> str:
    """One line: which parts ``path`` leaves at their initial values, and what to do."""
    parts = [f"{group} ({len(keys)} tensors {status})" for status in ("missing", "mismatched")
             for group, keys in _groups(report[status]).items()]
    shown = ", ".join(parts[:6]) + (f" and {len(parts) - 6} more" if len(parts) > 6 else "")
    hint = ""
    if class_head:
        key = class_head[0]
        hint = (f" Its class head is for another number of classes ({key}: file {list(shapes[key][0])}, model "
                f"{list(shapes[key][1])}; this model has MODEL.NUM_CLASSES {num_classes}): set MODEL.NUM_CLASSES "
                "(and MODEL.LABEL_SPACE) as the file was trained, e.g. 90 and category_id for torchvision's COCO "
                "weights, as the cfgs/coco configs ship.")
    return (f"{path} leaves part of the model at its random initial values: {shown}; its detections would be "
            f"meaningless.{hint} Point TEST.WEIGHTS (or --weights) at weights made for this config, or set "
            "TEST.ALLOW_RANDOM_WEIGHTS True to go on anyway.")


def _groups(keys: list[str]) -> OrderedDict[str, list[str]]:
    """``keys`` by :func:`_group`, in order."""
    groups: OrderedDict[str, list[str]] = OrderedDict()
    for key in keys:
        groups.setdefault(_group(key), []).append(key)
    return groups


def _modules(keys: list[str]) -> list[str]:
    """The modules (key less its last part) of ``keys``, in order: ``["roi_heads.box_predictor.cls_score", ...]``."""
    return list(dict.fromkeys(k.rpartition(".")[0] for k in keys))


def _report_table(report: dict[str, list[str]], shapes: dict[str, tuple[tuple, tuple]]) -> str:
    """One row per (status, module) with a tensor count; shape mismatches show one example."""
    rows = []
    for status, keys in report.items():
        for group, members in _groups(keys).items():
            row = [status, group, len(members)]
            if shapes:
                example = members[0]
                row.append(f"{example}: file {list(shapes[example][0])}, model {list(shapes[example][1])}"
                           if status == "mismatched" else "")
            rows.append(row)
    header = ["status", "module", "tensors"] + (["example"] if shapes else [])
    return format_table(header, rows)


def _group(key: str) -> str:
    """``backbone.fpn.inner_blocks.0.0.weight`` -> ``backbone.fpn.*``; short keys stay whole."""
    parts = key.split(".")
    return ".".join(parts[:2]) + ".*" if len(parts) > 3 else key
