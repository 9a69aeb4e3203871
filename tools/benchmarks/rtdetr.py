"""rtdetr: Pet's RT-DETR (or D-FINE) against transformers' with the same weights and pixels.

``--model rtdetr-r18`` (default): R18, the model of the hub's PekingU/rtdetr_r18vd (``RTDetrConfig`` with a
basic-block ResNet-18-vd, 80 classes), Pet's cfgs/coco/rtdetr_R-18.yaml against ``RTDetrForObjectDetection``.
``--model dfine-l``: D-FINE-L (``DFineConfig()`` with the L checkpoint's sampling points, 80 classes), Pet's
cfgs/coco/dfine_hgnetv2_L.yaml against ``DFineForObjectDetection``. Random weights (``use_pretrained_backbone=False``:
nothing is downloaded), which Pet's model takes through its key mapping (:mod:`pet.modeling.rtdetr.weights`,
:mod:`pet.modeling.dfine.weights`), as the parity tests do. Both run in the same memory format
and, per row, the same precision (float32, then bfloat16 autocast), on the same random pixels: the reference gets them
as float in [0, 1], Pet as the uint8 it normalises itself.

Inference is milliseconds per image at batch 1, the model and its post-processing (the reference's
``RTDetrImageProcessor.post_process_object_detection``, Pet's own top-k in the model); training is seconds per
step (forward with the losses, backward) at ``--batch``, on the same objects, denoising on as both default.
Rounds alternate which side runs first; the median counts.
"""
from __future__ import annotations

import argparse
import os
import statistics
from functools import partial
from typing import Any

import torch

from pet.config import load_cfg
from pet.engine.precision import Precision
from pet.modeling import build_model

from .common import format_fingerprint, interleaved
from .detectors import _seconds_per_call

__all__ = ["rtdetr_benchmark", "add_arguments"]

# --model: Pet's config, its config node, and the reference's class (transformers' name).
MODELS = {"rtdetr-r18": ("coco/rtdetr_R-18.yaml", "RTDETR", "RTDetrForObjectDetection"),
          "dfine-l": ("coco/dfine_hgnetv2_L.yaml", "DFINE", "DFineForObjectDetection")}
PRECISIONS = {"float32": None, "bfloat16": torch.bfloat16}


def _reference_config(model: str) -> Any:
    import transformers  # an optional dependency of the benchmark only, as sahi is for ``tiles``

    if model == "dfine-l":
        return transformers.DFineConfig(num_labels=80, use_pretrained_backbone=False, decoder_n_points=[3, 6, 3])
    backbone = transformers.RTDetrResNetConfig(depths=[2, 2, 2, 2], layer_type="basic",
                                               hidden_sizes=[64, 128, 256, 512], out_indices=[2, 3, 4])
    return transformers.RTDetrConfig(num_labels=80, use_pretrained_backbone=False, backbone_config=backbone,
                                     encoder_in_channels=[128, 256, 512], hidden_expansion=0.5, decoder_layers=3)


def _pair(memory_format: str, model: str = "rtdetr-r18", cfgs: str = "cfgs"
          ) -> tuple[torch.nn.Module, torch.nn.Module, Any]:
    """(Pet's model, the reference, its image processor): the reference's random weights loaded into Pet's;
    ``cfgs``: Pet's config folder."""
    import transformers  # an optional dependency of the benchmark only, as sahi is for ``tiles``

    cfg_file, node, reference_class = MODELS[model]
    torch.manual_seed(0)
    reference = getattr(transformers, reference_class)(_reference_config(model))
    cfg = load_cfg(os.path.join(cfgs, cfg_file), ["MODEL.CHANNELS_LAST", str(memory_format == "channels_last"),
                                                   f"MODEL.{node}.DETECTIONS_PER_IMAGE", "300"])
    pet = build_model(cfg)
    loaded = pet.load_state_dict(pet.convert_state_dict(reference.state_dict()), strict=False)
    left = [k for k in loaded.missing_keys if not k.endswith("num_batches_tracked")] + loaded.unexpected_keys
    if left:
        raise RuntimeError(f"The reference's weights do not map onto Pet's model: {left[:5]}")
    if memory_format == "channels_last":
        reference.to(memory_format=torch.channels_last)
    return pet, reference, transformers.RTDetrImageProcessor()


