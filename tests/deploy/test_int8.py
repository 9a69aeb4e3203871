"""int8 inference (pet/deploy/int8.py, tools/export.py --int8) and the choice of backend (pet/deploy/backend.py,
tools/test_net.py --backend auto).

The gate needs a model whose AP means something, without training one: a tiny Faster R-CNN with random weights (the
export tests' tiny model) detects on generated shapes images, and its most confident detections become the ground
truth of those images. The float model then scores close to 100 AP, and an int8 model scores what quantization
costs it. tools/export.py exports the model once; --check-only --int8 then quantizes that export twice:
calibrated on the training images (written, within the tolerance), and calibrated on blank images of the same names
and annotations (the damage: activations' ranges measured on nothing; the gate must refuse it). The tools run in
this process (support.helpers.run_tool_captured): a process each would add seconds of imports.

The backend choice is checked with the CPU's flags faked: the rule is a table of CPU classes, not a timing.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

import cv2
import numpy as np
import onnx
import pytest
import torch

from pet.config import load_cfg
from pet.data import DatasetMapper, collate_batch, read_image
from pet.deploy import backend as backend_module
from pet.deploy.backend import FLOAT_SHA256_KEY, WEIGHTS_SHA256_KEY, choose_backend, exported_models, int8_path
from pet.deploy.int8 import int8_image_sets, model_parts
from pet.deploy.openvino_model import OpenVinoModel
from pet.engine import precision as precision_module
from pet.engine.inference import inference_precision
from pet.engine.speed_probe import JsonCache, Timing
from pet.modeling import build_model
from pet.utils import cpu as cpu_module
from pet.utils.errors import DataError, PetError
from pet.utils.files import file_sha256
from support.helpers import CFGS, custom_datasets, run_tool_captured, run_tool_forked, run_tool_here
from support.tiny_models import TINY_TWO_STAGE, randomize_norms, rescale_layer_output

CFG = os.path.join(CFGS, "shapes", "faster_rcnn_R-10-FPN.yaml")
# The tiny Faster R-CNN at a small test size, one image a batch.
TINY_FASTER_RCNN = [*TINY_TWO_STAGE, "INPUT.MIN_SIZE_TEST", "160", "INPUT.MAX_SIZE_TEST", "214",
        "TEST.IMS_PER_BATCH", "1", "DATA.NUM_WORKERS", "0", "TEST.NUM_WARMUP", "0"]
# AP points. int8 costs this random model 2-15 AP on its own detections depending on the parts (random features are
# far more fragile than trained ones: the trained demo lost none, docs/benchmarks/cpu-inference.md); blank
# calibration costs ~95.
TOLERANCE = "20"
# The validation images: the AP gate's, and what test_net and predict run on.
GATE_IMAGES = 10
# OpenVINO's CPU plugin carries its own oneDNN, which ONEDNN_MAX_CPU_ISA caps too: under .ci/run's held-down SSE4.1
# (the numeric pass) it cannot compile the model ("bad combination"), and no CPU OpenVINO supports is that one. Its
# parts of this file run in the README's pass, on the real CPU.
OPENVINO_HERE = importlib.util.find_spec("openvino") is not None and not os.environ.get("ONEDNN_MAX_CPU_ISA")


def pseudo_labels(model: torch.nn.Module, cfg, root: str, split: str, out: str, per_image: int = 4) -> str:
    """A COCO file of ``split``'s images whose objects are ``model``'s detections above one score, the score that
    leaves ``per_image`` of them per image on average (one threshold for all images: an image's objects then all
    outscore every other image's non-objects, and the model's own AP is 100)."""
    with open(os.path.join(root, "annotations", f"{split}.json")) as f:
        data = json.load(f)
    mapper = DatasetMapper.from_config(cfg, is_train=False)
    found = []
    for entry in data["images"]:
        record = {"image_id": entry["id"], "boxes": np.zeros((0, 4), dtype=np.float32), "labels": []}
        image = read_image(os.path.join(root, split, entry["file_name"]))
        batch = collate_batch([mapper(record, image, np.random.default_rng(0))], cfg.INPUT.SIZE_DIVISIBILITY)
        with torch.no_grad():
            detections = model(*batch)[0]
        found += [(entry["id"], *d) for d in zip(detections["boxes"].tolist(), detections["labels"].tolist(),
                                                 detections["scores"].tolist())]
    threshold = sorted((score for *_, score in found), reverse=True)[per_image * len(data["images"])]
    annotations = [{"id": i + 1, "image_id": image_id, "category_id": label, "iscrowd": 0,
                    "bbox": [x0, y0, x1 - x0, y1 - y0], "area": (x1 - x0) * (y1 - y0)}
                   for i, (image_id, (x0, y0, x1, y1), label, score) in enumerate(found) if score > threshold]
    with open(out, "w") as f:
        json.dump({**data, "annotations": annotations}, f)
    return out


def blank_copies(image_dir: str, out: str) -> str:
    """``image_dir``'s images, same names and sizes, every pixel grey."""
    os.makedirs(out)
    for name in os.listdir(image_dir):
        height, width = cv2.imread(os.path.join(image_dir, name)).shape[:2]
        cv2.imwrite(os.path.join(out, name), np.full((height, width, 3), 127, np.uint8))
    return out


