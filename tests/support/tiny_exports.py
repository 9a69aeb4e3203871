"""Tiny detectors exported to ONNX by tools/export.py, for the deploy tests (tests/deploy/test_export.py,
tests/deploy/test_openvino.py), and the OpenVINO check each exporting architecture's own test runs on its export.

The models are the shapes configs made tiny (ResNet-18 stages up to 3 or 4, three FPN levels, narrow heads), with
random weights whose normalisation statistics are random but not trivial, the classifier rescaled so scores vary
from image to image, and the score threshold set just above the blank image's best score. Each architecture is
exported when a test first asks for it (an export is ~20 s of CPU, most of it torch.export and the ONNX conversion),
through tools/export.py in the test's process, so its own parity gate runs too, and once per session: the files
asking for the same architecture share its export, whichever xdist worker runs them (:class:`Exports`).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import pytest
import torch

from pet.config import load_cfg
from pet.deploy.parity import ParityReport, check_parity, parity_batches
from pet.modeling import build_model
from pet.utils.files import file_lock
from support.helpers import CFGS, custom_datasets, run_tool_captured
from support.tiny_models import TINY_TWO_STAGE, randomize_norms, rescale_layer_output, shapes_val_batch


@dataclass(frozen=True)
class ExportArch:
    config: str  # under cfgs/shapes/
    opts: tuple[str, ...]  # what makes it tiny
    score_key: str  # its score threshold
    classifier: str  # the layer whose outputs are rescaled to vary


_TWO_STAGE = tuple(TINY_TWO_STAGE)
EXPORT_ARCHS = {
    "faster_rcnn": ExportArch("faster_rcnn_R-10-FPN.yaml", _TWO_STAGE, "MODEL.ROI_HEADS.SCORE_THRESH_TEST",
                              "roi_heads.box_predictor.cls_score"),
    "mask_rcnn": ExportArch("mask_rcnn_R-18-FPN.yaml", (*_TWO_STAGE, "MODEL.ROI_MASK_HEAD.NUM_CONV", "1",
                                                        "MODEL.ROI_MASK_HEAD.CONV_DIM", "32"),
                            "MODEL.ROI_HEADS.SCORE_THRESH_TEST", "roi_heads.box_predictor.cls_score"),
    "retinanet": ExportArch("retinanet_R-18-FPN.yaml", ("MODEL.FPN.RETURNED_LAYERS", "[4]", "MODEL.FPN.OUT_CHANNELS",
                                                        "32", "MODEL.RETINANET.ANCHOR_SIZES", "[[32], [64], [128]]",
                                                        "MODEL.RETINANET.HEAD_NORM", "''"),
                            "MODEL.RETINANET.SCORE_THRESH_TEST", "head.classification_head.cls_logits"),
    "fcos": ExportArch("fcos_R-18-FPN.yaml", ("MODEL.FPN.RETURNED_LAYERS", "[4]", "MODEL.FPN.OUT_CHANNELS", "64",
                                              "MODEL.FCOS.NUM_CONVS", "1"),
                       "MODEL.FCOS.SCORE_THRESH_TEST", "head.classification_head.cls_logits"),
}


@dataclass
class Export:
    cfg_file: str
    opts: list[str]  # the tiny architecture, its score threshold, the test set, CKPT
    weights: str
    model: torch.nn.Module  # the PyTorch model, with the weights
    onnx_file: str
    run: subprocess.CompletedProcess  # tools/export.py's


def save_tiny_weights(arch: str, cfg_file: str, opts: list[str], weights: str) -> list[str]:
    """Build ``arch``'s tiny model with random weights, save them to ``weights``; returns its opts with the score
    threshold just above the best score on the parity gate's blank image."""
    spec = EXPORT_ARCHS[arch]
    cfg = load_cfg(cfg_file, [*opts, spec.score_key, "0.0"])
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    randomize_norms(model)
    batches = parity_batches(cfg)
    rescale_layer_output(model, spec.classifier, batches[0])
    with torch.no_grad():
        blank = model(*batches[-1])[0]["scores"].max().item()
    torch.save(model.state_dict(), weights)
    return [*opts, spec.score_key, f"{blank + 1e-3:.6f}"]


def pytorch_model(cfg_file: str, opts: list[str], weights: str) -> torch.nn.Module:
    model = build_model(load_cfg(cfg_file, opts)).eval()
    model.load_state_dict(torch.load(weights, weights_only=True))
    return model