def _scene(batch: int, size: int, seed: int = 0) -> tuple[torch.Tensor, list[dict], list[dict]]:
    """Random uint8 images and 4 random objects each: Pet's targets (xyxy px, labels 1..80) and the reference's
    (cx, cy, w, h in [0, 1], labels 0..79)."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=g)
    pet_targets, reference_labels = [], []
    for _ in range(batch):
        xy = torch.rand(4, 2, generator=g) * size * 0.6
        wh = (torch.rand(4, 2, generator=g) * 0.3 + 0.1) * size
        boxes = torch.cat([xy, xy + wh], 1)
        labels = torch.randint(1, 81, (4,), generator=g)
        pet_targets.append({"boxes": boxes, "labels": labels, "image_size": (size, size), "orig_size": (size, size)})
        cxcywh = torch.cat([(xy + wh / 2), wh], 1) / size
        reference_labels.append({"class_labels": labels - 1, "boxes": cxcywh})
    return images, pet_targets, reference_labels


def _pet_infer(model, precision: Precision, images, targets) -> None:
    with torch.inference_mode(), precision.autocast():
        model(images, targets)


def _reference_infer(model, processor, precision: Precision, pixels, sizes) -> None:
    with torch.inference_mode(), precision.autocast():
        processor.post_process_object_detection(model(pixel_values=pixels), threshold=0.0, target_sizes=sizes)


def _pet_train(model, precision: Precision, images, targets) -> None:
    with precision.autocast():
        losses = model(images, targets)
    model.zero_grad(set_to_none=True)
    sum(losses.values()).backward()


def _reference_train(model, precision: Precision, pixels, labels) -> None:
    with precision.autocast():
        loss = model(pixel_values=pixels, labels=labels).loss
    model.zero_grad(set_to_none=True)
    loss.backward()


def rtdetr_benchmark(args: argparse.Namespace, fingerprint: dict) -> dict:
    """Time inference and a training step of both sides in each precision, alternating; medians and ratios."""
    pet, reference, processor = _pair(args.memory_format, args.model)
    fmt = torch.channels_last if args.memory_format == "channels_last" else torch.contiguous_format
    images, pet_targets, labels = _scene(args.batch, args.size)
    pixels = (images.float() / 255).contiguous(memory_format=fmt)
    sizes = [(args.size, args.size)] * args.batch
    result: dict = {"model": args.model, "size": args.size, "batch": args.batch, "memory_format": args.memory_format,
                    "iters": args.iters,
                    "repeats": args.repeats, "cases": {}}
    print(format_fingerprint(fingerprint))
    print(f"rtdetr: Pet's {args.model} against transformers' {MODELS[args.model][2]}, the same random weights and "
          f"pixels ({args.size}x{args.size}), {args.memory_format} on both sides; median of {args.repeats} "
          f"alternating rounds of {args.iters} call(s) after one warm-up call")
    print(f"{'case':<10} {'precision':<9} {'Pet':>10} {'transformers':>13} {'Pet/ref':>8}")
    for name in args.precision:
        precision = Precision("cpu", PRECISIONS[name], False, "forced by the benchmark")
        cases = {
            "infer b1": (partial(_pet_infer, pet.eval(), precision, images[:1], pet_targets[:1]),
                         partial(_reference_infer, reference.eval(), processor, precision, pixels[:1], sizes[:1]),
                         1000.0, "ms"),
            f"train b{args.batch}": (partial(_pet_train, pet, precision, images, pet_targets),
                                     partial(_reference_train, reference, precision, pixels, labels), 1.0, "s"),
        }
        for case, (pet_fn, reference_fn, factor, unit) in cases.items():
            training = case.startswith("train")
            pet.train(training)
            reference.train(training)
            pet_fn(), reference_fn()  # warm-up: allocator, lazy initialisation
            samples = interleaved({"pet": partial(_seconds_per_call, pet_fn, args.iters),
                                   "transformers": partial(_seconds_per_call, reference_fn, args.iters)}, args.repeats)
            med = {k: statistics.median(v) for k, v in samples.items()}
            row = {"pet": med["pet"] * factor, "transformers": med["transformers"] * factor,
                   "ratio": med["pet"] / med["transformers"], "unit": unit, "samples_s": samples}
            result["cases"][f"{case} {name}"] = row
            print(f"{case:<10} {name:<9} {row['pet']:>8.3f} {unit:<2}{row['transformers']:>10.3f} {unit:<2} "
                  f"{row['ratio']:>7.2f}", flush=True)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=sorted(MODELS), default="rtdetr-r18", help="the pair to time")
    parser.add_argument("--size", type=int, default=640, help="square input side (the reference's 640)")
    parser.add_argument("--batch", type=int, default=2, help="training batch")
    parser.add_argument("--precision", nargs="+", choices=sorted(PRECISIONS), default=["float32", "bfloat16"],
                        help="autocast on both sides: float32 (none) and/or bfloat16")
    parser.add_argument("--memory-format", choices=["channels_last", "contiguous"], default="channels_last",
                        help="both sides' memory format (Pet's default MODEL.CHANNELS_LAST is channels_last)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: the cores)")
    parser.add_argument("--iters", type=int, default=1, help="calls per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds; the median counts")
    parser.add_argument("--out", default="benchmarks/rtdetr.json")