@dataclass
class Int8Runs:
    opts: list[str]  # the tiny model, its datasets, CKPT
    weights: str
    ckpt: str
    export: subprocess.CompletedProcess
    calibrated: subprocess.CompletedProcess  # --int8 --openvino calibrated on the training images
    damaged: subprocess.CompletedProcess  # --int8 calibrated on blank images
    damaged_output: str
    val_images: str


@pytest.fixture(scope="module")
def int8_runs(tmp_path_factory, shapes_set) -> Int8Runs:
    root = shapes_set(num_train=28, num_val=GATE_IMAGES)
    work = tmp_path_factory.mktemp("int8")
    ckpt = str(work / "ckpt")
    cfg = load_cfg(CFG, [*TINY_FASTER_RCNN, "MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.0"])
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    randomize_norms(model)
    mapper = DatasetMapper.from_config(cfg, is_train=False)
    image = read_image(os.path.join(root, "val", sorted(os.listdir(os.path.join(root, "val")))[0]))
    sample = mapper({"image_id": 1, "boxes": np.zeros((0, 4), dtype=np.float32), "labels": []}, image,
                    np.random.default_rng(0))
    rescale_layer_output(model, "roi_heads.box_predictor.cls_score",
                         collate_batch([sample], cfg.INPUT.SIZE_DIVISIBILITY))
    weights = str(work / "tiny.pth")
    torch.save(model.state_dict(), weights)
    labels = {split: pseudo_labels(model, cfg, root, split, str(work / f"{split}.json")) for split in ("train", "val")}
    blank = blank_copies(os.path.join(root, "train"), str(work / "blank"))
    datasets = custom_datasets(("int8_train", labels["train"], f"{root}/train"),
                               ("int8_val", labels["val"], f"{root}/val"),
                               ("int8_blank", labels["train"], blank))
    opts = [*TINY_FASTER_RCNN, "DATA.CUSTOM", datasets, "TRAIN.DATASETS", "('int8_train',)", "TEST.DATASETS",
            "('int8_val',)", "CKPT", ckpt]
    output = os.path.join(ckpt, "model.onnx")
    export = run_tool_captured("export.py", "--cfg", CFG, "--weights", weights, "--output", output, *opts)
    assert export.returncode == 0, export.stderr[-3000:]
    damaged_output = str(work / "damaged" / "model.onnx")
    os.makedirs(os.path.dirname(damaged_output))
    shutil.copy(output, damaged_output)
    int8 = ["--check-only", "--int8", "--calib", "8", "--int8-tolerance", TOLERANCE]
    calibrated = run_tool_captured("export.py", "--cfg", CFG, "--weights", weights, "--output", output, *int8,
                                   *(["--openvino"] if OPENVINO_HERE else []), *opts)
    damaged = run_tool_captured("export.py", "--cfg", CFG, "--weights", weights, "--output", damaged_output, *int8,
                                *opts, "TRAIN.DATASETS", "('int8_blank',)")
    return Int8Runs(opts, weights, ckpt, export, calibrated, damaged, damaged_output, f"{root}/val")


