"""Export a Pet detector to ONNX.

**Exporter.** :func:`export_onnx` traces the detector's batched graph (:mod:`pet.modeling.export_graph`) with
``torch.export``
and converts the program with ``torch.onnx.export(..., dynamo=True)``, the exporter torch 2.14 maintains and
defaults to. Detection post-processing is data-dependent (how many boxes pass a threshold or NMS is known only
at run time) and its sizes follow the input's: ``torch.export`` traces them as symbols and checks every rule
it assumes about them, so the batch, height and width stay free in the graph. The TorchScript exporter
(``dynamo=False``) still runs in torch 2.14 but warns that it is deprecated, and its tracer records
Python-level shape arithmetic (``min(k, anchors)``, ``max(height, width)``) as the example's constants: tried
on this graph, its Faster R-CNN export failed in onnxruntime at the second image size. The price of
``torch.export`` is export time, spent on symbolic shapes: about 50 s for the shapes demo and 85 s for
R-50-FPN Faster R-CNN on a 2-core CPU, against ~10 s for the tracer.

**The graph.** Inputs ``images`` uint8 ``[B, 3, H, W]`` and ``image_sizes`` int64 ``[B, 2]``, with ``B``, ``H``
and ``W`` dynamic (``H`` and ``W`` larger than the coarsest feature map's stride, e.g. 129 px for P7
models; multiples of the detector's ``size_multiple`` where it has one); outputs and their layout are those of
:mod:`pet.modeling.export_graph`. Boxes come out in the network input's pixels;
:class:`pet.deploy.onnxruntime_model.OnnxRuntimeModel` maps them to the original images and pastes masks, with the
PyTorch model's own functions.

The parity gate an export must pass before it counts is :mod:`pet.deploy.parity`.
"""
from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from pet.deploy.onnxruntime_model import INSTALL_EXPORT_EXTRA
from pet.modeling.export_graph import DetectorGraph, build_export_graph
from pet.modeling.preprocess import image_sizes
from pet.utils.errors import PetError

__all__ = ["Batch", "ExportError", "export_onnx", "import_onnx", "to_onnx"]

Batch = tuple[Tensor, list[dict[str, Any]]]
INPUT_NAMES = ("images", "image_sizes")
# The graph's largest batch and padded side. torch.export derives the largest size of every intermediate tensor from
# them; without a bound, those of the post-processing overflow int64 and the ONNX conversion fails.
MAX_BATCH, MAX_IMAGE_SIZE = 256, 8192


class ExportError(PetError):
    """The model cannot be exported; the message names the operation and the module that calls it."""


def import_onnx() -> ModuleType:
    """onnx, from the optional ``export`` extra; without it, one line saying how to install it, so a tool can check
    before minutes of work (tools/export.py does, before building the model), as with onnxruntime."""
    try:
        import onnx  # an optional extra ("export"): imported on use, so that importing this module never fails
    except ImportError as exc:
        raise PetError(f"onnx is not installed, and exporting to ONNX needs it: {INSTALL_EXPORT_EXTRA}") from exc
    return onnx


def export_onnx(model: torch.nn.Module, example: Batch, path: str, metadata: Mapping[str, str] | None = None) -> str:
    """Export ``model`` (a :class:`pet.modeling.Detector` with an export graph) to the ONNX file ``path``; returns
    ``path``.

    ``example`` is a batch as the test loader gives it (``(images, targets)``); its values do not matter, but
    every feature map of its images must be larger than 1x1 (the smallest size the graph then takes is
    recorded in the file's metadata as ``pet.min_image_size``, and what the sides must be a multiple of as
    ``pet.size_multiple``, beside the score threshold and detections per
    image it computes with, ``pet.score_thresh`` and ``pet.detections_per_img``, and the parts int8 keeps in float,
    ``pet.float_parts``); ``metadata`` adds the caller's
    entries (tools/export.py records the label space). The file is checked with ``onnx.checker``.
    An operation the exporter cannot handle is an :class:`ExportError` naming it and the module that calls it.
    """
    images, targets = example
    sizes = image_sizes(targets)
    graph = build_export_graph(model, images, sizes)
    if len(sizes) == 1:  # torch.export takes a size of 1 for a constant: trace a batch of two
        images, sizes = images.repeat(2, 1, 1, 1), sizes * 2
    args = (images.contiguous(), torch.tensor(sizes, dtype=torch.int64))
    multiple = graph.size_multiple
    min_size = math.ceil(_min_image_size(graph, args) / multiple) * multiple
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    height, width = (_side(name, min_size, multiple, size) for name, size in
                     zip(("height", "width"), args[0].shape[-2:]))
    dynamic = {"images": {0: batch, 2: height, 3: width}, "image_sizes": {0: batch}}
    onnx_program = to_onnx(graph, args, dynamic, INPUT_NAMES, graph.output_names)
    onnx_program.model.metadata_props.update({
        "pet.architecture": type(model).__name__,
        "pet.min_image_size": str(min_size),
        "pet.size_multiple": str(multiple),
        # The graph computes with them whatever a later config says (tools/predict.py warns about a lower threshold).
        "pet.score_thresh": str(model.score_thresh),
        "pet.detections_per_img": str(model.detections_per_img),
        "pet.float_parts": ",".join(model.float_parts),
        "pet.boxes": "network input pixels; map them with pet.modeling.postprocess.detections_to_original",
        **(metadata or {}),
    })
    onnx_program.save(path)
    import_onnx().checker.check_model(path, full_check=True)
    return path


