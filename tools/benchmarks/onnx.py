"""onnx: inference of Pet's PyTorch models against their ONNX exports in onnxruntime, on the same weights and inputs.

Each model is built from its config with random weights whose classifiers are biased as in detectors.py, so every
image reaches the per-image detection cap and post-processing is timed at full load. It is exported with
``pet.deploy.onnx.export_onnx`` (the export time is reported too), then every backend runs on the same random images:
PyTorch in float32 with Pet's memory format, onnxruntime's CPU session through
:class:`pet.deploy.onnxruntime_model.OnnxRuntimeModel`, which includes mapping boxes to the original image and
pasting masks, as the PyTorch model's forward does. Milliseconds per image, median of alternating rounds.

``--openvino`` adds the export compiled by OpenVINO (:class:`pet.deploy.OpenVinoModel`, float32), and with ``--int8``
that export quantized by NNCF (:class:`pet.deploy.openvino_int8.OpenVinoQuantizer`, every quantizable part, the same
calibration images). ``rtdetr`` is RT-DETR R-18 (cfgs/coco/rtdetr_R-18.yaml) at 640x640, its score threshold at 0 so
that every image keeps its top-k.

``--int8`` adds PyTorch in bfloat16 (where this CPU runs it natively) and the export quantized to int8 by
:class:`pet.deploy.int8.OnnxRuntimeQuantizer` with every quantizable part in int8 (what the gate chose for the
trained demo), calibrated on ``--calib`` other random images; ``--weights`` gives the demo trained weights
instead, and then the images are the first shapes_val images and the calibration images shapes_train's
(detections as trained, not at the cap). The int8 model's accuracy is not measured here: tools/export.py --int8
gates it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from functools import partial

import torch

from pet.checkpoint import load_weights
from pet.config import load_cfg
from pet.data import get_dataset
from pet.modeling import build_model
from pet.modeling.detector import score_thresh_key
from pet.utils.cpu import cpu_has_native

from .common import format_fingerprint, interleaved
from .detectors import ARCHS, DEMO_BATCH, DEMO_SIZE, _make_confident, _random_scene, _seconds_per_call

__all__ = ["onnx_vs_pytorch", "add_arguments"]

# Column name -> key in the JSON; the first is the reference of the ratios.
BACKENDS = {"PyTorch fp32": "pytorch_float32", "PyTorch bf16": "pytorch_bfloat16",
            "ORT fp32": "onnxruntime_float32", "ORT int8": "onnxruntime_int8",
            "OV fp32": "openvino_float32", "OV int8": "openvino_int8"}
# The configs: detectors.py's pairs, and RT-DETR (no torchvision twin) at its own 640x640.
CONFIGS = {**{arch: config for arch, (config, *_) in ARCHS.items()}, "rtdetr": "coco/rtdetr_R-18.yaml"}
RTDETR_SIZE = (640, 640)


def _infer(model: torch.nn.Module, images: torch.Tensor, targets: list[dict], dtype: torch.dtype | None = None
           ) -> list[dict]:
    with torch.inference_mode(), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        return model(images, targets)


def _scenes(arch: str, cfg, args: argparse.Namespace) -> tuple[tuple, list, tuple[int, int], int]:
    """The timed batch ``(images, targets)``, the calibration batches (one image each), the size and the batch."""
    if arch == "demo" and args.weights:
        from pet.deploy.int8 import RecordBatches  # onnxruntime is needed by this benchmark only

        val = RecordBatches(cfg, get_dataset("shapes_val").records[:DEMO_BATCH], DEMO_BATCH)
        calibration = RecordBatches(cfg, get_dataset("shapes_train").records[:args.calib], 1)
        images, targets = next(iter(val))
        return (images, targets), calibration, tuple(images.shape[-2:]), DEMO_BATCH
    size, batch = {"demo": (DEMO_SIZE, DEMO_BATCH), "rtdetr": (RTDETR_SIZE, args.batch)}.get(
        arch, (tuple(args.size[-2:]), args.batch))
    num_classes = cfg.MODEL.NUM_CLASSES
    images, targets = _random_scene(batch, size, num_classes)
    calibration = [_random_scene(1, size, num_classes, seed=1 + i) for i in range(args.calib)]
    return (images, targets), calibration, size, batch


def _arch(arch: str, args: argparse.Namespace, workdir: str) -> tuple[dict, dict]:
    """Export ``arch``; return its timed cases ``name -> ({backend: call}, images)`` and facts."""
    from pet.deploy.int8 import OnnxRuntimeQuantizer  # onnx and onnxruntime are needed by this benchmark only
    from pet.deploy.onnx import export_onnx
    from pet.deploy.onnxruntime_model import OnnxRuntimeModel

    cfg = load_cfg(os.path.join("cfgs", CONFIGS[arch]), [])
    if arch == "rtdetr":
        cfg = load_cfg(os.path.join("cfgs", CONFIGS[arch]), [score_thresh_key(cfg), "0.0"])
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    if arch == "demo" and args.weights:
        load_weights(model, args.weights)
    elif arch != "rtdetr":
        _make_confident(model)
    (images, targets), calibration, size, batch = _scenes(arch, cfg, args)
    path = os.path.join(workdir, f"{arch}.onnx")
    start = time.perf_counter()
    export_onnx(model, (images[:1], targets[:1]), path)
    facts = {"size": list(size), "batch": batch, "export_s": time.perf_counter() - start,
             "onnx_mb": os.path.getsize(path) / 2**20, "weights": (arch == "demo" and args.weights) or "random"}
    models = {"PyTorch fp32": partial(_infer, model), "ORT fp32": partial(_infer, OnnxRuntimeModel(path, args.threads))}
    if args.int8:
        if cpu_has_native("bfloat16"):
            models["PyTorch bf16"] = partial(_infer, model, dtype=torch.bfloat16)
        start = time.perf_counter()
        quantizer = OnnxRuntimeQuantizer(path, workdir, calibration, reduce_range=args.reduce_range)
        int8_path = quantizer.quantize(quantizer.parts, os.path.join(workdir, f"{arch}.int8.onnx"))
        facts.update(quantize_s=time.perf_counter() - start, int8_mb=os.path.getsize(int8_path) / 2**20,
                     int8_parts=list(quantizer.parts), reduce_range=args.reduce_range)
        models["ORT int8"] = partial(_infer, OnnxRuntimeModel(int8_path, args.threads))
    if args.openvino:
        from pet.deploy.openvino_model import OpenVinoModel, save_openvino

        xml = save_openvino(path, os.path.join(workdir, f"{arch}.xml"))
        models["OV fp32"] = partial(_infer, OpenVinoModel(xml, args.threads))
    if args.openvino and args.int8:
        from pet.deploy.openvino_int8 import OpenVinoQuantizer

        start = time.perf_counter()
        quantizer = OpenVinoQuantizer(path, workdir, calibration, reduce_range=args.reduce_range)
        int8_xml = quantizer.quantize(quantizer.parts, os.path.join(workdir, f"{arch}.int8.xml"))
        facts.update(openvino_quantize_s=time.perf_counter() - start)
        models["OV int8"] = partial(_infer, OpenVinoModel(int8_xml, args.threads))
    models = {name: models[name] for name in BACKENDS if name in models}
    facts["detections_per_image"] = {BACKENDS[name]: len(run(images[:1], targets[:1])[0]["boxes"])
                                     for name, run in models.items()}
    cases = {"infer b1": ({name: partial(run, images[:1], targets[:1]) for name, run in models.items()}, 1)}
    if batch > 1:
        cases[f"infer b{batch}"] = ({name: partial(run, images, targets) for name, run in models.items()}, batch)
    return cases, facts


def onnx_vs_pytorch(args: argparse.Namespace, fingerprint: dict) -> dict:
    """Time each architecture's cases, every backend in alternating order; medians and speed-ups."""
    import onnxruntime  # only this benchmark needs it

    result: dict = {"onnxruntime": onnxruntime.__version__, "iters": args.iters, "repeats": args.repeats,
                    "archs": {}}
    versions = f", onnxruntime {onnxruntime.__version__}"
    if args.openvino:
        import nncf
        import openvino

        result.update(openvino=openvino.__version__, nncf=nncf.__version__)
        versions += f", OpenVINO {openvino.__version__}, NNCF {nncf.__version__}"
    print(format_fingerprint(fingerprint) + versions)
    scene = ("the demo trained (--weights) on shapes_val images, the R-50 models on random images at the detection "
             "cap" if args.weights else "random weights and images, every image at the detection cap")
    print(f"onnx: {args.threads} thread(s) each; {scene}; median of {args.repeats} alternating rounds of "
          f"{args.iters} call(s) after one warm-up call (ms/image; the demo at {DEMO_BATCH}x{DEMO_SIZE[0]}x"
          f"{DEMO_SIZE[1]}, R-50 at {args.batch}x{args.size[0]}x{args.size[-1]})"
          + (f"; int8: every quantizable part, calibrated on {args.calib} images, reduce_range {args.reduce_range}"
             if args.int8 else ""))
    names = [name for name in BACKENDS if (args.int8 or "int8" not in name and "bf16" not in name)
             and (args.openvino or not name.startswith("OV"))]
    print(f"{'model':<12} {'case':<9} " + " ".join(f"{name:>12}" for name in names) + f" {'ORT/PT':>7}"
          + (f" {'int8 x PT32':>11} {'x ORT32':>8} {'x bf16':>7}" if args.int8 else "") + "  dets/image")
    with tempfile.TemporaryDirectory() as workdir:
        for arch in args.arch:
            # A folder each: the int8 quantizer keeps its calibration there, which is the model's own.
            os.makedirs(os.path.join(workdir, arch))
            cases, facts = _arch(arch, args, os.path.join(workdir, arch))
            result["archs"][arch] = {**facts, "cases": {}}
            for case, (runs, images) in cases.items():
                for run in runs.values():  # warm-up: allocator, lazy initialisation, onnxruntime's first run
                    run()
                samples = interleaved({name: partial(_seconds_per_call, run, args.iters) for name, run in runs.items()},
                                      args.repeats)
                ms = {name: statistics.median(values) * 1000 / images for name, values in samples.items()}
                row = {**{BACKENDS[name]: value for name, value in ms.items()},
                       "ort_over_pytorch": ms["ORT fp32"] / ms["PyTorch fp32"],
                       "samples_s": {BACKENDS[name]: values for name, values in samples.items()}}
                speedups = ""
                if "ORT int8" in ms:
                    row["int8_speedup"] = {BACKENDS[name]: value / ms["ORT int8"] for name, value in ms.items()
                                           if name != "ORT int8"}
                    bf16 = row["int8_speedup"].get("pytorch_bfloat16")
                    speedups = (f" {row['int8_speedup']['pytorch_float32']:>11.2f} "
                                f"{row['int8_speedup']['onnxruntime_float32']:>8.2f} "
                                f"{f'{bf16:.2f}' if bf16 else '-':>7}")
                row["over_pytorch_float32"] = {BACKENDS[name]: ms["PyTorch fp32"] / value for name, value in ms.items()}
                fastest = min(ms, key=ms.get)
                speedups += f"  fastest {fastest} {ms['PyTorch fp32'] / ms[fastest]:.2f}x PT fp32"
                result["archs"][arch]["cases"][case] = row
                cells = " ".join(f"{ms[name]:>9.1f} ms" if name in ms else f"{'-':>12}" for name in names)
                dets = ", ".join(str(n) for n in facts["detections_per_image"].values())
                print(f"{arch:<12} {case:<9} {cells} {row['ort_over_pytorch']:>7.2f}{speedups}  {dets}", flush=True)
            int8 = f", int8 quantization {facts['quantize_s']:.0f} s ({facts['int8_mb']:.1f} MB)" if args.int8 else ""
            if "openvino_quantize_s" in facts:
                int8 += f", NNCF {facts['openvino_quantize_s']:.0f} s"
            print(f"{arch:<12} export {facts['export_s']:.0f} s ({facts['onnx_mb']:.1f} MB){int8}")
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", nargs="+", choices=sorted(CONFIGS), default=["demo", "faster_rcnn", "retinanet",
                                                                               "fcos", "mask_rcnn"])
    parser.add_argument("--size", type=int, nargs="+", default=[800, 1333], metavar="H [W]",
                        help="R-50 input height and width (one number: square); the demo uses its own 256x256")
    parser.add_argument("--batch", type=int, default=1, help="R-50 second inference batch (the demo uses 8)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch threads and onnxruntime intra-op threads (default: the cores)")
    parser.add_argument("--openvino", action="store_true",
                        help="add the export in OpenVINO (and, with --int8, quantized by NNCF)")
    parser.add_argument("--int8", action="store_true",
                        help="add PyTorch bfloat16 (where native) and the export quantized to int8")
    parser.add_argument("--calib", type=int, default=8, help="int8 calibration images")
    parser.add_argument("--reduce-range", action="store_true", help="int8 weights in 7 bits (for CPUs without VNNI)")
    parser.add_argument("--weights", default="", metavar="FILE",
                        help="trained weights for the demo (then shapes_val images instead of random ones)")
    parser.add_argument("--iters", type=int, default=1, help="calls per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds; the median counts")
    parser.add_argument("--out", default="benchmarks/onnx.json")
