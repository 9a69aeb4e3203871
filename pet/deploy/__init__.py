"""Deployment: ONNX export with a parity gate, and exported models run by onnxruntime behind the PyTorch interface.

``export_onnx(model, example_batch, path)`` writes the graph (:mod:`pet.deploy.graph` says what it computes),
``check_parity(model, OnnxRuntimeModel(path), parity_batches(cfg))`` checks it against the PyTorch model, and
``OnnxRuntimeModel`` evaluates it through ``pet.engine.inference`` like any model (tools/export.py and
``tools/test_net.py --backend onnxruntime`` do all this). Needs the ``export`` extra (onnx, onnxruntime,
onnxscript); nothing else in Pet imports this package.
"""
from pet.deploy.onnx import ExportError, export_onnx
from pet.deploy.onnxruntime_model import OnnxRuntimeModel
from pet.deploy.parity import ParityError, Tolerance, check_parity, parity_batches

__all__ = ["ExportError", "ParityError", "Tolerance", "check_parity", "export_onnx", "parity_batches",
           "OnnxRuntimeModel"]
