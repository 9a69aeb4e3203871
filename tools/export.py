"""Export a detector to ONNX and check it: python tools/export.py --cfg FILE [--weights W] [--output FILE]
[--check-only] [--int8 [--calib N] [--int8-tolerance AP] [--gate-images N]] [--openvino] [KEY VALUE ...]

Writes an ONNX graph with a dynamic batch, height and width (RT-DETR: multiples of 32) and the whole
post-processing inside (pet/deploy/onnx.py says what it takes and returns), then runs the parity gate: the PyTorch
model and the ONNX model in onnxruntime detect on the first test images at several sizes and a blank image, and
must agree within the tolerances it prints (boxes within 1e-3 of the image size, scores within 1e-4,
labels equal, mask IoU >= 0.99, keypoints as boxes). Success is reported only then; a disagreement is one line and exit
status 2, and nothing is left at the output path (the export is written beside it under a temporary name and
renamed over it only once the gate passes, so a previous good export stays). ``--check-only`` runs the gate on an
existing ``--output`` file. Weights: --weights, else TEST.WEIGHTS, else CKPT/model_final.pth (in
HOOKS.CHECKPOINT.OUT_DIR when set). Default output: CKPT/model.onnx.

``--int8`` then quantizes the (checked) export to int8 beside it (CKPT/model.int8.onnx), calibrated on --calib
training images, and writes it only if its bbox AP (and segm AP) on the first --gate-images test images is within
--int8-tolerance AP points of the float model's; otherwise one line says how far it fell, exit status 2
(pet/deploy/int8.py says how).

``--openvino`` then converts the (checked) export to an OpenVINO IR beside it (CKPT/model.xml + model.bin, float32)
and runs the same parity gate on OpenVINO's detections; the IR is staged under temporary names and renamed into place
only once it passes (the .bin first, the .xml last), so a failing IR is one line, exit status 2, and nothing under
the final names. With ``--int8`` too, the export is also quantized for OpenVINO by NNCF (CKPT/model.int8.xml +
.bin), with the same images, parts that stay float and AP gate as onnxruntime's int8, the float model run in
OpenVINO (pet/deploy/openvino_int8.py). Needs the ``openvino`` extra.
"""
import argparse
import json
import logging
import os
import time
from typing import Any

import torch

from pet.checkpoint import load_checkpoint, load_weights
from pet.cli import launch_cli
from pet.config import default_weights, load_cfg
from pet.deploy.backend import WEIGHTS_SHA256_KEY, int8_path
from pet.deploy.onnx import Batch, export_onnx, import_onnx
from pet.deploy.onnxruntime_model import OnnxRuntimeModel, import_onnxruntime
from pet.deploy.openvino_model import OpenVinoModel, import_nncf, import_openvino, openvino_path, save_openvino
from pet.deploy.parity import ParityError, ParityReport, check_parity, parity_batches
from pet.modeling import build_model
from pet.predict.labels import ONNX_METADATA_KEY, label_space_from_checkpoint, model_label_space
from pet.utils.errors import ConfigError
from pet.utils.files import atomic_path, file_sha256
from pet.utils.logger import setup_logger

logger = logging.getLogger("pet.tools.export")


def check_output(output: str, check_only: bool, openvino: bool = False) -> None:
    """``--output`` checked before the minutes of building and exporting: a file path (an existing one to check),
    and with ``openvino`` not the name its IR would take (the IR would overwrite the ONNX file)."""
    if openvino and openvino_path(output) == output:
        raise ConfigError(f"--output {output} is where --openvino writes the IR of the ONNX export; name the ONNX file "
                          f"to write, e.g. {os.path.splitext(output)[0]}.onnx (the IR goes beside it).")
    if os.path.isdir(output):
        raise ConfigError(f"--output {output} is a directory; name the ONNX file to write, e.g. "
                          f"{os.path.join(output, 'model.onnx')}.")
    if check_only and not os.path.isfile(output):
        raise ConfigError(f"--check-only checks an existing export, and {output} does not exist: give its path with "
                          "--output, or leave out --check-only to export.")


