"""Parameters and FLOPs of a model, logged at the start of training and testing."""
from __future__ import annotations

import logging
import math
from typing import Any

import torch
from fvcore.common.config import CfgNode
from fvcore.nn import FlopCountAnalysis

__all__ = ["flops_input_size", "model_summary", "log_model_summary"]

logger = logging.getLogger(__name__)


def flops_input_size(cfg: CfgNode) -> tuple[int, int] | None:
    """``MODEL.FLOPS_INPUT_SIZE``, else ``INPUT.FIXED_SIZE_TEST``, else a 4:3 image at the test size; None when none
    is set."""
    for size in (cfg.MODEL.FLOPS_INPUT_SIZE, cfg.INPUT.FIXED_SIZE_TEST):
        if size:
            height, width = size
            return int(height), int(width)
    if cfg.INPUT.MIN_SIZE_TEST <= 0:
        return None
    height = cfg.INPUT.MIN_SIZE_TEST
    return height, min(math.ceil(height * 4 / 3), cfg.INPUT.MAX_SIZE_TEST)


class _ImageOnly(torch.nn.Module):
    """Calls a detector on one image tensor and returns its outputs as a flat tuple, which tracing needs."""

    def __init__(self, model: torch.nn.Module, height: int, width: int) -> None:
        super().__init__()
        self.model = model
        self.target = {"image_id": 0, "image_size": (height, width), "orig_size": (height, width)}

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = self.model(images, [self.target])
        return tuple(v for out in outputs for v in out.values() if isinstance(v, torch.Tensor))


def model_summary(model: torch.nn.Module, input_size: tuple[int, int] | None) -> dict[str, Any]:
    """``{"params", "trainable_params", "gflops", "input_size"}`` of ``model`` in eval mode.

    FLOPs are fvcore's count (one multiply-add = one FLOP) for a single uint8 RGB image of
    ``input_size`` (H, W), as the model sees it at test time; ``gflops`` is None without a size.
    """
    summary: dict[str, Any] = {
        "params": sum(p.numel() for p in model.parameters()),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "input_size": input_size,
        "gflops": None,
    }
    if input_size is None:
        return summary
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)  # leaves the global RNG, and so training, untouched
    image = torch.randint(0, 256, (1, 3, *input_size), dtype=torch.uint8, generator=generator).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            counter = FlopCountAnalysis(_ImageOnly(model, *input_size), (image,))
            counter.unsupported_ops_warnings(False).uncalled_modules_warnings(False).tracer_warnings("none")
            summary["gflops"] = counter.total() / 1e9
    finally:
        model.train(was_training)
    return summary


def log_model_summary(model: torch.nn.Module, cfg: CfgNode) -> dict[str, Any]:
    """Log the summary in one line; a model that cannot be traced gets a warning, not a failure."""
    input_size = flops_input_size(cfg)
    try:
        summary = model_summary(model, input_size)
    except Exception as exc:  # noqa: BLE001 - a summary must never stop a run
        logger.warning(f"Could not count FLOPs of {type(model).__name__}: {type(exc).__name__}: {exc}")
        summary = model_summary(model, None)
    line = (f"Model {type(model).__name__}: {summary['params'] / 1e6:.2f} M parameters "
            f"({summary['trainable_params'] / 1e6:.2f} M trainable)")
    if summary["gflops"] is not None:
        line += f", {summary['gflops']:.2f} GFLOPs on a {input_size[0]}x{input_size[1]} image (fvcore)"
    else:
        line += "; set MODEL.FLOPS_INPUT_SIZE (H, W) to count FLOPs"
    logger.info(line)
    return summary
