"""roofline: this machine's attainable peak, and how near each stage and layer of a detector's step comes to it.

- **The peak**, per precision: a ``torch.mm`` of 2048 x 2048 by 2048 x 2048 and a 3x3 convolution of 64 to 64
  channels on a channels-last batch of 8 maps of 64 x 64, each the best of :data:`PEAK_REPEATS` calls after
  :data:`PEAK_WARMUP`, at the run's thread count, before and after the steps (the better kept: :func:`best_peaks`);
  float32 always, bfloat16 where the CPU has it natively (:func:`pet.utils.cpu.cpu_native_support`, the test of
  Pet's precision rule). A precision's peak is the faster of the two kernels. The tables come after the second
  measurement.
- **The step**, per config and mode: one training step (Pet's :class:`pet.engine.step.TrainStep`: forward,
  backward, optimizer) or one inference batch (``inference_mode``), on the generated batch Pet's precision probe
  times (:func:`pet.data.synthetic.synthetic_batch`: the config's batch and size, at most 8 x 256 x 256 pixels),
  in the precision Pet would choose (``SOLVER.AMP`` / ``TEST.AMP``, measured and cached as a run does) or the
  one ``--precision`` forces. Random weights: the config's initialisation, nothing loaded. The optimizer's
  learning rate is 0, so every step does the same work: the step's arithmetic is the same at any rate, but random
  weights trained at the config's drift fast (R-50-FPN at 0.02: from the second step on the RPN's proposals were
  gone and the box head pooled the 2 ground-truth boxes instead of 512 RoIs; the third step's loss was NaN).
- **The counts**: the un-instrumented step's median wall time over ``--steps`` steps after a warm-up; then the
  same number of steps under :class:`benchmarks.stage_profile.StageProfiler`, which times every aten op and
  counts its FLOPs (dense arithmetic only: matrix products, convolutions, attention, and sparse products as
  2 x nnz x columns; elementwise and memory ops count 0) by stage and by layer. Achieved GFLOP/s are FLOPs over
  time; "% of peak" is the time the FLOPs would take at the peak of the dtype each op computed in (a bfloat16
  step keeps some ops in float32) over the time they took.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from pet.config import load_cfg
from pet.data.synthetic import synthetic_batch
from pet.engine.inference import inference_precision
from pet.engine.models import call_model, model_keypoint_count
from pet.engine.optim import build_optimizer
from pet.engine.precision import Precision, choose_precision
from pet.engine.speed_probe import model_probe
from pet.engine.step import TrainStep
from pet.modeling import build_model
from pet.utils.cpu import cpu_native_support

from .common import format_fingerprint
from .stage_profile import StageProfiler, Tally, detector_stage, named_losses

__all__ = ["DEFAULT_CASES", "measure_peaks", "best_peaks", "build_workload", "roofline", "add_arguments"]

# (config, its own opts): the demo, the keypoint demo, R-50-FPN at 800 x 1333 (one image: the probe's pixel
# budget), the RT-DETR demo.
DEFAULT_CASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("cfgs/shapes/faster_rcnn_R-10-FPN.yaml", ()),
    ("cfgs/shapes/keypoint_rcnn_R-10-FPN.yaml", ()),
    ("cfgs/coco/faster_rcnn_R-50-FPN_1x.yaml", ("MODEL.FLOPS_INPUT_SIZE", "(800, 1333)")),
    ("cfgs/shapes/rtdetr_R-18.yaml", ()),
)
MM_SIZE = 2048
CONV_BATCH, CONV_CHANNELS, CONV_SIZE = 8, 64, 64
PEAK_WARMUP, PEAK_REPEATS = 2, 10
FORCED = {"float32": None, "bfloat16": torch.bfloat16}
FLOPS_NOTE = ("FLOPs: dense arithmetic only, 2 per multiply-add (matrix products, convolutions, attention: "
              "torch.utils.flop_counter's formulas; sparse @ dense: 2 x nnz x columns); elementwise, normalisation, "
              "pooling and copying ops count as time with 0 FLOPs (the 0-FLOP column).")


def _best_gflops(fn: Callable[[], Any], flops: int, repeats: int = PEAK_REPEATS) -> float:
    """GFLOP/s of ``fn``'s fastest call out of ``repeats``, after :data:`PEAK_WARMUP` untimed ones (oneDNN
    creates its kernels on first use); the fastest is what the machine can attain, the others met interference."""
    seconds = []
    with torch.inference_mode():
        for _ in range(PEAK_WARMUP):
            fn()
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - start)
    return flops / min(seconds) / 1e9


def _mm_case(dtype: torch.dtype) -> tuple[Callable[[], Any], int]:
    a, b = (torch.randn(MM_SIZE, MM_SIZE, dtype=dtype) for _ in range(2))
    return partial(torch.mm, a, b), 2 * MM_SIZE**3


def _conv_case(dtype: torch.dtype) -> tuple[Callable[[], Any], int]:
    x = torch.randn(CONV_BATCH, CONV_CHANNELS, CONV_SIZE, CONV_SIZE, dtype=dtype).to(memory_format=torch.channels_last)
    w = torch.randn(CONV_CHANNELS, CONV_CHANNELS, 3, 3, dtype=dtype).to(memory_format=torch.channels_last)
    flops = 2 * CONV_BATCH * CONV_CHANNELS * CONV_CHANNELS * 9 * CONV_SIZE * CONV_SIZE
    return partial(F.conv2d, x, w, padding=1), flops


def measure_peaks() -> dict[str, dict[str, float]]:
    """``{dtype: {"mm": GFLOP/s, "conv": GFLOP/s}}``: float32, and bfloat16 where the CPU has it natively."""
    dtypes = ["float32"] + (["bfloat16"] if cpu_native_support("bfloat16").native else [])
    return {name: {"mm": _best_gflops(*_mm_case(getattr(torch, name))),
                   "conv": _best_gflops(*_conv_case(getattr(torch, name)))} for name in dtypes}


@dataclass
class Workload:
    """One step to measure: ``step()`` runs it on ``model`` and ``batch`` in ``precision``; ``optimizer`` is the
    training step's (None for inference)."""

    label: str
    model: torch.nn.Module
    batch: tuple[torch.Tensor, list[dict]]
    precision: Precision
    step: Callable[[], Any]
    optimizer: torch.optim.Optimizer | None


