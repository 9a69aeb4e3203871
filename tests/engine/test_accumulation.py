"""SOLVER.ACCUM_STEPS: one iteration is one optimizer step over ACCUM_STEPS batches."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from pet.config import load_cfg
from pet.engine.events import read_metrics
from pet.engine.trainer import Trainer
from support.processes import run_two_ranks
from support.toys import ToyModel


def _images(count: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(count, 4, generator=gen) * 3
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 1.0


def _weights_after_one_iteration(make_cfg, tmp_path, batch_size: int, accum_steps: int) -> dict[str, torch.Tensor]:
    """Train one iteration on the same 4 images, cut into batches of ``batch_size``."""
    x, y = _images(4)
    batches = [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, 4, batch_size)]
    torch.manual_seed(0)
    model = ToyModel()  # no batch statistics: the gradient of a batch is the mean of its images'
    # float32: the equivalence is exact arithmetic up to summation order; bfloat16 autocast (the default on
    # a CPU with native bf16) rounds each batch's forward separately, about 1e-3 apart.
    cfg = make_cfg("SOLVER.MAX_ITER", 1, "SOLVER.ACCUM_STEPS", accum_steps, "TRAIN.SAVE_AS_JSON", False,
                   "SOLVER.AMP.ENABLED", False,
                   "CKPT", tmp_path / f"{batch_size}x{accum_steps}")
    Trainer(cfg, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), data_loader=batches).train()
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.mark.numeric
@pytest.mark.parametrize("batch_size, accum_steps", [(1, 4), (2, 2)])
def test_accumulated_batches_give_the_weights_of_one_large_batch(make_cfg, tmp_path, batch_size, accum_steps):
    large = _weights_after_one_iteration(make_cfg, tmp_path, 4, 1)
    accumulated = _weights_after_one_iteration(make_cfg, tmp_path, batch_size, accum_steps)
    torch.manual_seed(0)
    untrained = ToyModel().state_dict()
    for name, value in large.items():
        assert not torch.equal(value, untrained[name]), name  # the step moved the weights
        assert torch.allclose(accumulated[name], value, atol=1e-5, rtol=0), name


def test_hooks_and_writers_count_optimizer_steps(make_cfg):
    """12 batches with ACCUM_STEPS 3 are 4 iterations: 4 lr values, 4 metrics lines, 4 optimizer steps."""
    x, y = _images(12)
    batches = [(x[i:i + 1], y[i:i + 1]) for i in range(12)]
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = []
    optimizer.register_step_post_hook(lambda *args: steps.append(1))
    cfg = make_cfg("SOLVER.MAX_EPOCHS", 1, "SOLVER.ACCUM_STEPS", 3, "DISPLAY_ITER", 1, "SOLVER.LR_POLICY", "step",
                   "SOLVER.STEPS", "(2,)")
    trainer = Trainer(cfg, model=model, optimizer=optimizer, data_loader=batches)
    trainer.train()
    assert trainer.iters_per_epoch == 4 and trainer.iter == 4 and len(steps) == 4
    records = read_metrics(f"{cfg.CKPT}/metrics.json")
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    assert [r["lr"] for r in records] == pytest.approx([0.05, 0.05, 0.005, 0.005])


def _one_iteration_cfg(ckpt: str, accum_steps: int):
    return load_cfg(None, ["CKPT", ckpt, "DEVICE", "cpu", "SOLVER.MAX_ITER", "1", "SOLVER.WARMUP_ITERS", "0",
                           "SOLVER.ACCUM_STEPS", str(accum_steps), "SOLVER.AMP.ENABLED", "False",
                           "TRAIN.AUTO_RESUME", "False", "TRAIN.SAVE_AS_JSON", "False"])


def _ddp_accumulation_worker(rank, init_file):
    """Rank r trains one iteration on images 2r and 2r+1, one per batch, ACCUM_STEPS 2, counting all-reduces."""
    torch.set_num_threads(1)
    x, y = _images(4)
    torch.manual_seed(0)
    model = ToyModel()
    trainer = Trainer(_one_iteration_cfg(f"{init_file}.run", 2), model=model,
                      optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                      data_loader=[(x[i:i + 1], y[i:i + 1]) for i in (2 * rank, 2 * rank + 1)])
    all_reduces = []

    def counting_allreduce(state, bucket):
        all_reduces.append(1)
        return default_hooks.allreduce_hook(state, bucket)

    trainer.model.register_comm_hook(None, counting_allreduce)
    trainer.train()
    return rank, len(all_reduces), {name: value.tolist() for name, value in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.numeric
def test_two_processes_accumulating_give_one_large_batch_with_one_all_reduce_per_iteration(tmp_path):
    """2 processes x 2 accumulated batches of 1 image = one batch of 4: DDP all-reduces once (no_sync on the first)."""
    x, y = _images(4)
    torch.manual_seed(0)
    model = ToyModel()
    Trainer(_one_iteration_cfg(str(tmp_path / "single"), 1), model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.05), data_loader=[(x, y)]).train()
    for rank, all_reduces, weights in run_two_ranks(_ddp_accumulation_worker, tmp_path / "init", timeout=120):
        assert all_reduces == 1, rank
        for name, value in model.state_dict().items():
            assert torch.allclose(torch.tensor(weights[name]), value, atol=1e-5, rtol=0), (rank, name)
