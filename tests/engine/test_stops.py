"""Stopping for real: SIGTERM / SIGINT (one rank or all), a NaN loss (raise or skip, on one rank or all)."""
from __future__ import annotations

import inspect
import math
import os
import re
import signal

import pytest
import torch
import torch.distributed as dist

from pet.checkpoint import read_last_checkpoint
from pet.config import load_cfg
from pet.engine.events import read_metrics
from pet.engine.hooks import TrainHook
from pet.engine.trainer import Trainer
from pet.utils import comm
from pet.utils.errors import TrainingInterrupted
from support.helpers import final_weights, run_toy_train_here, start_and_wait_for_report
from support.processes import run_two_ranks
from support.toys import IndexedToyLoader, NanLossModel, ToyModel, regular_iters, toy_trainer


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_saves_a_checkpoint_and_resume_continues_from_it(tmp_path, signum):
    ckpt, stopped_at = tmp_path / "run", 5
    # The child waits for the signal after iteration 5 and says so on a pipe; the two markers show that
    # after_train ran and the writers were closed.
    proc, _ = start_and_wait_for_report(ckpt, 10, "PauseForSignal", "--interval", "1000",
                                        "TRAIN.WRITERS", "[{'type': 'support.fault_plugins.CloseMarker'}]",
                                        at=stopped_at, also=[{"type": "support.fault_plugins.AfterTrainMarker"}])
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum
    assert err.strip().splitlines() == [
        f"Error: Training stopped by {signum.name} after iteration {stopped_at}; checkpoint "
        f"{ckpt}/model_iter{stopped_at}.pth. Run the same command to resume from it."], err
    assert (ckpt / "last_checkpoint").read_text() == f"model_iter{stopped_at}.pth"
    assert not (ckpt / "model_final.pth").exists()
    assert (ckpt / "after_train.txt").read_text() == str(stopped_at)
    assert (ckpt / "writer_closed.txt").read_text() == str(stopped_at)
    assert read_metrics(str(ckpt / "metrics.json"))[-1]["iteration"] == stopped_at

    code, out, err = run_toy_train_here(ckpt, stopped_at + 3)  # the stop needed a process; the resume does not
    assert code == 0, err
    assert f"Resumed from {ckpt}/model_iter{stopped_at}.pth at iteration {stopped_at}" in out
    iterations = [r["iteration"] for r in read_metrics(str(ckpt / "metrics.json"))]
    assert iterations == list(range(1, stopped_at + 4))  # one consistent history, no gap, no repeat


class SignalAt(TrainHook):
    """Sends ``signum`` to this process in ``after_step`` of iteration ``at`` (1-based), as a scheduler would."""

    def __init__(self, at: int, signum: int = signal.SIGTERM) -> None:
        self.at = at
        self.signum = signum

    def after_step(self, trainer, **kwargs):
        if trainer.iter == self.at:
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("at, kept", [(5, [4, 5]), (4, [2, 4])])
def test_signal_checkpoint_goes_through_the_checkpoint_hook(make_cfg, tmp_path, at, kept):
    """OUT_DIR, the kept list and MAX_KEEP apply to it; a step that just saved is not saved twice."""
    out = tmp_path / "out"
    opts = ("TRAIN.SAVE_AS_JSON", False, "HOOKS.CHECKPOINT.PERIOD", 2, "HOOKS.CHECKPOINT.MAX_KEEP", 2,
            "HOOKS.CHECKPOINT.OUT_DIR", out)
    trainer = toy_trainer(make_cfg(*opts), SignalAt(at))
    saved = []
    original = trainer.checkpointer.save

    def spy(filename, **kwargs):
        saved.append(filename)
        return original(filename, **kwargs)

    trainer.checkpointer.save = spy
    message = f"after iteration {at}; checkpoint {out}/model_iter{at}.pth"
    with pytest.raises(TrainingInterrupted, match=re.escape(message)):
        trainer.train()
    assert saved == [f"model_iter{n}.pth" for n in range(2, at + 1, 2)] + ([f"model_iter{at}.pth"] if at % 2 else [])
    assert regular_iters(out) == kept and not regular_iters(trainer.output_dir)
    assert read_last_checkpoint(trainer.output_dir) == str(out / f"model_iter{at}.pth")
    assert torch.load(out / f"model_iter{at}.pth", weights_only=True)["hooks"]["CheckpointHook"]["kept"] == [
        f"model_iter{n}.pth" for n in kept]

    resumed = toy_trainer(make_cfg(*opts, "SOLVER.MAX_ITER", 8))
    resumed.resume_or_load(resume=True)
    assert resumed.start_iter == at
    resumed.train()
    assert regular_iters(out) == [6, 8]  # MAX_KEEP pruned the signal checkpoint like any other


