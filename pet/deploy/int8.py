"""Static int8 quantization of an exported model, written only if it keeps the float model's AP.

:func:`quantize_with_gate` turns the float ONNX file of :func:`pet.deploy.onnx.export_onnx` into an int8 one, in
three steps on three disjoint sets of images (:func:`int8_image_sets`). A :class:`RuntimeQuantizer` quantizes for
one runtime: :class:`OnnxRuntimeQuantizer` (onnxruntime's tools, below) writes ``model.int8.onnx``;
:class:`pet.deploy.openvino_int8.OpenVinoQuantizer` (NNCF) writes OpenVINO's ``model.int8.xml``. The steps, the
parts that stay float and the gate are the same for both:

1. **Calibration** (``calibration``: training images, the test transforms): the float model runs on them and
   records every activation's range. onnxruntime: its pre-processing (``quant_pre_process``: shape inference,
   constant folding), then min and max of every activation, cached, so each candidate below is quantized without
   running the model again; format QDQ, weights int8 per output channel, activations uint8 (u8s8: the pair
   onnxruntime's x86 kernels fuse into ``QLinearConv``; s8s8 left most convolutions unfused there). OpenVINO: NNCF's
   post-training quantization of the IR, its own statistics and bias correction. ``reduce_range`` (7-bit weights)
   on a CPU without VNNI, where u8s8 products can saturate (:func:`pet.utils.cpu.cpu_int8_support`); the file
   records which.
2. **What runs int8** (``selection``: other training images): the convolutions and matrix products of each
   quantizable part (the detector's ``float_parts``, which the export records, stay float: see
   :class:`pet.modeling.Detector`), with the additions, ReLUs, max-pools
   and resizes between them so that activations stay int8 from one layer to the next. Post-processing (box
   decoding, NMS, RoIAlign, mask pasting) is float. All parts run int8 if the selection images' bbox (and segm)
   AP is within half the tolerance of the float model's; otherwise each part is measured alone and parts are
   added from the least harmful while the AP stays within it.
3. **The gate** (``gate``: TEST.DATASETS[0], never seen by steps 1 and 2, so the choice does not fit the gate's
   own images): the int8 model's bbox AP (and segm AP for masks) must be within ``tolerance`` AP points of the
   float model's (same runtime) on the same images. Only then is the file written; otherwise :class:`Int8AccuracyError`
   says how far it fell (one line and exit status 2 in tools/export.py).

AP is measured as tools/test_net.py measures it: :func:`pet.engine.inference.inference_on_dataset` with the COCO
evaluator, the float and the int8 model in the quantizer's runtime.
"""
from __future__ import annotations

import ast
import contextlib
import io
import json
import logging
import math
import os
import random
import tempfile
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fvcore.common.config import CfgNode

from pet.data import COCODataset, DatasetMapper, collate_batch, get_dataset, read_image, register_custom_datasets
from pet.deploy.exported_model import FLOAT_SHA256_KEY, ExportedModel
from pet.deploy.onnx import Batch
from pet.deploy.onnxruntime_model import INSTALL_EXPORT_EXTRA, OnnxRuntimeModel, session_inputs
from pet.engine.inference import inference_on_dataset
from pet.evaluation import COCOEvaluator
from pet.utils.cpu import cpu_int8_support
from pet.utils.errors import DataError, PetError
from pet.utils.files import file_sha256

try:  # the optional "export" extra: without it, importing this module is one line saying how to install it
    import onnx
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process
except ImportError as exc:
    raise PetError(f"{exc.name or 'onnxruntime'} is not installed, and int8 quantization needs it: "
                   f"{INSTALL_EXPORT_EXTRA}") from exc

__all__ = ["Int8AccuracyError", "Int8ImageSets", "Int8Report", "OnnxRuntimeQuantizer", "QUANTIZED_OPS",
           "RecordBatches", "RuntimeQuantizer", "default_image_counts", "detection_ap", "int8_image_sets",
           "model_parts", "quantize_with_gate"]

logger = logging.getLogger(__name__)

# The operations a quantized part runs in int8: its convolutions and matrix products, and what sits between them.
QUANTIZED_OPS = ("Conv", "Gemm", "MatMul", "Add", "Relu", "MaxPool", "Resize")
_SCOPES = "pkg.torch.onnx.name_scopes"  # the module path of each node, as torch's ONNX exporter records it


class Int8AccuracyError(PetError):
    """The int8 model's AP on the gate's images fell further below the float model's than the tolerance."""