@pytest.mark.slow
def test_int8_calibrated_on_training_images_passes_its_gate_and_is_written(int8_runs):
    run = int8_runs.calibrated
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    path = int8_path(os.path.join(int8_runs.ckpt, "model.onnx"))
    assert "int8 gate passed: bbox AP" in run.stdout and os.path.isfile(path)
    meta = {p.key: p.value for p in onnx.load(path).metadata_props}
    gate = json.loads(meta["pet.int8.gate"])
    assert gate["images"] == GATE_IMAGES and gate["dataset"] == "int8_val" and gate["tolerance"] == float(TOLERANCE)
    assert gate["ap"]["float32"]["bbox"] - gate["ap"]["int8"]["bbox"] <= float(TOLERANCE)
    assert gate["ap"]["float32"]["bbox"] > 90  # the pseudo labels are the float model's own detections
    # What runs int8 is chosen on the selection images; this random model loses AP in some parts.
    assert set(meta["pet.int8.parts"].split(",")) <= {"backbone.body", "backbone.fpn", "rpn.head", "roi_heads.box_head"}
    assert meta["pet.int8.reduce_range"] == str(not cpu_module.cpu_int8_support().native)
    ops = {node.op_type for node in onnx.load(path).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear", "NonMaxSuppression", "RoiAlign"} <= ops


def _quantized_inputs(ir) -> set[str]:
    """The operations of the OpenVINO model ``ir`` that take an input through a FakeQuantize (run in int8). A
    ``ShapeOf`` reading a quantized tensor's shape computes nothing in int8 (and is OpenVINO's node, in no ONNX part),
    so it is not one of them."""
    return {target.get_node().get_friendly_name() for op in ir.get_ordered_ops() if op.get_type_name() == "FakeQuantize"
            for target in op.output(0).get_target_inputs() if target.get_node().get_type_name() != "ShapeOf"}


@pytest.mark.slow
def test_openvino_int8_by_nncf_passes_the_same_gate_and_keeps_the_float_parts_float(int8_runs):
    """--openvino --int8: NNCF's model is written beside the IR after the same AP gate (against the float export in
    OpenVINO), records the gate, the float export it came from and its weights, and quantizes no operation of the
    detector's float parts (the box predictor) or of post-processing."""
    if not OPENVINO_HERE:
        pytest.skip("OpenVINO is not installed, or its oneDNN is capped by ONEDNN_MAX_CPU_ISA (see OPENVINO_HERE)")
    import openvino  # the optional extra, checked just above

    run = int8_runs.calibrated
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    float_path = os.path.join(int8_runs.ckpt, "model.onnx")
    xml = int8_path(os.path.join(int8_runs.ckpt, "model.xml"))
    assert "OpenVINO int8 gate passed: bbox AP" in run.stdout and f"Wrote {xml}" in run.stdout
    assert os.path.isfile(xml) and os.path.isfile(xml.replace(".xml", ".bin"))
    model = OpenVinoModel(xml)
    gate = json.loads(model.metadata["pet.int8.gate"])
    assert gate["images"] == GATE_IMAGES and gate["dataset"] == "int8_val"
    assert gate["ap"]["float32"]["bbox"] > 90 and gate["ap"]["float32"]["bbox"] - gate["ap"]["int8"]["bbox"] <= 20
    assert model.metadata[FLOAT_SHA256_KEY] == file_sha256(float_path)
    assert model.metadata[WEIGHTS_SHA256_KEY] == file_sha256(int8_runs.weights)
    assert model.metadata["pet.int8.reduce_range"] == str(not cpu_module.cpu_int8_support().native)
    ir = openvino.Core().read_model(xml)
    quantized = _quantized_inputs(ir)
    parts = model_parts(onnx.load(float_path), op_types=None)
    chosen = model.metadata["pet.int8.parts"].split(",")
    assert quantized and quantized <= {name for part in chosen for name in parts[part]}
    every_part = {name for names in parts.values() for name in names}
    float_parts = [node.name for node in onnx.load(float_path).graph.node if node.name not in every_part]
    assert not quantized & set(float_parts) and "roi_heads.box_predictor" not in parts


@pytest.mark.slow
def test_the_gate_refuses_an_int8_model_calibrated_on_blank_images_with_one_line_and_exit_2(int8_runs):
    run = int8_runs.damaged
    assert run.returncode == 2, f"{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: int8 gate failed: bbox AP"), run.stderr[-2000:]
    assert "points below float32's" in lines[0] and f"(tolerance {TOLERANCE})" in lines[0]
    assert not os.path.exists(int8_path(int8_runs.damaged_output))
    assert not [name for name in os.listdir(os.path.dirname(int8_runs.damaged_output)) if name.startswith(".int8")]


