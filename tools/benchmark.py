"""Side-by-side benchmarks; each prints a table and writes JSON.

    python tools/benchmark.py engine [--iters 5000] [--repeats 3] [--out FILE]
    python tools/benchmark.py train [--arch faster_rcnn retinanet fcos mask_rcnn] [--size 512] [--batch 2]
                                    [--threads 2] [--iters 3] [--repeats 3] [--out FILE]
    python tools/benchmark.py infer [the same options as train]
    python tools/benchmark.py data [--workers 0 1] [--batches 40] [--repeats 5] [--out FILE]

engine: per-iteration overhead of Pet's Trainer (default hooks and writers) over a
plain PyTorch loop on a trivial model (compute ~0; the same loader and SGD with momentum
and weight decay everywhere), and MMEngine's Runner with its
default hooks when mmengine is importable (it is not a Pet dependency: install it in
the benchmark's own environment). Per-iteration time is the steady state, clocked by a
lowest-priority hook after every iteration (see _StepClock); the time with building and
finishing the run is printed next to it. Runs are interleaved and repeated; the median counts.

train / infer: Pet's R-50-FPN detectors against torchvision's (fasterrcnn/retinanet/fcos/
maskrcnn_resnet50_fpn) holding the same random weights, on the same random images, interleaved:
seconds per training step (forward, backward) at --batch, or milliseconds per image in inference
at batch 1 and at --batch.

data: images/s of Pet's training loader as the demo config builds it (opencv decode of
the shapes JPEGs, multi-scale shorter-side resize, flip, boxes, batching) against PIL
decode + torchvision.transforms.v2 doing the same work on the same images in the same
batches, both single-threaded.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

BATCH = 8


class _Batches(torch.utils.data.Dataset):
    """Pre-made ``{"x", "y"}`` batches: the loader does no work, so the loop overhead shows."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.xs = torch.randn(n, BATCH, 4, generator=gen)

    def __len__(self) -> int:
        return len(self.xs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.xs[i]
        return {"x": x, "y": x.sum(dim=1, keepdim=True)}


def _first(items: list) -> dict[str, torch.Tensor]:
    return items[0]


def _make_loader(n: int) -> torch.utils.data.DataLoader:
    """The same loader for every framework: batch_size 1 over pre-made batches, 0 workers."""
    return torch.utils.data.DataLoader(_Batches(n), batch_size=1, shuffle=False, num_workers=0, collate_fn=_first)


class _LossDictModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.linear(x), y)}


# Iterations run before the steady-state clock starts: lazy initialisation, first-use costs.
WARM_ITERS = 100


