"""``--backend auto``: the fastest way to run a detector on this CPU among those available, and why.

On a GPU (``DEVICE``) the answer is PyTorch; the rest is about CPUs.

:func:`choose_backend` picks from what the CPU is (native bfloat16, VNNI: :mod:`pet.utils.cpu`) and which
exports exist (:func:`exported_models`), never from a timing probe, so one class of machine always makes the same
choice. The ranking is the one measured in docs/BENCHMARKS.md ("CPU inference: which backend"); on the
AVX-512 BF16 + VNNI machine there, from fastest:

1. onnxruntime int8 (``CKPT/model.int8.onnx``, tools/export.py --int8): only on a CPU with VNNI, where it was
   measured fastest and where its products cannot saturate (without VNNI, AVX2's u8 x s8 path can, unless the
   model was quantized there with 7-bit weights; its speed there is not measured);
2. PyTorch in bfloat16, where the CPU runs it natively (``TEST.AMP`` auto decides, :mod:`pet.engine.precision`);
3. onnxruntime float32 (``CKPT/model.onnx``, tools/export.py): 0.5-0.8x PyTorch float32's time;
4. PyTorch float32.

An export older than the weights it should hold (``TEST.WEIGHTS``, else ``CKPT/model_final.pth``) is passed over:
it was made from other weights. An export computes with the thresholds and sizes it was exported with, whatever
the config says now. This module imports neither onnx nor onnxruntime (it only asks whether onnxruntime is
installed), so tools can call it before deciding what to load.
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass

from fvcore.common.config import CfgNode

from pet.config import load_cfg
from pet.engine.models import resolve_device
from pet.engine.precision import choose_precision
from pet.utils.cpu import cpu_int8_support
from pet.utils.errors import ConfigError

__all__ = ["BackendChoice", "choose_backend", "exported_models", "int8_path", "resolve_backend"]


@dataclass(frozen=True)
class BackendChoice:
    """``backend``: "pytorch" or "onnxruntime"; ``model``: the ONNX file for onnxruntime ("" for PyTorch);
    ``precision``: "int8", "bfloat16" or "float32"; ``reason``: why, for the log."""

    backend: str
    model: str
    precision: str
    reason: str

    def __str__(self) -> str:
        model = f" {self.model}" if self.model else ""
        return f"{self.backend}{model} in {self.precision}: {self.reason}"


def int8_path(onnx_path: str) -> str:
    """Where tools/export.py --int8 writes the int8 model of the float export ``onnx_path``: ``model.onnx`` ->
    ``model.int8.onnx`` beside it."""
    root, ext = os.path.splitext(onnx_path)
    return f"{root}.int8{ext or '.onnx'}"


def exported_models(cfg: CfgNode) -> dict[str, str]:
    """The exports of this config's weights that exist: ``{"float32": CKPT/model.onnx, "int8": CKPT/model.int8.onnx}``
    (the names tools/export.py writes by default), leaving out any older than the weights file."""
    weights = cfg.TEST.WEIGHTS or os.path.join(cfg.CKPT, "model_final.pth")
    weights_time = os.path.getmtime(weights) if os.path.isfile(weights) else None
    float_path = os.path.join(cfg.CKPT, "model.onnx")
    found = {}
    for precision, path in (("float32", float_path), ("int8", int8_path(float_path))):
        if os.path.isfile(path) and (weights_time is None or os.path.getmtime(path) >= weights_time):
            found[precision] = path
    return found


def choose_backend(cfg: CfgNode, available: Mapping[str, str]) -> BackendChoice:
    """The fastest backend for this CPU among PyTorch and the ONNX files in ``available`` (``{"float32": path,
    "int8": path}``, e.g. :func:`exported_models`), by the ranking in the module docstring."""
    device = resolve_device(cfg.DEVICE)
    pytorch = choose_precision(cfg.TEST.AMP.ENABLED, cfg.TEST.AMP.DTYPE, device, training=False, key="TEST.AMP")
    if device.type != "cpu":
        return BackendChoice("pytorch", "", pytorch.name, f"DEVICE {cfg.DEVICE} runs on {device.type}; the exports "
                                                          "run on the CPU")
    onnxruntime = importlib.util.find_spec("onnxruntime") is not None
    int8 = cpu_int8_support()
    skipped = []
    if "int8" in available:
        if not onnxruntime:
            skipped.append("onnxruntime is not installed (pip install -e \".[export]\")")
        elif int8.native:
            return BackendChoice("onnxruntime", available["int8"], "int8",
                                 f"{int8.reason}: int8 runs fastest there (docs/BENCHMARKS.md)")
        else:
            skipped.append(f"int8 passed over because {int8.reason}")
    if pytorch.dtype is not None:
        reason = f"{pytorch.reason}: faster than onnxruntime float32 there (docs/BENCHMARKS.md)"
        return BackendChoice("pytorch", "", pytorch.name, "; ".join([*skipped, reason]))
    if "float32" in available and onnxruntime:
        reason = f"no native bfloat16 ({pytorch.reason}): onnxruntime float32 is faster than PyTorch float32"
        return BackendChoice("onnxruntime", available["float32"], "float32", "; ".join([*skipped, reason]))
    missing = "no export of these weights" if "float32" not in available else "onnxruntime is not installed"
    reason = f"{pytorch.reason}, and {missing} (tools/export.py writes {os.path.join(cfg.CKPT, 'model.onnx')})"
    return BackendChoice("pytorch", "", "float32", "; ".join([*skipped, reason]))


def resolve_backend(cfg_file: str, opts: list[str], backend: str, model: str) -> BackendChoice | None:
    """A tool's ``--backend`` and ``--model`` checked (one line naming the mistake otherwise); for ``auto``, the
    choice for the config ``cfg_file`` with ``opts``, else None (the tool runs what was asked)."""
    if model and backend != "onnxruntime":
        raise ConfigError(f"--model names the ONNX file of --backend onnxruntime; --backend {backend} takes "
                          "the PyTorch weights from TEST.WEIGHTS" + (" and finds the exports in CKPT itself."
                                                                     if backend == "auto" else "."))
    if backend == "onnxruntime" and not model:
        raise ConfigError("--backend onnxruntime needs --model FILE, an ONNX file written by tools/export.py.")
    if backend != "auto":
        return None
    cfg = load_cfg(cfg_file, opts)
    return choose_backend(cfg, exported_models(cfg))