def _precision(cfg: Any, model: torch.nn.Module, batch: Any, training: bool, name: str) -> Precision:
    """``name`` forced, or for "auto" Pet's own decision for this config, as training and test_net take it."""
    if name != "auto":
        return Precision("cpu", FORCED[name], False, "forced by --precision")
    if training:
        return choose_precision(cfg.SOLVER.AMP.ENABLED, cfg.SOLVER.AMP.DTYPE, "cpu", training=True,
                                probe=lambda: model_probe(model, batch, training=True))
    return inference_precision(cfg, model)


def _infer(model: torch.nn.Module, precision: Precision, batch: Any) -> None:
    with torch.inference_mode(), precision.autocast():
        call_model(model, batch)


def build_workload(cfg_file: str, opts: Sequence[str], mode: str, precision: str = "auto") -> Workload:
    """The config's model (random weights, on the CPU) and generated batch, and its training step
    (``mode`` "train") or inference batch ("infer") in ``precision`` (auto, float32 or bfloat16)."""
    cfg = load_cfg(cfg_file, list(opts))
    training = mode == "train"
    model = build_model(cfg).train(training)
    batch = synthetic_batch(cfg, training=training, num_keypoints=model_keypoint_count(model, cfg))
    chosen = _precision(cfg, model, batch, training, precision)
    label = f"{cfg_file} {' '.join(opts)}".strip()
    if not training:
        return Workload(label, model, batch, chosen, partial(_infer, model, chosen, batch), None)
    optimizer = build_optimizer(cfg, model)
    for group in optimizer.param_groups:  # see the module docstring
        group["lr"] = 0.0
    step = TrainStep(model, optimizer, chosen, clip_grad_norm=cfg.SOLVER.CLIP_GRAD_NORM)
    return Workload(label, model, batch, chosen, partial(step, [batch], iteration=1, data_seconds=0.0), optimizer)


def time_steps(step: Callable[[], Any], steps: int) -> list[float]:
    """Seconds of each of ``steps`` calls after one untimed warm-up call."""
    step()
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return seconds


def profile_steps(workload: Workload, steps: int) -> tuple[StageProfiler, float]:
    """``steps`` steps under a :class:`StageProfiler` (the loss functions named); the mean seconds per step."""
    profiler = StageProfiler(workload.model, workload.optimizer)
    start = time.perf_counter()
    with profiler, named_losses(profiler, workload.model):
        for _ in range(steps):
            workload.step()
    return profiler, (time.perf_counter() - start) / steps


