"""The test loop: run a model over a loader, time it honestly, evaluate.

The loop is model-agnostic: a batch goes to ``model(*batch)``, the outputs and the
batch go to an evaluator (``reset`` / ``process(inputs, outputs)`` / ``evaluate``) built
from ``TEST.EVALUATOR`` by registry name, and to any :class:`TestCallback`.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from fvcore.common.config import CfgNode

from pet.data import DatasetMapper, build_test_loader
from pet.data.synthetic import synthetic_batch
from pet.data.workers import watched
from pet.engine.inference_timer import InferenceTimer
from pet.engine.metrics import flatten_metrics
from pet.engine.models import (
    call_model,
    default_evaluator_builder,
    default_model_builder,
    model_device,
    prepare_model,
    resolve_device,
)
from pet.engine.precision import Precision, choose_precision
from pet.engine.speed_probe import SpeedProbe, model_probe
from pet.utils import comm
from pet.utils.rng import get_rng_state, set_rng_state
from pet.utils.tensor import move_to_device
from pet.utils.timers import activate

__all__ = ["Evaluator", "TestCallback", "inference_on_dataset", "evaluate_on_datasets",
           "inference_precision", "validation_loss"]

logger = logging.getLogger(__name__)


class Evaluator(Protocol):
    def reset(self) -> None: ...

    def process(self, inputs: Any, outputs: Any) -> None: ...

    def evaluate(self) -> dict[str, dict[str, float]]: ...


class TestCallback:
    """Base class of test-time callbacks: every point is a no-op, called with keyword arguments only.

    Subclass it and override what you need (``def after_test_iter(self, outputs, **kwargs)``);
    name the class in ``TEST.HOOKS`` (registered in ``HOOKS`` or by dotted path) to use it
    from tools/test_net.py.
    """

    __test__ = False  # not a pytest test class, despite the name

    def before_test(self, **kwargs: Any) -> None:
        """Before the first batch, with ``model`` and ``data_loader``."""

    def after_test_iter(self, **kwargs: Any) -> None:
        """After each batch, with ``inputs`` (the batch) and ``outputs`` (the model's)."""

    def after_test(self, **kwargs: Any) -> None:
        """After the last batch, with ``results`` (predictions) and ``metrics``."""


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
    test_hook: InferenceTimer | None = None,
    hooks: Iterable[TestCallback] = (),
    precision: Precision | None = None,
) -> dict[str, dict[str, float]]:
    """Run ``model`` in eval mode over ``data_loader`` and return ``evaluator.evaluate()``.

    ``precision`` (from :func:`inference_precision`) autocasts the model's forward; float32 when not given.

    ``test_hook`` (an InferenceTimer, or a :class:`pet.engine.hooks.TestHook`, which offers its timer's API) times the
    stages (per batch: data, infer, post; iter = all three plus the loop itself); the
    periodic ``[Testing]`` line also shows any extra timers (for example ``timed("rpn")``
    in model code). It receives the callbacks too when it is a TestCallback; ``hooks``
    receive only the callbacks.
    """
    test_hook = test_hook or InferenceTimer()
    callbacks = [hook for hook in (test_hook, *hooks) if isinstance(hook, TestCallback)]
    device = model_device(model)
    precision = precision or Precision(device.type, None, False, "no precision given")
    test_hook.configure(device, getattr(data_loader, "batch_size", None) or 1)
    start, end, total = _shard_range(data_loader)

    evaluator.reset()
    for hook in callbacks:
        hook.before_test(model=model, data_loader=data_loader)
    was_training = model.training
    model.eval()
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode())
        stack.enter_context(activate(test_hook))
        test_hook.tic("iter")
        test_hook.tic("data")
        for index, batch in enumerate(watched(data_loader), 1):
            test_hook.toc("data")
            with test_hook.stage("infer", wait=True):
                batch = move_to_device(batch, device)
                with precision.autocast():
                    outputs = call_model(model, batch)
            with test_hook.stage("post"):
                evaluator.process(batch, outputs)
                for hook in callbacks:
                    hook.after_test_iter(inputs=batch, outputs=outputs)
            # The next iteration's clock starts as this one stops, so iterations tile the loop: logging and
            # anything else between batches is counted, and iter x batches is the loop's wall time.
            test_hook.toc("iter")
            test_hook.tic("iter")
            test_hook.log_progress(index, start, end, total)
            test_hook.tic("data")
    model.train(was_training)

    metrics = evaluator.evaluate()
    test_hook.log_summary()
    for hook in callbacks:
        hook.after_test(results=getattr(evaluator, "predictions", None), metrics=metrics)
    return metrics


