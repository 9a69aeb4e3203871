"""Detectors defined outside Pet (tests/support/plugin_detectors.py) go through every tool with no edit to Pet: a
subclass of each family (Keypoint R-CNN, FCOS, RT-DETR) and a new family (CenterDetector, with its own config keys and
export graph) train, test, predict by tiles, export through the parity gate and quantize to int8.

Each plugin is named in a YAML file by dotted path (``MODEL.META_ARCHITECTURE:
support.plugin_detectors.CenterDetector``) and made tiny (160 px images, narrow heads). One run per plugin, shared by
the module's tests: tools/train_net.py for a few iterations, then tools/test_net.py, tools/predict.py --tile and
tools/export.py --int8 on its final weights, all in this process (support.helpers.run_tool_captured). The keypoint
plugin trains on the shapes set's corners (pet/data/shapes_keypoints.py) and must keep them to the end: a subclass of
the keypoint model is what code that looked at class names silently stripped of its keypoints.

The int8 gate's tolerance is 100 AP points: a few iterations leave the models' AP near 0, and the point here is that
quantizing runs, through the parts the export records, not what it costs (tests/deploy/test_int8.py measures that). The
float export's parity gate is the strict part.
"""
from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import onnx
import pytest

from pet.config import load_cfg
from pet.data.shapes_keypoints import SHAPE_KEYPOINTS, generate_shapes_keypoints
from pet.deploy.backend import int8_path
from pet.modeling import Detector, build_model
from pet.modeling.detector import detector_class, keypoint_count
from pet.predict.predictor import model_score_thresh
from support.helpers import CFGS, SMALL_FLOPS, custom_datasets, run_tool_captured
from support.plugin_detectors import CenterDetector, FCOSPlugin, KeypointPlugin, RTDETRPlugin
from support.tiny_models import TINY_RTDETR, TINY_TWO_STAGE


@dataclass(frozen=True)
class Plugin:
    detector: type[Detector]
    base: str  # the shipped config the YAML file inherits, under cfgs/shapes/
    yaml: str  # what the YAML file adds under MODEL, beside META_ARCHITECTURE
    opts: tuple[str, ...]  # what makes it tiny
    max_iter: int
    score_key: str
    score_thresh: float


# tests/modeling/test_keypoint_rcnn.py's tiny Keypoint R-CNN, with the shapes corners' 7 points.
_TINY_KEYPOINT = (*TINY_TWO_STAGE, "MODEL.ROI_KEYPOINT_HEAD.CONV_DIMS", "[16, 16]",
              "MODEL.ROI_KEYPOINT_HEAD.POOLER_RESOLUTION", "7")
# tests/modeling/test_rtdetr.py's tiny RT-DETR.
PLUGINS = {
    "keypoint": Plugin(KeypointPlugin, "keypoint_rcnn_R-10-FPN.yaml", "", _TINY_KEYPOINT, 4,
                       "MODEL.ROI_HEADS.SCORE_THRESH_TEST", 0.01),
    "fcos": Plugin(FCOSPlugin, "fcos_R-18-FPN.yaml", "",
                   ("MODEL.FPN.RETURNED_LAYERS", "[4]", "MODEL.FPN.OUT_CHANNELS", "32", "MODEL.FCOS.NUM_CONVS", "1"),
                   4, "MODEL.FCOS.SCORE_THRESH_TEST", 0.01),
    "rtdetr": Plugin(RTDETRPlugin, "rtdetr_R-18.yaml", "", tuple(TINY_RTDETR), 4, "MODEL.RTDETR.SCORE_THRESH_TEST",
                     0.0),
    # The new family's own keys, set in its YAML file (add_config added them before it was merged).
    "center": Plugin(CenterDetector, "faster_rcnn_R-10-FPN.yaml",
                     "  CENTER:\n    CHANNELS: 32\n    SCORE_THRESH_TEST: 0.01\n    DETECTIONS_PER_IMAGE: 50\n", (),
                     40, "MODEL.CENTER.SCORE_THRESH_TEST", 0.01),
}
TILE = 128


@dataclass
class PluginRun:
    plugin: Plugin
    cfg_file: str  # the YAML file naming the plugin
    opts: list[str]
    ckpt: str
    val_dir: str
    train: subprocess.CompletedProcess
    test: subprocess.CompletedProcess
    predict: subprocess.CompletedProcess
    predict_dir: str
    export: subprocess.CompletedProcess
    onnx_file: str


