"""RT-DETR's ONNX export (pet/deploy/graph.py's RTDETRGraph, tools/export.py): it passes the parity gate with a
dynamic batch and sides that are multiples of 32, onnxruntime gives the PyTorch detections at two sizes, the gate
rejects a perturbed graph, a side that is not a multiple of 32 is refused saying what to do, test_net's onnxruntime
backend gives PyTorch's AP, and the int8 pre-processing takes the export and finds its parts.

D-FINE, whose graph is RT-DETR's (the family's export graph), passes the same gate and the same onnxruntime parity.

The model is tests/modeling/test_rtdetr.py's tiny one with random weights (the box heads' last layers too: they start at
zero) and its score threshold at the median score of the gate's first batch, so that the graph's threshold drops
some of the top-k. It is exported once for the module, through tools/export.py in this process (most of its ~35 s
go to torch.export and the ONNX conversion).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import onnx
import pytest
import torch

from pet.config import load_cfg
from pet.data import DatasetMapper, collate_batch
from pet.deploy.int8 import OnnxRuntimeQuantizer
from pet.deploy.onnx import ExportError, export_onnx
from pet.deploy.onnxruntime_model import OnnxRuntimeModel
from pet.deploy.parity import ParityError, check_parity, parity_batches
from pet.modeling import build_model
from pet.utils.errors import PetError
from support.helpers import custom_datasets, run_tool_captured
from support.tiny_exports import assert_openvino_gives_the_pytorch_detections
from support.tiny_models import RTDETR_SHAPES_CFG, TINY_QUERY_DETECTORS, shapes_val_batch


@dataclass
class Export:
    cfg_file: str
    opts: list[str]
    weights: str
    model: torch.nn.Module
    onnx_file: str
    stdout: str
    stderr: str
    returncode: int


def _export(root, shapes_root, family: str) -> Export:
    """A tiny detector of the family, random weights, exported by tools/export.py."""
    tiny = TINY_QUERY_DETECTORS[family]
    opts = [*tiny.opts, "CKPT", str(root / "ckpt"), "TEST.DATASETS", "('rtdetr_val',)",
            "DATA.CUSTOM", custom_datasets(("rtdetr_val", f"{shapes_root}/annotations/val.json", f"{shapes_root}/val"))]
    torch.manual_seed(0)
    model = build_model(load_cfg(tiny.cfg_file, opts)).eval()
    with torch.no_grad():
        for head in model.decoder.box_heads:  # initialised to zero: the decoder would refine no box
            head.layers[-1].weight.normal_(0, 0.1)
            head.layers[-1].bias.normal_(0, 0.1)
        scores = torch.cat([d["scores"] for d in model(*parity_batches(load_cfg(tiny.cfg_file, opts))[0])])
    opts += [f"MODEL.{tiny.node}.SCORE_THRESH_TEST", f"{scores.median().item():.6f}"]
    model.score_thresh = float(opts[-1])
    weights, onnx_file = str(root / f"{family}.pth"), str(root / f"{family}.onnx")
    torch.save(model.state_dict(), weights)
    run = run_tool_captured("export.py", "--cfg", tiny.cfg_file, "--weights", weights, "--output", onnx_file, *opts)
    return Export(tiny.cfg_file, opts, weights, model, onnx_file, run.stdout, run.stderr, run.returncode)


@pytest.fixture(scope="module")
def export(tmp_path_factory, shapes_root) -> Export:
    """The tiny RT-DETR, exported."""
    return _export(tmp_path_factory.mktemp("rtdetr_export"), shapes_root, "rtdetr")


@pytest.fixture(scope="module")
def dfine_export(tmp_path_factory, shapes_root) -> Export:
    """The tiny D-FINE, exported."""
    return _export(tmp_path_factory.mktemp("dfine_export"), shapes_root, "dfine")


@pytest.mark.slow
@pytest.mark.parametrize("exported", ["export", "dfine_export"])
def test_tools_export_writes_a_graph_with_grid_sample_no_nms_and_dynamic_sides_in_32s(exported, request):
    export = request.getfixturevalue(exported)
    assert export.returncode == 0, f"{export.stdout[-2000:]}\n{export.stderr[-3000:]}"
    assert "Parity gate passed: 5 images" in export.stdout
    graph = onnx.load(export.onnx_file)
    dims = [[d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.graph.input]
    (batch, channels, height, width), (sizes_batch, two) = dims
    assert batch == sizes_batch and isinstance(batch, str) and (channels, two) == (3, 2)
    assert height.startswith("32*") and width.startswith("32*") and height != width, dims
    ops = {node.op_type for node in graph.graph.node}
    assert "GridSample" in ops and "TopK" in ops and "NonMaxSuppression" not in ops
    metadata = {p.key: p.value for p in graph.metadata_props}
    assert (metadata["pet.size_multiple"], metadata["pet.min_image_size"]) == ("32", "64")
    assert float(metadata["pet.score_thresh"]) == export.model.score_thresh
    assert metadata["pet.detections_per_img"] == "20"


def _onnxruntime_parity(export: Export, shapes_root: str) -> None:
    cfg = load_cfg(export.cfg_file, export.opts)
    batches = [shapes_val_batch(cfg, shapes_root, [2, 3]), shapes_val_batch(cfg, shapes_root, [4, 5], scale=0.7)]
    assert batches[0][0].shape[-2:] != batches[1][0].shape[-2:]
    report = check_parity(export.model, OnnxRuntimeModel(export.onnx_file), batches)
    assert report.images == 4 and report.box_fraction <= 1e-3 and report.score <= 1e-4
    # The threshold drops some of the top-k, not all: the graph's filter is exercised.
    assert 0 < report.detections < 4 * 20


@pytest.mark.slow
@pytest.mark.numeric
def test_onnxruntime_gives_the_pytorch_detections_at_two_sizes_in_batches_of_two(export, shapes_root):
    _onnxruntime_parity(export, shapes_root)


@pytest.mark.slow
def test_dfine_onnxruntime_gives_the_pytorch_detections_at_two_sizes(dfine_export, shapes_root):
    """As RT-DETR's, whose graph D-FINE's is; not numeric: the foreign-CPU pass checks the graph on RT-DETR's export
    rather than making this one again (30 s)."""
    _onnxruntime_parity(dfine_export, shapes_root)


@pytest.mark.slow
@pytest.mark.parametrize("exported", ["export", "dfine_export"])
def test_openvino_ir_gives_the_pytorch_detections_within_the_gates_tolerances(exported, request, shapes_root,
                                                                              tmp_path):
    export = request.getfixturevalue(exported)
    assert_openvino_gives_the_pytorch_detections(export.model, export.onnx_file, load_cfg(export.cfg_file, export.opts),
                                                 shapes_root, str(tmp_path))


def test_the_gate_rejects_a_graph_whose_boxes_are_off(export, tmp_path, shapes_root):
    """The last box head's bias moved by 0.01 (in logits of cx, cy, w, h): the boxes move, and the gate fails."""
    graph = onnx.load(export.onnx_file)
    bias = next(t for t in graph.graph.initializer if t.name == "decoder.box_heads.1.layers.2.bias")
    values = onnx.numpy_helper.to_array(bias) + 0.01
    bias.CopyFrom(onnx.numpy_helper.from_array(values, bias.name))
    perturbed = str(tmp_path / "perturbed.onnx")
    onnx.save(graph, perturbed)
    batches = [shapes_val_batch(load_cfg(RTDETR_SHAPES_CFG, export.opts), shapes_root, [2, 3])]
    with pytest.raises(ParityError, match="disagrees with the PyTorch model"):
        check_parity(export.model, OnnxRuntimeModel(perturbed), batches)