def _backend_facts(line: str) -> tuple[str, ...]:
    """What a "--backend auto: ..." line chose: backend, file and precision."""
    return tuple(line.split("--backend auto: ", 1)[1].split(": ", 1)[0].replace(" in ", " ").split())


def test_auto_times_every_export_once_and_test_net_and_predict_run_its_choice(int8_runs, tmp_path):
    """test_net --backend auto times all the candidates here (PyTorch float32, bfloat16 where the CPU has it, the
    four exports), logs them and runs what it chose; predict then reuses that measurement (one machine, one choice).
    Both run as a user runs them, each in a process of its own on two threads (forked from the session's fork
    server, without a fresh interpreter's seconds of imports): the candidates' runtimes are not loaded into this
    process (OpenVINO's threads left in a pytest worker crashed a later test's video decoding there)."""
    opts = [*int8_runs.opts, "TEST.WEIGHTS", int8_runs.weights]
    available = exported_models(load_cfg(CFG, opts))
    assert set(available) == set(ALL) if OPENVINO_HERE else {"onnxruntime float32", "onnxruntime int8"}
    test_net = run_tool_forked("test_net.py", "--cfg", CFG, "--backend", "auto", *opts, "TEST.DIAGNOSTICS.ENABLED",
                               "False", threads=2, check=False)
    assert test_net.returncode == 0, f"{test_net.stdout[-2000:]}\n{test_net.stderr[-3000:]}"
    with open(os.path.join(int8_runs.ckpt, "log.txt")) as f:
        measured = next(line for line in f if "--backend auto: " in line)
    assert "(measured on this machine, a batch of 1" in measured  # (and "unsteady: ..." where it was)
    assert all(f" {name} " in measured for name in ["pytorch float32", *available])
    with open(os.path.join(int8_runs.ckpt, "test", "metrics.json")) as f:
        metrics = json.load(f)
    assert metrics["metrics"]["bbox/AP"] > 50
    assert (metrics["backend"], metrics["precision"]) == (_backend_facts(measured)[0], _backend_facts(measured)[-1])
    out = tmp_path / "predict"
    predict = run_tool_forked("predict.py", "--cfg", CFG, "--input", int8_runs.val_images, "--output", out, "--save",
                              "csv", "--backend", "auto", *opts, threads=2, check=False)
    assert predict.returncode == 0, f"{predict.stdout[-2000:]}\n{predict.stderr[-3000:]}"
    with open(out / "log.txt") as f:
        reused = next(line for line in f if "--backend auto: " in line)
    assert _backend_facts(reused) == _backend_facts(measured) and "measured earlier on this machine, reused" in reused
    with open(out / "predictions.csv") as f:
        assert len(f.read().splitlines()) > GATE_IMAGES  # the header and detections on every gate image


