"""``--backend auto``: the fastest way to run a detector on this CPU among those available, and why.

On a GPU (``DEVICE``) the answer is PyTorch; the rest is about CPUs.

:func:`choose_backend` picks from what the CPU is (VNNI: :mod:`pet.utils.cpu`), which precision PyTorch runs the
model in here (``TEST.AMP``, :mod:`pet.engine.precision`: where bfloat16 instructions exist, measured once per
machine and model and cached, so one machine always makes the same choice) and which exports exist
(:func:`exported_models`). The ranking is the one measured in docs/benchmarks/cpu-inference.md ("CPU inference: int8,
bfloat16 or float32"); on the AVX-512 BF16 + VNNI machine there, from fastest:

1. onnxruntime int8 (``CKPT/model.int8.onnx``, tools/export.py --int8): only on a CPU with VNNI, where it was
   measured fastest and where its products cannot saturate (without VNNI, AVX2's u8 x s8 path can, unless the
   model was quantized there with 7-bit weights; its speed there is not measured);
2. PyTorch in bfloat16, where ``TEST.AMP`` auto measured it clearly faster than float32 for this model (or
   ``TEST.AMP.ENABLED True`` on a CPU that runs it natively);
3. onnxruntime float32 (``CKPT/model.onnx``, tools/export.py): 0.5-0.8x PyTorch float32's time;
4. PyTorch float32.

An export is offered only if it was made from the weights being evaluated (``TEST.WEIGHTS``, else
``CKPT/model_final.pth``): tools/export.py records their sha256 in the file's metadata (``pet.weights_sha256``),
and an export of other weights, or one without the record (older than it), is passed over and the reason logged.
An int8 export also records the sha256 of the float export it was quantized from (``pet.int8.float_sha256``): it
computes with that export's thresholds, so beside a float export it is offered only if it was quantized from that
very file (re-exporting ``model.onnx``, say with another ``MODEL.ROI_HEADS.SCORE_THRESH_TEST``, leaves the old int8
file). With no float export beside it, nothing newer contradicts it: it is offered, and the log says it was not
checked.
An export computes with the thresholds and sizes it was exported with, whatever the config says now. This module
imports onnxruntime nowhere and onnx only to read an existing export's metadata, so tools can call it before
deciding what to load.
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from fvcore.common.config import CfgNode

from pet.config import default_weights, load_cfg
from pet.deploy.exported_model import ExportedModel
from pet.deploy.onnxruntime_model import OnnxRuntimeModel
from pet.deploy.openvino_model import OpenVinoModel
from pet.engine.inference import inference_precision
from pet.engine.models import resolve_device
from pet.utils.cpu import cpu_int8_support, cpu_native_support
from pet.utils.errors import ConfigError
from pet.utils.files import file_sha256

__all__ = ["BackendChoice", "EXPORT_RUNTIMES", "ExportRuntime", "FLOAT_SHA256_KEY", "WEIGHTS_SHA256_KEY",
           "choose_backend", "exported_models", "int8_path", "resolve_backend"]

# The metadata key under which tools/export.py records the sha256 of the weights file it exported.
WEIGHTS_SHA256_KEY = "pet.weights_sha256"
# The metadata key under which tools/export.py --int8 records the sha256 of the float export it quantized.
FLOAT_SHA256_KEY = "pet.int8.float_sha256"


@dataclass(frozen=True)
class ExportRuntime:
    """A runtime for tools/export.py's files, as ``--backend`` names it: ``model(path, threads=N)`` loads one
    (an :class:`ExportedModel`), ``default_file`` is the one it loads from ``CKPT`` when no file is named, ``files``
    says which files ``--model`` names for it."""

    model: Callable[..., ExportedModel]
    default_file: str
    files: str


# The backends that run an export rather than the PyTorch model (pet.predict.loading.BACKENDS adds "pytorch"); the
# tools' --backend choices, --model checks and loading all read this table.
EXPORT_RUNTIMES = {
    "onnxruntime": ExportRuntime(OnnxRuntimeModel, "model.onnx", "an ONNX file written by tools/export.py"),
    "openvino": ExportRuntime(OpenVinoModel, "model.xml", "an OpenVINO IR (.xml, beside its .bin) written by "
                                                          "tools/export.py --openvino, or an ONNX file"),
}


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


def exported_models(cfg: CfgNode, passed_over: list[str] | None = None) -> dict[str, str]:
    """The exports of this config's weights that exist: ``{"float32": CKPT/model.onnx, "int8": CKPT/model.int8.onnx}``
    (the names tools/export.py writes by default), leaving out any whose recorded weights are not the weights
    file's (sha256), and an int8 export not quantized from the float export beside it; why each was left out (or
    that an int8 export without a float one beside it was offered unchecked) is appended to ``passed_over``."""
    weights = default_weights(cfg)
    float_path = os.path.join(cfg.CKPT, "model.onnx")
    paths = {"float32": float_path, "int8": int8_path(float_path)}
    exports = {precision: path for precision, path in paths.items() if os.path.isfile(path)}
    found, skipped = {}, []
    if exports and not os.path.isfile(weights):
        skipped.append(f"{' and '.join(exports.values())} passed over: the weights {weights} are not there to check "
                       "that they were exported from them")
    elif exports and importlib.util.find_spec("onnx") is None:
        skipped.append(f"{' and '.join(exports.values())} passed over: onnx is not installed to read which weights "
                       "they hold (pip install -e \".[export]\")")
    elif exports:
        sha = file_sha256(weights)
        for precision, path in exports.items():
            metadata = _metadata(path)
            recorded = metadata.get(WEIGHTS_SHA256_KEY)
            if recorded is None:
                skipped.append(f"{path} passed over: it does not record the weights it was exported from (an "
                               f"export older than that record); export {weights} again with tools/export.py")
            elif recorded != sha:
                skipped.append(f"{path} passed over: it was exported from other weights than {weights} (sha256 "
                               f"{recorded[:12]}, not {sha[:12]}); export them with tools/export.py")
            elif precision == "int8" and "float32" not in exports:
                found[precision] = path
                skipped.append(f"{path} offered unchecked: {float_path}, the float export it must have been quantized "
                               "from, is not there to show that it computes with that export's thresholds")
            elif precision == "int8" and (stale := _int8_stale(path, metadata.get(FLOAT_SHA256_KEY), float_path)):
                skipped.append(stale)
            else:
                found[precision] = path
    if passed_over is not None:
        passed_over.extend(skipped)
    return found


def _int8_stale(path: str, recorded: str | None, float_path: str) -> str:
    """Why the int8 export ``path`` is passed over, given the sha256 of the float export it ``recorded`` being
    quantized from: it computes with that export's thresholds, so it must be the float export ``float_path`` now
    beside it ("" when it is)."""
    requantize = f"quantize it again with tools/export.py --check-only --int8 --output {float_path}"
    if recorded is None:
        return (f"{path} passed over: it does not record the float export it was quantized from (older than that "
                f"record), so it may compute with other thresholds than {float_path}; {requantize}")
    if recorded != file_sha256(float_path):
        return (f"{path} passed over: it was quantized from an earlier export than {float_path} (exported again "
                f"since, perhaps with other TEST options, which the int8 model does not compute with); {requantize}")
    return ""


def _metadata(path: str) -> dict[str, str]:
    """The metadata_props of the ONNX file ``path`` ({} for a file onnx cannot read)."""
    import onnx  # an optional extra ("export"): only a CKPT that holds exports needs it

    try:
        model = onnx.load(path, load_external_data=False)
    except Exception:  # noqa: BLE001 - protobuf raises its own types for a damaged file; it is then not offered
        return {}
    return {prop.key: prop.value for prop in model.metadata_props}


def choose_backend(cfg: CfgNode, available: Mapping[str, str], passed_over: Sequence[str] = (),
                   model: torch.nn.Module | None = None) -> BackendChoice:
    """The fastest backend for this CPU among PyTorch and the ONNX files in ``available`` (``{"float32": path,
    "int8": path}``, e.g. :func:`exported_models`), by the ranking in the module docstring. ``passed_over``: why
    exports were left out of ``available``, which the reason then starts with. ``model``: the PyTorch model whose
    precision is weighed (default: the config's, built only if it has to be measured)."""
    device = resolve_device(cfg.DEVICE)
    # warn=False: an export may run instead; the PyTorch run warns about emulated bfloat16 itself if it is chosen.
    pytorch = inference_precision(cfg, model, warn=False)
    if device.type != "cpu":
        return BackendChoice("pytorch", "", pytorch.name, f"DEVICE {cfg.DEVICE} runs on {device.type}; the exports "
                                                          "run on the CPU")
    onnxruntime = importlib.util.find_spec("onnxruntime") is not None
    int8 = cpu_int8_support()
    skipped = list(passed_over)
    if "int8" in available:
        if not onnxruntime:
            skipped.append("onnxruntime is not installed (pip install -e \".[export]\")")
        elif int8.native:
            reason = f"{int8.reason}: int8 runs fastest there (docs/benchmarks/cpu-inference.md)"
            return BackendChoice("onnxruntime", available["int8"], "int8", "; ".join([*skipped, reason]))
        else:
            skipped.append(f"int8 passed over because {int8.reason}")
    # TEST.AMP True autocasts on any CPU; only where the CPU runs it natively is that the fast way.
    autocast = cpu_native_support(pytorch.name) if pytorch.dtype is not None else None
    if autocast is not None and autocast.native:
        reason = f"{pytorch.reason}: faster than onnxruntime float32 there (docs/benchmarks/cpu-inference.md)"
        return BackendChoice("pytorch", "", pytorch.name, "; ".join([*skipped, reason]))
    precision = pytorch.reason if autocast is None else f"{pytorch.reason}, emulated: {autocast.reason}"
    if "float32" in available and onnxruntime:
        reason = (f"PyTorch would run {pytorch.name} ({precision}): onnxruntime float32 is faster than that "
                  "(docs/benchmarks/cpu-inference.md)")
        return BackendChoice("onnxruntime", available["float32"], "float32", "; ".join([*skipped, reason]))
    missing = "no export of these weights" if "float32" not in available else "onnxruntime is not installed"
    reason = f"{precision}, and {missing} (tools/export.py writes {os.path.join(cfg.CKPT, 'model.onnx')})"
    return BackendChoice("pytorch", "", pytorch.name, "; ".join([*skipped, reason]))


def resolve_backend(cfg_file: str, opts: list[str], backend: str, model: str) -> BackendChoice | None:
    """A tool's ``--backend`` and ``--model`` checked (one line naming the mistake otherwise); for ``auto``, the
    choice for the config ``cfg_file`` with ``opts``, else None (the tool runs what was asked)."""
    runtime = EXPORT_RUNTIMES.get(backend)
    if model and runtime is None:
        raise ConfigError(f"--model names the exported file of --backend {' or '.join(EXPORT_RUNTIMES)}; --backend "
                          f"{backend} takes the PyTorch weights from TEST.WEIGHTS" +
                          (" and finds the exports in CKPT itself." if backend == "auto" else "."))
    if runtime is not None and not model:
        raise ConfigError(f"--backend {backend} needs --model FILE, {runtime.files}.")
    if backend != "auto":
        return None
    cfg = load_cfg(cfg_file, opts)
    passed_over: list[str] = []
    return choose_backend(cfg, exported_models(cfg, passed_over), passed_over)