class _StepClock:
    """Timestamps after each iteration. Steady-state time per iteration is measured between the end
    of iteration WARM_ITERS and the end of the last one, so it holds every per-iteration cost (loop,
    hooks, writers) and none of the one-off ones (building, final checkpoint, curves.png)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def tick(self) -> None:
        self.times.append(time.perf_counter())

    def result(self, start: float, end: float) -> dict[str, float]:
        iters = len(self.times)
        return {"steady": (self.times[-1] - self.times[WARM_ITERS - 1]) / (iters - WARM_ITERS),
                "total": (end - start) / iters}


def run_plain(iters: int) -> dict[str, float]:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    loader = _make_loader(iters)
    clock = _StepClock()
    start = time.perf_counter()
    for batch in loader:
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        clock.tick()
    return clock.result(start, time.perf_counter())


def run_pet(iters: int) -> dict[str, float]:
    from pet.config import load_cfg
    from pet.engine.hooks import TrainHook
    from pet.engine.trainer import Trainer

    clock = _StepClock()

    class ClockHook(TrainHook):
        priority = "LOWEST"

        def after_step(self, **kwargs: Any) -> None:
            clock.tick()

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        cfg = load_cfg(None, ["CKPT", tmp, "DEVICE", "cpu", "SOLVER.MAX_ITER", str(iters), "SOLVER.BASE_LR",
                              "0.01", "SOLVER.WARMUP_ITERS", "0", "TRAIN.AUTO_RESUME", "False"])
        trainer = Trainer(cfg, model=_LossDictModel(), data_loader=_make_loader(iters))
        trainer.register_hooks([ClockHook()])
        trainer.train()
        return clock.result(start, time.perf_counter())


def run_mmengine(iters: int) -> dict[str, float] | None:
    try:
        from mmengine.hooks import Hook
        from mmengine.model import BaseModel
        from mmengine.runner import Runner
    except ImportError:
        return None

    class MMModel(BaseModel):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, x, y, mode="loss"):  # noqa: ANN001 - MMEngine's calling convention
            return {"loss": torch.nn.functional.mse_loss(self.linear(x), y)}

    clock = _StepClock()

    class ClockHook(Hook):
        priority = "LOWEST"

        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:  # noqa: ANN001
            clock.tick()

    loader = _make_loader(iters + 10)  # + 10: never exhausted (MMEngine sleeps 2 s when it is)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        runner = Runner(
            model=MMModel(),
            work_dir=tmp,
            train_dataloader=loader,
            optim_wrapper={"optimizer": {"type": "SGD", "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4}},
            train_cfg={"by_epoch": False, "max_iters": iters},
            default_hooks={"checkpoint": {"type": "CheckpointHook", "interval": 10**9}},
            custom_hooks=[ClockHook()],
            log_level="WARNING",
        )
        runner.train()
        return clock.result(start, time.perf_counter())


def engine(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    logging.getLogger("pet").setLevel(logging.WARNING)
    runners = {"plain": run_plain, "pet": run_pet, "mmengine": run_mmengine}
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, fn in runners.items():  # interleaved: machine noise hits every framework alike
            seconds = fn(args.iters)
            if seconds is not None:
                samples[name].append(seconds)
    us = {name: {kind: statistics.median(s[kind] for s in v) * 1e6 for kind in ("steady", "total")}
          for name, v in samples.items() if v}
    overhead = {name: us[name]["steady"] - us["plain"]["steady"] for name in us if name != "plain"}
    print(f"engine overhead, trivial model, {args.iters} iterations x {args.repeats} interleaved repeats (median), "
          f"1 thread; steady state after {WARM_ITERS} iterations; 'with set-up' adds building and finishing the run")
    print(f"{'loop':<10} {'us/iter':>10} {'overhead us':>12} {'us/iter with set-up':>20}")
    for name, value in us.items():
        print(f"{name:<10} {value['steady']:>10.1f} {overhead.get(name, 0.0):>12.1f} {value['total']:>20.1f}")
    if "mmengine" in overhead:
        print(f"Pet overhead / MMEngine overhead = {overhead['pet'] / overhead['mmengine']:.2f}")
    return {"us_per_iter": us, "overhead_us": overhead, "samples_s": samples}


def _random_scene(batch: int, size: int, seed: int = 0) -> tuple[torch.Tensor, list[dict]]:
    gen = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=gen)
    targets = []
    for i in range(batch):
        xy = torch.rand(4, 2, generator=gen) * size * 0.6
        wh = 32 + torch.rand(4, 2, generator=gen) * size * 0.3
        targets.append({"image_id": i, "image_size": (size, size), "orig_size": (size, size),
                        "boxes": torch.cat([xy, xy + wh], dim=1), "labels": torch.randint(1, 81, (4,), generator=gen)})
    return images, targets


def _time(fn, iters: int) -> float:
    fn()  # warm-up: allocator, lazy initialisation
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


# --arch name -> (Pet's config, torchvision's model class, returned ResNet stages, top FPN block).
ARCHS = {
    "faster_rcnn": ("faster_rcnn_R-50-FPN_1x.yaml", "FasterRCNN", [1, 2, 3, 4], "maxpool"),
    "retinanet": ("retinanet_R-50-FPN_1x.yaml", "RetinaNet", [2, 3, 4], "p6p7"),
    "fcos": ("fcos_R-50-FPN_1x.yaml", "FCOS", [2, 3, 4], "p6p7"),
    "mask_rcnn": ("mask_rcnn_R-50-FPN_1x.yaml", "MaskRCNN", [1, 2, 3, 4], "maxpool"),
}


def _model_pair(arch: str, size: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Pet's model and torchvision's, holding the same random weights.

    torchvision's ``*_resnet50_fpn`` builders use trainable BatchNorm and train every stage when
    given no weights; the reference is assembled as they do with weights instead (FrozenBatchNorm,
    stem and res2 frozen), which is what Pet's COCO configs train. 80 classes + 1 on both sides.
    """
    from torchvision.models import detection, resnet50
    from torchvision.models.detection.backbone_utils import _resnet_fpn_extractor
    from torchvision.ops import FrozenBatchNorm2d
    from torchvision.ops.feature_pyramid_network import LastLevelMaxPool, LastLevelP6P7

    from pet.config import load_cfg
    from pet.modeling import build_model

    cfg_file, model_class, returned_layers, top_block = ARCHS[arch]
    torch.manual_seed(0)
    extra_blocks = LastLevelMaxPool() if top_block == "maxpool" else LastLevelP6P7(256, 256)
    backbone = _resnet_fpn_extractor(resnet50(norm_layer=FrozenBatchNorm2d), 3, returned_layers, extra_blocks)
    reference = getattr(detection, model_class)(backbone, num_classes=81, min_size=size, max_size=size)
    pet_model = build_model(load_cfg(os.path.join("cfgs", "coco", cfg_file), []))
    pet_model.load_state_dict(reference.state_dict(), strict=True)
    return pet_model, reference