def test_an_int8_model_is_offered_only_beside_the_float_export_it_was_quantized_from(int8_runs, tmp_path):
    """The int8 model computes with the thresholds of the export it was quantized from. Re-exporting model.onnx (here
    with another score threshold, made from the first) leaves it beside the new export, recording the same weights:
    --backend auto passes it over, saying why. Alone in CKPT (nothing newer contradicts it) it is offered, the log
    saying it is unchecked."""
    float_path = os.path.join(int8_runs.ckpt, "model.onnx")
    opts = [*int8_runs.opts, "TEST.WEIGHTS", int8_runs.weights]
    assert {name: path for name, path in exported_models(load_cfg(CFG, opts)).items() if "onnxruntime" in name} == {
        "onnxruntime float32": float_path, "onnxruntime int8": int8_path(float_path)}
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(int8_path(float_path), ckpt)
    cfg = load_cfg(CFG, [*opts, "CKPT", str(ckpt)])
    passed_over: list[str] = []
    assert exported_models(cfg, passed_over) == {"onnxruntime int8": str(ckpt / "model.int8.onnx")}
    assert passed_over == [f"{ckpt / 'model.int8.onnx'} offered unchecked: {ckpt / 'model.onnx'}, the float export it "
                           "must have been made from, is not there to show that it computes with that export's "
                           "thresholds"]
    # Exported again: another float export of the same weights (tools/export.py records them, test_export checks).
    # Made from the first by changing its recorded score threshold, which changes its bytes as an export with
    # another threshold does: that is all the choice reads, and a real export would cost ~25 s of CPU.
    again = onnx.load(float_path)
    next(p for p in again.metadata_props if p.key == "pet.score_thresh").value = "0.5"
    onnx.save(again, str(ckpt / "model.onnx"))
    passed_over = []
    assert exported_models(cfg, passed_over) == {"onnxruntime float32": str(ckpt / "model.onnx")}
    assert len(passed_over) == 1 and passed_over[0].startswith(
        f"{ckpt / 'model.int8.onnx'} passed over: it was made from an earlier export than {ckpt / 'model.onnx'}")


def test_with_a_checkpoint_out_dir_test_net_export_and_auto_take_the_final_weights_there(tmp_path, monkeypatch,
                                                                                            capsys):
    """Training writes model_final.pth to HOOKS.CHECKPOINT.OUT_DIR when set: that is the default weights of all
    three (one helper), not CKPT/model_final.pth."""
    ckpt, out_dir = tmp_path / "ckpt", tmp_path / "weights"
    ckpt.mkdir()
    opts = ["CKPT", str(ckpt), "HOOKS.CHECKPOINT.OUT_DIR", str(out_dir)]
    for tool in ("test_net.py", "export.py"):  # nothing trained yet: each names where it looked
        status, stderr = run_tool_here(monkeypatch, capsys, tool, "--cfg", CFG, *opts)
        assert status == 2 and f"Weights file not found: {out_dir / 'model_final.pth'} " in stderr, tool
    out_dir.mkdir()
    (out_dir / "model_final.pth").write_bytes(b"the final weights")
    _export_recording(ckpt / "model.onnx", file_sha256(str(out_dir / "model_final.pth")))
    assert exported_models(load_cfg(CFG, opts)) == {"onnxruntime float32": str(ckpt / "model.onnx")}


def test_without_onnxruntime_the_int8_module_says_how_to_install_it(monkeypatch):
    for name in [name for name in sys.modules if name == "onnxruntime" or name.startswith("onnxruntime.")]:
        monkeypatch.setitem(sys.modules, name, None)  # what Python does with a package that is not installed
    monkeypatch.delitem(sys.modules, "pet.deploy.int8")
    with pytest.raises(PetError, match=r'is not installed, and int8 quantization needs it: pip install -e "\.\[export'):
        importlib.import_module("pet.deploy.int8")


