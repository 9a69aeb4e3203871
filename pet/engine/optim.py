"""Optimizer and learning-rate schedule built from ``SOLVER.*``.

The schedule is a multiplier of ``BASE_LR`` per iteration: a linear warm-up from
``WARMUP_FACTOR`` times an fvcore parameter schedule (step or cosine) evaluated at the
fraction of training done. It is wrapped in torch's ``LambdaLR`` so its state
(``last_epoch``, the iteration count) goes into checkpoints like any torch scheduler.
"""
from __future__ import annotations

import torch
from fvcore.common.config import CfgNode
from fvcore.common.param_scheduler import CosineParamScheduler, MultiStepParamScheduler, ParamScheduler

__all__ = ["build_optimizer", "build_lr_scheduler", "lr_multiplier", "WarmupLR"]

_NORM_TYPES = (
    torch.nn.modules.batchnorm._BatchNorm,
    torch.nn.GroupNorm,
    torch.nn.LayerNorm,
    torch.nn.LocalResponseNorm,
)


def build_optimizer(cfg: CfgNode, model: torch.nn.Module) -> torch.optim.Optimizer:
    """SGD or AdamW over the trainable parameters; norm layers get ``WEIGHT_DECAY_NORM``."""
    solver = cfg.SOLVER
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            (no_decay if isinstance(module, _NORM_TYPES) else decay).append(param)
    groups = [{"params": decay, "weight_decay": solver.WEIGHT_DECAY}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": solver.WEIGHT_DECAY_NORM})
    if solver.OPTIMIZER == "SGD":
        return torch.optim.SGD(groups, lr=solver.BASE_LR, momentum=solver.MOMENTUM)
    return torch.optim.AdamW(groups, lr=solver.BASE_LR)


def lr_multiplier(cfg: CfgNode, max_iter: int) -> ParamScheduler:
    """The fvcore schedule of the LR multiplier over ``where`` in [0, 1) (warm-up not included)."""
    solver = cfg.SOLVER
    if solver.LR_POLICY == "cosine":
        return CosineParamScheduler(1.0, 0.0)
    milestones = [step for step in solver.STEPS if step < max_iter]
    values = [solver.GAMMA**k for k in range(len(milestones) + 1)]
    return MultiStepParamScheduler(values, num_updates=max_iter, milestones=milestones)


class _WarmupMultiplier:
    """Picklable ``iteration -> lr factor`` for LambdaLR."""

    def __init__(self, schedule: ParamScheduler, max_iter: int, warmup_iters: int, warmup_factor: float) -> None:
        self.schedule = schedule
        self.max_iter = max_iter
        self.warmup_iters = warmup_iters
        self.warmup_factor = warmup_factor

    def __call__(self, iteration: int) -> float:
        where = min(iteration / self.max_iter, 1.0 - 1e-9)
        factor = self.schedule(where)
        if iteration < self.warmup_iters:
            alpha = iteration / self.warmup_iters
            factor *= self.warmup_factor * (1 - alpha) + alpha
        return factor


class WarmupLR(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR whose state is only its counters, so checkpoints load with ``weights_only=True``.

    The multiplier is rebuilt from the config, which lets a resumed run change
    ``SOLVER.MAX_ITER`` and continue on the new schedule.
    """

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["lr_lambdas"] = [None] * len(self.lr_lambdas)
        return state


def build_lr_scheduler(cfg: CfgNode, optimizer: torch.optim.Optimizer, max_iter: int) -> WarmupLR:
    """A per-iteration scheduler: warm-up, then step or cosine decay over ``max_iter``."""
    multiplier = _WarmupMultiplier(
        lr_multiplier(cfg, max_iter), max_iter, cfg.SOLVER.WARMUP_ITERS, cfg.SOLVER.WARMUP_FACTOR
    )
    return WarmupLR(optimizer, multiplier)
