"""OpenVINO as a deploy backend (pet/deploy/openvino_model.py, tools/export.py --openvino, --backend openvino): every
architecture that exports gives the PyTorch model's detections through OpenVINO's IR at the parity gate's
tolerances, tools/export.py writes the IR only once it passes that gate (a failing IR leaves nothing under its
names), test_net and predict run the IR, and a missing file or a missing openvino is one line.

The models are tiny, with random weights as in tests/deploy/test_export.py (random normalisation statistics,
classifiers rescaled so that scores vary, the score threshold just above the blank image's best score). Each is
exported once for the module with export_onnx, without tools/export.py's onnxruntime gate (test_export.py checks
that); only Faster R-CNN's export runs outside the slow group: every other architecture is ~20 s of CPU more.
The openvino extra is in the test extra, so these tests run in CI; without it they are skipped.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import sys
from dataclasses import dataclass

import pytest
import torch

from pet.config import load_cfg
from pet.deploy.backend import FLOAT_SHA256_KEY, WEIGHTS_SHA256_KEY
from pet.deploy.onnx import export_onnx
from pet.deploy.openvino_model import OpenVinoModel, openvino_path, save_openvino
from pet.deploy.parity import check_parity, parity_batches
from pet.modeling import build_model
from pet.modeling.detector import score_thresh_key
from pet.predict.labels import ONNX_METADATA_KEY, model_label_space
from pet.predict.loading import load_inference_model
from pet.utils.errors import ConfigError, PetError
from pet.utils.files import file_sha256
from support.helpers import CFGS, custom_datasets, run_tool_here, run_tool_in_process
from support.tiny_models import TINY_RTDETR, TINY_TWO_STAGE, randomize_norms, rescale_layer_output, shapes_val_batch

# Pet imports openvino only where it runs a model: the skip can come after the imports.
pytest.importorskip("openvino", reason='the openvino extra is not installed (pip install -e ".[openvino]")')
SHAPES = ["circle", "rectangle", "triangle"]  # the shapes set's categories, the label space the exports record


@dataclass(frozen=True)
class Arch:
    config: str  # under cfgs/shapes/
    opts: tuple[str, ...]  # what makes it tiny
    classifiers: tuple[str, ...]  # the layers whose outputs are rescaled to vary ((): RT-DETR, see _random_weights)


_TWO_STAGE = tuple(TINY_TWO_STAGE)
_BOX_CLASSIFIER = ("roi_heads.box_predictor.cls_score",)
ARCHS = {
    "faster_rcnn": Arch("faster_rcnn_R-10-FPN.yaml", _TWO_STAGE, _BOX_CLASSIFIER),
    "mask_rcnn": Arch("mask_rcnn_R-18-FPN.yaml", (*_TWO_STAGE, "MODEL.ROI_MASK_HEAD.NUM_CONV", "1",
                                                  "MODEL.ROI_MASK_HEAD.CONV_DIM", "32"), _BOX_CLASSIFIER),
    "keypoint_rcnn": Arch("faster_rcnn_R-10-FPN.yaml", (
        "MODEL.META_ARCHITECTURE", "KeypointRCNN", *_TWO_STAGE, "MODEL.ROI_KEYPOINT_HEAD.NUM_KEYPOINTS", "4",
        "MODEL.ROI_KEYPOINT_HEAD.CONV_DIMS", "[16, 16]", "MODEL.ROI_KEYPOINT_HEAD.POOLER_RESOLUTION", "7"),
        (*_BOX_CLASSIFIER, "roi_heads.keypoint_predictor.kps_score_lowres")),
    "cascade_rcnn": Arch("cascade_rcnn_R-10-FPN.yaml", _TWO_STAGE,
                         tuple(f"roi_heads.box_predictor.{k}.cls_score" for k in range(3))),
    "retinanet": Arch("retinanet_R-18-FPN.yaml", ("MODEL.FPN.RETURNED_LAYERS", "[4]", "MODEL.FPN.OUT_CHANNELS", "32",
                                                  "MODEL.RETINANET.ANCHOR_SIZES", "[[32], [64], [128]]",
                                                  "MODEL.RETINANET.HEAD_NORM", "''"),
                      ("head.classification_head.cls_logits",)),
    "fcos": Arch("fcos_R-18-FPN.yaml", ("MODEL.FPN.RETURNED_LAYERS", "[4]", "MODEL.FPN.OUT_CHANNELS", "64",
                                        "MODEL.FCOS.NUM_CONVS", "1"), ("head.classification_head.cls_logits",)),
    "rtdetr": Arch("rtdetr_R-18.yaml", tuple(TINY_RTDETR), ()),
}


@dataclass
class Export:
    cfg_file: str
    opts: list[str]  # the tiny architecture, its score threshold, the test set, CKPT
    weights: str
    model: torch.nn.Module  # the PyTorch model, with the weights
    onnx_file: str


def _random_weights(arch: str, cfg_file: str, opts: list[str]) -> tuple[torch.nn.Module, float]:
    """``arch``'s tiny model with random but non-trivial weights, and the score threshold to export it with: just
    above the blank image's best score (RT-DETR, which keeps its top-k whatever the image: the median score of the
    gate's first batch, so that the threshold drops some of them)."""
    cfg = load_cfg(cfg_file, [*opts, score_thresh_key(load_cfg(cfg_file, opts)), "0.0"])
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    batches = parity_batches(cfg)
    with torch.no_grad():
        if arch == "rtdetr":
            for head in model.decoder.box_heads:  # initialised to zero: the decoder would refine no box
                head.layers[-1].weight.normal_(0, 0.1)
                head.layers[-1].bias.normal_(0, 0.1)
            return model, torch.cat([d["scores"] for d in model(*batches[0])]).median().item()
    randomize_norms(model)
    for layer in ARCHS[arch].classifiers:
        rescale_layer_output(model, layer, batches[0])
    with torch.no_grad():
        return model, model(*batches[-1])[0]["scores"].max().item() + 1e-3


