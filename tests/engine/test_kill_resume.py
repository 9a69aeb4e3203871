"""SIGKILL a real detector's training before its first checkpoint and at three seeded iterations; the same command
restarts it each time and it ends bit for bit as an uninterrupted run.

The demo's Faster R-CNN R-10-FPN (fp32) trains through ``tools/train_net.py`` on a tiny generated shapes set.
``support.kill_plugins.KillAt`` (given through ``HOOKS.CUSTOM``) SIGKILLs the process after the step of each kill
point, before that step's metrics or checkpoint are written, so every restart resumes from an earlier
checkpoint, or starts over when there is none yet, and trains some iterations again. The first kill comes at
iteration ``INTERVAL``, the last before the first checkpoint (that run has logged iterations it never saved);
the other three come from ``random.Random(PET_KILL_SEED)`` (default 0) and are printed:
``PET_KILL_SEED=7 python -m pytest tests/engine/test_kill_resume.py -s`` tries others.
"""
from __future__ import annotations

import os
import random
import re
import signal
from typing import Any

import pytest
import torch

from pet.data import generate_shapes
from pet.engine.events import read_metrics
from support.helpers import DEMO_CFG, run_tool_forked
from support.helpers import tiny_set_opts as _opts

MAX_ITER = 12
INTERVAL = 2  # checkpoint period: a kill loses up to INTERVAL iterations, which the restart trains again
SEED = int(os.environ.get("PET_KILL_SEED", "0"))


@pytest.fixture(scope="module")
def small_shapes(tmp_path_factory) -> str:
    """8 training images of 64-96 px with 1-3 objects of 12-40 px."""
    root = str(tmp_path_factory.mktemp("small_shapes"))
    return generate_shapes(root, num_train=8, num_val=1, seed=1, image_size=(64, 96), object_size=(12, 40),
                           max_objects=3)


def _train_command(data: str, ckpt: str, *extra: str) -> list[str]:
    return ["train_net.py", "--cfg", DEMO_CFG, *_opts(data, ckpt), "SOLVER.MAX_ITER", str(MAX_ITER),
            "SOLVER.WARMUP_ITERS", "3", "SOLVER.AMP.ENABLED", "False", "HOOKS.CHECKPOINT.PERIOD", str(INTERVAL),
            "HOOKS.CHECKPOINT.MAX_KEEP", "1", "DISPLAY_ITER", "1", "TRAIN.USE_TENSORBOARD", "False",
            "MODEL.FLOPS_INPUT_SIZE", "()", "HOOKS.EVAL.PERIOD", "0",
            # One thread: on a busy 2-core machine two OpenMP threads made each step 4-8x slower.
            "NUM_THREADS", "1", *extra]


def _tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested checkpoint structure, by its path."""
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list | tuple) else ()
    return {path: t for key, value in items for path, t in _tensors(value, f"{prefix}/{key}").items()}


@pytest.mark.slow
def test_sigkill_before_the_first_checkpoint_and_at_three_seeded_iterations_ends_bit_identical(small_shapes, tmp_path):
    kills = [INTERVAL, *sorted(random.Random(SEED).sample(range(INTERVAL + 1, MAX_ITER + 1), 3))]
    resumes = [(k - 1) // INTERVAL * INTERVAL for k in kills]  # the kill comes before iteration k's checkpoint
    print(f"PET_KILL_SEED={SEED}: SIGKILL after iterations {kills}; expected restarts at {resumes}")

    # Every run is a process of its own (forked from the session's fork server: the kills are real, the imports
    # made once), so a restart starts from what the killed one left on disk, and nothing else.
    reference = tmp_path / "reference"
    run_tool_forked(*_train_command(small_shapes, str(reference)))

    ckpt = tmp_path / "killed"
    command = _train_command(small_shapes, str(ckpt),
                             "HOOKS.CUSTOM", f"[{{'type': 'support.kill_plugins.KillAt', 'at': {kills}}}]")
    for k, resume in zip(kills, resumes):
        proc = run_tool_forked(*command, check=False)
        assert proc.returncode == -signal.SIGKILL, f"not killed at {k}: {proc.returncode}\n{proc.stderr[-3000:]}"
        assert sorted(p.name for p in ckpt.glob("killed_at_*")) == sorted(f"killed_at_{j}" for j in kills if j <= k)
        if resume:
            assert (ckpt / "last_checkpoint").read_text() == f"model_iter{resume}.pth"
        else:  # killed before the first checkpoint: nothing to resume, the same command starts over
            assert not (ckpt / "last_checkpoint").exists() and not list(ckpt.glob("*.pth"))
        assert not (ckpt / "model_final.pth").exists()
    run_tool_forked(*command)

    log = (ckpt / "log.txt").read_text(encoding="utf-8")
    assert re.findall(r"Resumed from (\S+) at iteration (\d+)", log) == [
        (str(ckpt / f"model_iter{r}.pth"), str(r)) for r in resumes if r]
    assert [r["iteration"] for r in read_metrics(str(ckpt / "metrics.json"))] == list(range(1, MAX_ITER + 1))
    expected = torch.load(reference / "model_final.pth", weights_only=True)
    final = torch.load(ckpt / "model_final.pth", weights_only=True)
    assert final["iter"] == expected["iter"] == MAX_ITER
    for part in ("model", "optimizer"):
        ours, ref = _tensors(final[part]), _tensors(expected[part])
        assert ours.keys() == ref.keys() and len(ours) > 10
        assert [name for name in ref if not torch.equal(ours[name], ref[name])] == [], part