def to_onnx(module: torch.nn.Module, args: tuple[Any, ...], dynamic_shapes: dict[str, Any],
            input_names: Sequence[str], output_names: Sequence[str]) -> torch.onnx.ONNXProgram:
    """``module`` traced by ``torch.export`` and converted by ``torch.onnx``; returns the in-memory ONNX program.

    A failure in either step becomes an :class:`ExportError` naming the submodule (its path in ``module``) and,
    where the exporter says, the operation: the innermost module on the traceback when ``torch.export``
    fails, the module that called the operation ``torch.onnx`` has no ONNX translation for.
    """
    try:
        with warnings.catch_warnings():  # torchvision's NMS uses a deprecated torch API; nothing a user can change
            warnings.filterwarnings("ignore", message=".*create_unbacked_symint.*", category=FutureWarning)
            program = torch.export.export(module, args, dynamic_shapes=dynamic_shapes)
    except Exception as exc:
        path, culprit = _innermost_module(exc, module)
        if culprit is None:
            raise
        raise ExportError(f"Cannot export {path} ({type(culprit).__name__}) to ONNX: torch.export failed in its "
                          f"forward with {type(exc).__name__}: {_first_line(exc)} Make its forward traceable by "
                          "torch.export: torch operations (a custom one needs a fake implementation), no Python "
                          "branching on tensor values.") from exc
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*create_unbacked_symint.*", category=FutureWarning)
            return torch.onnx.export(program, input_names=list(input_names), output_names=list(output_names),
                                     dynamo=True, external_data=False, verbose=False)
    except torch.onnx.OnnxExporterError as exc:
        node = _failed_node(exc, program)
        if node is None:
            raise
        stack = node.meta.get("nn_module_stack") or {}
        path, cls = list(stack.values())[-1] if stack else ("", "")
        op = node.target.name() if hasattr(node.target, "name") else str(node.target)
        raise ExportError(f"Cannot export {path or 'the top-level module'} ({cls.rsplit('.', 1)[-1]}) to ONNX: "
                          f"the ONNX exporter has no translation for operation {op}{_source_line(node)}. Use "
                          "standard torch operations there, or export with a custom_translation_table entry for "
                          "it.") from exc


def _side(name: str, min_size: int, multiple: int, example: int) -> Any:
    """The dynamic dimension of a padded side: free from ``min_size`` to :data:`MAX_IMAGE_SIZE`, or ``multiple`` x a
    free count of cells where the graph needs sides that are multiples of it (the detector's ``size_multiple``),
    whose example must be one; ``min_size`` is then one too."""
    if multiple == 1:
        return torch.export.Dim(name, min=min_size, max=MAX_IMAGE_SIZE)
    if example % multiple:
        raise ExportError(f"The example images' padded {name} ({example} px) is not a multiple of {multiple}, which "
                          f"this model's graph needs: export with INPUT.SIZE_DIVISIBILITY {multiple}.")
    cells = torch.export.Dim(f"{name}_cells", min=min_size // multiple, max=MAX_IMAGE_SIZE // multiple)
    return multiple * cells


def _min_image_size(graph: DetectorGraph, args: tuple[Tensor, Tensor]) -> int:
    """The smallest padded side for which every feature map is larger than 1 cell: the coarsest stride + 1.

    torch.export specialises sizes of 1 (they broadcast), so the graph holds only above them. The stride is
    the power of two that the example's coarsest feature map is downsampled by.
    """
    with torch.no_grad():
        features = graph.features(*args)
    coarsest = min(features.values(), key=lambda f: f.shape[-1] * f.shape[-2])
    if min(coarsest.shape[-2:]) < 2:
        raise ExportError(f"The example images ({tuple(args[0].shape[-2:])} px) are too small: the coarsest feature "
                          "map is 1 cell high or wide. Export with larger images.")
    stride = max(args[0].shape[-2] / coarsest.shape[-2], args[0].shape[-1] / coarsest.shape[-1])
    return 2 ** math.ceil(math.log2(stride)) + 1


def _innermost_module(exc: BaseException, graph: torch.nn.Module) -> tuple[str | None, torch.nn.Module | None]:
    """The deepest submodule of ``graph`` whose ``forward`` is on ``exc``'s traceback, and its path."""
    names = {id(module): name for name, module in graph.named_modules()}
    found: tuple[str | None, torch.nn.Module | None] = (None, None)
    tb = exc.__traceback__
    while tb is not None:
        module = tb.tb_frame.f_locals.get("self")
        if id(module) in names and names[id(module)]:
            found = (names[id(module)], module)
        tb = tb.tb_next
    return found


def _failed_node(exc: BaseException, program: torch.export.ExportedProgram) -> torch.fx.Node | None:
    """The node of ``program`` that the ONNX exporter's message says it failed to translate."""
    match = re.search(r"Error when translating node %(\w+)", str(exc))
    if match is None:
        return None
    return next((node for node in program.graph.nodes if node.name == match.group(1)), None)


def _source_line(node: torch.fx.Node) -> str:
    """`` (file.py:123)``: where ``node``'s operation is called, from the trace's stack."""
    lines = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    return f" ({lines[-1][0]}:{lines[-1][1]})" if lines else ""


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[0] if lines else "").rstrip(".") + "."