def validation_loss(model: torch.nn.Module, data_loader: Iterable[Any], precision: Precision) -> dict[str, float]:
    """Each loss term of the model's training forward, and ``total_loss``, averaged over ``data_loader``.

    Nothing a training run depends on changes: the model computes its losses in training
    mode (where detectors compute them) but with every BatchNorm layer in eval mode, so
    running statistics are not updated; no gradients; and the Python / numpy / torch RNG
    states are restored afterwards, so the random stream training continues with (proposal
    sampling, augmentation) is the one it would have had. Averaged over processes.
    """
    device = model_device(model)
    was_training = model.training
    rng = get_rng_state()
    sums: dict[str, float] = {}
    batches = 0
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.eval()
    try:
        with torch.no_grad():
            for batch in data_loader:
                with precision.autocast():
                    losses = call_model(model, move_to_device(batch, device))
                values = {name: float(value) for name, value in losses.items()}
                values["total_loss"] = sum(values.values())
                for name, value in values.items():
                    sums[name] = sums.get(name, 0.0) + value
                batches += 1
    finally:
        model.train(was_training)
        set_rng_state(rng)
    return comm.reduce_scalars({name: value / max(batches, 1) for name, value in sums.items()})


def inference_precision(cfg: CfgNode, model: torch.nn.Module | None = None, *, warn: bool = True) -> Precision:
    """Inference precision of ``model`` from ``TEST.AMP`` (the rule of :mod:`pet.engine.precision`; where it has to
    measure, a no-grad forward on a generated test batch of ``cfg``'s shape). Without ``model``: the config's
    model on ``DEVICE``, built only if it has to be measured (its weights do not change the decision)."""
    device = model_device(model) if model is not None else resolve_device(cfg.DEVICE)

    def probe() -> SpeedProbe:
        timed = model if model is not None else prepare_model(default_model_builder()(cfg), cfg, device)
        return model_probe(timed, synthetic_batch(cfg, training=False), training=False)

    return choose_precision(cfg.TEST.AMP.ENABLED, cfg.TEST.AMP.DTYPE, device, training=False, key="TEST.AMP",
                            warn=warn, probe=probe)


def evaluate_on_datasets(
    cfg: CfgNode,
    model: torch.nn.Module,
    output_dir: str,
    test_hook: InferenceTimer | None = None,
    hooks: Iterable[TestCallback] = (),
    precision: Precision | None = None,
) -> dict[str, float]:
    """Evaluate on every ``TEST.DATASETS`` entry; flat ``{"bbox/AP": ...}`` metrics.

    With ``TEST.VAL_LOSS`` the losses of the model's training forward on the same images
    (:func:`validation_loss`) follow as ``loss/total_loss``, ``loss/<term>``. With several
    datasets the names are prefixed: ``"coco_2017_val/bbox/AP"``. ``precision``: :func:`inference_precision`'s
    decision unless given.
    """
    datasets = list(cfg.TEST.DATASETS)
    precision = precision or inference_precision(cfg, model)
    logger.info(f"Test precision: {precision}")
    flat: dict[str, float] = {}
    for name in datasets:
        loader = build_test_loader(cfg, name)
        out_dir = output_dir if len(datasets) == 1 else os.path.join(output_dir, name)
        evaluator = default_evaluator_builder()(cfg, loader.dataset, out_dir)
        results = inference_on_dataset(model, loader, evaluator, test_hook, hooks, precision)
        if cfg.TEST.VAL_LOSS:
            # Training targets (masks too for a mask model), the test transforms.
            mapper = DatasetMapper.from_config(cfg, is_train=False, mask_on=bool(cfg.MODEL.MASK_ON))
            results["loss"] = validation_loss(model, build_test_loader(cfg, name, mapper), precision)
        flat.update(flatten_metrics(results, "" if len(datasets) == 1 else f"{name}/"))
    comm.synchronize()
    return flat
