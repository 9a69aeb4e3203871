"""Faults injected for real: signals, SIGKILL at a random iteration, a NaN loss, a full disk, leftover files."""
from __future__ import annotations

import math
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from conftest import IndexedToyLoader, ToyModel, run_two_ranks

from pet.config import load_cfg
from pet.engine.checkpoint import read_last_checkpoint
from pet.engine.events import read_metrics
from pet.engine.hooks import TrainHook
from pet.engine.trainer import Trainer
from pet.utils import comm
from pet.utils.errors import TrainingInterrupted

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "toy_train.py")


def start(ckpt, max_iter, *args):
    return subprocess.Popen([sys.executable, SCRIPT, "--ckpt", str(ckpt), "--max-iter", str(max_iter), *args],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def run(ckpt, max_iter, *args):
    proc = start(ckpt, max_iter, *args)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def wait_for_iteration(ckpt, iteration, proc, timeout=60.0):
    path = os.path.join(ckpt, "metrics.json")
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(path) and any(r["iteration"] >= iteration for r in read_metrics(path)):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"iteration {iteration} not reached")


def final_weights(ckpt):
    return torch.load(os.path.join(ckpt, "model_final.pth"), weights_only=True)["model"]


# Loaded by dotted path in the child: they show that after_train ran and the writers were closed.
MARKERS = ("HOOKS.CUSTOM", "[{'type': 'fault_plugins.AfterTrainMarker'}]",
           "TRAIN.WRITERS", "[{'type': 'fault_plugins.CloseMarker'}]")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_saves_a_checkpoint_and_resume_continues_from_it(tmp_path, signum):
    ckpt = tmp_path / "run"
    proc = start(ckpt, 400, "--sleep", "0.02", "--interval", "1000", *MARKERS)
    wait_for_iteration(ckpt, 5, proc)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: Training stopped by {signum.name} after iteration ")
    stopped_at = int(lines[0].split("after iteration ")[1].split(";")[0])
    assert f"checkpoint {ckpt}/model_iter{stopped_at}.pth." in lines[0]
    assert (ckpt / "last_checkpoint").read_text() == f"model_iter{stopped_at}.pth"
    assert not (ckpt / "model_final.pth").exists()
    assert (ckpt / "after_train.txt").read_text() == str(stopped_at)
    assert (ckpt / "writer_closed.txt").read_text() == str(stopped_at)
    assert read_metrics(str(ckpt / "metrics.json"))[-1]["iteration"] == stopped_at

    code, out, err = run(ckpt, stopped_at + 3)
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
        if trainer.iter + 1 == self.at:
            os.kill(os.getpid(), self.signum)


def _toy_trainer(cfg, *hooks, default_hooks=True):
    torch.manual_seed(0)
    trainer = Trainer(cfg, model=ToyModel(), data_loader=IndexedToyLoader(), default_hooks=default_hooks)
    trainer.register_hooks(hooks)
    return trainer


def _iters_in(directory):
    return sorted(int(m[1]) for m in map(re.compile(r"model_iter(\d+)\.pth").fullmatch, os.listdir(directory)) if m)


