"""Every aten op's time and FLOPs, attributed to the module that ran it (forward and backward) and to its stage.

:class:`StageProfiler` runs one ``TorchDispatchMode``: each aten op is timed (on the CPU an op is synchronous,
so its wall time is its cost) and its FLOPs counted, and both go to the innermost place open when it ran:

- in the forward, the innermost module of the model being called (global forward hooks keep a stack), or a
  named region (:meth:`StageProfiler.region`: the loss functions, the optimizer step);
- in the backward, the place that was open when the forward created the autograd node now running (a node
  creation hook gives each node pre- and post-hooks that say so), so a layer's backward is the layer's.

FLOPs count dense arithmetic only, 2 per multiply-add: matrix products, convolutions and attention, with
``torch.utils.flop_counter``'s formulas, plus the CPU attention kernels it lacks. A product with a sparse
operand (Pet's training RoIAlign, :func:`pet.modeling.poolers.roi_align_sparse`: ``aten._sparse_addmm`` forward,
``aten.mm`` of the transposed sparse matrix backward) does 2 x nnz x (the dense operand's other side) and is
counted so: a generic counter takes it for a dense product of the same shapes, thousands of times more.
Under ``inference_mode`` convolutions and linear layers reach the mode as composite ops (conv2d, linear), which
are decomposed (:data:`DECOMPOSED`) to be counted. Elementwise, normalisation, pooling, indexing and copying ops
count 0 FLOPs; their time is kept apart
(``zero_flop_seconds``) because it is what keeps a layer from its peak.

A place's stage comes from :func:`detector_stage`: the top-level child of the detector, except where
:data:`DETECTOR_STAGES` says otherwise (``backbone.fpn`` is the FPN, the RoI heads' box branch the box head).
"""
from __future__ import annotations

import contextlib
import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torchvision.models.detection.roi_heads as tv_roi_heads
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

import pet.modeling.cascade_roi_heads as pet_cascade

__all__ = ["Tally", "StageProfiler", "sparse_product_flops", "detector_stage", "named_losses",
           "OUTSIDE", "ROOT"]

aten = torch.ops.aten

# The places that are not a module of the model: ops outside any module, the model's own code outside its children.
OUTSIDE = "[other]"
ROOT = "[detector]"

# Products that take a sparse operand, and the positions of their two matrix operands.
SPARSE_PRODUCTS: dict[Any, tuple[int, int]] = {
    aten.mm: (0, 1), aten._sparse_mm: (0, 1), aten.smm: (0, 1), aten.hspmm: (0, 1),
    aten.addmm: (1, 2), aten._sparse_addmm: (1, 2), aten.sspaddmm: (1, 2),
}