def _with_masks(targets: list[dict], size: int) -> list[dict]:
    """Box-shaped instance masks, for Mask R-CNN's training step."""
    for t in targets:
        masks = torch.zeros((len(t["boxes"]), size, size), dtype=torch.uint8)
        for mask, box in zip(masks, t["boxes"].round().int().tolist()):
            mask[box[1]:box[3], box[0]:box[2]] = 1
        t["masks"] = masks
    return targets


def _train_step(m: torch.nn.Module, *inputs: Any) -> None:
    m.train()
    losses = m(*inputs)
    m.zero_grad(set_to_none=True)
    sum(losses.values()).backward()


def _infer(m: torch.nn.Module, *inputs: Any) -> None:
    m.eval()
    with torch.inference_mode():
        m(*inputs)


def _arch_cases(arch: str, size: int, batch: int, kind: str) -> dict[str, tuple[Callable, Callable, float]]:
    """``case -> (Pet's step, torchvision's step, seconds-to-reported-unit factor)`` for one architecture;
    ``kind`` "train" gives the training step, "infer" inference at batch 1 and at ``batch``."""
    pet_model, reference = _model_pair(arch, size)
    images, targets = _random_scene(batch, size)
    if arch == "mask_rcnn":
        targets = _with_masks(targets, size)
    tv_images = [im.float() / 255 for im in images]
    tv_targets = [{k: t[k] for k in ("boxes", "labels", "masks") if k in t} for t in targets]
    if kind == "train":
        return {f"train b{batch}": (partial(_train_step, pet_model, images, targets),
                                    partial(_train_step, reference, tv_images, tv_targets), 1.0)}
    return {
        "infer b1": (partial(_infer, pet_model, images[:1], targets[:1]),
                     partial(_infer, reference, tv_images[:1]), 1000.0),
        f"infer b{batch}": (partial(_infer, pet_model, images, targets),
                            partial(_infer, reference, tv_images), 1000.0 / batch),
    }