@pytest.mark.parametrize("at, kept", [(5, [4, 5]), (4, [2, 4])])
def test_signal_checkpoint_goes_through_the_checkpoint_hook(make_cfg, tmp_path, at, kept):
    """OUT_DIR, the kept list and MAX_KEEP apply to it; a step that just saved is not saved twice."""
    out = tmp_path / "out"
    opts = ("TRAIN.SAVE_AS_JSON", False, "HOOKS.CHECKPOINT.INTERVAL", 2, "HOOKS.CHECKPOINT.MAX_KEEP", 2,
            "HOOKS.CHECKPOINT.OUT_DIR", out)
    trainer = _toy_trainer(make_cfg(*opts), SignalAt(at))
    saved = []
    original = trainer.save_checkpoint

    def spy(filename, **kwargs):
        saved.append(filename)
        return original(filename, **kwargs)

    trainer.save_checkpoint = spy
    message = f"after iteration {at}; checkpoint {out}/model_iter{at}.pth"
    with pytest.raises(TrainingInterrupted, match=re.escape(message)):
        trainer.train()
    assert saved == [f"model_iter{n}.pth" for n in range(2, at + 1, 2)] + ([f"model_iter{at}.pth"] if at % 2 else [])
    assert _iters_in(out) == kept and not _iters_in(trainer.output_dir)
    assert read_last_checkpoint(trainer.output_dir) == str(out / f"model_iter{at}.pth")
    assert torch.load(out / f"model_iter{at}.pth", weights_only=True)["hooks"]["CheckpointHook"]["kept"] == [
        f"model_iter{n}.pth" for n in kept]

    resumed = _toy_trainer(make_cfg(*opts, "SOLVER.MAX_ITER", 8))
    resumed.resume_or_load(resume=True)
    assert resumed.start_iter == at
    resumed.train()
    assert _iters_in(out) == [6, 8]  # MAX_KEEP pruned the signal checkpoint like any other


def test_signal_checkpoint_without_a_checkpoint_hook_goes_to_ckpt(make_cfg):
    trainer = _toy_trainer(make_cfg("TRAIN.SAVE_AS_JSON", False), SignalAt(3, signal.SIGINT), default_hooks=False)
    with pytest.raises(TrainingInterrupted, match="stopped by SIGINT after iteration 3") as stop:
        trainer.train()
    assert stop.value.exit_code == 128 + signal.SIGINT
    assert read_last_checkpoint(trainer.output_dir) == os.path.join(trainer.output_dir, "model_iter3.pth")


def test_sigkill_at_a_random_iteration_then_resume_ends_bit_identical(tmp_path):
    reference = tmp_path / "reference"
    code, _, err = run(reference, 30)
    assert code == 0, err

    ckpt = tmp_path / "killed"
    proc = start(ckpt, 30, "--sleep", "0.01")
    wait_for_iteration(ckpt, random.Random(os.getpid()).randint(3, 25), proc)
    proc.kill()
    proc.communicate()
    leftovers = [f for f in os.listdir(ckpt) if ".tmp" in f]
    code, _, err = run(ckpt, 30)
    assert code == 0, err
    assert not [f for f in os.listdir(ckpt) if ".tmp" in f], leftovers
    for name, value in final_weights(reference).items():
        assert torch.equal(value, final_weights(ckpt)[name]), name


def test_nan_loss_stops_naming_iteration_and_term_and_keeps_last_checkpoint(tmp_path):
    ckpt = tmp_path / "run"
    code, _, err = run(ckpt, 20, "--nan-at", "7", "--interval", "2")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert "Non-finite loss at iteration 7: loss_l1=nan" in lines[0] and "SOLVER.SKIP_NONFINITE" in lines[0]
    assert (ckpt / "last_checkpoint").read_text() == "model_iter6.pth"
    assert not (ckpt / "model_final.pth").exists()


def test_the_finite_check_uses_the_loss_reduced_over_processes(make_cfg, monkeypatch):
    """Another rank's NaN reaches this one through the step's single reduction: every rank skips together."""
    calls = []

    def reduce_like_another_rank_had_nan(values, **kwargs):
        calls.append(dict(values))
        reduced = dict(values, data_time=123.0)
        if len(calls) == 3:
            reduced.update(loss_l1=float("nan"), total_loss=float("nan"))
        return reduced

    monkeypatch.setattr(comm, "reduce_scalars", reduce_like_another_rank_had_nan)
    trainer = _toy_trainer(make_cfg("SOLVER.MAX_ITER", 5, "SOLVER.SKIP_NONFINITE", True, "TRAIN.SAVE_AS_JSON", False),
                           default_hooks=False)
    trainer.train()
    assert len(calls) == 5 and all(math.isfinite(c["total_loss"]) for c in calls)  # once per step, local values
    assert trainer.nonfinite_skipped == 1
    assert trainer.storage.history("data_time").values()[-1][0] == 123.0  # stored as reduced, not reduced again
    assert math.isnan(trainer.storage.history("total_loss").values()[2][0])