def _kind(module: torch.nn.Module | None) -> str:
    """A layer's shape in a few characters: what decides how near its peak it can come."""
    if isinstance(module, (torch.nn.Conv2d, torch.nn.ConvTranspose2d)):
        kernel = "x".join(map(str, module.kernel_size))
        prefix = "convT" if isinstance(module, torch.nn.ConvTranspose2d) else "conv"
        groups = f" g{module.groups}" if module.groups > 1 else ""
        return f"{prefix}{kernel} {module.in_channels}->{module.out_channels} s{module.stride[0]}{groups}"
    if isinstance(module, torch.nn.Linear):
        return f"linear {module.in_features}->{module.out_features}"
    return type(module).__name__ if module is not None else ""


def _row(tally: Tally, steps: int, peaks: dict[str, float]) -> dict[str, Any]:
    """Per-step figures of a tally: GFLOP, ms, GFLOP/s, % of the peak of its dtypes, 0-FLOP ms."""
    seconds = tally.seconds / steps
    return {"gflop": tally.flops / steps / 1e9, "ms": seconds * 1e3,
            "gflops": tally.flops / steps / 1e9 / seconds if seconds else 0.0,
            "percent_of_peak": 100 * tally.peak_seconds(peaks) / tally.seconds if tally.seconds else 0.0,
            "zero_flop_ms": tally.zero_flop_seconds / steps * 1e3, "calls": tally.calls // steps}


def summarize(workload: Workload, profiler: StageProfiler, plain: list[float], instrumented_s: float, steps: int,
              peaks: dict[str, float], layers: int) -> dict[str, Any]:
    """The JSON of one case: the step's totals, its stages and its ``layers`` slowest places."""
    total = profiler.total()
    step_s = statistics.median(plain)
    places = sorted(profiler.by_place().items(), key=lambda item: -item[1].seconds)[:layers]
    return {
        "cfg": workload.label, "batch": list(workload.batch[0].shape), "precision": workload.precision.name,
        "precision_reason": workload.precision.reason, "step_s": step_s, "step_samples_s": plain,
        "instrumented_step_s": instrumented_s, "op_s": total.seconds / steps, "gflop": total.flops / steps / 1e9,
        "achieved_gflops": total.flops / steps / 1e9 / step_s,
        "percent_of_peak": 100 * total.peak_seconds(peaks) / steps / step_s,
        "sparse_gflop": profiler.sparse_flops / steps / 1e9,
        "sparse_as_dense_gflop": profiler.sparse_dense_equivalent / steps / 1e9,
        "stages": {stage: _row(tally, steps, peaks) for stage, tally in profiler.by_stage().items()},
        "layers": [{"place": _layer_name(place, profiler.modules.get(place)), "stage": detector_stage(place),
                    "kind": _kind(profiler.modules.get(place)), "output": list(tally.output_shape or ()),
                    **_row(tally, steps, peaks)} for place, tally in places],
    }


def _layer_name(place: str, module: torch.nn.Module | None) -> str:
    """``place``, marked "(own ops)" for a module with children: its row counts only the ops of its own code
    (box sampling, NMS, a residual sum), not its children's."""
    has_children = module is not None and next(module.children(), None) is not None
    return f"{place} (own ops)" if has_children else place


def _print_case(mode: str, case: dict[str, Any], peaks: dict[str, float]) -> None:
    peak = peaks.get(case["precision"], peaks["float32"]) / 1e9
    print(f"\n{case['cfg']} [{mode}], batch {'x'.join(map(str, case['batch']))}, {case['precision']} "
          f"({case['precision_reason']})")
    print(f"  step {case['step_s'] * 1e3:.1f} ms un-instrumented (median of {len(case['step_samples_s'])}); "
          f"{case['instrumented_step_s'] * 1e3:.1f} ms instrumented, {case['op_s'] * 1e3:.1f} ms of it in aten ops "
          "(the times below; the rest is Python between ops and the profiler's own cost)")
    print(f"  {case['gflop']:.2f} GFLOP per step -> {case['achieved_gflops']:.1f} GFLOP/s over the un-instrumented "
          f"step, {case['percent_of_peak']:.1f}% of peak ({case['precision']} peak {peak:.0f} GFLOP/s); sparse "
          f"products {case['sparse_gflop']:.3f} GFLOP (as dense products: {case['sparse_as_dense_gflop']:.1f})")
    print(f"  {'stage':<16}{'GFLOP':>8}{'ms':>9}{'time%':>7}{'GFLOP/s':>9}{'%peak':>7}{'0-FLOP ms':>10}")
    for stage, row in case["stages"].items():
        share = 100 * row["ms"] / (case["op_s"] * 1e3)
        print(f"  {stage:<16}{row['gflop']:>8.2f}{row['ms']:>9.1f}{share:>7.1f}{row['gflops']:>9.1f}"
              f"{row['percent_of_peak']:>7.1f}{row['zero_flop_ms']:>10.1f}")
    print(f"  {'slowest layers':<42}{'kind':<24}{'output':<18}{'GFLOP':>7}{'ms':>8}{'GFLOP/s':>9}{'%peak':>7}"
          f"{'0-FLOP ms':>10}")
    for row in case["layers"]:
        output = "x".join(map(str, row["output"]))
        print(f"  {row['place'][:41]:<42}{row['kind'][:23]:<24}{output[:17]:<18}{row['gflop']:>7.3f}{row['ms']:>8.1f}"
              f"{row['gflops']:>9.1f}{row['percent_of_peak']:>7.1f}{row['zero_flop_ms']:>10.1f}")
    if any(row["percent_of_peak"] > 100 for row in (*case["stages"].values(), *case["layers"])):
        print("  note: something ran faster than the measured peak: other processes held a core whenever the peak "
              "was measured, and not while this ran; measure again on a quiet machine")


def _cases(args: argparse.Namespace) -> list[tuple[str, tuple[str, ...]]]:
    """``--cfg`` files with ``--opts``, or :data:`DEFAULT_CASES` with ``--opts`` after their own."""
    if args.cfg:
        return [(cfg, tuple(args.opts)) for cfg in args.cfg]
    return [(cfg, (*opts, *args.opts)) for cfg, opts in DEFAULT_CASES]


def roofline(args: argparse.Namespace, fingerprint: dict) -> dict:
    """Measure the peaks, each config's steps in each mode, the peaks again; print the tables, return the JSON."""
    print(format_fingerprint(fingerprint))
    before = measure_peaks()
    measured = []
    for cfg_file, opts in _cases(args):
        for mode in args.mode:
            workload = build_workload(cfg_file, opts, mode, args.precision)
            plain = time_steps(workload.step, args.steps)
            profiler, instrumented_s = profile_steps(workload, args.steps)
            measured.append((mode, workload, profiler, plain, instrumented_s))
            print(f"measured {workload.label} [{mode}]: {statistics.median(plain) * 1e3:.1f} ms per step", flush=True)
    peak_gflops = best_peaks(before, measure_peaks())
    peaks = {dtype: max(kinds.values()) * 1e9 for dtype, kinds in peak_gflops.items()}
    print(f"\npeak (the best of {PEAK_REPEATS} calls after {PEAK_WARMUP} warm-up ones, before and after the steps, "
          f"{torch.get_num_threads()} thread(s)): "
          + "; ".join(f"{dtype} mm {MM_SIZE}^3 {kinds['mm']:.1f} GFLOP/s, conv3x3 {CONV_CHANNELS}->{CONV_CHANNELS} "
                      f"{CONV_SIZE}x{CONV_SIZE} b{CONV_BATCH} channels-last {kinds['conv']:.1f} GFLOP/s"
                      for dtype, kinds in peak_gflops.items()))
    print(FLOPS_NOTE)
    result: dict[str, Any] = {"peaks_gflops": peak_gflops, "steps": args.steps, "cases": []}
    for mode, workload, profiler, plain, instrumented_s in measured:
        case = summarize(workload, profiler, plain, instrumented_s, args.steps, peaks, args.layers)
        _print_case(mode, case, peaks)
        result["cases"].append({"mode": mode, **case})
    return result


def best_peaks(*measurements: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The best GFLOP/s of each dtype and kernel over ``measurements``: what the machine attains when no other
    process holds a core (on a shared machine, one that did made 2-thread kernels several times slower)."""
    return {dtype: {kind: max(m[dtype][kind] for m in measurements) for kind in kinds}
            for dtype, kinds in measurements[0].items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cfg", nargs="+", default=None,
                        help="config files (default: the demo, the keypoint demo, R-50-FPN at 800x1333, RT-DETR demo)")
    parser.add_argument("--opts", nargs="*", default=[], help="KEY VALUE pairs for every config, after its own")
    parser.add_argument("--mode", nargs="+", choices=["train", "infer"], default=["train", "infer"])
    parser.add_argument("--precision", choices=["auto", *FORCED], default="auto",
                        help="auto: Pet's own choice (SOLVER.AMP / TEST.AMP); or force one")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    parser.add_argument("--steps", type=int, default=3, help="timed steps, plain and instrumented, after a warm-up")
    parser.add_argument("--layers", type=int, default=15, help="rows of the slowest-layers table")
    parser.add_argument("--out", default="benchmarks/roofline.json")
