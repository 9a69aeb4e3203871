"""OpenVINO as a deploy backend (pet/deploy/openvino_model.py, tools/export.py --openvino, --backend openvino): every
architecture that exports gives the PyTorch model's detections through OpenVINO's IR at the parity gate's
tolerances, tools/export.py writes the IR only once it passes that gate (a failing IR leaves nothing under its
names), test_net and predict run the IR, and a missing file or a missing openvino is one line.

Every architecture's IR is checked against the PyTorch model on that architecture's own export, in the test that
makes it (support.tiny_exports.assert_openvino_gives_the_pytorch_detections: tests/deploy/test_export.py,
test_rtdetr_export.py, tests/modeling/test_cascade_rcnn.py, test_keypoint_rcnn.py), so no model is exported twice
for it. The tests here need one export, tests/support/tiny_exports.py's tiny Faster R-CNN, the one test_export.py's
tests check (made once per session, for both files). The openvino extra is in the test extra, so these tests run
in CI; without it they are skipped.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import sys

import pytest

from pet.config import load_cfg
from pet.deploy.backend import FLOAT_SHA256_KEY, WEIGHTS_SHA256_KEY
from pet.deploy.openvino_model import OpenVinoModel, openvino_path, save_openvino
from pet.predict.labels import ONNX_METADATA_KEY
from pet.predict.loading import load_inference_model
from pet.utils.errors import ConfigError, PetError
from pet.utils.files import file_sha256
from support.helpers import CFGS, run_tool_here, run_tool_in_process, session_shared_folder
from support.tiny_exports import EXPORT_ARCHS, Export, Exports

# Pet imports openvino only where it runs a model: the skip can come after the imports.
pytest.importorskip("openvino", reason='the openvino extra is not installed (pip install -e ".[openvino]")')
SHAPES = ["circle", "rectangle", "triangle"]  # the shapes set's categories, the label space the exports record


@pytest.fixture(scope="module")
def exports(tmp_path_factory, shapes_root) -> Exports:
    """test_export.py's exports: Faster R-CNN's is made once per session, for both files."""
    return Exports(session_shared_folder(tmp_path_factory, "tiny_exports"), shapes_root,
                   tmp_path_factory.mktemp("openvino") / "ckpt")


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
    cfg_file = os.path.join(CFGS, "shapes", EXPORT_ARCHS["faster_rcnn"].config)
    status, stderr = run_tool_here(monkeypatch, capsys, "export.py", "--cfg", cfg_file, "--output", output,
                                   "--openvino", "CKPT", tmp_path / "nothing")
    assert status == 2 and stderr.strip() == (f"Error: --output {output} is where --openvino writes the IR of the "
                                              f"ONNX export; name the ONNX file to write, e.g. {tmp_path / 'model'}"
                                              ".onnx (the IR goes beside it).")