class NanOnOneRank(ToyModel):
    """Returns a NaN ``loss_l1`` on rank 1 only, at its ``nan_at``-th call."""

    def __init__(self, nan_at: int) -> None:
        super().__init__()
        self.nan_at = nan_at
        self.calls = 0

    def forward(self, x, y):
        self.calls += 1
        losses = super().forward(x, y)
        if dist.get_rank() == 1 and self.calls == self.nan_at:
            losses["loss_l1"] = losses["loss_l1"] * float("nan")
        return losses


def _nonfinite_worker(rank, init_file, opts, queue):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        cfg = load_cfg(None, opts)
        trainer = Trainer(cfg, model=NanOnOneRank(nan_at=3), data_loader=IndexedToyLoader(seed=rank))
        try:
            trainer.train()
            queue.put((rank, "finished", trainer.iter, trainer.nonfinite_skipped))
        except Exception as exc:  # reported, not raised: the parent compares what every rank saw
            queue.put((rank, f"{type(exc).__name__}: {exc}".split(". ")[0], trainer.iter, trainer.nonfinite_skipped))
    finally:
        dist.destroy_process_group()


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
        if dist.get_rank() == 1 and trainer.iter == 2:
            os.kill(os.getpid(), signal.SIGTERM)


def _signal_worker(rank, init_file, opts, queue):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        trainer = Trainer(load_cfg(None, opts), model=ToyModel(), data_loader=IndexedToyLoader(seed=rank))
        trainer.register_hook(SignalRankOne())
        try:
            trainer.train()
            queue.put((rank, "finished", trainer.iter))
        except TrainingInterrupted as exc:
            queue.put((rank, str(exc).split(";")[0], trainer.iter))
    finally:
        dist.destroy_process_group()


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
    code, out, err = run(ckpt, 10, "--nan-at", "4", "SOLVER.SKIP_NONFINITE", "True")
    assert code == 0, err
    assert "Non-finite loss at iteration 4 (loss_l1=nan); step skipped (1 skipped so far)" in out
    last = read_metrics(str(ckpt / "metrics.json"))[-1]
    assert last["iteration"] == 10 and last["nonfinite_skipped"] == 1
    assert all(torch.isfinite(v).all() for v in final_weights(ckpt).values())


def test_failed_checkpoint_write_keeps_the_previous_one_and_names_path_and_cause(tmp_path):
    ckpt = tmp_path / "run"
    code, _, err = run(ckpt, 4, "--interval", "2")
    assert code == 0, err
    previous = torch.load(ckpt / "model_iter4.pth", weights_only=True)
    # Resume with files capped at 12 kB: the 17 kB checkpoint at iteration 6 cannot be written.
    code, _, err = run(ckpt, 8, "--interval", "2", "--file-size-limit", "12000")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"Could not write {ckpt}/model_iter6.pth" in lines[0]
    assert "File too large" in lines[0] and "The previous checkpoint is intact" in lines[0]
    assert (ckpt / "last_checkpoint").read_text() == "model_iter4.pth"
    assert not [f for f in os.listdir(ckpt) if ".tmp" in f]
    reloaded = torch.load(ckpt / "model_iter4.pth", weights_only=True)
    assert all(torch.equal(v, reloaded["model"][k]) for k, v in previous["model"].items())