class Exports(dict):
    """Each architecture exported to ONNX when a test first asks for it (~20 s of CPU each)."""

    def __init__(self, root, shapes_root: str) -> None:
        super().__init__()
        self.root = root
        self.data = ["DATA.CUSTOM", custom_datasets(("openvino_val", f"{shapes_root}/annotations/val.json",
                                                     f"{shapes_root}/val")),
                     "TEST.DATASETS", "('openvino_val',)", "CKPT", str(root / "ckpt")]

    def __missing__(self, arch: str) -> Export:
        cfg_file = os.path.join(CFGS, "shapes", ARCHS[arch].config)
        opts = [*ARCHS[arch].opts, *self.data]
        model, threshold = _random_weights(arch, cfg_file, opts)
        opts += [score_thresh_key(load_cfg(cfg_file, opts)), f"{threshold:.6f}"]
        weights = str(self.root / f"{arch}.pth")
        torch.save(model.state_dict(), weights)
        cfg = load_cfg(cfg_file, opts)
        model = build_model(cfg).eval()  # with the threshold the graph computes with
        model.load_state_dict(torch.load(weights, weights_only=True))
        onnx_file = str(self.root / arch / "model.onnx")
        os.makedirs(os.path.dirname(onnx_file))
        with torch.no_grad():
            labels = model_label_space(cfg, None, weights).to_list()  # as tools/export.py records them
            export_onnx(model, parity_batches(cfg)[0], onnx_file,
                        {WEIGHTS_SHA256_KEY: file_sha256(weights), ONNX_METADATA_KEY: json.dumps(labels)})
        self[arch] = Export(cfg_file, opts, weights, model, onnx_file)
        return self[arch]


@pytest.fixture(scope="module")
def exports(tmp_path_factory, shapes_root) -> Exports:
    return Exports(tmp_path_factory.mktemp("openvino"), shapes_root)


def _dynamic_dims(model: OpenVinoModel) -> list[list[bool]]:
    """Which dimensions of each input of the compiled model are dynamic."""
    return [[dim.is_dynamic for dim in port.get_partial_shape()] for port in model.compiled.inputs]


@pytest.mark.parametrize("arch", [arch if arch == "faster_rcnn" else pytest.param(arch, marks=pytest.mark.slow)
                                  for arch in ARCHS])
def test_openvino_ir_gives_the_pytorch_detections_within_the_gates_tolerances(exports, shapes_root, tmp_path, arch):
    """The IR, compiled once with a dynamic batch and sides, on the gate's batches (two images, one with a blank,
    the blank alone) and two more images at another size: the gate's pairing and tolerances hold, with masks and
    keypoints compared where the model has them, and the export's threshold read back from the IR."""
    export = exports[arch]
    xml = save_openvino(export.onnx_file, str(tmp_path / "model.xml"))
    model = OpenVinoModel(xml)
    assert _dynamic_dims(model) == [[True, False, True, True], [True, False]]
    assert model.score_thresh == pytest.approx(export.model.score_thresh, abs=1e-6)
    cfg = load_cfg(export.cfg_file, export.opts)
    batches = [*parity_batches(cfg), shapes_val_batch(cfg, shapes_root, [4, 5], scale=0.7)]
    report = check_parity(export.model, model, batches)
    assert report.images == 7 and report.detections > 0, report.summary()
    assert report.box_fraction <= 1e-3 and report.score <= 1e-4
    assert (report.mask_iou is not None) == (arch == "mask_rcnn") and (report.mask_iou or 1.0) >= 0.99
    assert (report.keypoint_px is not None) == (arch == "keypoint_rcnn")


