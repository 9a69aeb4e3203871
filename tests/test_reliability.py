"""Faults injected for real: signals, SIGKILL at a random iteration, a NaN loss."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from pet.engine.events import read_metrics

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


def test_sigterm_saves_a_checkpoint_and_resume_continues_from_it(tmp_path):
    ckpt = tmp_path / "run"
    proc = start(ckpt, 400, "--sleep", "0.02", "--interval", "1000")
    wait_for_iteration(ckpt, 5, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: Training stopped by SIGTERM after iteration ")
    stopped_at = int(lines[0].split("after iteration ")[1].split(";")[0])
    assert (ckpt / "last_checkpoint").read_text() == f"model_iter{stopped_at}.pth"
    assert not (ckpt / "model_final.pth").exists()

    code, out, err = run(ckpt, stopped_at + 3)
    assert code == 0, err
    assert f"Resumed from {ckpt}/model_iter{stopped_at}.pth at iteration {stopped_at}" in out
    iterations = [r["iteration"] for r in read_metrics(str(ckpt / "metrics.json"))]
    assert iterations == list(range(1, stopped_at + 4))  # one consistent history, no gap, no repeat


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
