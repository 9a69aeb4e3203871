"""The test loop: run a model over a loader, time it honestly with TestHook, evaluate.

The loop is model-agnostic: a batch goes to ``model(*batch)``, the outputs and the
batch go to an evaluator (``reset`` / ``process(inputs, outputs)`` / ``evaluate``).
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from fvcore.common.config import CfgNode

from pet.engine.hooks.test_hook import TestHook
from pet.engine.precision import Precision, choose_precision
from pet.engine.trainer import call_model
from pet.utils import comm
from pet.utils.registry import EVALUATOR_REGISTRY, build_from_spec
from pet.utils.tensor import move_to_device
from pet.utils.timers import activate

__all__ = ["Evaluator", "inference_on_dataset", "evaluate_on_datasets", "build_test_hooks", "inference_precision"]

logger = logging.getLogger(__name__)


class Evaluator(Protocol):
    def reset(self) -> None: ...

    def process(self, inputs: Any, outputs: Any) -> None: ...

    def evaluate(self) -> dict[str, dict[str, float]]: ...


def _shard_range(data_loader: Any) -> tuple[int, int, int]:
    """(first index, end index, dataset size) of this process's shard; a plain sequence of batches counts batches."""
    total = len(getattr(data_loader, "dataset", data_loader))
    sampler = getattr(data_loader, "sampler", None)
    start = getattr(sampler, "start", 0)
    end = getattr(sampler, "end", total)
    return start, end, total


def inference_on_dataset(
    model: torch.nn.Module,
    data_loader: Iterable[Any],
    evaluator: Evaluator,
    test_hook: TestHook | None = None,
    hooks: Iterable[TestHook] = (),
    precision: Precision | None = None,
) -> dict[str, dict[str, float]]:
    """Run ``model`` in eval mode over ``data_loader`` and return ``evaluator.evaluate()``.

    ``precision`` (from :func:`inference_precision`) autocasts the model's forward; float32 when not given.

    ``test_hook`` times the stages (per batch: data, infer, post; iter = all three plus
    the loop itself); the periodic ``[Testing]`` line also shows any extra timers (for
    example ``timed("rpn")`` in model code). ``hooks`` only receive the callbacks.
    """
    test_hook = test_hook or TestHook()
    callbacks = [test_hook, *hooks]
    device = next(model.parameters()).device
    precision = precision or Precision(device.type, None, False, "no precision given")
    test_hook.cuda_sync = device.type == "cuda"
    test_hook.device = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    test_hook.ims_per_batch = getattr(data_loader, "batch_size", None) or 1
    start, end, total = _shard_range(data_loader)

    evaluator.reset()
    for hook in callbacks:
        hook.before_test(model=model, data_loader=data_loader)
    was_training = model.training
    model.eval()
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode())
        stack.enter_context(activate(test_hook))
        test_hook.iter_tic()
        test_hook.data_tic()
        for index, batch in enumerate(data_loader, 1):
            test_hook.data_toc()

            test_hook.infer_tic()
            batch = move_to_device(batch, device)
            with precision.autocast():
                outputs = call_model(model, batch)
            test_hook.wait()
            test_hook.infer_toc()

            test_hook.post_tic()
            evaluator.process(batch, outputs)
            for hook in callbacks:
                hook.after_test_iter(inputs=batch, outputs=outputs)
            test_hook.post_toc()

            # The next iteration's clock starts as this one stops, so iterations tile the loop: logging and
            # anything else between batches is counted, and iter x batches is the loop's wall time.
            test_hook.iter_toc()
            test_hook.iter_tic()
            test_hook.log_stats(index, start, end, total, test_hook.ims_per_batch,
                                log_all=bool(test_hook.extra_timers))
            test_hook.data_tic()
    model.train(was_training)

    metrics = evaluator.evaluate()
    test_hook.log_summary()
    for hook in callbacks:
        hook.after_test(results=getattr(evaluator, "predictions", None), metrics=metrics)
    return metrics


def inference_precision(cfg: CfgNode, device: torch.device) -> Precision:
    """Inference precision from ``TEST.AMP`` (the rule of :mod:`pet.engine.precision`)."""
    return choose_precision(cfg.TEST.AMP.ENABLED, cfg.TEST.AMP.DTYPE, device, training=False, key="TEST.AMP")


def build_test_hooks(cfg: CfgNode, cfg_filename: str | None = None) -> tuple[TestHook, list[TestHook]]:
    """The timing TestHook and the ``TEST.HOOKS`` callbacks."""
    from pet.engine.hooks import HOOKS

    timer = TestHook(cfg_filename, logperiod=cfg.TEST.LOG_PERIOD, num_warmup=cfg.TEST.NUM_WARMUP)
    extra = []
    for spec in cfg.TEST.HOOKS:
        hook = build_from_spec(HOOKS, spec, output_dir=cfg.CKPT)
        if not isinstance(hook, TestHook):
            raise TypeError(f"TEST.HOOKS entry {dict(spec)} built {type(hook).__name__}, not a TestHook")
        extra.append(hook)
    return timer, extra


def evaluate_on_datasets(
    cfg: CfgNode,
    model: torch.nn.Module,
    output_dir: str,
    test_hook: TestHook | None = None,
    hooks: Iterable[TestHook] = (),
) -> dict[str, float]:
    """Evaluate on every ``TEST.DATASETS`` entry; flat ``{"bbox/AP": ...}`` metrics.

    With several datasets the names are prefixed: ``"coco_2017_val/bbox/AP"``.
    """
    from pet.data import build_test_loader

    datasets = list(cfg.TEST.DATASETS)
    precision = inference_precision(cfg, next(model.parameters()).device)
    logger.info(f"Test precision: {precision}")
    flat: dict[str, float] = {}
    for name in datasets:
        loader = build_test_loader(cfg, name)
        out_dir = output_dir if len(datasets) == 1 else os.path.join(output_dir, name)
        evaluator = EVALUATOR_REGISTRY.get("COCOEvaluator")(loader.dataset, out_dir)
        results = inference_on_dataset(model, loader, evaluator, test_hook, hooks, precision)
        prefix = "" if len(datasets) == 1 else f"{name}/"
        for task, values in results.items():
            for metric, value in values.items():
                flat[f"{prefix}{task}/{metric}"] = value
    comm.synchronize()
    return flat