def gate_staged(model: torch.nn.Module, staged_model: Any, path: str, batches: list[Batch],
                what: str) -> ParityReport:
    """The parity gate on an export still under its temporary name; its messages name ``path``, the file the user
    asked for, and a failure says that nothing was written there (and whether a previous ``what`` is kept)."""
    staged_model.path = path
    try:
        return check_parity(model, staged_model, batches)
    except ParityError as exc:
        kept = f" (the previous {what} there is unchanged)" if os.path.exists(path) else ""
        raise ParityError(f"{exc} It was not written to {path}{kept}.") from exc


def write_openvino(model: torch.nn.Module, output: str, batches: list[Batch]) -> tuple[str, ParityReport]:
    """The OpenVINO IR of the checked export ``output``, written beside it (:func:`openvino_path`) only once it has
    passed the parity gate against ``model`` on ``batches``; returns its path and the gate's report.

    Both files are staged under temporary names (``model.tmpPID.xml``, and OpenVINO's ``model.tmpPID.bin`` beside
    it) and renamed over the final ones when the gate passes, the .xml last: a failure removes them and leaves a
    previous IR as it was."""
    xml = openvino_path(output)
    weights = f"{os.path.splitext(xml)[0]}.bin"
    with atomic_path(xml, keep_extension=True) as staged, atomic_path(weights, keep_extension=True):
        save_openvino(output, staged)
        staged_model = OpenVinoModel(staged, threads=torch.get_num_threads())
        report = gate_staged(model, staged_model, xml, batches, "IR")
        del staged_model  # OpenVINO maps the staged .bin: let go of it before the rename
    return xml, report


