"""Side-by-side benchmarks against a reference, in alternating rounds; each prints a table and writes JSON.

    python tools/benchmark.py engine [--iters 5000] [--repeats 3] [--out FILE]
    python tools/benchmark.py train  [--arch faster_rcnn retinanet fcos mask_rcnn demo] [--size 800 1333]
                                     [--batch 1] [--precision auto] [--memory-format channels_last]
                                     [--threads N] [--iters 1] [--repeats 3] [--out FILE]
    python tools/benchmark.py infer  [the same options as train]
    python tools/benchmark.py data   [--workers 0 1] [--batches 40] [--repeats 5] [--out FILE]
    python tools/benchmark.py augmentations [--cfg FILE] [--opts KEY VALUE ...] [--samples 300] [--warmup 20]
                                            [--out FILE]
    python tools/benchmark.py low-data [--models faster_rcnn rtdetr] [--seeds 1 2 3] [--train-images 150]
                                       [--arms default strong] [--strong lsj|mixup] [--strong-max-iter N]
                                       [--max-iter N] [--out FILE]
    python tools/benchmark.py onnx   [--arch demo faster_rcnn retinanet fcos mask_rcnn rtdetr] [--size 800 1333]
                                     [--batch 1] [--int8 [--calib 8] [--reduce-range] [--weights DEMO_WEIGHTS]]
                                     [--openvino]
                                     [--threads N] [--iters 1] [--repeats 3] [--out FILE]
    python tools/benchmark.py coco-eval [--images 5000] [--classes 80] [--tasks bbox segm] [--repeats 3] [--out FILE]
    python tools/benchmark.py predict [--part stream video] [--images 2000] [--batch 8] [--frames 320]
                                      [--vid-stride 2] [--out FILE]
    python tools/benchmark.py tiles   [--mosaic 192] [--scenes 3] [--tile 256] [--tile-overlap 0.25] [--batch 8]
                                      [--max-det 5000] [--sahi [--sahi-conf 0.3]] [--out FILE]
    python tools/benchmark.py resume-skip [--iters 10 90000 900000] [--world-size 2] [--repeats 3] [--out FILE]
    python tools/benchmark.py rtdetr [--model rtdetr-r18|dfine-l] [--size 640] [--batch 2]
                                     [--precision float32 bfloat16] [--threads N] [--memory-format channels_last]
                                     [--iters 1] [--repeats 3] [--out FILE]
    python tools/benchmark.py roofline [--cfg FILE ...] [--opts KEY VALUE ...] [--mode train infer]
                                       [--precision auto|float32|bfloat16] [--threads N] [--steps 3] [--layers 15]
                                       [--out FILE]
    python tools/benchmark.py gpu [--checks demo_amp test_timing torchvision_parity architectures nccl onnx_cuda]
                                  [--iters 600] [--steps 5] [--val-images 0] [--work-dir DIR] [--out FILE]
    python tools/benchmark.py cascade-detectron2 --weights CASCADE_CKPT [--cfg FILE] [--images N] [--tol 1e-3]
                                                 [--opts KEY VALUE ...] [--out FILE]
    python tools/benchmark.py strict-iou-ap [--gt COCO_JSON] GROUP=RUN_DIR [GROUP=RUN_DIR ...] [--out FILE]
    python tools/benchmark.py ultralytics-rtdetr [--minutes 10] [--model rtdetr-resnet50.yaml] [--imgsz 256]
                                                 [--batch 8] [--workers 1] [--threads N] [--work-dir DIR] [--out FILE]

engine: Pet's Trainer overhead per iteration over a plain loop and MMEngine's Runner
(tools/benchmarks/engine.py). train / infer: Pet's detectors against torchvision's on the same
weights, inputs, precision and memory format (tools/benchmarks/detectors.py). data: Pet's
training loader against PIL + torchvision.transforms.v2 (tools/benchmarks/data.py).
augmentations: milliseconds per training image of each transform alone and of whole recipes, Pet's opencv mapper
against a v2 pipeline (tools/benchmarks/augmentations.py). low-data: the shapes demo models trained on 150 images with
their default pipeline and with a strong one, 3 seeds each (tools/benchmarks/low_data.py). coco-eval: one COCO
evaluation with pycocotools against faster-coco-eval on a synthetic COCO-sized set (tools/benchmarks/coco_eval.py).
onnx: Pet's PyTorch models against their ONNX exports in onnxruntime (and with --openvino in OpenVINO), and with --int8
also PyTorch bfloat16 and the export quantized to int8 (onnxruntime's, and NNCF's with --openvino)
(tools/benchmarks/onnx.py).
predict: tools/predict.py with the trained demo model: memory and images/s of a long stream against test_net,
video frames/s (tools/benchmarks/predict.py). tiles: tiled prediction with each merge against the same model on
uncut pictures (a mosaic of demo pictures, generated scenes) and against SAHI's sliced prediction of the same
model with every merge setting (--sahi, with sahi importable) (tools/benchmarks/tiles.py).
resume-skip: the wait for the first batch after resuming at iteration n, Pet's skip by pass arithmetic against the
item-by-item skip (tools/benchmarks/resume_skip.py).
rtdetr: Pet's RT-DETR R18 (or D-FINE-L) against transformers' with the same weights and pixels, inference
and a training step in float32 and bfloat16 autocast (tools/benchmarks/rtdetr.py; needs transformers, Pet's test
extra).
roofline: this CPU's peak GFLOP/s (a 2048^3 matmul, a 3x3 64->64 convolution; float32 and native bfloat16), and
per config a training step's and an inference batch's FLOPs (dense arithmetic; sparse RoIAlign products as
2 x nnz x columns), time, GFLOP/s and % of peak, by stage and by slowest layer (tools/benchmarks/roofline.py).
gpu: the check to run when a CUDA GPU is lent: the demo trained in float16 (GradScaler) and bfloat16 autocast,
TestHook's timings against torch.cuda.Event's, parity with torchvision, a few steps of every architecture, two NCCL
processes, the ONNX parity gate in onnxruntime's CUDA provider; one report (JSON, with the Markdown summary and Pet's
log beside it), exit status 1 when a check failed; without CUDA every check is reported skipped, exit status 0
(tools/benchmarks/gpu.py).
cascade-detectron2: Pet's cascade RoI heads against detectron2's CascadeROIHeads on the same features, proposals and
weights; exit status 1 when they differ (tools/benchmarks/cascade_vs_detectron2.py; needs detectron2).
strict-iou-ap: AP, AP50, AP75 and AP at IoU 0.9 of finished runs, with their s/iter, mean and spread per group
(tools/benchmarks/strict_iou_ap.py). ultralytics-rtdetr: Ultralytics' own RT-DETR trainer on the shapes set for a
wall-clock budget, then its AP (tools/benchmarks/ultralytics_rtdetr.py; needs ultralytics).
Optional references (detectron2, ultralytics, sahi, transformers, mmengine) are imported only by the subcommand
that needs them. The docs' pages of figures, one per subject: docs/benchmarks/README.md.
Every table starts with the machine's fingerprint, which the JSON keeps with the command.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

# Python runs this file with its own folder, tools/, on the path: the package is "benchmarks" then. With the
# repository root on the path instead (the tests run this file in their process), "tools.benchmarks".
try:
    from tools import benchmarks
except ModuleNotFoundError as error:
    if error.name != "tools":
        raise
    import benchmarks  # type: ignore[no-redef]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("engine", help="trainer overhead per iteration")
    p.add_argument("--iters", type=int, default=5000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/engine.json")
    for kind, what in (("train", "training step"), ("infer", "inference")):
        benchmarks.detectors.add_arguments(sub.add_parser(kind, help=f"detectors' {what} against torchvision's"),
                                           kind)
    p = sub.add_parser("data", help="training data pipeline against PIL + torchvision.transforms.v2")
    p.add_argument("--workers", type=int, nargs="+", default=[0],
                   help="DataLoader workers to measure, e.g. 0 1 (the demo config uses 1)")
    p.add_argument("--batches", type=int, default=40, help="batches per timed run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="benchmarks/data.json")
    benchmarks.augmentations.add_arguments(sub.add_parser(
        "augmentations", help="ms per training image of each transform and recipe, opencv against v2"))
    benchmarks.low_data.add_arguments(sub.add_parser(
        "low-data", help="AP of a strong augmentation pipeline against the default one on 150 training images"))
    benchmarks.coco_eval.add_arguments(sub.add_parser(
        "coco-eval", help="COCO evaluation: pycocotools against faster-coco-eval"))
    benchmarks.onnx.add_arguments(sub.add_parser(
        "onnx", help="PyTorch inference against the ONNX export in onnxruntime and OpenVINO"))
    benchmarks.predict.add_arguments(sub.add_parser("predict", help="tools/predict.py: streams and video"))
    benchmarks.tiles.add_arguments(sub.add_parser("tiles", help="tiled prediction against uncut pictures and SAHI"))
    benchmarks.resume_skip.add_arguments(sub.add_parser(
        "resume-skip", help="first batch after a resume, two ways of skipping"))
    benchmarks.rtdetr.add_arguments(sub.add_parser("rtdetr", help="RT-DETR against transformers' on the same weights"))
    benchmarks.roofline.add_arguments(sub.add_parser(
        "roofline", help="peak GFLOP/s, and each stage's and layer's share of it"))
    benchmarks.gpu.add_arguments(sub.add_parser("gpu", help="the checks to run on a CUDA GPU, one report"))
    benchmarks.cascade_vs_detectron2.add_arguments(sub.add_parser(
        "cascade-detectron2", help="cascade RoI heads against detectron2's on the same weights (needs detectron2)"))
    benchmarks.strict_iou_ap.add_arguments(sub.add_parser(
        "strict-iou-ap", help="AP at IoU 0.75 and 0.9 of finished runs"))
    benchmarks.ultralytics_rtdetr.add_arguments(sub.add_parser(
        "ultralytics-rtdetr", help="Ultralytics' RT-DETR trainer on the shapes set (needs ultralytics)"))
    args = parser.parse_args()
    if args.command in ("train", "infer", "onnx", "rtdetr", "roofline"):
        torch.set_num_threads(args.threads)
    if args.command in ("train", "infer"):
        run = benchmarks.detectors.detectors
    else:
        run = {
            "engine": benchmarks.engine.engine,
            "data": benchmarks.data.data,
            "low-data": benchmarks.low_data.low_data,
            "augmentations": benchmarks.augmentations.augmentations,
            "coco-eval": benchmarks.coco_eval.coco_eval,
            "onnx": benchmarks.onnx.onnx_vs_pytorch,
            "predict": benchmarks.predict.predict_benchmark,
            "tiles": benchmarks.tiles.tiles_benchmark,
            "resume-skip": benchmarks.resume_skip.resume_skip,
            "rtdetr": benchmarks.rtdetr.rtdetr_benchmark,
            "roofline": benchmarks.roofline.roofline,
            "gpu": benchmarks.gpu.gpu_check,
            "cascade-detectron2": benchmarks.cascade_vs_detectron2.cascade_vs_detectron2,
            "strict-iou-ap": benchmarks.strict_iou_ap.strict_iou_ap,
            "ultralytics-rtdetr": benchmarks.ultralytics_rtdetr.ultralytics_rtdetr,
        }[args.command]
    machine = benchmarks.common.fingerprint()
    result = {"command": " ".join(sys.argv), "machine": machine, "date": time.strftime("%Y-%m-%d"),
              **run(args, machine)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    if args.command == "gpu":
        summary = os.path.splitext(args.out)[0] + ".md"
        benchmarks.gpu.write_markdown(result, summary)
        print(f"wrote {summary}")
        sys.exit(benchmarks.gpu.exit_status(result))
    if args.command == "cascade-detectron2" and not result["agree"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