def test_a_side_that_is_not_a_multiple_of_32_is_refused_saying_what_to_do(export, tmp_path):
    cfg = load_cfg(RTDETR_SHAPES_CFG, export.opts)
    mapper = DatasetMapper.from_config(cfg, is_train=False)
    image = mapper({"image_id": 1, "boxes": np.zeros((0, 4), dtype=np.float32), "labels": []},
                   np.full((150, 200, 3), 127, dtype=np.uint8), np.random.default_rng(0))
    images, targets = collate_batch([image], 16)  # 160 x 208: 208 is not a multiple of 32
    with pytest.raises(PetError, match=r"multiples of 32; this batch is \(160, 208\) px\. Pad batches with "
                                       r"INPUT\.SIZE_DIVISIBILITY 32"):
        OnnxRuntimeModel(export.onnx_file)(images, targets)
    # The export says the same before torch.export's work.
    with pytest.raises(ExportError, match=r"padded width \(208 px\) is not a multiple of 32.*INPUT.SIZE_DIVISIBILITY"):
        export_onnx(export.model, (images, targets), str(tmp_path / "never.onnx"))
    assert not os.path.exists(tmp_path / "never.onnx")


def test_test_net_onnxruntime_gives_the_pytorch_ap(export, tmp_path):
    opts = [*export.opts, "TEST.WEIGHTS", export.weights, "TEST.IMS_PER_BATCH", "2", "DATA.NUM_WORKERS", "0",
            "TEST.NUM_WARMUP", "0", "TEST.AMP.ENABLED", "False"]
    metrics = {}
    for backend, extra in (("pytorch", []), ("onnxruntime", ["--model", export.onnx_file])):
        run = run_tool_captured("test_net.py", "--cfg", RTDETR_SHAPES_CFG, "--backend", backend, *extra, *opts,
                                "CKPT", str(tmp_path / backend))
        assert run.returncode == 0, f"{backend}:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
        with open(tmp_path / backend / "test" / "metrics.json") as f:
            metrics[backend] = json.load(f)["metrics"]
    assert metrics["onnxruntime"] == pytest.approx(metrics["pytorch"], abs=1e-4, nan_ok=True)


@pytest.mark.slow
def test_int8_pre_processing_takes_the_export_and_finds_the_parts_inside_module_lists(export, tmp_path):
    """onnxruntime's symbolic shape inference fails on this graph (the quantizer pre-processes without it), and the
    backbone stages, encoder blocks and decoder layers, elements of ModuleLists, are parts that can run int8."""
    parts = OnnxRuntimeQuantizer(export.onnx_file, str(tmp_path), [], reduce_range=False).parts
    assert {"backbone.stem", "backbone.stages", "encoder.aifi", "encoder.fpn_blocks", "decoder.layers"} <= set(parts)
    assert all(parts.values())  # each part's nodes are still there after the pre-processing
