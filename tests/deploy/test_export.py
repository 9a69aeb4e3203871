"""ONNX export (pet/deploy, tools/export.py): each detector exports with a dynamic batch, height and width and its
post-processing inside; onnxruntime then gives the PyTorch model's detections, a blank image gives none, the parity
gate rejects a perturbed graph, and a module that cannot be exported is named with its operation.

The models are tests/support/tiny_exports.py's tiny detectors with random weights. The four exports run through
tools/export.py (export, then its own parity gate) in this process, once for the session (Faster R-CNN's serves
test_openvino.py too): most of an export's CPU goes to torch.export and the ONNX conversion, and a process each would
add seconds of imports. OpenVINO's IR of each export is checked here too (the IR tests that need one export are
tests/deploy/test_openvino.py's), as each other exporting architecture's test checks its own export.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import onnx
import pytest
import torch

from pet.config import load_cfg
from pet.data import DatasetMapper, collate_batch
from pet.deploy import onnx as onnx_module
from pet.deploy.backend import WEIGHTS_SHA256_KEY
from pet.deploy.onnx import ExportError, export_onnx, to_onnx
from pet.deploy.onnxruntime_model import OnnxRuntimeModel
from pet.deploy.parity import ParityError, check_parity, parity_batches
from pet.modeling.preprocess import image_sizes
from pet.modeling.registry import ROI_BOX_HEAD_REGISTRY
from pet.modeling.roi_heads import TwoMLPHead
from pet.utils.errors import PetError
from pet.utils.files import file_sha256
from support.against_reference import Tolerance, detection_tensors, match_detections
from support.helpers import CFGS, run_tool_captured, run_tool_here, session_shared_folder
from support.tiny_exports import EXPORT_ARCHS, Exports, assert_openvino_gives_the_pytorch_detections, pytorch_model
from support.tiny_models import shapes_val_batch


@pytest.fixture(scope="module")
def exports(tmp_path_factory, shapes_root) -> Exports:
    """Every architecture exported by tools/export.py (each when a test first asks for it, once per session:
    test_openvino.py's tests use the same Faster R-CNN export)."""
    return Exports(session_shared_folder(tmp_path_factory, "tiny_exports"), shapes_root,
                   tmp_path_factory.mktemp("export") / "ckpt")


@pytest.mark.slow
def test_tools_export_writes_a_graph_with_dynamic_batch_and_size_and_its_parity_gate_passes(exports):
    for arch, export in exports.items():
        assert export.run.returncode == 0, f"{arch}:\n{export.run.stdout[-2000:]}\n{export.run.stderr[-3000:]}"
        assert "Parity gate passed" in export.run.stdout and "largest differences" in export.run.stdout
        images = onnx.load(export.onnx_file).graph.input[0]
        dims = images.type.tensor_type.shape.dim
        assert [bool(dims[i].dim_param) for i in range(4)] == [True, False, True, True], arch
        metadata = {p.key: p.value for p in onnx.load(export.onnx_file).metadata_props}
        assert metadata[WEIGHTS_SHA256_KEY] == file_sha256(export.weights), arch  # --backend auto matches on it


# Numeric for Faster R-CNN only: each architecture is one more export (~25 s of CPU) in the numeric pass.
@pytest.mark.slow
@pytest.mark.parametrize("arch", [pytest.param(arch, marks=pytest.mark.numeric) if arch == "faster_rcnn" else arch
                                  for arch in EXPORT_ARCHS])
def test_onnxruntime_gives_the_pytorch_detections_at_two_sizes_in_batches_of_two(exports, shapes_root, arch):
    export = exports[arch]
    cfg = load_cfg(export.cfg_file, export.opts)
    batches = [shapes_val_batch(cfg, shapes_root, [2, 3]), shapes_val_batch(cfg, shapes_root, [4, 5], scale=0.7)]
    assert batches[0][0].shape[0] == 2 and batches[0][0].shape[-2:] != batches[1][0].shape[-2:]
    report = check_parity(export.model, OnnxRuntimeModel(export.onnx_file), batches)
    assert report.images == 4 and report.detections > 0
    assert report.box_fraction <= 1e-3 and report.score <= 1e-4
    assert (report.mask_iou is not None) == (arch == "mask_rcnn") and (report.mask_iou or 1.0) >= 0.99


@pytest.mark.slow
@pytest.mark.parametrize("arch", EXPORT_ARCHS)
def test_openvino_ir_gives_the_pytorch_detections_within_the_gates_tolerances(exports, shapes_root, tmp_path, arch):
    export = exports[arch]
    assert_openvino_gives_the_pytorch_detections(export.model, export.onnx_file, load_cfg(export.cfg_file, export.opts),
                                                 shapes_root, str(tmp_path), masks=arch == "mask_rcnn")


class _Shifted:
    """An ONNX model whose boxes move by ``box`` x the image's longer side and whose scores move by ``score``."""

    def __init__(self, onnx_model: OnnxRuntimeModel, box: float = 0.0, score: float = 0.0) -> None:
        self.onnx_model, self.box, self.score, self.path = onnx_model, box, score, onnx_model.path

    def network_detections(self, images, targets):
        detections = self.onnx_model.network_detections(images, targets)
        for detection, size in zip(detections, image_sizes(targets)):
            # In the network input's pixels: scaled to the original image, the shift is box x its longer side.
            detection["boxes"] = detection["boxes"] + self.box * max(size)
            detection["scores"] = detection["scores"] + self.score
        return detections


# The gate's tolerances as docs/deploy.md states them (box: a fraction of the image's longer side; score: absolute).
STATED_TOLERANCE = {"box": 1e-3, "score": 1e-4}


@pytest.mark.numeric
@pytest.mark.parametrize("factor, passes", [(0.9, True), (1.1, False)])
@pytest.mark.parametrize("what", ["box", "score"])
def test_the_gate_holds_its_stated_box_and_score_tolerances(exports, shapes_root, what, factor, passes):
    """Every box (or score) moved by 0.9x the stated tolerance passes, by 1.1x fails: a tolerance loosened or
    tightened by more than 10% fails one of the two. The export's own differences are under a tenth of the
    tolerance (checked first), so whatever their sign they cannot carry a shift across it."""
    export = exports["faster_rcnn"]
    batches = [shapes_val_batch(load_cfg(export.cfg_file, export.opts), shapes_root, [2, 3])]
    onnx_model = OnnxRuntimeModel(export.onnx_file)
    unshifted = check_parity(export.model, onnx_model, batches)
    assert unshifted.detections > 0
    assert {"box": unshifted.box_fraction, "score": unshifted.score}[what] < 0.1 * STATED_TOLERANCE[what]
    shifted = _Shifted(onnx_model, **{what: factor * STATED_TOLERANCE[what]})
    if passes:
        assert check_parity(export.model, shifted, batches).detections == unshifted.detections
    else:
        with pytest.raises(ParityError, match="disagrees with the PyTorch model"):
            check_parity(export.model, shifted, batches)


class _Fixed(torch.nn.Module):
    """A detector giving fixed detections (in the network input's pixels, the original image's here), with the
    score threshold and per-image cap the gate reads."""

    score_thresh, detections_per_img = 0.5, 100

    def __init__(self, detections: list[dict[str, torch.Tensor]]) -> None:
        super().__init__()
        self.detections = detections

    def forward(self, images, targets):
        return [dict(d) for d in self.detections]

    def network_detections(self, images, targets):  # as OnnxRuntimeModel's
        return self(images, targets)


def _detections(*rows: tuple[float, float]) -> dict[str, torch.Tensor]:
    """(x0, score) rows: 20 px boxes of label 1 along a row, by decreasing score."""
    return {"boxes": torch.tensor([[x0, 10.0, x0 + 20, 30.0] for x0, _ in rows]).reshape(-1, 4),
            "scores": torch.tensor([score for _, score in rows]), "labels": torch.ones(len(rows), dtype=torch.int64)}


@pytest.mark.parametrize("pytorch, onnxruntime, problem", [
    # A detection scoring within the score tolerance of the threshold, kept by one side alone: a near-tie.
    ([(0, 0.9), (40, 0.50004)], [(0, 0.9)], None),
    ([(0, 0.9)], [(0, 0.9), (40, 0.49996)], None),
    # Anything else one side alone keeps is a disagreement, whichever side it is.
    ([(0, 0.9), (40, 0.7)], [(0, 0.9)], "detection 1 .* has no onnxruntime counterpart"),
    ([(0, 0.9)], [(0, 0.9), (40, 0.7)], r"onnxruntime's detection 1 .* has no PyTorch counterpart \(1 detections "
                                        r"in PyTorch, 2 in onnxruntime\)"),
    ([(0, 0.9), (40, 0.50004)], [(0, 0.9), (40, 0.50004), (80, 0.50102)], "has no PyTorch counterpart"),
])
def test_a_detection_only_one_side_keeps_passes_only_as_a_near_tie_at_the_threshold(pytorch, onnxruntime, problem):
    """The gate's counts may differ where a score lies within rounding of the threshold (which side keeps it
    depends on the CPU's kernels), and only there."""
    batch = (torch.zeros(1, 3, 64, 128, dtype=torch.uint8),
             [{"image_id": 1, "image_size": (64, 128), "orig_size": (64, 128)}])
    model, exported = _Fixed([_detections(*pytorch)]), _Fixed([_detections(*onnxruntime)])
    exported.path = "model.onnx"
    if problem is None:
        assert check_parity(model, exported, [batch]).detections == len(pytorch)
    else:
        with pytest.raises(ParityError, match=problem):
            check_parity(model, exported, [batch])


def test_the_gate_runs_two_images_one_image_and_a_blank_image(exports):
    """The batches docs/deploy.md names: test images of several sizes and a blank one, in batches of 2 and 1; and
    tools/export.py compares on all of them (5 images in its report, for every architecture)."""
    export = exports["faster_rcnn"]
    batches = parity_batches(load_cfg(export.cfg_file, export.opts))
    assert [len(targets) for _, targets in batches] == [2, 2, 1]
    sizes = [size for _, targets in batches for size in image_sizes(targets)]
    assert len(set(sizes)) >= 3
    # The blank image alone in a batch, and beside an image with shapes in another.
    assert [_flat(*batch) for batch in batches] == [[False, False], [False, True], [True]]
    for arch, other in exports.items():
        assert "Parity gate passed: 5 images" in other.run.stdout, arch


def _flat(images: torch.Tensor, targets: list[dict]) -> list[bool]:
    """Whether each image of a batch is one flat colour (its padding left out)."""
    return [bool((images[i, :, :h, :w] == images[i, :, :1, :1]).all()) for i, (h, w) in enumerate(image_sizes(targets))]


@pytest.mark.parametrize("arch", EXPORT_ARCHS)
def test_a_blank_image_yields_zero_detections_without_error(exports, arch):
    export = exports[arch]
    cfg = load_cfg(export.cfg_file, export.opts)
    mapper = DatasetMapper.from_config(cfg, is_train=False)
    blank = mapper({"image_id": 1, "boxes": np.zeros((0, 4), dtype=np.float32), "labels": []},
                   np.full((200, 240, 3), 127, dtype=np.uint8), np.random.default_rng(0))
    images, targets = collate_batch([blank], cfg.INPUT.SIZE_DIVISIBILITY)
    (detections,) = OnnxRuntimeModel(export.onnx_file)(images, targets)
    assert {k: tuple(v.shape) for k, v in detections.items()} == {
        "boxes": (0, 4), "scores": (0,), "labels": (0,), **({"masks": (0, 200, 240)} if arch == "mask_rcnn" else {})}


def test_the_gate_rejects_a_perturbed_graph_with_one_line_and_a_non_zero_exit(exports, tmp_path):
    export = exports["faster_rcnn"]
    model = onnx.load(export.onnx_file)
    weight = next(t for t in model.graph.initializer if t.name == "roi_heads.box_predictor.cls_score.weight")
    values = onnx.numpy_helper.to_array(weight)
    weight.CopyFrom(onnx.numpy_helper.from_array(values * 1.01, weight.name))  # 1% off: scores move by ~1e-3
    perturbed = str(tmp_path / "perturbed.onnx")
    onnx.save(model, perturbed)
    run = run_tool_captured("export.py", "--cfg", export.cfg_file, "--weights", export.weights, "--output", perturbed,
                            "--check-only", *export.opts)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {perturbed} disagrees with the PyTorch model")
    assert "largest differences" in lines[0] and "Parity gate passed" not in run.stdout


def test_an_export_failing_its_gate_leaves_the_previous_file_and_nothing_else(exports, monkeypatch, capsys,
                                                                             tmp_path):
    """The export is staged beside --output and renamed over it only after the gate: onnxruntime's boxes moved by
    1% of the image fail it, and the folder then holds the previous export, unchanged, and no staged file.

    The staged file is the module's export of these weights, copied by export_onnx's stand-in: what is checked is
    the staging around the export (tools/export.py's own), and a second export of the same model would cost
    ~25 s of CPU for the same bytes."""
    export = exports["faster_rcnn"]
    output = tmp_path / "out" / "model.onnx"
    output.parent.mkdir()
    output.write_bytes(b"the previous, good export")
    monkeypatch.setattr(onnx_module, "export_onnx", lambda model, example, path, metadata=None: shutil.copyfile(
        export.onnx_file, path))
    network_detections = OnnxRuntimeModel.network_detections

    def shifted(self, images, targets):
        detections = network_detections(self, images, targets)
        return [{**d, "boxes": d["boxes"] + 0.01 * max(size)} for d, size in zip(detections, image_sizes(targets))]

    monkeypatch.setattr(OnnxRuntimeModel, "network_detections", shifted)
    status, stderr = run_tool_here(monkeypatch, capsys, "export.py", "--cfg", export.cfg_file, "--weights",
                                   export.weights, "--output", output, *export.opts)
    assert status == 2
    assert stderr.startswith(f"Error: {output} disagrees with the PyTorch model")
    assert "It was not written" in stderr and "unchanged" in stderr
    assert os.listdir(output.parent) == ["model.onnx"] and output.read_bytes() == b"the previous, good export"


def test_an_output_that_is_a_folder_is_refused_before_the_model_is_built(monkeypatch, capsys, tmp_path):
    status, stderr = run_tool_here(monkeypatch, capsys, "export.py", "--cfg", os.path.join(CFGS, "shapes", EXPORT_ARCHS[
        "faster_rcnn"].config), "--output", tmp_path, "CKPT", tmp_path / "nothing")
    assert status == 2 and stderr.strip() == (f"Error: --output {tmp_path} is a directory; name the ONNX file to "
                                              f"write, e.g. {tmp_path / 'model.onnx'}.")


def test_without_onnxruntime_export_and_onnx_models_say_how_to_install_it(monkeypatch, capsys, tmp_path):
    """The export extra missing is one line naming the pip command: for tools/export.py before it builds the model,
    and for any run of an ONNX model."""
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # what Python does with a package that is not installed
    with pytest.raises(PetError, match=r'^onnxruntime is not installed, .*: pip install -e "\.\[export\]"$'):
        OnnxRuntimeModel(str(tmp_path / "model.onnx"))
    status, stderr = run_tool_here(monkeypatch, capsys, "export.py", "--cfg", os.path.join(CFGS, "shapes", EXPORT_ARCHS[
        "faster_rcnn"].config), "CKPT", tmp_path / "nothing")
    assert status == 2 and stderr.strip() == ('Error: onnxruntime is not installed, and ONNX models run in it: '
                                              'pip install -e ".[export]"')


def test_without_onnx_export_says_how_to_install_it(monkeypatch, capsys, tmp_path):
    """onnx itself missing is the same one line as onnxruntime missing, not an import traceback: tools/export.py
    imports pet.deploy.onnx (here imported anew, as in a fresh process) before it can check."""
    monkeypatch.setitem(sys.modules, "onnx", None)  # what Python does with a package that is not installed
    monkeypatch.delitem(sys.modules, "pet.deploy.onnx")
    status, stderr = run_tool_here(monkeypatch, capsys, "export.py", "--cfg", os.path.join(CFGS, "shapes", EXPORT_ARCHS[
        "faster_rcnn"].config), "CKPT", tmp_path / "nothing")
    assert status == 2 and stderr.strip() == ('Error: onnx is not installed, and exporting to ONNX needs it: '
                                              'pip install -e ".[export]"')


def test_test_net_evaluates_the_export_through_the_same_loop_evaluator_and_timers(exports, tmp_path):
    export = exports["faster_rcnn"]
    # onnxruntime computes in float32, so the PyTorch run does too (its default is bfloat16 on a CPU with native bf16).
    opts = [*export.opts, "TEST.WEIGHTS", export.weights, "TEST.IMS_PER_BATCH", "2", "DATA.NUM_WORKERS", "0",
            "TEST.NUM_WARMUP", "0", "TEST.AMP.ENABLED", "False"]
    reports = {}
    for backend, extra in (("pytorch", []), ("onnxruntime", ["--model", export.onnx_file])):
        run = run_tool_captured("test_net.py", "--cfg", export.cfg_file, "--backend", backend, *extra, *opts,
                                "CKPT", str(tmp_path / backend))
        assert run.returncode == 0, f"{backend}:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
        with open(tmp_path / backend / "test" / "metrics.json") as f:
            reports[backend] = json.load(f)
    assert reports["onnxruntime"]["metrics"] == pytest.approx(reports["pytorch"]["metrics"], abs=1e-4, nan_ok=True)
    assert {"iter", "data", "infer", "post", "images_per_second"} <= set(reports["onnxruntime"]["speed"])
    assert reports["onnxruntime"]["speed"]["timed_iters"] == reports["pytorch"]["speed"]["timed_iters"]
    assert [(r["backend"], r["precision"]) for r in reports.values()] == [("pytorch", "float32"),
                                                                          ("onnxruntime", "export's own")]


@torch.library.custom_op("pet_export_test::shift", mutates_args=())
def _shift(x: torch.Tensor) -> torch.Tensor:
    """An operation with an eager kernel only: torch.export cannot trace it (no fake implementation)."""
    return x + 1


@torch.library.custom_op("pet_export_test::double", mutates_args=())
def _double(x: torch.Tensor) -> torch.Tensor:
    """An operation torch.export traces (it has a fake implementation) but ONNX has no translation for."""
    return x * 2


@_double.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@ROI_BOX_HEAD_REGISTRY.register()
class ShiftedMLPHead(TwoMLPHead):
    """A user's box head calling an operation torch.export cannot trace."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _shift(super().forward(x))


def test_a_custom_box_head_that_cannot_be_traced_is_named_with_its_operation(exports, tmp_path):
    export = exports["faster_rcnn"]
    cfg_file, opts = export.cfg_file, [*export.opts, "MODEL.ROI_BOX_HEAD.NAME", "ShiftedMLPHead"]
    model = pytorch_model(cfg_file, opts, export.weights)
    with pytest.raises(ExportError) as error:
        export_onnx(model, parity_batches(load_cfg(cfg_file, opts))[0], str(tmp_path / "model.onnx"))
    message = str(error.value)
    assert message.startswith("Cannot export roi_heads.box_head (ShiftedMLPHead) to ONNX")
    assert "pet_export_test" in message and "shift" in message


def test_an_operation_without_an_onnx_translation_is_named_with_the_module_calling_it():
    class Doubler(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _double(x)

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.Sequential(Doubler()))
    with pytest.raises(ExportError) as error:
        to_onnx(model, (torch.randn(1, 3, 8, 8),), {"input": {}}, ["input"], ["output"])
    message = str(error.value)
    assert message.startswith("Cannot export 1.0 (Doubler) to ONNX")
    assert "operation pet_export_test::double" in message and "test_export.py" in message


@pytest.mark.numeric
def test_predict_runs_the_export_with_the_class_names_it_records(exports, shapes_root):
    """tools/export.py records the label space (here the fallback: TEST.DATASETS[0]'s categories, as the weights
    are a plain state_dict); the onnxruntime Predictor names its detections with it and gives the float32
    PyTorch model's detections within the parity gate's tolerances."""
    from pet.predict import Predictor

    export = exports["faster_rcnn"]
    metadata = {p.key: p.value for p in onnx.load(export.onnx_file).metadata_props}
    assert [e["name"] for e in json.loads(metadata["pet.label_space"])] == ["circle", "rectangle", "triangle"]
    cfg = load_cfg(export.cfg_file, [*export.opts, "DEVICE", "cpu", "TEST.AMP.ENABLED", "False"])
    exported = Predictor(cfg, export.onnx_file, backend="onnxruntime")
    pytorch = Predictor(cfg, model=export.model, label_space=exported.label_space)
    pictures = list(zip(exported.stream(f"{shapes_root}/val", 2), pytorch.stream(f"{shapes_root}/val", 2)))
    assert len(pictures) == 6 and sum(len(ref) for _, ref in pictures) > 0
    heads = export.model.roi_heads
    for ours, ref in pictures:
        # Paired one to one (near-ties may swap places, or fall either side of the threshold or the cap).
        pairs = match_detections(*(detection_tensors(d) for d in (ref, ours)),
                                 Tolerance(box=1e-3 * max(ref.height, ref.width), score=1e-4),
                                 heads.score_thresh, capped=len(ref) == heads.detections_per_img)
        assert all(ours.names[j] == ref.names[i] for i, j in pairs)


def test_predict_says_once_that_an_export_cannot_go_below_its_own_score_threshold(exports, shapes_root, tmp_path,
                                                                                   monkeypatch, capsys):
    """tools/export.py records the threshold the graph computes with; --score-thresh below it is one warning naming
    the export and how to export again, not the PyTorch path's 'lowering that too' (which an export cannot do)."""
    export = exports["faster_rcnn"]
    exported = float({p.key: p.value for p in onnx.load(export.onnx_file).metadata_props}["pet.score_thresh"])
    assert f"{EXPORT_ARCHS['faster_rcnn'].score_key} {exported:.6f}" in " ".join(export.opts)
    status, stderr = run_tool_here(monkeypatch, capsys, "predict.py", "--cfg", export.cfg_file, "--input",
                                   f"{shapes_root}/val", "--output", tmp_path / "predict", "--save", "csv",
                                   "--backend", "onnxruntime", "--model", export.onnx_file,
                                   "--score-thresh", exported / 2, *export.opts)
    assert status == 0, stderr[-2000:]
    log = (tmp_path / "predict" / "log.txt").read_text()
    warnings = [line for line in log.splitlines() if "cannot go below the export's own threshold" in line]
    assert len(warnings) == 1 and f"{export.onnx_file} was exported with score threshold {exported}" in warnings[0]
    assert f"tools/export.py --cfg {export.cfg_file}" in warnings[0] and "lowering" not in log