class Exports(Mapping[str, Export]):
    """Each architecture exported by tools/export.py when first asked for (the numeric tests, run alone, need only
    Faster R-CNN's: an export is ~25 s of CPU), once per session: the weights, the ONNX file and the run's output are
    kept in ``shared`` (:func:`support.helpers.session_shared_folder`), where another test file, in this process or in
    another xdist worker, finds them (tests/deploy/test_export.py and test_openvino.py both check Faster R-CNN's).

    What each test file gets is its own: the PyTorch model (built from the weights), and opts naming its own copy of
    the session's shapes set and ``ckpt``, its own CKPT. The set is the same images in every worker (generated from
    one seed), so the score threshold found on it is too."""

    def __init__(self, shared, shapes_root: str, ckpt) -> None:
        self.shared, self.found = shared, {}
        self.data = ["DATA.CUSTOM", custom_datasets(("export_val", f"{shapes_root}/annotations/val.json",
                                                     f"{shapes_root}/val")),
                     "TEST.DATASETS", "('export_val',)", "CKPT", str(ckpt)]

    def __getitem__(self, arch: str) -> Export:
        if arch not in self.found:
            spec = EXPORT_ARCHS[arch]
            cfg_file, weights = os.path.join(CFGS, "shapes", spec.config), str(self.shared / f"{arch}.pth")
            onnx_file, record = str(self.shared / f"{arch}.onnx"), self.shared / f"{arch}.json"
            with file_lock(str(self.shared / f"{arch}.lock")):
                if not record.exists():
                    opts = save_tiny_weights(arch, cfg_file, [*spec.opts, *self.data], weights)
                    run = run_tool_captured("export.py", "--cfg", cfg_file, "--weights", weights, "--output",
                                            onnx_file, *opts)
                    staged = record.with_suffix(".tmp")  # renamed once whole: a record is never half written
                    staged.write_text(json.dumps({"score_thresh": opts[-1], "args": run.args,
                                                  "returncode": run.returncode, "stdout": run.stdout,
                                                  "stderr": run.stderr}))
                    staged.replace(record)
            made = json.loads(record.read_text())
            opts = [*spec.opts, *self.data, spec.score_key, made["score_thresh"]]
            run = subprocess.CompletedProcess(made["args"], made["returncode"], made["stdout"], made["stderr"])
            self.found[arch] = Export(cfg_file, opts, weights, pytorch_model(cfg_file, opts, weights), onnx_file, run)
        return self.found[arch]

    def __iter__(self) -> Iterator[str]:
        return iter(EXPORT_ARCHS)

    def __len__(self) -> int:
        return len(EXPORT_ARCHS)


def assert_openvino_gives_the_pytorch_detections(model: torch.nn.Module, onnx_file: str, cfg, shapes_root: str,
                                                 folder: str, *, masks: bool = False,
                                                 keypoints: bool = False) -> ParityReport:
    """The IR of ``onnx_file``, compiled once with a dynamic batch and sides, on the gate's batches (two images, one
    with a blank, the blank alone) and two more images at another size: the gate's pairing and tolerances hold,
    with masks and keypoints compared where the model has them, and the export's threshold read back from the IR.
    Skips where the openvino extra is not installed."""
    if importlib.util.find_spec("openvino") is None:
        pytest.skip('the openvino extra is not installed (pip install -e ".[openvino]")')
    from pet.deploy.openvino_model import OpenVinoModel, save_openvino  # imports openvino

    ir = OpenVinoModel(save_openvino(onnx_file, os.path.join(folder, "model.xml")))
    dynamic = [[dim.is_dynamic for dim in port.get_partial_shape()] for port in ir.compiled.inputs]
    assert dynamic == [[True, False, True, True], [True, False]]
    assert ir.score_thresh == pytest.approx(model.score_thresh, abs=1e-6)
    batches = [*parity_batches(cfg), shapes_val_batch(cfg, shapes_root, [4, 5], scale=0.7)]
    report = check_parity(model, ir, batches)
    assert report.images == 7 and report.detections > 0, report.summary()
    assert report.box_fraction <= 1e-3 and report.score <= 1e-4
    assert (report.mask_iou is not None) == masks and (report.mask_iou or 1.0) >= 0.99
    assert (report.keypoint_px is not None) == keypoints
    return report
