"""RT-DETR, D-FINE and DEIMv2 in two real processes (gloo on CPU): 2 processes x 1 image end with the weights of 1
process x 2 images (DEIMv2's dense one-to-one union is normalised by its size averaged over processes).

What makes it hold: each process matches its own images (the Hungarian matching is per image, as in DETR and
transformers' ``RTDetrLoss``), and the loss normaliser ``num_boxes`` is the objects of the whole batch averaged over
processes (all-reduced), so the gradient DDP averages is that of the one-process loss. Rank 1's image has no object:
a process whose batch is empty of objects still takes part in every all-reduce and normalises by the batch's count.

Two settings are the test's, not Pet's defaults: BatchNorm is frozen (``NORM BN`` normalises by each process's own
images, which is what per-process BN means, so 1 image and 2 images differ by design), and there is no denoising
(its noise is drawn per process, and its groups follow each process's most objects, as in the reference).
"""
from __future__ import annotations

import pytest
import torch
from torchvision.ops import FrozenBatchNorm2d

from pet.engine.trainer import Trainer
from pet.modeling import build_model
from support.helpers import detector_batch
from support.processes import run_two_ranks
from support.tiny_models import TINY_TRAINING_DETECTORS

pytestmark = pytest.mark.numeric

ITERATIONS = 2


def _batch() -> tuple[torch.Tensor, list[dict]]:
    """Two images padded alike (128 px): image 0 with 2 objects, image 1 with none."""
    images, targets = detector_batch()
    targets[1]["boxes"], targets[1]["labels"] = torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64)
    return images, targets


def _frozen_bn(module: torch.nn.Module) -> None:
    """Every BatchNorm2d of ``module`` as a FrozenBatchNorm2d with its statistics (no batch statistics)."""
    for name, child in module.named_children():
        if isinstance(child, torch.nn.BatchNorm2d):
            frozen = FrozenBatchNorm2d(child.num_features, eps=child.eps)
            frozen.load_state_dict({k: v for k, v in child.state_dict().items() if k != "num_batches_tracked"})
            setattr(module, name, frozen)
        else:
            _frozen_bn(child)


def _cfg(family: str, *opts: str):
    tiny = TINY_TRAINING_DETECTORS[family]
    return tiny.cfg(f"MODEL.{tiny.node}.NUM_DENOISING", "0", *opts)


def _untie(model: torch.nn.Module) -> None:
    """The box heads' last layers (zero at initialisation) drawn at random: from zero, D-FINE's edge distributions are
    uniform, its distillation loss is 0 and every bin ties in its quality head's top-k, which hides what the test is
    for."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for head in model.decoder.box_heads:
            last = head.layers[-1]
            last.weight.copy_(torch.randn(last.weight.shape, generator=generator) * 0.1)
            last.bias.copy_(torch.randn(last.bias.shape, generator=generator) * 0.1)


def _train(ckpt: str, batches: list, family: str) -> dict[str, torch.Tensor]:
    """ITERATIONS SGD steps (no clipping: it would hide a wrong gradient scale) on ``batches``; the final weights."""
    cfg = _cfg(family, "CKPT", ckpt, "DEVICE", "cpu", "SOLVER.MAX_ITER", str(ITERATIONS), "SOLVER.WARMUP_ITERS", "0",
               "SOLVER.AMP.ENABLED", "False", "SOLVER.CLIP_GRAD_NORM", "0.0", "TRAIN.AUTO_RESUME", "False",
               "TRAIN.SAVE_AS_JSON", "False", "HOOKS.EVAL.PERIOD", "0")
    torch.manual_seed(0)
    model = build_model(cfg)
    _frozen_bn(model)
    _untie(model)
    Trainer(cfg, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=batches).train()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _rank_worker(rank, init_file, family):
    torch.set_num_threads(1)
    images, targets = _batch()
    weights = _train(f"{init_file}.run{rank}", [(images[rank:rank + 1], targets[rank:rank + 1])] * ITERATIONS, family)
    return rank, {name: value.tolist() for name, value in weights.items()}


# D-FINE does not hold yet (a known bug, issue 49's notes): after 2 steps the two runs differ by up to 1e-2, most in
# the pre-box head (its aux set's box and distribution losses), also with DDF off. DDF's batch statistics were one
# cause, now made the whole batch's (pet/modeling/dfine/criterion.py); DEIMv2, with the same DDF, now holds.
FAMILIES = [pytest.param(f, marks=pytest.mark.xfail(strict=True, reason="D-FINE: 2 processes != 1, cause not found"))
            if f == "dfine" else f for f in TINY_TRAINING_DETECTORS]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_two_processes_of_one_image_train_as_one_process_of_two(family, tmp_path):
    """Same weights within 1e-5 (float32; only the order of the sums differs) after 2 iterations."""
    torch.set_num_threads(1)
    single = _train(str(tmp_path / "single"), [_batch()] * ITERATIONS, family)
    torch.manual_seed(0)
    untrained = build_model(_cfg(family)).state_dict()
    moved = [name for name, value in single.items() if value.is_floating_point() and name in untrained
             and not torch.equal(value, untrained[name])]
    assert len(moved) > 100  # the steps trained the model
    for rank, weights in run_two_ranks(_rank_worker, tmp_path / "init", family, timeout=120):
        worst = max((torch.tensor(weights[name]) - single[name]).abs().max().item() for name in moved)
        assert worst < 1e-5, (rank, worst)