def _check_and_convert(export: Export, output) -> list[object]:
    """tools/export.py's command line that checks the export at ``output`` and writes its IR beside it."""
    return ["--cfg", export.cfg_file, "--weights", export.weights, "--output", output, "--check-only", "--openvino",
            *export.opts]


def _ir_files(folder) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name != "model.onnx")


def test_tools_export_writes_the_ir_beside_the_onnx_file_after_its_gate(exports, tmp_path, monkeypatch, capsys):
    """--check-only --openvino on an export: both gates pass, and model.xml + model.bin appear beside model.onnx,
    carrying the export's record of its weights and label space (what --backend openvino and predict read) and of
    the export it was made from (what --backend auto checks)."""
    export = exports["faster_rcnn"]
    output = tmp_path / "model.onnx"
    shutil.copyfile(export.onnx_file, output)
    run = run_tool_in_process(monkeypatch, capsys, "export.py", *_check_and_convert(export, output))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "OpenVINO parity gate passed: 5 images" in run.stdout and f"Wrote {tmp_path / 'model.xml'}" in run.stdout
    assert _ir_files(tmp_path) == ["model.bin", "model.xml"] and openvino_path(str(output)) == str(tmp_path /
                                                                                                   "model.xml")
    ir = OpenVinoModel(str(tmp_path / "model.xml"))
    assert ir.metadata[WEIGHTS_SHA256_KEY] == file_sha256(export.weights)
    assert ir.metadata[FLOAT_SHA256_KEY] == file_sha256(str(output))  # --backend auto: made from this very export
    assert [entry["name"] for entry in json.loads(ir.metadata[ONNX_METADATA_KEY])] == SHAPES


def _moved_boxes(monkeypatch, px: float) -> None:
    """OpenVINO's graph outputs with every box moved by ``px`` (a broken runtime or conversion)."""
    run_graph = OpenVinoModel.run_graph

    def moved(self, inputs):
        outputs = run_graph(self, inputs)
        boxes = self.output_names.index("boxes")
        outputs[boxes] = outputs[boxes] + px
        return outputs

    monkeypatch.setattr(OpenVinoModel, "run_graph", moved)


@pytest.mark.parametrize("previous", [False, True])
def test_an_ir_failing_its_gate_leaves_nothing_under_its_names(exports, tmp_path, monkeypatch, capsys, previous):
    """OpenVINO's boxes moved by 2 px (the onnxruntime gate passes): one line naming the IR, exit status 2, and the
    folder as it was, a previous IR unchanged and no staged file."""
    export = exports["faster_rcnn"]
    output = tmp_path / "model.onnx"
    shutil.copyfile(export.onnx_file, output)
    if previous:
        (tmp_path / "model.xml").write_text("the previous xml")
        (tmp_path / "model.bin").write_text("the previous bin")
    _moved_boxes(monkeypatch, 2.0)
    status, stderr = run_tool_here(monkeypatch, capsys, "export.py", *_check_and_convert(export, output))
    xml = tmp_path / "model.xml"
    assert status == 2 and len(stderr.strip().splitlines()) == 1
    assert stderr.startswith(f"Error: {xml} disagrees with the PyTorch model") and f"not written to {xml}" in stderr
    assert ("the previous IR there is unchanged" in stderr) == previous
    if previous:
        assert _ir_files(tmp_path) == ["model.bin", "model.xml"]
        assert (xml.read_text(), (tmp_path / "model.bin").read_text()) == ("the previous xml", "the previous bin")
    else:
        assert _ir_files(tmp_path) == []