def _cpu_attention_flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                         **kwargs: Any) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_attention_backward_flops(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                                  value: torch.Tensor, *args: Any, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


# Composite ops with dense arithmetic inside, which reach the mode whole under inference_mode (with autograd they
# arrive decomposed): run as their decomposition, whose ops (convolution, addmm, bmm) come back through the mode to be
# timed and counted, as torch's FlopCounterMode does. Only these: some composite ops decompose into Python code far
# slower than their kernel (upsample_bicubic2d, which the keypoint head's post-processing calls per RoI).
DECOMPOSED = {aten.conv1d, aten.conv2d, aten.conv3d, aten.conv_transpose1d, aten.conv_transpose2d,
              aten.conv_transpose3d, aten.linear, aten.bilinear, aten.matmul, aten.einsum, aten.tensordot,
              aten.scaled_dot_product_attention}
# flop_registry covers the GPU attention kernels; F.scaled_dot_product_attention runs these on the CPU.
CPU_FORMULAS: dict[Any, Callable[..., int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flops,
}


def sparse_product_flops(func: Any, args: tuple) -> int | None:
    """2 x nnz x the dense operand's other side for a product with a sparse operand (S [m, k] @ D [k, n]:
    each stored entry meets n columns; D [m, k] @ S [k, n]: m rows); None when no operand is sparse.
    ``_nnz()`` counts stored entries, duplicates of an uncoalesced matrix included: each is multiplied."""
    positions = SPARSE_PRODUCTS.get(func.overloadpacket)
    if positions is None:
        return None
    left, right = (args[i] for i in positions)
    if left.layout != torch.strided:
        return 2 * left._nnz() * right.shape[1]
    if right.layout != torch.strided:
        return 2 * right._nnz() * left.shape[0]
    return None


def _formula_flops(func: Any, args: tuple, kwargs: dict[str, Any], out: Any) -> int:
    """The count of flop_registry's formula for ``func`` (or :data:`CPU_FORMULAS`'), which takes every operand
    for dense; 0 for an op without one."""
    formula = flop_registry.get(func.overloadpacket) or CPU_FORMULAS.get(func.overloadpacket)
    return int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0


def _dense_product_flops(func: Any, args: tuple) -> int:
    """What a generic counter says of a product with a sparse operand: a dense product of the same shapes."""
    left, right = (args[i] for i in SPARSE_PRODUCTS[func.overloadpacket])
    return 2 * left.shape[0] * left.shape[1] * right.shape[1]


def _dtype_name(args: tuple) -> str:
    """The dtype an op computes in: its first floating-point tensor argument's."""
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.is_floating_point():
            return str(arg.dtype).replace("torch.", "")
    return "float32"


@dataclass
class Tally:
    """What the ops at one place did: their seconds, FLOPs (by dtype, to set each against its own peak),
    the seconds of those that do no dense arithmetic, the calls, and the output shape of the first op with
    FLOPs (what a layer table shows: a convolution's channels and map size)."""

    seconds: float = 0.0
    flops: int = 0
    flops_by_dtype: dict[str, int] = field(default_factory=dict)
    zero_flop_seconds: float = 0.0
    calls: int = 0
    output_shape: tuple[int, ...] | None = None

    def add(self, seconds: float, flops: int, dtype: str, output_shape: tuple[int, ...] | None) -> None:
        self.seconds += seconds
        self.calls += 1
        if flops:
            self.flops += flops
            self.flops_by_dtype[dtype] = self.flops_by_dtype.get(dtype, 0) + flops
            if self.output_shape is None:
                self.output_shape = output_shape
        else:
            self.zero_flop_seconds += seconds

    def merge(self, other: Tally) -> None:
        self.seconds += other.seconds
        self.flops += other.flops
        for dtype, flops in other.flops_by_dtype.items():
            self.flops_by_dtype[dtype] = self.flops_by_dtype.get(dtype, 0) + flops
        self.zero_flop_seconds += other.zero_flop_seconds
        self.calls += other.calls
        self.output_shape = self.output_shape or other.output_shape

    def peak_seconds(self, peaks: dict[str, float]) -> float:
        """The seconds these FLOPs take at ``peaks`` (FLOP/s by dtype; a dtype without one: float32's)."""
        return sum(flops / peaks.get(dtype, peaks["float32"]) for dtype, flops in self.flops_by_dtype.items())


class _OpMode(TorchDispatchMode):
    """The dispatch mode of a :class:`StageProfiler`: runs each op and hands it, its time and output to
    ``record``. A mode of its own, so that re-entering it (to decompose an op) leaves the profiler's hooks alone."""

    def __init__(self, record: Callable[[Any, tuple, dict[str, Any], Any, float], None]) -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket in DECOMPOSED:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        start = time.perf_counter()
        out = func(*args, **kwargs)
        self.record(func, args, kwargs, out, time.perf_counter() - start)
        return out


class StageProfiler:
    """Times and counts every aten op while open, by place (see the module docstring) and phase.

    ``tallies[(place, phase)]``: ``place`` is a module's path in ``model`` (:data:`ROOT` for the model's own
    code, :data:`OUTSIDE` outside it) or a region's name ("[optimizer]": ``optimizer.step``); ``phase`` "forward"
    or "backward". ``sparse_flops`` and ``sparse_dense_equivalent``: the sparse products' FLOPs, counted right
    and as a dense count has them.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.optimizer = optimizer
        self.paths = {module: path or ROOT for path, module in model.named_modules()}
        self.modules = {path: module for module, path in self.paths.items()}
        self.tallies: dict[tuple[str, str], Tally] = defaultdict(Tally)
        self.sparse_flops = self.sparse_dense_equivalent = 0
        self._forward: list[str] = []  # open modules and regions, innermost last
        self._backward: list[str] = []  # the places of the autograd nodes running, innermost last
        self._hooks = contextlib.ExitStack()

    def place(self) -> str:
        """Where an op running now belongs."""
        if self._backward:
            return self._backward[-1]
        return self._forward[-1] if self._forward else OUTSIDE

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Ops in the block (and their backward) belong to ``name``, e.g. "[loss] fastrcnn_loss"."""
        self._forward.append(name)
        try:
            yield
        finally:
            self._forward.pop()

    def __enter__(self) -> StageProfiler:
        self._hooks.enter_context(register_module_forward_pre_hook(self._enter_module))
        self._hooks.enter_context(register_module_forward_hook(self._exit_module, always_call=True))
        self._hooks.enter_context(torch.autograd.graph.node_creation_hook(self._on_node))
        if self.optimizer is not None:
            self._hooks.enter_context(self.optimizer.register_step_pre_hook(self._enter_optimizer))
            self._hooks.enter_context(self.optimizer.register_step_post_hook(self._exit_optimizer))
        self._hooks.enter_context(_OpMode(self._record))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.close()

    def _enter_module(self, module: torch.nn.Module, inputs: Any) -> None:
        if module in self.paths:
            self._forward.append(self.paths[module])

    def _exit_module(self, module: torch.nn.Module, inputs: Any, outputs: Any) -> None:
        if module in self.paths:
            self._forward.pop()

    def _enter_optimizer(self, *args: Any) -> None:
        self._forward.append("[optimizer]")

    def _exit_optimizer(self, *args: Any) -> None:
        self._forward.pop()

    def _on_node(self, node: torch.autograd.graph.Node) -> None:
        """Give a node created now the place open now, for its backward (the closures hold no node: no cycle)."""
        place = self.place()

        def enter(grad_outputs: Any) -> None:
            self._backward.append(place)

        def leave(grad_inputs: Any, grad_outputs: Any) -> None:  # returns None: the gradients stay as they are
            self._backward.pop()

        node.register_prehook(enter)
        node.register_hook(leave)

    def _record(self, func: Any, args: tuple, kwargs: dict[str, Any], out: Any, seconds: float) -> None:
        """Add one op call's time and FLOPs to the place running now."""
        flops = sparse_product_flops(func, args)
        if flops is not None:
            self.sparse_flops += flops
            self.sparse_dense_equivalent += _dense_product_flops(func, args)
        else:
            flops = _formula_flops(func, args, kwargs, out)
        first = out[0] if isinstance(out, (tuple, list)) else out
        shape = tuple(first.shape) if flops and isinstance(first, torch.Tensor) else None
        phase = "backward" if self._backward else "forward"
        self.tallies[(self.place(), phase)].add(seconds, flops, _dtype_name(args), shape)

    def by_place(self) -> dict[str, Tally]:
        """Forward and backward together, per place, in the order places first ran."""
        merged: dict[str, Tally] = {}
        for (place, _), tally in self.tallies.items():
            merged.setdefault(place, Tally()).merge(tally)
        return merged

    def by_stage(self, stage_of: Callable[[str], str] | None = None) -> dict[str, Tally]:
        """Per stage (``stage_of(place)``, default :func:`detector_stage`), in the order stages first ran."""
        stage_of = stage_of or detector_stage
        merged: dict[str, Tally] = {}
        for place, tally in self.by_place().items():
            merged.setdefault(stage_of(place), Tally()).merge(tally)
        return merged

    def total(self) -> Tally:
        total = Tally()
        for tally in self.tallies.values():
            total.merge(tally)
        return total


# Module paths of Pet's detectors whose stage is not their top-level child's name; the longest prefix wins.
DETECTOR_STAGES = {
    "normalizer": "preprocess",
    "backbone.body": "backbone", "backbone.fpn": "fpn",
    "roi_heads": "roi heads",  # proposal sampling and matching, box decoding, NMS: the RoI heads' own code
    **{f"roi_heads.{branch}_{part}": f"{branch} head" for branch in ("box", "mask", "keypoint")
       for part in ("roi_pool", "head", "predictor")},
    "criterion": "loss",  # RT-DETR's
}


def detector_stage(place: str) -> str:
    """The stage of a place: a region's bracketed name ("[loss] fastrcnn_loss": loss; :data:`OUTSIDE`: other;
    :data:`ROOT`: detector), else the :data:`DETECTOR_STAGES` entry of the module path's longest prefix, else
    its top-level child's name."""
    if place.startswith("["):
        return place[1:place.index("]")]
    parts = place.split(".")
    for end in range(len(parts), 0, -1):
        stage = DETECTOR_STAGES.get(".".join(parts[:end]))
        if stage is not None:
            return stage
    return parts[0]


# Where Pet's detectors compute losses outside a module of their own: module-level functions they call by name,
# and the ``compute_loss`` method of torchvision's RPN and one-stage detectors (and RetinaNet's head).
LOSS_FUNCTIONS = ((tv_roi_heads, ("fastrcnn_loss", "maskrcnn_loss", "keypointrcnn_loss")),
                  (pet_cascade, ("cascade_stage_loss", "maskrcnn_loss")))
LOSS_METHOD = "compute_loss"


@contextlib.contextmanager
def named_losses(profiler: StageProfiler, model: torch.nn.Module) -> Iterator[None]:
    """Run each loss function of :data:`LOSS_FUNCTIONS` and each module's ``compute_loss`` in a "[loss] NAME"
    region of ``profiler`` inside the block (replaced in their modules and on the instances, then restored)."""

    def in_region(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with profiler.region(f"[loss] {name}"):
                return function(*args, **kwargs)
        return wrapped

    restore: list[Callable[[], None]] = []
    try:
        for namespace, names in LOSS_FUNCTIONS:
            for name in names:
                original = getattr(namespace, name)
                setattr(namespace, name, in_region(name, original))
                restore.append(functools.partial(setattr, namespace, name, original))
        for path, module in model.named_modules():
            if callable(getattr(module, LOSS_METHOD, None)):
                object.__setattr__(module, LOSS_METHOD, in_region(f"{path or 'model'}.{LOSS_METHOD}",
                                                                  getattr(module, LOSS_METHOD)))
                restore.append(functools.partial(object.__delattr__, module, LOSS_METHOD))
        yield
    finally:
        for undo in reversed(restore):
            undo()