def plugin_yaml(plugin: Plugin, path: Path) -> str:
    """Write the YAML file that names ``plugin`` by dotted path over its shipped base config; returns its path."""
    path.write_text(f"_BASE_: {os.path.join(CFGS, 'shapes', plugin.base)}\n"
                    f"MODEL:\n  META_ARCHITECTURE: support.plugin_detectors.{plugin.detector.__name__}\n{plugin.yaml}")
    return str(path)


def _failed(run: subprocess.CompletedProcess) -> str:
    return f"{run.args[0]} exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"


@pytest.fixture(scope="module")
def keypoint_root(tiny_set, tmp_path_factory) -> str:
    """The tiny set's corner annotations (its images stay in the tiny set's folders)."""
    return generate_shapes_keypoints(str(tmp_path_factory.mktemp("plugin_kp")), tiny_set)


@pytest.fixture(scope="module", params=list(PLUGINS))
def plugin_run(request, tiny_set, keypoint_root, tmp_path_factory) -> PluginRun:
    """One plugin trained, tested, predicted with by tiles, exported and quantized, by the tools."""
    name, plugin = request.param, PLUGINS[request.param]
    work = tmp_path_factory.mktemp(f"plugin_{name}")
    cfg_file = plugin_yaml(plugin, work / f"{name}.yaml")
    annotations = keypoint_root if name == "keypoint" else tiny_set
    ckpt = str(work / "ckpt")
    opts = [*plugin.opts, plugin.score_key, str(plugin.score_thresh), "CKPT", ckpt,
            "DATA.CUSTOM", custom_datasets(("plug_train", f"{annotations}/annotations/train.json", f"{tiny_set}/train"),
                                           ("plug_val", f"{annotations}/annotations/val.json", f"{tiny_set}/val")),
            "TRAIN.DATASETS", "('plug_train',)", "TEST.DATASETS", "('plug_val',)", "SOLVER.MAX_ITER",
            str(plugin.max_iter), "SOLVER.IMS_PER_BATCH", "2", "SOLVER.WARMUP_ITERS", "0", "TEST.IMS_PER_BATCH", "2",
            "INPUT.MIN_SIZE_TRAIN", "(160,)", "INPUT.MAX_SIZE_TRAIN", "214", "INPUT.MIN_SIZE_TEST", "160",
            "INPUT.MAX_SIZE_TEST", "214", "DATA.NUM_WORKERS", "0", "TEST.NUM_WARMUP", "0", "DISPLAY_ITER", "10",
            "HOOKS.CHECKPOINT.PERIOD", "1000", "HOOKS.EVAL.PERIOD", "0", "TRAIN.AUTO_RESUME", "False",
            "SOLVER.AMP.ENABLED", "False", "TEST.AMP.ENABLED", "False", "TEST.DIAGNOSTICS.ENABLED", "False",
            *SMALL_FLOPS]
    train = run_tool_captured("train_net.py", "--cfg", cfg_file, *opts)
    assert train.returncode == 0, _failed(train)
    test = run_tool_captured("test_net.py", "--cfg", cfg_file, *opts)
    predict_dir = str(work / "predict")
    predict = run_tool_captured("predict.py", "--cfg", cfg_file, "--input", f"{tiny_set}/val", "--output", predict_dir,
                                "--save", "csv,json", "--tile", TILE, *opts)
    onnx_file = os.path.join(ckpt, "model.onnx")
    export = run_tool_captured("export.py", "--cfg", cfg_file, "--output", onnx_file, "--int8", "--calib", "2",
                               "--gate-images", "2", "--int8-tolerance", "100", *opts)
    return PluginRun(plugin, cfg_file, opts, ckpt, f"{tiny_set}/val", train, test, predict, predict_dir, export,
                     onnx_file)


@pytest.mark.parametrize("name", list(PLUGINS))
def test_the_config_names_the_plugin_and_the_contract_answers_for_it(name, tmp_path):
    """Before any model is built: the class the dotted path names, its score threshold key (the new family's from its
    own add_config), its keypoints; then the model it builds."""
    plugin = PLUGINS[name]
    cfg = load_cfg(plugin_yaml(plugin, tmp_path / "plugin.yaml"), [*plugin.opts, plugin.score_key, "0.125"])
    assert detector_class(cfg) is plugin.detector
    assert model_score_thresh(cfg) == (plugin.score_key, 0.125)
    assert keypoint_count(cfg) == (len(SHAPE_KEYPOINTS) if name == "keypoint" else 0)
    model = build_model(cfg)
    assert type(model) is plugin.detector and model.score_thresh == 0.125