def test_test_net_and_predict_run_the_ir_end_to_end(exports, shapes_root, tmp_path, monkeypatch, capsys):
    """test_net --backend openvino gives the float32 PyTorch run's metrics through the same loop and evaluator;
    predict --backend openvino writes its CSV with the class names the IR records (here: the test set's)."""
    export = exports["faster_rcnn"]
    xml = save_openvino(export.onnx_file, str(tmp_path / "model.xml"))
    opts = [*export.opts, "TEST.WEIGHTS", export.weights, "TEST.IMS_PER_BATCH", "2", "DATA.NUM_WORKERS", "0",
            "TEST.NUM_WARMUP", "0", "TEST.AMP.ENABLED", "False"]
    reports = {}
    for backend, extra in (("pytorch", []), ("openvino", ["--model", xml])):
        status, stderr = run_tool_here(monkeypatch, capsys, "test_net.py", "--cfg", export.cfg_file, "--backend",
                                       backend, *extra, *opts, "CKPT", tmp_path / backend)
        assert status == 0, f"{backend}: {stderr[-3000:]}"
        reports[backend] = json.loads((tmp_path / backend / "test" / "metrics.json").read_text())
    assert reports["openvino"]["metrics"] == pytest.approx(reports["pytorch"]["metrics"], abs=1e-4, nan_ok=True)
    assert reports["openvino"]["metrics"]["bbox/AP"] >= 0 and reports["openvino"]["backend"] == "openvino"
    status, stderr = run_tool_here(monkeypatch, capsys, "predict.py", "--cfg", export.cfg_file, "--input",
                                   f"{shapes_root}/val", "--output", tmp_path / "predict", "--save", "csv",
                                   "--backend", "openvino", "--model", xml, *export.opts)
    assert status == 0, stderr[-3000:]
    with open(tmp_path / "predict" / "predictions.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and {row["name"] for row in rows} <= set(SHAPES)


def test_a_missing_or_unusable_ir_is_one_line(exports, tmp_path, monkeypatch, capsys):
    """No --model, a path that is not there, and an .xml without its .bin: each one line, exit status 2."""
    export = exports["faster_rcnn"]
    shutil.copyfile(save_openvino(export.onnx_file, str(tmp_path / "model.xml")), tmp_path / "alone.xml")
    run = ["--cfg", export.cfg_file, *export.opts, "CKPT", tmp_path / "ckpt"]
    cases = {
        (): "Error: --backend openvino needs --model FILE, an OpenVINO IR (.xml, beside its .bin) written by "
            "tools/export.py --openvino, or an ONNX file.",
        ("--model", tmp_path / "nothing.xml"): f"Error: Exported model not found for --backend openvino: "
                                               f"{tmp_path / 'nothing.xml'} (give --model FILE, an OpenVINO IR",
        ("--model", tmp_path / "alone.xml"): f"Error: Cannot load the OpenVINO model {tmp_path / 'alone.xml'}: Empty "
                                             "weights data in bin file or bin file cannot be found!",
    }
    for model, expected in cases.items():
        status, stderr = run_tool_here(monkeypatch, capsys, "test_net.py", "--backend", "openvino", *model, *run)
        assert status == 2 and len(stderr.strip().splitlines()) == 1, stderr[-2000:]
        assert stderr.startswith(expected), stderr


def test_without_openvino_the_backend_and_export_say_how_to_install_it(exports, tmp_path, monkeypatch, capsys):
    """openvino missing is one line naming the pip command: for the model, for test_net --backend openvino, and for
    tools/export.py --openvino before it builds the model."""
    export = exports["faster_rcnn"]
    xml = save_openvino(export.onnx_file, str(tmp_path / "model.xml"))
    monkeypatch.setitem(sys.modules, "openvino", None)  # what Python does with a package that is not installed
    line = 'openvino is not installed, and OpenVINO models run in it: pip install -e ".[openvino]"'
    with pytest.raises(PetError) as error:
        OpenVinoModel(xml)
    assert str(error.value) == line
    for tool, args in (("test_net.py", ["--backend", "openvino", "--model", xml, *export.opts]),
                       ("export.py", ["--openvino", "--output", tmp_path / "new.onnx"])):
        status, stderr = run_tool_here(monkeypatch, capsys, tool, "--cfg", export.cfg_file, *args, "CKPT",
                                       tmp_path / "nothing")
        assert (status, stderr.strip()) == (2, f"Error: {line}"), tool
    assert not os.path.exists(tmp_path / "new.onnx")


def test_test_time_augmentation_is_refused_for_openvino_as_for_onnxruntime():
    """TEST.AUG runs around the PyTorch model only: --backend openvino says so before loading anything."""
    cfg = load_cfg(os.path.join(CFGS, "shapes", "faster_rcnn_R-10-FPN.yaml"), ["TEST.AUG.ENABLED", "True"])
    with pytest.raises(ConfigError, match=r"PyTorch backend only, not onnxruntime or openvino \(here openvino\)"):
        load_inference_model(cfg, "openvino", "no-such-model.xml")


def test_an_output_named_like_the_ir_is_refused_before_the_model_is_built(tmp_path, monkeypatch, capsys):
    """--openvino writes model.xml beside --output: an --output ending in .xml would be overwritten by its own IR."""
    output = tmp_path / "model.xml"
    status, stderr = run_tool_here(monkeypatch, capsys, "export.py", "--cfg", os.path.join(
        CFGS, "shapes", ARCHS["faster_rcnn"].config), "--output", output, "--openvino", "CKPT", tmp_path / "nothing")
    assert status == 2 and stderr.strip() == (f"Error: --output {output} is where --openvino writes the IR of the "
                                              f"ONNX export; name the ONNX file to write, e.g. {tmp_path / 'model'}"
                                              ".onnx (the IR goes beside it).")