def test_the_three_image_sets_are_disjoint_even_when_training_and_test_sets_are_one(shapes_root):
    one = custom_datasets(("int8_one", f"{shapes_root}/annotations/val.json", f"{shapes_root}/val"))
    cfg = load_cfg(CFG, ["DATA.CUSTOM", one, "TRAIN.DATASETS", "('int8_one',)", "TEST.DATASETS", "('int8_one',)"])
    sets = int8_image_sets(cfg, calibration=2, selection=10, gate=2)  # 6 images: 2 gate, 2 calibration, 2 left
    files = {name: {r["file_name"] for r in getattr(sets, name)} for name in ("calibration", "selection", "gate")}
    assert [len(f) for f in files.values()] == [2, 2, 2]
    assert not files["calibration"] & files["selection"]
    assert not files["gate"] & (files["calibration"] | files["selection"])
    with pytest.raises(DataError, match="has only 4 that are not test images"):
        int8_image_sets(cfg, calibration=4, selection=1, gate=2)


# ------------------------------------------------------------------------------------------------ the choice
# CPU classes as torch's CPUID reader reports them (lower-case flags) and the capability torch's kernels use.
ZEN4 = ({"avx512_bf16": True, "avx512_vnni": True, "avx_vnni": True}, "AVX512")  # bfloat16 and VNNI
HASWELL = ({}, "AVX2")  # neither
ALL = ("onnxruntime float32", "onnxruntime int8", "openvino float32", "openvino int8")


def fake_cpu(monkeypatch, cpu: tuple[dict[str, bool], str]) -> None:
    """This process sees the CPU class ``cpu`` (flags, capability), with no instruction-set cap in force."""
    flags, capability = cpu
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cpu_module, "_cpu_flags", lambda: {"avx2": True, **flags})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)


class FakeTimer:
    """backend.measure_candidates replaced: each candidate "takes" the milliseconds per image in ``ms`` (a batch of
    one image); ``calls`` records the candidates it was asked to time, call by call."""

    def __init__(self, monkeypatch, ms: dict[str, float]) -> None:
        self.ms, self.calls = ms, []
        monkeypatch.setattr(backend_module, "measure_candidates", self)

    def __call__(self, cfg, candidates, model=None):
        self.calls.append([c.name for c in candidates])
        return {c.name: Timing(self.ms[c.name] / 1000, 3, 0.01) for c in candidates}, 1


def fake_exports(tmp_path, names=ALL) -> tuple[list[str], dict[str, str]]:
    """A CKPT with weights and files standing for the exports ``names`` (the choice reads their bytes' sha256 only:
    what they are is exported_models' business); the config's opts and ``{name: path}``."""
    (tmp_path / "model_final.pth").write_bytes(b"weights")
    files = {name: tmp_path / f"{name.replace(' ', '_')}.bin" for name in names}
    for name, path in files.items():
        path.write_bytes(name.encode())
    return ["CKPT", str(tmp_path), "DEVICE", "cpu"], {name: str(path) for name, path in files.items()}


