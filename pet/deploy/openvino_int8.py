"""int8 for OpenVINO: NNCF's post-training quantization of the export, behind :mod:`pet.deploy.int8`'s gate.

:class:`OpenVinoQuantizer` is the OpenVINO :class:`pet.deploy.int8.RuntimeQuantizer`:
``quantize_with_gate(..., quantizer=OpenVinoQuantizer)`` (tools/export.py --openvino --int8) takes the same three
image sets, chooses the same parts and holds the same AP gate as onnxruntime's int8, against the float export run
in OpenVINO, and writes ``model.int8.xml`` + ``model.int8.bin`` beside the export only if it passes.

- **What runs int8**: the nodes of the chosen parts (:func:`pet.deploy.int8.model_parts` with every operation type;
  OpenVINO keeps the ONNX nodes' names), found in the IR by name; every other operation, post-processing and the
  detector's ``float_parts`` included, is in NNCF's ignored scope and stays float32.
- **How**: ``nncf.quantize`` on the IR read from the ONNX export, calibrated on the calibration images (one per
  batch, all of them), its default preset for CPUs (symmetric int8 weights per output channel, int8 activations)
  and fast bias correction. Where the CPU has no VNNI, NNCF's overflow fix takes every layer's weights to 7 bits
  (onnxruntime's ``reduce_range``), so the file runs without saturating on any CPU; the file records which.
- **The file**: weights stay as NNCF wrote them (int8 where quantized, float32 elsewhere: not compressed to
  float16); the export's metadata travels in ``rt_info`` with the ``pet.int8.*`` record of the gate.

Needs the ``openvino`` extra (openvino and nncf).
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
from collections.abc import Iterable, Sequence

import onnx

from pet.deploy.exported_model import ExportedModel, session_inputs
from pet.deploy.int8 import RecordBatches, RuntimeQuantizer, model_parts, no_parts_error
from pet.deploy.onnx import Batch
from pet.deploy.openvino_model import OpenVinoModel, import_nncf, import_openvino

__all__ = ["OpenVinoQuantizer"]

logger = logging.getLogger(__name__)


class OpenVinoQuantizer(RuntimeQuantizer):
    """NNCF's post-training quantization of the float export ``float_path`` for OpenVINO (see the module docstring);
    ``workdir`` is unused (NNCF keeps its statistics in memory)."""

    suffix = ".xml"

    def __init__(self, float_path: str, workdir: str, calibration: RecordBatches | Sequence[Batch],
                 reduce_range: bool) -> None:
        self.openvino, self.nncf = import_openvino(), import_nncf()
        self.float_path = float_path
        self.parts = model_parts(onnx.load(float_path, load_external_data=False), op_types=None)
        if not self.parts:
            raise no_parts_error(float_path)
        self.reduce_range = reduce_range
        self._calibration = calibration

    def quantize(self, parts: Iterable[str], path: str) -> str:
        nncf = self.nncf
        model = self.openvino.Core().read_model(self.float_path)
        int8 = {name for part in parts for name in self.parts[part]}
        ignored = nncf.IgnoredScope(names=[op.get_friendly_name() for op in model.get_ordered_ops()
                                           if op.get_friendly_name() not in int8], validate=False)
        overflow = nncf.OverflowFix.ENABLE if self.reduce_range else nncf.OverflowFix.DISABLE
        logger.info(f"int8 (OpenVINO): NNCF calibrating on {len(self._calibration)} images")
        nncf.set_log_level(logging.ERROR)  # NNCF logs each operation it leaves alone
        with contextlib.redirect_stdout(io.StringIO()):  # and draws progress bars
            quantized = nncf.quantize(model, nncf.Dataset(self._calibration, lambda batch: session_inputs(*batch)),
                                      subset_size=len(self._calibration), ignored_scope=ignored,
                                      advanced_parameters=nncf.AdvancedQuantizationParameters(overflow_fix=overflow))
        self.openvino.save_model(quantized, path, compress_to_fp16=False)
        return path

    def load(self, path: str, threads: int) -> ExportedModel:
        return OpenVinoModel(path, threads=threads)

    def record(self, path: str, facts: dict[str, str]) -> None:
        model = self.openvino.Core().read_model(path)
        for key, value in facts.items():
            model.set_rt_info(value, ["framework", key])
        root = os.path.splitext(path)[0]
        self.openvino.save_model(model, f"{root}.recorded.xml", compress_to_fp16=False)
        del model  # OpenVINO maps the .bin it read: let go of it before replacing it
        self.publish(f"{root}.recorded.xml", path)

    def publish(self, path: str, output: str) -> None:
        """The .bin first, the .xml last: an .xml under ``output``'s name always has its weights beside it."""
        os.replace(f"{os.path.splitext(path)[0]}.bin", f"{os.path.splitext(output)[0]}.bin")
        os.replace(path, output)