def test_a_full_disk_keeps_the_previous_checkpoint_and_names_path_and_cause(tmp_path):
    """A real ENOSPC: checkpoints go to a tmpfs shrunk to hold the first one and not the second."""
    ckpt, disk = tmp_path / "run", tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "pet-test-tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        out_dir = ("--interval", "2", "HOOKS.CHECKPOINT.OUT_DIR", str(disk))
        code, _, err = run(ckpt, 2, *out_dir)
        assert code == 0, err
        previous = torch.load(disk / "model_iter2.pth", weights_only=True)
        stats = os.statvfs(disk)
        page = stats.f_frsize
        assert os.path.getsize(disk / "model_iter2.pth") > page  # so one spare page cannot hold the next one
        used = (stats.f_blocks - stats.f_bfree) * page
        shrink = subprocess.run(["mount", "-o", f"remount,size={used + page}", str(disk)], capture_output=True,
                                text=True)
        assert shrink.returncode == 0, shrink.stderr

        code, _, err = run(ckpt, 4, *out_dir)
        assert code == 2
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert f"Could not write {disk}/model_iter4.pth: No space left on device." in lines[0]
        assert "The previous checkpoint is intact" in lines[0]
        assert (ckpt / "last_checkpoint").read_text() == str(disk / "model_iter2.pth")
        assert sorted(os.listdir(disk)) == ["model_final.pth", "model_iter2.pth"]  # no partial or temporary file
        reloaded = torch.load(disk / "model_iter2.pth", weights_only=True)
        assert reloaded["iter"] == 2
        assert all(torch.equal(v, reloaded["model"][k]) for k, v in previous["model"].items())

        subprocess.run(["mount", "-o", "remount,size=1m", str(disk)], check=True)  # space freed: resume
        code, out, err = run(ckpt, 4, *out_dir)
        assert code == 0, err
        assert f"Resumed from {disk}/model_iter2.pth at iteration 2" in out
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_resume_ignores_and_removes_leftover_temporary_files_but_not_user_files(make_cfg):
    opts = ("TRAIN.SAVE_AS_JSON", False, "HOOKS.CHECKPOINT.INTERVAL", 2)
    _toy_trainer(make_cfg(*opts, "SOLVER.MAX_ITER", 4)).train()
    ckpt = make_cfg().CKPT
    leftovers = {"model_iter6.pth.tmp4242": b"half a checkpoint", "last_checkpoint.tmp4242": b"model_iter6.pth"}
    user_files = ("notes.tmp", "model_iter6.pth.tmp", "scores.tmp1.json", "run.tmpl")
    for name, data in leftovers.items():
        with open(os.path.join(ckpt, name), "wb") as f:
            f.write(data)
    for name in user_files:
        with open(os.path.join(ckpt, name), "w") as f:
            f.write("mine")

    resumed = _toy_trainer(make_cfg(*opts, "SOLVER.MAX_ITER", 6))
    resumed.resume_or_load(resume=True)
    assert resumed.start_iter == 4
    assert not [name for name in leftovers if os.path.exists(os.path.join(ckpt, name))]
    assert all(os.path.isfile(os.path.join(ckpt, name)) for name in user_files)
    with open(os.path.join(ckpt, "last_checkpoint")) as f:
        assert f.read() == "model_iter4.pth"
    resumed.train()
    assert _iters_in(ckpt) == [2, 4, 6]


def test_only_the_main_process_removes_leftover_temporary_files(make_cfg, monkeypatch):
    _toy_trainer(make_cfg("TRAIN.SAVE_AS_JSON", False, "SOLVER.MAX_ITER", 2, "HOOKS.CHECKPOINT.INTERVAL", 2)).train()
    ckpt = make_cfg().CKPT
    leftover = os.path.join(ckpt, "model_iter4.pth.tmp4242")
    with open(leftover, "wb") as f:
        f.write(b"half a checkpoint")
    monkeypatch.setattr(comm, "is_main_process", lambda: False)
    assert read_last_checkpoint(ckpt) == os.path.join(ckpt, "model_iter2.pth")
    assert os.path.isfile(leftover)  # the main process cleans it; the others would race it


class _NotATensor:
    pass


def test_checkpoints_load_weights_only_unless_asked(tmp_path):
    from pet.engine.checkpoint import load_checkpoint
    from pet.utils.errors import ConfigError

    path = tmp_path / "pickled.pth"
    torch.save({"model": {}, "extra": _NotATensor()}, path)
    with pytest.raises(ConfigError, match="--unsafe-load"):
        load_checkpoint(str(path))
    assert isinstance(load_checkpoint(str(path), unsafe=True)["extra"], _NotATensor)