@pytest.mark.parametrize("cpu, ms, opts, expected", [
    # An int8 model 2x faster than the fastest float32 one: taken.
    (ZEN4, {"pytorch float32": 20, "pytorch bfloat16": 12, "onnxruntime float32": 10, "onnxruntime int8": 6,
            "openvino float32": 8, "openvino int8": 4}, [], ("openvino", "openvino int8", "int8")),
    # Only 1.1x faster (below speed_probe.MARGIN): the fastest float32 one, which the parity gate made equal.
    (ZEN4, {"pytorch float32": 20, "pytorch bfloat16": 12, "onnxruntime float32": 10, "onnxruntime int8": 7.5,
            "openvino float32": 8, "openvino int8": 7.3}, [], ("openvino", "openvino float32", "float32")),
    # PyTorch bfloat16 fastest by far (a CPU with AMX): PyTorch, told to compute in bfloat16.
    (ZEN4, {"pytorch float32": 20, "pytorch bfloat16": 5, "onnxruntime float32": 10, "onnxruntime int8": 9,
            "openvino float32": 8, "openvino int8": 7}, [], ("pytorch", "", "bfloat16")),
    # TEST.AMP.ENABLED False: bfloat16 is no candidate, however fast it would be.
    (ZEN4, {"pytorch float32": 20, "onnxruntime float32": 10, "onnxruntime int8": 9, "openvino float32": 8,
            "openvino int8": 7.5}, ["TEST.AMP.ENABLED", "False"], ("openvino", "openvino float32", "float32")),
    # No bfloat16 instructions: no bfloat16 candidate; PyTorch float32 can win too.
    (HASWELL, {"pytorch float32": 5, "onnxruntime float32": 10, "onnxruntime int8": 9, "openvino float32": 8,
               "openvino int8": 7}, [], ("pytorch", "", "float32")),
])
def test_auto_times_every_candidate_and_takes_the_fastest(monkeypatch, tmp_path, cpu, ms, opts, expected):
    fake_cpu(monkeypatch, cpu)
    timer = FakeTimer(monkeypatch, ms)
    base, available = fake_exports(tmp_path)
    cfg = load_cfg(CFG, [*base, *opts])
    choice = choose_backend(cfg, available, cache=JsonCache("backend.json", str(tmp_path / "cache")))
    assert timer.calls == [list(ms)]  # every candidate, PyTorch first
    backend, model, precision = expected
    assert (choice.backend, choice.model, choice.precision) == (backend, available.get(model, ""), precision)
    assert choice.opts == (("TEST.AMP.ENABLED", "True", "TEST.AMP.DTYPE", "bfloat16") if precision == "bfloat16"
                           else ("TEST.AMP.ENABLED", "False"))
    fastest = min(ms, key=ms.get)
    assert f"ms/image {fastest} {ms[fastest]:.1f}, " in choice.reason
    assert "(measured on this machine, a batch of 1): the fastest float32 candidate" in choice.reason


def test_auto_reuses_its_measurement_until_a_candidate_file_changes(monkeypatch, tmp_path):
    fake_cpu(monkeypatch, ZEN4)
    timer = FakeTimer(monkeypatch, {"pytorch float32": 20, "pytorch bfloat16": 12, "onnxruntime float32": 10,
                                    "openvino float32": 8})
    base, available = fake_exports(tmp_path, ("onnxruntime float32", "openvino float32"))
    cfg = load_cfg(CFG, base)
    cache = JsonCache("backend.json", str(tmp_path / "cache"))
    first = choose_backend(cfg, available, cache=cache)
    again = choose_backend(cfg, available, cache=cache)
    assert len(timer.calls) == 1 and (again.backend, again.model) == (first.backend, first.model) == (
        "openvino", available["openvino float32"])
    assert f"measured earlier on this machine, reused from {cache.path} (delete it to measure again)" in again.reason
    with open(available["openvino float32"], "ab") as f:  # exported again: another file, measured again
        f.write(b" again")
    choose_backend(cfg, available, cache=cache)
    assert len(timer.calls) == 2


def test_without_an_export_auto_leaves_the_precision_to_pytorchs_own_decision(monkeypatch, tmp_path, caplog):
    """Nothing to time PyTorch against: TEST.AMP decides as in any run (here forced to bfloat16 on a CPU that would
    emulate it): the choice warns about nothing, the PyTorch run warns once when it starts."""
    fake_cpu(monkeypatch, HASWELL)
    timer = FakeTimer(monkeypatch, {})
    monkeypatch.setattr(precision_module, "_warned", set())
    cfg = load_cfg(CFG, ["DEVICE", "cpu", "TEST.AMP.ENABLED", "True", "CKPT", str(tmp_path)])
    with caplog.at_level(logging.WARNING, logger="pet"):
        choice = choose_backend(cfg, {})
        assert not caplog.records and not timer.calls
        assert (choice.backend, choice.precision, choice.opts) == ("pytorch", "bfloat16", ())
        assert "no export of these weights to measure it against" in choice.reason
        assert inference_precision(cfg, build_model(cfg)).name == "bfloat16"  # the PyTorch run's own decision
    assert len(caplog.records) == 1 and caplog.records[0].getMessage().startswith(
        "TEST.AMP.ENABLED True asks for bfloat16 autocast, which this CPU does not run natively")