def test_signal_checkpoint_without_a_checkpoint_hook_goes_to_ckpt(make_cfg):
    trainer = toy_trainer(make_cfg("TRAIN.SAVE_AS_JSON", False), SignalAt(3, signal.SIGINT), default_hooks=False)
    with pytest.raises(TrainingInterrupted, match="stopped by SIGINT after iteration 3") as stop:
        trainer.train()
    assert stop.value.exit_code == 128 + signal.SIGINT
    assert read_last_checkpoint(trainer.output_dir) == os.path.join(trainer.output_dir, "model_iter3.pth")


def test_nan_loss_stops_naming_iteration_and_term_and_keeps_last_checkpoint(tmp_path):
    ckpt = tmp_path / "run"
    code, _, err = run_toy_train_here(ckpt, 20, "--nan-at", "7", "--interval", "2")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert "Non-finite loss at iteration 7: loss_l1=nan" in lines[0] and "SOLVER.SKIP_NONFINITE" in lines[0]
    assert (ckpt / "last_checkpoint").read_text() == "model_iter6.pth"
    assert not (ckpt / "model_final.pth").exists()


def test_the_finite_check_uses_the_loss_reduced_over_processes(make_cfg, monkeypatch):
    """Another rank's NaN reaches this one through the step's single reduction: every rank skips together."""
    calls = []

    def reduce_like_another_rank_had_nan(values, flag, **kwargs):
        calls.append(dict(values))
        reduced = dict(values, data_time=123.0)
        if len(calls) == 3:
            reduced.update(loss_l1=float("nan"), total_loss=float("nan"))
        return reduced, flag

    monkeypatch.setattr(comm, "reduce_scalars_with_flag", reduce_like_another_rank_had_nan)
    trainer = toy_trainer(make_cfg("SOLVER.MAX_ITER", 5, "SOLVER.SKIP_NONFINITE", True, "TRAIN.SAVE_AS_JSON", False),
                          default_hooks=False)
    trainer.train()
    assert len(calls) == 5 and all(math.isfinite(c["total_loss"]) for c in calls)  # once per step, local values
    assert trainer.train_step.nonfinite_skipped == 1
    assert trainer.storage.history("data_time").values()[-1][0] == 123.0  # stored as reduced, not reduced again
    assert math.isnan(trainer.storage.history("total_loss").values()[2][0])


def _nonfinite_worker(rank, init_file, opts):
    torch.manual_seed(0)
    cfg = load_cfg(None, opts)
    trainer = Trainer(cfg, model=NanLossModel(nan_at=3, rank=1), data_loader=IndexedToyLoader(seed=rank))
    try:
        trainer.train()
        outcome = "finished"
    except Exception as exc:  # reported, not raised: the parent compares what every rank saw
        outcome = f"{type(exc).__name__}: {exc}".split(". ")[0]
    return rank, outcome, trainer.iter, trainer.train_step.nonfinite_skipped


@pytest.mark.slow
@pytest.mark.parametrize("skip, expected", [
    (True, ("finished", 6, 1)),
    (False, ("TrainingError: Non-finite loss at iteration 3: loss_l1=nan", 2, 0)),
])
def test_a_nan_on_one_rank_stops_or_skips_on_every_rank_without_hanging(tmp_path, skip, expected):
    opts = ["CKPT", str(tmp_path / "run"), "DEVICE", "cpu", "SOLVER.MAX_ITER", "6", "SOLVER.BASE_LR", "0.01",
            "SOLVER.WARMUP_ITERS", "0", "TRAIN.SAVE_AS_JSON", "False", "DISPLAY_ITER", "100",
            "SOLVER.SKIP_NONFINITE", str(skip)]
    results = run_two_ranks(_nonfinite_worker, tmp_path / "init", opts)  # a hang: queue.Empty
    assert results == [(0, *expected), (1, *expected)]