def detectors(args: argparse.Namespace) -> dict:
    """Pet's detectors against torchvision's on the same weights, inputs and work, interleaved.

    torchvision's models take float images in [0, 1] and normalise (and resize, here by a factor
    of 1) inside; Pet's take the loader's uint8 batch and normalise inside. Each side's timing
    includes its own normalisation; Pet's resize, done by its data loader, is not timed.
    """
    torch.set_num_threads(args.threads)
    result: dict = {"size": args.size, "batch": args.batch, "threads": args.threads, "archs": {}}
    unit = "s/iter" if args.command == "train" else "ms/image"
    print(f"{args.size}x{args.size} random images with 4 boxes each, fp32, {args.threads} thread(s), median of "
          f"{args.repeats} interleaved runs of {args.iters} iterations ({unit})")
    print(f"{'model':<12} {'case':<10} {'Pet':>10} {'torchvision':>12} {'Pet/tv':>8}")
    for arch in args.arch:
        result["archs"][arch] = {}
        for case, (pet_fn, tv_fn, factor) in _arch_cases(arch, args.size, args.batch, args.command).items():
            samples: dict[str, list[float]] = {"pet": [], "torchvision": []}
            for _ in range(args.repeats):  # interleaved: machine noise hits both alike
                samples["pet"].append(_time(pet_fn, args.iters))
                samples["torchvision"].append(_time(tv_fn, args.iters))
            med = {k: statistics.median(v) for k, v in samples.items()}
            row = {"pet": med["pet"] * factor, "torchvision": med["torchvision"] * factor,
                   "ratio": med["pet"] / med["torchvision"], "samples_s": samples}
            result["archs"][arch][case] = row
            unit_name = "s" if case.startswith("train") else "ms"
            print(f"{arch:<12} {case:<10} {row['pet']:>8.3f} {unit_name:<2}{row['torchvision']:>9.3f} {unit_name:<2} "
                  f"{row['ratio']:>7.2f}", flush=True)
    return result


DATA_SCALES = (320, 352, 384, 416, 448, 480)
DATA_MAX_SIZE = 800


class _ReferenceDataset(torch.utils.data.Dataset):
    """The reference pipeline: PIL decode, then torchvision.transforms.v2 on the image and its boxes.

    The transforms run on the uint8 tensor (ToImage first) without antialiasing: on this data
    that is ~2x faster than resizing the PIL image, and every resize here enlarges, where
    antialiasing changes nothing but costs ~15%. So the reference is torchvision's fastest option.
    """

    def __init__(self, records: list[dict], flip_prob: float) -> None:
        from torchvision.transforms import v2

        self.records = records
        self.transform = v2.Compose([
            v2.ToImage(), v2.RandomShortestSize(list(DATA_SCALES), DATA_MAX_SIZE, antialias=False),
            v2.RandomHorizontalFlip(flip_prob),
        ])

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        from PIL import Image
        from torchvision import tv_tensors

        record = self.records[key[0]]  # key: (index, seed) from Pet's sampler, so both see the same images
        with Image.open(record["file_name"]) as pil:
            image = pil.convert("RGB")
        boxes = tv_tensors.BoundingBoxes(torch.from_numpy(record["boxes"]), format="XYXY",
                                         canvas_size=(image.height, image.width))
        image, boxes = self.transform(image, boxes)
        return {"image": image.as_subclass(torch.Tensor), "image_id": record["image_id"],
                "image_size": tuple(image.shape[-2:]), "boxes": boxes.as_subclass(torch.Tensor),
                "labels": torch.from_numpy(record["labels"])}


