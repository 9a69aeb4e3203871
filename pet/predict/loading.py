"""One way to load a detector for inference, whatever runs it: tools/test_net.py, tools/predict.py and
:class:`pet.predict.Predictor` all call :func:`load_inference_model`.

``backend`` "pytorch": the config's model with its weights (``path``, else :func:`pet.config.default_weights`)
on ``DEVICE``, wrapped in :class:`pet.modeling.test_time_augmentation.DetectorWithTTA` with ``TEST.AUG.ENABLED``
(so test_net and predict both run test-time augmentation, and the engine need not know); "onnxruntime": an ONNX
export of tools/export.py (``path``, else ``CKPT/model.onnx``) in onnxruntime, and "openvino": its OpenVINO IR
(``path``, else ``CKPT/model.xml``; tools/export.py --openvino) or the ONNX file in OpenVINO, both with the threads
PyTorch would use (no test-time augmentation; the runtimes are :data:`pet.deploy.backend.EXPORT_RUNTIMES`).
``--backend auto`` is decided before, by :func:`pet.deploy.backend.resolve_backend`, which names a backend and the
file it runs.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from fvcore.common.config import CfgNode

from pet.checkpoint import load_checkpoint
from pet.config import default_weights
from pet.deploy.backend import EXPORT_RUNTIMES, BackendChoice
from pet.engine.build import build_test_model
from pet.modeling.test_time_augmentation import DetectorWithTTA
from pet.predict.labels import ONNX_METADATA_KEY, label_space_from_checkpoint, model_keypoint_meta
from pet.utils.errors import ConfigError

__all__ = ["BACKENDS", "InferenceModel", "load_inference_model", "add_backend_arguments", "backend_opts"]

# What runs a detector at inference: PyTorch, or a runtime of the exports.
BACKENDS = ("pytorch", *EXPORT_RUNTIMES)


def add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    """test_net's and predict's ``--backend`` and ``--model``, one definition for both tools."""
    parser.add_argument("--backend", choices=(*BACKENDS, "auto"), default="pytorch",
                        help="run the PyTorch model, an ONNX export of it in onnxruntime or OpenVINO (needs "
                             "--model), or the fastest of PyTorch and the exports in CKPT, measured on this "
                             "machine (auto)")
    parser.add_argument("--model", default="", metavar="FILE",
                        help="the exported file for --backend onnxruntime (ONNX) or openvino (its .xml IR, or ONNX)")


def backend_opts(opts: list[str], backend: str, choice: BackendChoice | None) -> list[str]:
    """``opts`` and the precision the backend computes in: ``--backend auto``'s ``choice`` says the one it measured;
    an export computes in float32 (int8 for an int8 export) whatever TEST.AMP says, and the log then says so too."""
    if choice:
        return [*opts, *choice.opts]
    return [*opts, "TEST.AMP.ENABLED", "False"] if backend != "pytorch" else list(opts)


@dataclass
class InferenceModel:
    """A detector ready for inference: ``model`` (a PyTorch detector or an exported one, e.g. an
    :class:`pet.deploy.OnnxRuntimeModel` or :class:`pet.deploy.OpenVinoModel`, all with
    Pet's batch contract), the ``backend`` that runs it, the ``path`` it was loaded from and the label space the
    file records (:meth:`pet.data.categories.LabelSpace.to_list` entries; None when it records none)."""

    model: torch.nn.Module
    backend: str
    path: str
    recorded_labels: list[dict[str, Any]] | None


def load_inference_model(cfg: CfgNode, backend: str = "pytorch", path: str = "", *,
                         unsafe: bool = False) -> InferenceModel:
    """The detector of ``cfg`` for ``backend`` from ``path`` (defaults in the module docstring); ``unsafe`` loads
    a PyTorch checkpoint with ``weights_only=False``."""
    if cfg.TEST.AUG.ENABLED and backend in BACKENDS and backend != "pytorch":
        raise ConfigError(f"TEST.AUG.ENABLED (test-time augmentation) runs with the PyTorch backend only, not "
                          f"{' or '.join(EXPORT_RUNTIMES)} (here {backend}): use --backend pytorch, or set "
                          "TEST.AUG.ENABLED False.")
    if backend in EXPORT_RUNTIMES:
        runtime = EXPORT_RUNTIMES[backend]
        path = path or os.path.join(cfg.CKPT, runtime.default_file)
        if not os.path.isfile(path):
            raise ConfigError(f"Exported model not found for --backend {backend}: {path} (give --model FILE, "
                              f"{runtime.files}).")
        model = runtime.model(path, threads=torch.get_num_threads())  # the threads PyTorch would use
        recorded = model.metadata.get(ONNX_METADATA_KEY)
        return InferenceModel(model, backend, path, json.loads(recorded) if recorded else None)
    if backend == "pytorch":
        flip_map = _keypoint_flip_map(cfg) if cfg.TEST.AUG.ENABLED else None  # before the model: fails early
        path = path or default_weights(cfg)
        checkpoint = load_checkpoint(path, unsafe=unsafe)  # read once: weights and label space
        model = build_test_model(cfg, weights=path, checkpoint=checkpoint)
        if cfg.TEST.AUG.ENABLED:
            model = DetectorWithTTA.from_config(cfg, model, keypoint_flip_map=flip_map)
        return InferenceModel(model, backend, path, label_space_from_checkpoint(checkpoint))
    raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}.")


def _keypoint_flip_map(cfg: CfgNode) -> list[int] | None:
    """The flip map a keypoint model's mirrored TTA passes renumber points by: TEST.DATASETS[0]'s (checkpoints do not
    record it, as :func:`pet.predict.labels.model_keypoint_meta` explains); None without keypoints or mirroring."""
    meta = model_keypoint_meta(cfg) if cfg.TEST.AUG.FLIP else None
    if meta is None:
        return None
    if meta.names == tuple(f"kp_{i}" for i in range(meta.num_keypoints)):  # the stand-in names: no set to read
        raise ConfigError("TEST.AUG.FLIP mirrors the keypoint model's input, and renumbering its left and right points "
                          "needs the keypoint flip map of TEST.DATASETS[0], which is not there to read: make that "
                          "dataset available, or set TEST.AUG.FLIP False.")
    return list(meta.flip_map)