def test_an_int8_model_with_8_bit_weights_is_passed_over_on_a_cpu_without_vnni(monkeypatch, tmp_path):
    """Quantized on a VNNI machine (8-bit weights), an int8 model's u8 x s8 products can saturate on AVX2's
    VPMADDUBSW: not offered there, and the reason says to quantize on this machine (7-bit weights)."""
    (tmp_path / "model_final.pth").write_bytes(b"weights")
    sha = file_sha256(str(tmp_path / "model_final.pth"))
    _export_recording(tmp_path / "model.onnx", sha)
    float_sha = file_sha256(str(tmp_path / "model.onnx"))
    _export_recording(tmp_path / "model.int8.onnx", sha, **{FLOAT_SHA256_KEY: float_sha,
                                                             "pet.int8.reduce_range": "False"})
    cfg = load_cfg(CFG, ["CKPT", str(tmp_path)])
    fake_cpu(monkeypatch, ZEN4)
    assert exported_models(cfg) == {"onnxruntime float32": str(tmp_path / "model.onnx"),
                                    "onnxruntime int8": str(tmp_path / "model.int8.onnx")}
    fake_cpu(monkeypatch, HASWELL)
    passed_over: list[str] = []
    assert exported_models(cfg, passed_over) == {"onnxruntime float32": str(tmp_path / "model.onnx")}
    assert passed_over == [f"{tmp_path / 'model.int8.onnx'} passed over: it was quantized with 8-bit weights for a "
                           "CPU with VNNI, and this CPU has none (its int8 products could saturate); quantize it on "
                           "this machine (tools/export.py --int8 writes 7-bit weights where there is no VNNI)"]
    _export_recording(tmp_path / "model.int8.onnx", sha, **{FLOAT_SHA256_KEY: float_sha,
                                                             "pet.int8.reduce_range": "True"})
    assert exported_models(cfg) == {"onnxruntime float32": str(tmp_path / "model.onnx"),
                                    "onnxruntime int8": str(tmp_path / "model.int8.onnx")}


def _export_recording(path, sha256: str | None, **metadata: str) -> None:
    """A minimal ONNX file (one Identity node) holding what tools/export.py records of its weights, if anything, and
    ``metadata``."""
    io = [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [1]) for name in ("x", "y")]
    model = onnx.helper.make_model(onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "g",
                                                          io[:1], io[1:]))
    for key, value in {**({WEIGHTS_SHA256_KEY: sha256} if sha256 is not None else {}), **metadata}.items():
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(path))


def test_only_exports_of_the_weights_evaluated_are_offered_and_the_others_say_why(tmp_path):
    """An export of model_iter2.pth is not the final weights' even when written after them; one without the record
    (older than it) is not offered either. The choice's reason names both."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model_iter2.pth").write_bytes(b"iteration 2")
    (ckpt / "model_final.pth").write_bytes(b"iteration 4")
    _export_recording(ckpt / "model.onnx", file_sha256(str(ckpt / "model_iter2.pth")))
    _export_recording(ckpt / "model.int8.onnx", None)
    cfg = load_cfg(CFG, ["CKPT", str(ckpt), "DEVICE", "cpu", "TEST.AMP.ENABLED", "False"])
    passed_over: list[str] = []
    assert exported_models(cfg, passed_over) == {}
    choice = choose_backend(cfg, {}, passed_over)
    assert (choice.backend, choice.precision) == ("pytorch", "float32")
    assert f"{ckpt / 'model.onnx'} passed over: it was exported from other weights than {ckpt / 'model_final.pth'}" \
           in choice.reason
    assert f"{ckpt / 'model.int8.onnx'} passed over: it does not record the weights it was exported" in choice.reason
    iter2 = ["TEST.WEIGHTS", str(ckpt / "model_iter2.pth")]
    assert exported_models(load_cfg(CFG, ["CKPT", str(ckpt), *iter2])) == {"onnxruntime float32": str(ckpt /
                                                                                                      "model.onnx")}
    assert exported_models(load_cfg(CFG, ["CKPT", str(tmp_path / "nothing")])) == {}