@dataclass
class Int8ImageSets:
    """The three disjoint sets of images quantization uses, as dataset records, with their datasets."""

    train: COCODataset
    calibration: list[dict[str, Any]]  # the activations' ranges
    selection: list[dict[str, Any]]  # which parts run int8
    test: COCODataset
    gate: list[dict[str, Any]]  # the accuracy gate


def default_image_counts(cfg: CfgNode, calibration: int = 0) -> tuple[int, int]:
    """How many calibration and selection images to use: ``calibration`` if given, else a few hundred (256) for
    small inputs and 64 where test images are resized to 600 px or more (R-50 models at 800x1333, where each
    image costs seconds); selection images: up to 100 (50 for large inputs), as many as the training set has left."""
    large = cfg.INPUT.MIN_SIZE_TEST >= 600
    return calibration or (64 if large else 256), 50 if large else 100


def int8_image_sets(cfg: CfgNode, calibration: int, selection: int, gate: int = 0) -> Int8ImageSets:
    """``calibration`` and then up to ``selection`` images of TRAIN.DATASETS[0] in a fixed shuffled order, and the
    first ``gate`` images (0: all) of TEST.DATASETS[0]. A training image whose file is also a gate image is left out,
    so the sets are disjoint even when training and test sets overlap."""
    register_custom_datasets(cfg)
    train = _first_dataset(cfg.TRAIN.DATASETS, "TRAIN", "calibration")
    test = _first_dataset(cfg.TEST.DATASETS, "TEST", "gate")
    gate_records = test.records[:gate] if gate > 0 else list(test.records)
    gate_files = {os.path.realpath(r["file_name"]) for r in gate_records}
    pool = [r for r in train.records if os.path.realpath(r["file_name"]) not in gate_files]
    random.Random(0).shuffle(pool)
    if len(pool) <= calibration:
        raise DataError(f"int8 quantization takes {calibration} calibration images from TRAIN.DATASETS[0] "
                        f"'{train.name}' and more to choose what runs int8, but it has only {len(pool)} that are not "
                        "test images. Ask for fewer with --calib N.")
    return Int8ImageSets(train, pool[:calibration], pool[calibration:calibration + selection], test, gate_records)


def _first_dataset(names: Sequence[str], key: str, use: str) -> COCODataset:
    if not names:
        raise DataError(f"int8 quantization takes its {use} images from {key}.DATASETS, which is empty. Name one, "
                        f"e.g. {key}.DATASETS \"('shapes_{'train' if key == 'TRAIN' else 'val'}',)\".")
    return get_dataset(names[0])