def _pad_batch(samples: list[dict]) -> tuple[torch.Tensor, list[dict]]:
    """The reference's collate: zero-pad [3, h, w] images into a [B, 3, H, W] batch (H, W multiples of 32)."""
    height = -(-max(s["image"].shape[1] for s in samples) // 32) * 32
    width = -(-max(s["image"].shape[2] for s in samples) // 32) * 32
    images = torch.zeros((len(samples), 3, height, width), dtype=torch.uint8)
    for image, sample in zip(images, samples):
        image[:, :sample["image"].shape[1], :sample["image"].shape[2]].copy_(sample["image"])
    return images, [{k: v for k, v in s.items() if k != "image"} for s in samples]


def _data_loaders(workers: int) -> dict[str, torch.utils.data.DataLoader]:
    """Pet's loader from the demo config (resize changed to multi-scale 320-480) and the reference on its batches."""
    from pet.config import load_cfg
    from pet.data import build_train_loader

    cfg = load_cfg(os.path.join("cfgs", "shapes", "faster_rcnn_R-18-FPN.yaml"), [
        "DEVICE", "cpu", "DATA.NUM_WORKERS", str(workers), "INPUT.MIN_SIZE_TRAIN", str(DATA_SCALES),
        "INPUT.MAX_SIZE_TRAIN", str(DATA_MAX_SIZE)])
    pet_loader = build_train_loader(cfg)
    dataset = pet_loader.dataset
    records = [dataset.record(i) for i in range(len(dataset))]
    reference = torch.utils.data.DataLoader(
        _ReferenceDataset(records, cfg.INPUT.FLIP_PROB), batch_sampler=pet_loader.batch_sampler,
        num_workers=workers, persistent_workers=workers > 0, collate_fn=_pad_batch,
    )
    return {"pet": pet_loader, "reference": reference}


def data(args: argparse.Namespace) -> dict:
    """Images per second of the two training pipelines, per number of workers."""
    import cv2

    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    logging.getLogger("pet").setLevel(logging.WARNING)
    result: dict = {"scales": DATA_SCALES, "max_size": DATA_MAX_SIZE, "batches": args.batches,
                    "repeats": args.repeats, "workers": {}}
    for workers in args.workers:
        loaders = _data_loaders(workers)
        iterators = {name: iter(loader) for name, loader in loaders.items()}
        batch_size = loaders["pet"].batch_sampler.batch_size
        samples: dict[str, list[float]] = {name: [] for name in loaders}
        for it in iterators.values():  # warm-up: worker start, first-use costs
            for _ in range(3):
                next(it)
        for _ in range(args.repeats):
            for name, it in iterators.items():  # interleaved; both consume the same batches in step
                start = time.perf_counter()
                for _ in range(args.batches):
                    next(it)
                samples[name].append(args.batches * batch_size / (time.perf_counter() - start))
        med = {name: statistics.median(v) for name, v in samples.items()}
        result["workers"][workers] = {**med, "ratio": med["pet"] / med["reference"], "samples_images_per_s": samples}
        del iterators, loaders
    print(f"training data pipeline, shapes train JPEGs (192-256 px) -> shorter side {DATA_SCALES[0]}-{DATA_SCALES[-1]} "
          f"(max {DATA_MAX_SIZE}), flip 0.5, boxes, batch {batch_size}; 1 thread per process; median of "
          f"{args.repeats} interleaved runs of {args.batches} batches")
    print(f"{'workers':<8} {'Pet img/s':>10} {'PIL+tv2 img/s':>14} {'Pet/ref':>8}")
    for workers, r in result["workers"].items():
        print(f"{workers:<8} {r['pet']:>10.0f} {r['reference']:>14.0f} {r['ratio']:>8.2f}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("engine", help="trainer overhead per iteration")
    p.add_argument("--iters", type=int, default=5000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/engine.json")
    for kind, what in (("train", "training step"), ("infer", "inference")):
        p = sub.add_parser(kind, help=f"detectors' {what} against torchvision's")
        p.add_argument("--arch", nargs="+", choices=sorted(ARCHS), default=["faster_rcnn", "retinanet", "fcos"])
        p.add_argument("--size", type=int, default=512)
        p.add_argument("--batch", type=int, default=2, help="training batch / the second inference batch")
        p.add_argument("--threads", type=int, default=2, help="torch threads (the machine's cores by default)")
        p.add_argument("--iters", type=int, default=3)
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--out", default=f"benchmarks/{kind}.json")
    p = sub.add_parser("data", help="training data pipeline against PIL + torchvision.transforms.v2")
    p.add_argument("--workers", type=int, nargs="+", default=[0],
                   help="DataLoader workers to measure, e.g. 0 1 (the demo config uses 1)")
    p.add_argument("--batches", type=int, default=40, help="batches per timed run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="benchmarks/data.json")
    args = parser.parse_args()
    result = {"command": " ".join(sys.argv), "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              **{"engine": engine, "train": detectors, "infer": detectors, "data": data}[args.command](args)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