@pytest.mark.slow
def test_train_net_trains_the_plugin(plugin_run):
    run = plugin_run
    assert os.path.isfile(os.path.join(run.ckpt, "model_final.pth"))
    with open(os.path.join(run.ckpt, "log.txt")) as f:
        log = f.read()
    assert f"Model {run.plugin.detector.__name__}:" in log
    with open(os.path.join(run.ckpt, "metrics.json")) as f:
        last = json.loads(f.read().splitlines()[-1])
    assert last["iteration"] == run.plugin.max_iter
    losses = {key: value for key, value in last.items() if key.startswith("loss_")}
    assert losses and all(math.isfinite(value) for value in losses.values()), last
    if run.plugin.detector is KeypointPlugin:  # trained on the corners
        assert "loss_keypoint" in losses
    if run.plugin.detector is CenterDetector:
        assert set(losses) == {"loss_cls", "loss_box"}


@pytest.mark.slow
def test_test_net_scores_the_plugin(plugin_run):
    run = plugin_run
    assert run.test.returncode == 0, _failed(run.test)
    with open(os.path.join(run.ckpt, "test", "metrics.json")) as f:
        metrics = json.load(f)["metrics"]
    assert 0 <= metrics["bbox/AP"] <= 100
    if run.plugin.detector is KeypointPlugin:
        assert 0 <= metrics["keypoints/AP"] <= 100


@pytest.mark.slow
def test_predict_by_tiles_writes_the_plugins_detections(plugin_run):
    run = plugin_run
    assert run.predict.returncode == 0, _failed(run.predict)
    with open(os.path.join(run.predict_dir, "predictions.csv"), newline="") as f:
        rows = list(csv.reader(f))
    header, rows = rows[0], rows[1:]
    assert rows and {os.path.dirname(r[0]) for r in rows} == {run.val_dir}
    with open(os.path.join(run.predict_dir, "log.txt")) as f:
        assert f"tiles of {TILE} px" in f.read()
    # Each tile's detections are moved to the picture's pixels: those of the tiles right of the first lie beyond it.
    assert max(float(r[3]) for r in rows) > TILE
    points = [f"{point}_{what}" for point in SHAPE_KEYPOINTS for what in ("x", "y", "score")]
    if run.plugin.detector is KeypointPlugin:  # named after the test set's points
        assert header[8:] == points
        assert all(len(r) == 8 + len(points) for r in rows)
        with open(os.path.join(run.predict_dir, "json", "000001.json")) as f:
            record = json.load(f)
        assert record["keypoint_names"] == list(SHAPE_KEYPOINTS)
        assert all(len(d["keypoints"]) == len(SHAPE_KEYPOINTS) for d in record["detections"])
    else:
        assert len(header) == 8


@pytest.mark.slow
def test_export_passes_the_parity_gate_and_records_the_plugins_answers(plugin_run):
    run = plugin_run
    passed = re.search(r"Parity gate passed: (\d+) images, (\d+) detections.*", run.export.stdout)
    assert passed, _failed(run.export)
    assert int(passed.group(2)) > 0, passed.group(0)  # the gate compared detections, not two empty lists
    if run.plugin.detector is KeypointPlugin:  # and the keypoints, which the graph ends at the heatmaps of
        assert "px and keypoint scores" in passed.group(0)
        assert [o.name for o in onnx.load(run.onnx_file).graph.output][-1] == "keypoint_heatmaps"
    metadata = {p.key: p.value for p in onnx.load(run.onnx_file).metadata_props}
    detector = run.plugin.detector
    assert metadata["pet.architecture"] == detector.__name__
    assert metadata["pet.float_parts"] == ",".join(detector.float_parts)
    assert float(metadata["pet.score_thresh"]) == run.plugin.score_thresh
    assert metadata["pet.size_multiple"] == str(detector.size_multiple)


@pytest.mark.slow
def test_export_int8_quantizes_the_plugin_past_its_gate(plugin_run):
    run = plugin_run
    assert run.export.returncode == 0, _failed(run.export)
    assert "int8 gate passed: bbox AP" in run.export.stdout
    path = int8_path(run.onnx_file)
    metadata = {p.key: p.value for p in onnx.load(path).metadata_props}
    parts = [part for part in metadata["pet.int8.parts"].split(",") if part]
    # Some part runs int8, and none that the detector keeps float (the export recorded them: pet.float_parts).
    assert parts and not set(parts) & set(run.plugin.detector.float_parts), parts
    if run.plugin.detector is CenterDetector:  # the new family's parts, two levels down as int8 finds them
        assert set(parts) <= {"backbone.body", "head.cls"}, parts
    ops = {node.op_type for node in onnx.load(path).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
