"""Deployment: ONNX export with a parity gate, exported models run by onnxruntime behind the PyTorch interface,
int8 quantization behind an accuracy gate, and the choice of the fastest backend for a CPU.

``export_onnx(model, example_batch, path)`` writes the graph (:mod:`pet.deploy.graph` says what it computes),
``check_parity(model, OnnxRuntimeModel(path), parity_batches(cfg))`` checks it against the PyTorch model, and
``OnnxRuntimeModel`` evaluates it through ``pet.engine.inference`` like any model (tools/export.py and
``tools/test_net.py --backend onnxruntime`` do all this). :mod:`pet.deploy.int8` quantizes an export
(tools/export.py --int8); :mod:`pet.deploy.backend` picks among PyTorch and the exports (``--backend auto``).
Needs the ``export`` extra (onnx, onnxruntime, onnxscript), except :mod:`pet.deploy.backend`: the names below
are imported on first use, so importing that module loads neither onnx nor onnxruntime.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ExportError": "pet.deploy.onnx", "export_onnx": "pet.deploy.onnx",
    "OnnxRuntimeModel": "pet.deploy.onnxruntime_model",
    "ParityError": "pet.deploy.parity", "Tolerance": "pet.deploy.parity", "check_parity": "pet.deploy.parity",
    "parity_batches": "pet.deploy.parity",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pet.deploy' has no attribute '{name}'")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