class RecordBatches:
    """Dataset records read and transformed as the test loader does (``INPUT``'s test resize, padding), in batches.

    Re-iterable, and lazy: one batch of images in memory at a time.
    """

    def __init__(self, cfg: CfgNode, records: Sequence[dict[str, Any]], batch_size: int) -> None:
        self.records, self.batch_size = records, batch_size
        self.size_divisibility = cfg.INPUT.SIZE_DIVISIBILITY
        self.mapper = DatasetMapper.from_config(cfg, is_train=False)

    def __len__(self) -> int:
        return math.ceil(len(self.records) / self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        rng = np.random.default_rng(0)  # the test transforms draw nothing; the mapper takes a generator
        for start in range(0, len(self.records), self.batch_size):
            group = self.records[start:start + self.batch_size]
            samples = [self.mapper(r, read_image(r["file_name"], r["image_id"]), rng) for r in group]
            yield collate_batch(samples, self.size_divisibility)


class _CalibrationReader(CalibrationDataReader):
    """The calibration batches as onnxruntime's calibrator reads them: a dict of input arrays per call, then None."""

    def __init__(self, batches: Iterable[Batch]) -> None:
        self._batches = iter(batches)

    def get_next(self) -> dict[str, np.ndarray] | None:
        batch = next(self._batches, None)
        return None if batch is None else session_inputs(*batch)


def model_parts(model: onnx.ModelProto, op_types: Sequence[str] | None = QUANTIZED_OPS) -> dict[str, list[str]]:
    """The names of the ``op_types`` nodes (None: every node) of each part of an exported model, in graph order.

    A part is a module two levels down the detector (``backbone.body``, ``backbone.fpn``, ``rpn.head``,
    ``roi_heads.box_head``, ``head.classification_head``, RT-DETR's ``encoder.aifi``, ``decoder.layers``, ...), read
    from the module path torch's exporter records with each node; nodes outside such a module (post-processing) and
    the parts the export lists in its ``pet.float_parts`` metadata (the detector's ``float_parts``) are in none. A
    ``ModuleList`` has no forward, so the exporter records no path for it, only
    for its elements (``decoder.layers.0``): their nodes belong to the list's part.
    """
    float_parts = next((p.value.split(",") for p in model.metadata_props if p.key == "pet.float_parts"), [])
    parts: dict[str, list[str]] = {}
    for node in model.graph.node:
        if op_types is not None and node.op_type not in op_types:
            continue
        scopes = next((ast.literal_eval(p.value) for p in node.metadata_props if p.key == _SCOPES), [])
        part = next((".".join(s.split(".")[:2]) for s in scopes if s.count(".") >= 1), None)
        if part is not None and part not in float_parts:
            parts.setdefault(part, []).append(node.name)
    return parts


def no_parts_error(float_path: str) -> PetError:
    return PetError(f"{float_path} has no part that can run in int8 (no convolution or matrix product inside a module "
                    "of the detector, as torch's exporter records them). Export it again with tools/export.py.")


class RuntimeQuantizer:
    """An exported float model made ready to quantize once; :meth:`quantize` writes a version of it with the chosen
    parts in int8, for one runtime.

    A subclass is made with ``(float_path, workdir, calibration, reduce_range)``: the float ONNX export, a folder
    for its working files, the batches of one image each that the activations' ranges are measured on (read at the
    first :meth:`quantize`), and whether weights take 7 bits (a CPU without VNNI). It sets :attr:`parts` (the
    names of the nodes of each quantizable part, :func:`model_parts`) and :attr:`suffix` (its files' extension).
    """

    parts: dict[str, list[str]]
    suffix = ".onnx"

    def quantize(self, parts: Iterable[str], path: str) -> str:
        """Write to ``path`` the model with ``parts`` (keys of :attr:`parts`) in int8; returns ``path``."""
        raise NotImplementedError

    def load(self, path: str, threads: int) -> ExportedModel:
        """The model at ``path`` (the float export, or one :meth:`quantize` wrote) in this runtime."""
        raise NotImplementedError

    def record(self, path: str, facts: dict[str, str]) -> None:
        """Add ``facts`` to the metadata of the model at ``path``."""
        raise NotImplementedError

    def publish(self, path: str, output: str) -> None:
        """Move the model at ``path`` to ``output`` (a rename: the previous file stays until then)."""
        os.replace(path, output)


class OnnxRuntimeQuantizer(RuntimeQuantizer):
    """onnxruntime's static quantization (QDQ): the float export pre-processed once, its calibration cached in
    ``workdir``, so each :meth:`quantize` only writes the model."""

    def __init__(self, float_path: str, workdir: str, calibration: RecordBatches | Sequence[Batch],
                 reduce_range: bool) -> None:
        self.model_path = os.path.join(workdir, "preprocessed.onnx")
        try:
            quant_pre_process(float_path, self.model_path, auto_merge=True, guess_output_rank=True)
        except TypeError as exc:
            # onnxruntime's symbolic shape inference gives up on some graphs (RT-DETR's: reductions of opset 18 leave
            # outputs without a rank, and it takes their length). It only serves the transformer fusions; ONNX's own
            # shape inference, which quantization needs, still runs without it.
            logger.info(f"int8: onnxruntime's symbolic shape inference failed on {float_path} ({exc}); "
                        "pre-processing without it")
            quant_pre_process(float_path, self.model_path, skip_symbolic_shape=True)
        # The parts are read from the export: pre-processing folds FrozenBatchNorm's multiply-add into the convolution
        # before it, keeping the convolution's name but not the module path recorded with it.
        kept = {node.name for node in onnx.load(self.model_path).graph.node}
        self.parts = {part: [name for name in names if name in kept]
                      for part, names in model_parts(onnx.load(float_path)).items()}
        if not self.parts:
            raise no_parts_error(float_path)
        self.reduce_range = reduce_range
        self._cache = os.path.join(workdir, "calibration.json")
        self._calibration = calibration

    def quantize(self, parts: Iterable[str], path: str) -> str:
        nodes = [name for part in parts for name in self.parts[part]]
        reader = None
        if not os.path.isfile(self._cache):
            logger.info(f"int8: calibrating on {len(self._calibration)} images")
            reader = _CalibrationReader(self._calibration)
        quantize_static(self.model_path, path, reader, quant_format=QuantFormat.QDQ, per_channel=True,
                        reduce_range=self.reduce_range, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        op_types_to_quantize=list(QUANTIZED_OPS), nodes_to_quantize=nodes,
                        calibration_cache_path=self._cache)
        return path

    def load(self, path: str, threads: int) -> ExportedModel:
        return OnnxRuntimeModel(path, threads=threads)

    def record(self, path: str, facts: dict[str, str]) -> None:
        model = onnx.load(path)
        for key, value in facts.items():
            model.metadata_props.add(key=key, value=value)
        onnx.save(model, path)


@dataclass
class Int8Report:
    """What quantization chose and measured; ``ap`` maps ``"float32"`` and ``"int8"`` to ``{task: AP}`` on the gate."""

    parts: list[str]
    reduce_range: bool
    tolerance: float
    gate_images: int
    gate_dataset: str
    ap: dict[str, dict[str, float]] = field(default_factory=dict)

    def summary(self) -> str:
        scores = ", ".join(f"{task} AP {self.ap['int8'][task]:.2f} against float32 {self.ap['float32'][task]:.2f}"
                           for task in self.ap["float32"])
        return (f"{scores} on {self.gate_images} images of {self.gate_dataset} (tolerance {self.tolerance:g} AP); "
                f"int8: {', '.join(self.parts)}{' (7-bit weights: reduce_range)' if self.reduce_range else ''}")


def detection_ap(model: ExportedModel, dataset: COCODataset, batches: RecordBatches) -> dict[str, float]:
    """``{"bbox": AP}`` (and ``"segm"`` for a model with masks) of ``model`` on ``batches``' images of ``dataset``,
    logged as one line (the test loop's progress and the evaluator's tables are left out)."""
    evaluator = COCOEvaluator(dataset, None, diagnostics=False)
    with _quiet("pet.engine", "pet.evaluation"), contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints
        metrics = inference_on_dataset(model, batches, evaluator)
    ap = {task: metrics[task]["AP"] for task in ("bbox", "segm") if task in metrics}
    logger.info(f"int8: {os.path.basename(model.path)} on {len(batches.records)} images of {dataset.name}: "
                + ", ".join(f"{task} AP {value:.2f}" for task, value in ap.items()))
    return ap


@contextlib.contextmanager
def _quiet(*names: str) -> Iterator[None]:
    """Only warnings and errors from the loggers ``names`` inside the block."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def quantize_with_gate(cfg: CfgNode, float_path: str, output: str, sets: Int8ImageSets, tolerance: float = 1.0,
                       threads: int = 0, quantizer: type[RuntimeQuantizer] = OnnxRuntimeQuantizer) -> Int8Report:
    """Quantize ``float_path`` as the module docstring says and write ``output`` if it passes the gate.

    ``tolerance``: how many AP points (0-100) below the float model the int8 model may be on the gate's images.
    ``threads``: the runtime's threads. ``quantizer``: the runtime's :class:`RuntimeQuantizer` (default
    onnxruntime's); the float model it is measured against runs in that runtime too. Raises
    :class:`Int8AccuracyError` (nothing written) otherwise.
    """
    support = cpu_int8_support()
    reduce_range = not support.native
    logger.info(f"int8: {support.reason}, so weights are quantized to {'7' if reduce_range else '8'} bits "
                f"(reduce_range {reduce_range})")
    batch_size = cfg.TEST.IMS_PER_BATCH
    with tempfile.TemporaryDirectory(prefix=".int8-", dir=os.path.dirname(os.path.abspath(output))) as workdir:
        # One image per calibration batch: the ranges do not depend on the batch, and no padding is calibrated.
        q = quantizer(float_path, workdir, RecordBatches(cfg, sets.calibration, 1), reduce_range)
        float_model = q.load(float_path, threads)
        selection = RecordBatches(cfg, sets.selection, batch_size)
        parts, notes = _choose_parts(q, float_model, sets.train, selection, tolerance / 2, threads, workdir)
        logger.info(f"int8: chose {', '.join(parts)} ({'; '.join(notes)})")
        candidate = q.quantize(parts, os.path.join(workdir, f"model.int8{q.suffix}"))
        report = Int8Report(parts, reduce_range, tolerance, len(sets.gate), sets.test.name)
        gate = RecordBatches(cfg, sets.gate, batch_size)
        report.ap["float32"] = _reference_ap(float_model, sets.test, gate, "gate")
        report.ap["int8"] = detection_ap(q.load(candidate, threads), sets.test, gate)
        _check_gate(report, output)
        q.record(candidate, _facts(report, len(sets.calibration), sets.train.name, float_path))
        q.publish(candidate, output)
    return report


def _choose_parts(quantizer: RuntimeQuantizer, float_model: ExportedModel, dataset: COCODataset,
                  batches: RecordBatches, budget: float, threads: int, workdir: str) -> tuple[list[str], list[str]]:
    """The parts to run in int8: all if the selection images' AP stays within ``budget`` points of the float model's,
    else those added from the least harmful (each measured alone) while it does. Returns them and a log of why."""
    reference = _reference_ap(float_model, dataset, batches, "selection")
    path = os.path.join(workdir, f"candidate{quantizer.suffix}")

    def loss(parts: Sequence[str]) -> float:
        ap = detection_ap(quantizer.load(quantizer.quantize(parts, path), threads), dataset, batches)
        return max(reference[task] - ap[task] for task in reference)

    everything = list(quantizer.parts)
    worst = loss(everything)
    notes = [f"all of {', '.join(everything)}: {worst:.2f} AP below float32 on {len(batches.records)} selection images"]
    if worst <= budget:
        return everything, notes
    alone = sorted(everything, key=lambda part: loss([part]))
    chosen: list[str] = []
    for part in alone:
        drop = loss([*chosen, part])
        notes.append(f"+{part}: {drop:.2f} AP below")
        if drop <= budget:
            chosen.append(part)
    if not chosen:
        raise Int8AccuracyError(f"No part of {float_model.path} keeps its AP in int8 within {budget:g} points on "
                                f"{len(batches.records)} selection images of {dataset.name} ({'; '.join(notes)}). "
                                "Calibrate on more or other images (--calib N, TRAIN.DATASETS) or raise "
                                "--int8-tolerance.")
    return [part for part in everything if part in chosen], notes


def _reference_ap(model: ExportedModel, dataset: COCODataset, batches: RecordBatches, use: str) -> dict[str, float]:
    """The float model's AP, which must be a number: images without annotated objects have none to compare."""
    ap = detection_ap(model, dataset, batches)
    if not ap or any(math.isnan(value) for value in ap.values()):
        raise DataError(f"The int8 {use} images ({len(batches.records)} of {dataset.name}) give no AP ({ap}): they "
                        "have no annotated objects to compare the float and int8 models on. Use a dataset with "
                        "annotations.")
    return ap


def _check_gate(report: Int8Report, output: str) -> None:
    drops = {task: report.ap["float32"][task] - report.ap["int8"][task] for task in report.ap["float32"]}
    failed = {task: drop for task, drop in drops.items() if not drop <= report.tolerance}  # NaN fails too
    if failed:
        task, drop = max(failed.items(), key=lambda item: item[1] if not math.isnan(item[1]) else math.inf)
        raise Int8AccuracyError(
            f"int8 gate failed: {task} AP {report.ap['int8'][task]:.2f} is {drop:.2f} points below float32's "
            f"{report.ap['float32'][task]:.2f} on {report.gate_images} images of {report.gate_dataset} (tolerance "
            f"{report.tolerance:g}); {output} not written. Calibrate on more or other images (--calib N, "
            "TRAIN.DATASETS) or allow more with --int8-tolerance AP.")


def _facts(report: Int8Report, calibration_images: int, calibration_dataset: str, float_path: str) -> dict[str, str]:
    """What the int8 model is and what its gate measured, for its metadata (``pet.int8.*``), with the sha256 of the
    float export it was quantized from (--backend auto offers it only beside that export: it has its thresholds)."""
    return {FLOAT_SHA256_KEY: file_sha256(float_path),
            "pet.int8.parts": ",".join(report.parts), "pet.int8.reduce_range": str(report.reduce_range),
            "pet.int8.calibration": f"{calibration_images} images of {calibration_dataset}",
            "pet.int8.gate": json.dumps({"dataset": report.gate_dataset, "images": report.gate_images,
                                         "tolerance": report.tolerance, "ap": report.ap})}


def __getattr__(name: str) -> Any:
    """``Quantizer``, :class:`OnnxRuntimeQuantizer`'s name before OpenVINO's joined it, with a DeprecationWarning until
    Pet 0.4.0."""
    if name == "Quantizer":
        warnings.warn("pet.deploy.int8.Quantizer is now pet.deploy.int8.OnnxRuntimeQuantizer; the old name goes in "
                      "Pet 0.4.0.", DeprecationWarning, stacklevel=2)
        return OnnxRuntimeQuantizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