class SignalRankOne(TrainHook):
    """Sends SIGTERM to rank 1's own process after its third step: rank 0 never receives it."""

    def after_step(self, trainer, **kwargs):
        if dist.get_rank() == 1 and trainer.iter == 3:
            os.kill(os.getpid(), signal.SIGTERM)


def _signal_worker(rank, init_file, opts):
    torch.manual_seed(0)
    trainer = Trainer(load_cfg(None, opts), model=ToyModel(), data_loader=IndexedToyLoader(seed=rank))
    trainer.register_hook(SignalRankOne())
    try:
        trainer.train()
        outcome = "finished"
    except TrainingInterrupted as exc:
        outcome = str(exc).split(";")[0]
    return rank, outcome, trainer.iter


@pytest.mark.slow
def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """The signal travels in the step's reduction: no rank waits in a collective the others never join."""
    opts = ["CKPT", str(tmp_path / "run"), "DEVICE", "cpu", "SOLVER.MAX_ITER", "8", "SOLVER.BASE_LR", "0.01",
            "SOLVER.WARMUP_ITERS", "0", "TRAIN.SAVE_AS_JSON", "False", "DISPLAY_ITER", "100"]
    results = run_two_ranks(_signal_worker, tmp_path / "init", opts)  # a hang: queue.Empty
    # Rank 1 is signalled during step 3's hooks; the next step's reduction carries it to rank 0.
    assert results == [(r, "Training stopped by SIGTERM after iteration 4", 4) for r in range(2)]
    assert read_last_checkpoint(str(tmp_path / "run")).endswith("model_iter4.pth")


def test_skip_nonfinite_skips_and_counts(tmp_path):
    ckpt = tmp_path / "run"
    code, out, err = run_toy_train_here(ckpt, 10, "--nan-at", "4", "SOLVER.SKIP_NONFINITE", "True")
    assert code == 0, err
    assert "Non-finite loss at iteration 4 (loss_l1=nan); step skipped (1 skipped so far)" in out
    last = read_metrics(str(ckpt / "metrics.json"))[-1]
    assert last["iteration"] == 10 and last["nonfinite_skipped"] == 1
    assert all(torch.isfinite(v).all() for v in final_weights(ckpt).values())




class StackAtSave(TrainHook):
    """Records the call stack of the checkpoint write, from the write up to the loop's ``_save_and_stop``."""

    def __init__(self) -> None:
        self.frames, self.counters = [], None

    def before_stop(self, trainer, storage, **kwargs):
        self.counters = (trainer.iter, storage.iter)

    def before_save_checkpoint(self, **kwargs):
        stack = [(os.path.basename(f.filename), f.function) for f in inspect.stack()[1:]]
        self.frames = stack[:stack.index(("loops.py", "_save_and_stop")) + 1]


@pytest.mark.parametrize("default_hooks", [True, False], ids=["CheckpointHook", "no-hook"])
def test_a_stop_goes_one_way_loop_then_hook_then_checkpointer(make_cfg, default_hooks):
    """SIGTERM: the loop calls before_stop, CheckpointHook saves through the checkpointer, whose
    before_save_checkpoint goes to the hooks: nothing calls back into the loop (or the trainer). Without a
    CheckpointHook the loop saves through the checkpointer itself."""
    trace = StackAtSave()
    trainer = toy_trainer(make_cfg("HOOKS.CHECKPOINT.PERIOD", 100, "TRAIN.SAVE_AS_JSON", False), SignalAt(3), trace,
                          default_hooks=default_hooks)
    with pytest.raises(TrainingInterrupted, match=re.escape(f"checkpoint {trainer.output_dir}/model_iter3.pth")):
        trainer.train()
    hook = [("checkpoint.py", "before_stop"), ("base.py", "__call__"), ("loops.py", "call_hooks")]
    assert trace.frames == [("base.py", "__call__"), ("checkpointer.py", "save"),
                            *([("checkpoint.py", "_save_regular"), ("checkpoint.py", "_save_unless_saved"), *hook]
                              if default_hooks else []),
                            ("loops.py", "_save_and_stop")]
    assert read_last_checkpoint(trainer.output_dir) == os.path.join(trainer.output_dir, "model_iter3.pth")
    assert trace.counters == (3, 3)  # before_stop sees the last completed iteration, one counter
