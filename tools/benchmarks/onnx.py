"""onnx: inference of Pet's PyTorch models against their ONNX exports in onnxruntime, on the same weights and inputs.

Each model is built from its config with random weights whose classifiers are biased as in detectors.py, so every
image reaches the per-image detection cap and post-processing is timed at full load. It is exported with
``pet.deploy.onnx.export_onnx`` (the export time is reported too), then both run on the same random images: PyTorch
in float32 (onnxruntime computes in float32) with Pet's memory format, onnxruntime's CPU session through
:class:`pet.deploy.onnxruntime_model.OnnxRuntimeModel`, which includes mapping boxes to the original image and
pasting masks, as the PyTorch model's forward does. Milliseconds per image, median of alternating rounds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from functools import partial

import torch

from benchmarks.common import format_fingerprint, interleaved
from benchmarks.detectors import ARCHS, DEMO_BATCH, DEMO_SIZE, _make_confident, _random_scene, _seconds_per_call
from pet.config import load_cfg
from pet.modeling import build_model

__all__ = ["onnx_vs_pytorch", "add_arguments"]


def _infer(model: torch.nn.Module, images: torch.Tensor, targets: list[dict]) -> list[dict]:
    with torch.inference_mode(), torch.autocast("cpu", enabled=False):
        return model(images, targets)


def _arch(arch: str, args: argparse.Namespace, workdir: str) -> tuple[dict, dict]:
    """Export ``arch`` and return its timed cases ``name -> (PyTorch call, onnxruntime call, images)`` and facts."""
    from pet.deploy.onnx import export_onnx  # onnx and onnxruntime are needed by this benchmark only
    from pet.deploy.onnxruntime_model import OnnxRuntimeModel

    size, batch = (DEMO_SIZE, DEMO_BATCH) if arch == "demo" else (tuple(args.size[-2:]), args.batch)
    cfg = load_cfg(os.path.join("cfgs", ARCHS[arch][0]), [])
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    _make_confident(model)
    images, targets = _random_scene(batch, size, cfg.MODEL.NUM_CLASSES)
    path = os.path.join(workdir, f"{arch}.onnx")
    start = time.perf_counter()
    export_onnx(model, (images[:1], targets[:1]), path)
    facts = {"size": list(size), "batch": batch, "export_s": time.perf_counter() - start,
             "onnx_mb": os.path.getsize(path) / 2**20}
    session = OnnxRuntimeModel(path, threads=args.threads)
    facts["detections_per_image"] = {"pytorch": len(_infer(model, images[:1], targets[:1])[0]["boxes"]),
                                     "onnxruntime": len(_infer(session, images[:1], targets[:1])[0]["boxes"])}
    cases = {"infer b1": (partial(_infer, model, images[:1], targets[:1]),
                          partial(_infer, session, images[:1], targets[:1]), 1)}
    if batch > 1:
        cases[f"infer b{batch}"] = (partial(_infer, model, images, targets), partial(_infer, session, images, targets),
                                    batch)
    return cases, facts


def onnx_vs_pytorch(args: argparse.Namespace, fingerprint: dict) -> dict:
    """Time each architecture's cases, PyTorch and onnxruntime in alternating order; medians and ratios."""
    import onnxruntime  # only this benchmark needs it

    result: dict = {"onnxruntime": onnxruntime.__version__, "iters": args.iters, "repeats": args.repeats,
                    "archs": {}}
    print(format_fingerprint(fingerprint) + f", onnxruntime {onnxruntime.__version__}")
    print(f"onnx: float32 on both sides, {args.threads} thread(s) each; random images, every image at the detection "
          f"cap; median of {args.repeats} alternating rounds of {args.iters} call(s) after one warm-up call "
          f"(ms/image; the demo at {DEMO_BATCH}x{DEMO_SIZE[0]}x{DEMO_SIZE[1]}, R-50 at "
          f"{args.batch}x{args.size[0]}x{args.size[-1]})")
    print(f"{'model':<12} {'case':<10} {'PyTorch':>10} {'onnxruntime':>12} {'ORT/PT':>7} {'dets PT, ORT':>13} "
          f"{'export':>8}")
    with tempfile.TemporaryDirectory() as workdir:
        for arch in args.arch:
            cases, facts = _arch(arch, args, workdir)
            result["archs"][arch] = {**facts, "cases": {}}
            dets = facts["detections_per_image"]
            for case, (pytorch_fn, onnx_fn, images) in cases.items():
                pytorch_fn(), onnx_fn()  # warm-up: allocator, lazy initialisation, onnxruntime's first run
                samples = interleaved({"pytorch": partial(_seconds_per_call, pytorch_fn, args.iters),
                                       "onnxruntime": partial(_seconds_per_call, onnx_fn, args.iters)}, args.repeats)
                med = {k: statistics.median(v) * 1000 / images for k, v in samples.items()}
                row = {**med, "ratio": med["onnxruntime"] / med["pytorch"], "samples_s": samples}
                result["archs"][arch]["cases"][case] = row
                print(f"{arch:<12} {case:<10} {med['pytorch']:>7.1f} ms {med['onnxruntime']:>9.1f} ms "
                      f"{row['ratio']:>7.2f} {dets['pytorch']:>6}, {dets['onnxruntime']:<5} "
                      f"{facts['export_s']:>6.0f} s", flush=True)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", nargs="+", choices=sorted(ARCHS), default=["demo", "faster_rcnn", "retinanet",
                                                                             "fcos", "mask_rcnn"])
    parser.add_argument("--size", type=int, nargs="+", default=[800, 1333], metavar="H [W]",
                        help="R-50 input height and width (one number: square); the demo uses its own 256x256")
    parser.add_argument("--batch", type=int, default=1, help="R-50 second inference batch (the demo uses 8)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch threads and onnxruntime intra-op threads (default: the cores)")
    parser.add_argument("--iters", type=int, default=1, help="calls per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds; the median counts")
    parser.add_argument("--out", default="benchmarks/onnx.json")