def main() -> None:
    parser = argparse.ArgumentParser(description="Export a detector to ONNX and check it against PyTorch.")
    parser.add_argument("--cfg", dest="cfg_file", required=True, metavar="FILE", help="YAML config file")
    parser.add_argument("--weights", default="", metavar="FILE",
                        help="weights to export (default: TEST.WEIGHTS, else model_final.pth in CKPT, or in "
                             "HOOKS.CHECKPOINT.OUT_DIR when set)")
    parser.add_argument("--output", default="", metavar="FILE", help="ONNX file to write (default: CKPT/model.onnx)")
    parser.add_argument("--check-only", action="store_true",
                        help="only run the parity gate on the --output file (and --int8 on it)")
    parser.add_argument("--int8", action="store_true",
                        help="also write an int8 model beside the output (model.int8.onnx; with --openvino also "
                             "model.int8.xml) if it passes its AP gate")
    parser.add_argument("--calib", type=int, default=0, metavar="N",
                        help="int8 calibration images from TRAIN.DATASETS[0] (default: 256, or 64 for test images "
                             "resized to 600 px or more)")
    parser.add_argument("--int8-tolerance", type=float, default=1.0, metavar="AP",
                        help="how many AP points (0-100) below float32 the int8 model may be on the gate (default 1)")
    parser.add_argument("--gate-images", type=int, default=500, metavar="N",
                        help="the int8 gate's images: the first N of TEST.DATASETS[0] (0: all; default 500)")
    parser.add_argument("--openvino", action="store_true",
                        help="also write an OpenVINO IR beside the output (model.xml + model.bin, float32) if it "
                             "passes the same parity gate")
    parser.add_argument("--unsafe-load", action="store_true",
                        help="load the weights with weights_only=False (only for files you trust)")
    parser.add_argument("opts", nargs=argparse.REMAINDER, metavar="KEY VALUE", help="config overrides")
    args = parser.parse_args()
    setup_logger()  # terminal only: an export leaves the run's log.txt alone
    cfg = load_cfg(args.cfg_file, args.opts)
    output = args.output or os.path.join(cfg.CKPT, "model.onnx")
    check_output(output, args.check_only, args.openvino)
    import_onnx()  # the export is written with onnx: without it, say so before the export's minutes
    import_onnxruntime()  # the gate runs the export in onnxruntime: without it, say so before the export's minutes
    if args.openvino:
        import_openvino()  # and the IR in OpenVINO
    if args.openvino and args.int8:
        import_nncf()  # which quantizes it

    # The int8 step's images are checked before the export, which takes minutes.
    sets = None
    if args.int8:
        # Imported here: it needs onnxruntime's quantization tools, which a float export does not.
        from pet.deploy.int8 import default_image_counts, int8_image_sets, quantize_with_gate

        sets = int8_image_sets(cfg, *default_image_counts(cfg, args.calib), args.gate_images)
    model = build_model(cfg)
    weights = args.weights or default_weights(cfg)
    load_weights(model, weights, unsafe=args.unsafe_load, for_inference=True,
                 allow_random=cfg.TEST.ALLOW_RANDOM_WEIGHTS)
    model.eval()
    batches = parity_batches(cfg)
    if args.check_only:
        report = check_parity(model, OnnxRuntimeModel(output), batches)
    else:
        start = time.perf_counter()
        # The class names travel with the model (tools/predict.py reads them back), and which weights it holds
        # (--backend auto offers it only for them).
        recorded = label_space_from_checkpoint(load_checkpoint(weights, unsafe=args.unsafe_load))
        metadata = {ONNX_METADATA_KEY: json.dumps(model_label_space(cfg, recorded, weights).to_list()),
                    WEIGHTS_SHA256_KEY: file_sha256(weights)}
        # Staged beside the output and renamed over it only once the gate passes: a failed export leaves no file
        # (and a previous good one in place).
        with atomic_path(output) as staged:
            with torch.no_grad():
                export_onnx(model, batches[0], staged, metadata)
            logger.info(f"Exported {type(model).__name__} to {output} ({os.path.getsize(staged) / 2**20:.1f} MB) "
                        f"in {time.perf_counter() - start:.0f} s")
            report = gate_staged(model, OnnxRuntimeModel(staged), output, batches, "file")
    logger.info(f"Parity gate passed: {report.summary()}")
    logger.info(f"{output} gives the PyTorch model's detections; evaluate it with tools/test_net.py --cfg "
                f"{args.cfg_file} --backend onnxruntime --model {output}")
    if args.openvino:
        xml, openvino_report = write_openvino(model, output, batches)
        logger.info(f"OpenVINO parity gate passed: {openvino_report.summary()}")
        logger.info(f"Wrote {xml}; evaluate it with tools/test_net.py --cfg {args.cfg_file} --backend openvino "
                    f"--model {xml}")
    if sets is not None:
        int8_report = quantize_with_gate(cfg, output, int8_path(output), sets, args.int8_tolerance,
                                         threads=torch.get_num_threads())
        logger.info(f"int8 gate passed: {int8_report.summary()}")
        logger.info(f"Wrote {int8_path(output)}; evaluate it with tools/test_net.py --cfg {args.cfg_file} --backend "
                    f"onnxruntime --model {int8_path(output)}, or let --backend auto choose")
    if sets is not None and args.openvino:
        from pet.deploy.openvino_int8 import OpenVinoQuantizer

        xml_int8 = int8_path(openvino_path(output))
        openvino_report = quantize_with_gate(cfg, output, xml_int8, sets, args.int8_tolerance,
                                             threads=torch.get_num_threads(), quantizer=OpenVinoQuantizer)
        logger.info(f"OpenVINO int8 gate passed: {openvino_report.summary()}")
        logger.info(f"Wrote {xml_int8}; evaluate it with tools/test_net.py --cfg {args.cfg_file} --backend openvino "
                    f"--model {xml_int8}, or let --backend auto choose")


if __name__ == "__main__":
    launch_cli(main)
