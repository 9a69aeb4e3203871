"""Deployment: ONNX export with a parity gate, exported models run by onnxruntime (or OpenVINO) behind the PyTorch
interface, int8 quantization behind an accuracy gate, and the choice of the fastest backend for a CPU.

``export_onnx(model, example_batch, path)`` writes the graph (:mod:`pet.deploy.graph` says what it computes),
``check_parity(model, OnnxRuntimeModel(path), parity_batches(cfg))`` checks it against the PyTorch model, and
``OnnxRuntimeModel`` evaluates it through ``pet.engine.inference`` like any model (tools/export.py and
``tools/test_net.py --backend onnxruntime`` do all this). :mod:`pet.deploy.int8` quantizes an export
(tools/export.py --int8); ``OpenVinoModel`` runs an export, or the OpenVINO IR that tools/export.py --openvino
writes after the same gate, in OpenVINO (the ``openvino`` extra); :mod:`pet.deploy.backend` names the runtimes
(``EXPORT_RUNTIMES``) and picks among PyTorch and the exports (``--backend auto``).
Needs the ``export`` extra (onnx, onnxruntime, onnxscript) only to run: each module imports those packages
where it uses them, so importing ``pet.deploy`` (tools/test_net.py does, to pick a backend) never fails without it.
"""
from pet.deploy.exported_model import ExportedModel
from pet.deploy.onnx import ExportError, export_onnx
from pet.deploy.onnxruntime_model import OnnxRuntimeModel
from pet.deploy.openvino_model import OpenVinoModel
from pet.deploy.parity import ParityError, Tolerance, check_parity, parity_batches

__all__ = ["ExportError", "ExportedModel", "OnnxRuntimeModel", "OpenVinoModel", "ParityError", "Tolerance",
           "check_parity", "export_onnx", "parity_batches"]
