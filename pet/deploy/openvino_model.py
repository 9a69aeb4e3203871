"""An exported Pet detector run by OpenVINO on the CPU, behind the PyTorch model's interface.

:class:`OpenVinoModel` is :class:`pet.deploy.OnnxRuntimeModel`'s sibling: the same call contract and outputs
(:class:`pet.deploy.exported_model.ExportedModel`), the graph run by OpenVINO instead. It reads the OpenVINO IR that
``tools/export.py --openvino`` writes (:func:`save_openvino`: ``model.onnx`` -> ``model.xml`` + ``model.bin``, only
after the IR itself has passed the parity gate), or an ONNX file directly (OpenVINO converts it on load, each time).

The graph's dynamic batch, height and width stay dynamic: OpenVINO compiles the model once for any shape. It computes
in float32 whatever the CPU supports: OpenVINO's CPU plugin would otherwise run bfloat16 where the CPU has it, and the
parity gate holds float32's tolerances; an int8 IR (:mod:`pet.deploy.openvino_int8`, NNCF) computes its quantized
parts in int8 and the rest in float32.
"""
from __future__ import annotations

import os
from types import ModuleType

import numpy as np

from pet.deploy.exported_model import FLOAT_SHA256_KEY, ExportedModel
from pet.utils.errors import PetError
from pet.utils.files import file_sha256

__all__ = ["INSTALL_OPENVINO_EXTRA", "OpenVinoModel", "import_nncf", "import_openvino", "openvino_metadata",
           "openvino_path", "save_openvino"]

# How to install OpenVINO, an extra of its own: onnxruntime alone is the default deployment path.
INSTALL_OPENVINO_EXTRA = 'pip install -e ".[openvino]"'


def import_openvino() -> ModuleType:
    """openvino, from the optional ``openvino`` extra; without it, one line saying how to install it, so a tool can
    check before minutes of work (tools/export.py --openvino does, before exporting)."""
    try:
        import openvino  # an optional extra ("openvino"): only an OpenVINO run or IR needs it
    except ImportError as exc:
        raise PetError(f"openvino is not installed, and OpenVINO models run in it: {INSTALL_OPENVINO_EXTRA}") from exc
    return openvino


def import_nncf() -> ModuleType:
    """nncf, from the optional ``openvino`` extra; without it, one line saying how to install it (tools/export.py
    checks before exporting)."""
    try:
        import nncf  # an optional extra ("openvino"): only OpenVINO's int8 needs it
    except ImportError as exc:
        raise PetError(f"nncf is not installed, and OpenVINO's int8 quantization needs it: {INSTALL_OPENVINO_EXTRA}"
                       ) from exc
    return nncf


def openvino_path(onnx_path: str) -> str:
    """Where tools/export.py --openvino writes the IR of the export ``onnx_path``: ``model.onnx`` -> ``model.xml``
    beside it (and its weights in ``model.bin``, the name OpenVINO derives from the .xml's)."""
    return f"{os.path.splitext(onnx_path)[0]}.xml"


def save_openvino(onnx_path: str, xml_path: str) -> str:
    """Convert the ONNX export ``onnx_path`` to an OpenVINO IR at ``xml_path`` (+ the .bin beside it); returns
    ``xml_path``. The weights stay float32 (OpenVINO's default compresses them to float16), and the ONNX file's
    metadata (score threshold, label space, weights' sha256) travels in the IR's ``rt_info``, with the sha256 of
    ``onnx_path`` itself (``FLOAT_SHA256_KEY``: the IR computes with that export's thresholds)."""
    openvino = import_openvino()
    try:
        model = openvino.Core().read_model(onnx_path)
        model.set_rt_info(file_sha256(onnx_path), ["framework", FLOAT_SHA256_KEY])
        openvino.save_model(model, xml_path, compress_to_fp16=False)
    except Exception as exc:  # OpenVINO raises RuntimeError subclasses of its own, with multi-line messages
        raise PetError(f"OpenVINO cannot convert {onnx_path}: {_cause(exc)}") from exc
    return xml_path


class OpenVinoModel(ExportedModel):
    """An OpenVINO IR (``.xml`` beside its ``.bin``) or an ONNX file written by :func:`pet.deploy.onnx.export_onnx`,
    compiled by OpenVINO for ``device`` (the CPU) in float32.

    ``threads``: OpenVINO's inference threads (0: its default, one per physical core).
    """

    runtime = "OpenVINO"

    def __init__(self, path: str, threads: int = 0, device: str = "CPU") -> None:
        openvino = import_openvino()
        super().__init__()
        if not os.path.isfile(path):
            raise PetError(f"Cannot load the OpenVINO model {path}: no such file (tools/export.py --openvino writes "
                           "one beside the ONNX export).")
        config = {"INFERENCE_PRECISION_HINT": "f32", **({"INFERENCE_NUM_THREADS": threads} if threads else {})}
        try:
            core = openvino.Core()
            model = core.read_model(path)
            self.compiled = core.compile_model(model, device, config)
        except Exception as exc:  # a damaged file, a missing .bin: OpenVINO's own RuntimeError, many lines long
            raise PetError(f"Cannot load the OpenVINO model {path}: {_cause(exc)}") from exc
        self.request = self.compiled.create_infer_request()
        self.path = path
        self.output_names = [output.get_any_name() for output in self.compiled.outputs]
        self.read_metadata(_metadata(model))

    def run_graph(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        # share_outputs=False: the arrays are copies, so the next batch does not overwrite detections still in use.
        results = self.request.infer(inputs, share_inputs=True, share_outputs=False)
        return [results[output] for output in self.compiled.outputs]


def openvino_metadata(path: str) -> dict[str, str]:
    """The metadata an IR (or an ONNX file) carries, as :class:`OpenVinoModel` reads it ({} for a file OpenVINO cannot
    read), without compiling it."""
    openvino = import_openvino()
    try:
        return _metadata(openvino.Core().read_model(path))
    except Exception:  # noqa: BLE001 - OpenVINO's own RuntimeError for a damaged file: then it records nothing
        return {}


def _metadata(model: object) -> dict[str, str]:
    """The export's metadata_props as OpenVINO keeps them: under ``rt_info["framework"]``, for an ONNX file and for
    an IR saved from one ({} for a model without them)."""
    info = model.get_rt_info()
    if "framework" not in info:
        return {}
    return {key: value.astype(str) for key, value in info["framework"].items()}


def _cause(exc: BaseException) -> str:
    """The last non-empty line of ``exc``'s message: OpenVINO's start with the C++ source locations of the checks that
    failed and end with what went wrong (``Empty weights data in bin file or bin file cannot be found!``)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
