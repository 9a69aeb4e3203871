"""A data-loading worker killed mid-run (as the out-of-memory killer does) stops training cleanly.

Real runs of the demo detector through ``tools/train_net.py`` with two loader workers on a tiny
shapes set; ``support.kill_plugins.KillWorkerAt`` SIGKILLs one worker after a chosen iteration. The run must
save that iteration through the CheckpointHook, end with exit status 75 and one line naming the worker,
the signal, the likely cause and what to try, and the same command must resume it to the weights of
an uninterrupted run. With two gloo processes, a worker of rank 1 dying must stop both ranks after the
same iteration (none waits forever in the gradient all-reduce).
"""
from __future__ import annotations

import os
import re
import signal

import pytest
import torch

from pet.data import workers
from pet.data.workers import WORKER_DIED_EXIT_CODE, fetch, worker_death
from support.helpers import DEMO_CFG, final_weights, run_tool, run_tool_forked, tiny_set_opts

MAX_ITER = 6
KILL_AT = 3
# How a SIGKILLed worker is reported: by its signal, or (when the fetch notices first) by its absence.
DIED = (r"(was killed by signal SIGKILL \(Killed\), most likely by the out-of-memory killer"
        r"|exited unexpectedly \(killed for memory, or crashed in native code\))")


def _opts(data: str, ckpt: str, *extra: str) -> list[str]:
    return [*tiny_set_opts(data, ckpt, max_iter=MAX_ITER, checkpoint_period=4), "DATA.NUM_WORKERS", "2",
            "SOLVER.AMP.ENABLED", "False", "SOLVER.WARMUP_ITERS", "2", "HOOKS.EVAL.PERIOD", "0", "DEVICE", "cpu",
            "MODEL.FLOPS_INPUT_SIZE", "()", "TRAIN.USE_TENSORBOARD", "False", "SEED", "5",
            "NUM_THREADS", "1", *extra]  # one thread: bit-identical arithmetic run to run


def _train(data: str, ckpt: str, *extra: str, check: bool = True):
    """A fresh interpreter, as a user starts it (in processes forked from the session's fork server, a killed
    worker's death once went unnoticed to the end of the run: 1 run in 8 of two ranks; 0 in 5 from torchrun)."""
    return run_tool("train_net.py", "--cfg", DEMO_CFG, *_opts(data, ckpt, *extra), check=check)


@pytest.fixture(scope="module")
def uninterrupted(tiny_set, tmp_path_factory) -> str:
    """The CKPT of the run a killed and resumed one must end as (no worker dies in it: a process forked from the
    session's fork server, without a fresh interpreter's imports); the test loader's test tests its weights."""
    ckpt = str(tmp_path_factory.mktemp("worker_death") / "uninterrupted")
    run_tool_forked("train_net.py", "--cfg", DEMO_CFG, *_opts(tiny_set, ckpt))
    return ckpt


def _kill_worker(ckpt: str, rank: int | None = None) -> list[str]:
    spec = {"type": "support.kill_plugins.KillWorkerAt", "at": KILL_AT, "output_dir": ckpt}
    if rank is not None:
        spec["rank"] = rank
    return ["HOOKS.CUSTOM", f"[{spec}]"]


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("Error: ")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.mark.slow
def test_a_killed_worker_saves_the_last_iteration_exits_75_and_the_same_command_resumes(uninterrupted, tiny_set,
                                                                                         tmp_path):
    ckpt = str(tmp_path / "killed")
    command = _kill_worker(ckpt)
    proc = _train(tiny_set, ckpt, *command, check=False)
    assert proc.returncode == WORKER_DIED_EXIT_CODE, proc.stderr[-3000:]
    line = _error_line(proc.stderr)
    with open(os.path.join(ckpt, "worker_killed"), encoding="utf-8") as f:
        pid = f.read().strip()
    # The death is acted on at the next fetch that sees it: usually the very next one.
    stopped = int(re.match(r"Error: Training stopped after iteration (\d+):", line).group(1))
    assert KILL_AT <= stopped < MAX_ITER, line
    saved = os.path.join(ckpt, f"model_iter{stopped}.pth")
    assert re.fullmatch(rf"Error: Training stopped after iteration {stopped}: a data-loading worker \(pid {pid}\) "
                        rf"{DIED}; checkpoint {re.escape(saved)}\. Run the same command to resume from it\. If it "
                        r"happens again: lower DATA.NUM_WORKERS \(now 2\) or SOLVER.IMS_PER_BATCH, or free memory\.",
                        line), line
    assert "Traceback" not in proc.stderr
    with open(os.path.join(ckpt, "last_checkpoint"), encoding="utf-8") as f:
        assert f.read().strip() == f"model_iter{stopped}.pth"
    assert torch.load(saved, weights_only=True)["iter"] == stopped

    _train(tiny_set, ckpt, *command)
    with open(os.path.join(ckpt, "log.txt"), encoding="utf-8") as f:
        assert f"Resumed from {saved} at iteration {stopped}" in f.read()
    expected, got = final_weights(uninterrupted), final_weights(ckpt)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected), "resumed weights differ from an uninterrupted run"


@pytest.mark.slow
def test_a_worker_dying_on_one_rank_stops_both_ranks_after_the_same_iteration(tiny_set, tmp_path):
    ckpt = str(tmp_path / "two")
    proc = run_tool("train_net.py", "--cfg", DEMO_CFG, *_opts(tiny_set, ckpt, *_kill_worker(ckpt, rank=1)), nproc=2,
                    check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error: Training stopped after")]
    assert len(errors) == 2, proc.stderr[-3000:]  # each rank says it once, and neither hangs
    stopped = set()
    for line in errors:
        found = re.search(rf"after iteration (\d+): a data-loading worker of rank 1 \(pid \d+\) {DIED}", line)
        assert found, line
        stopped.add(int(found.group(1)))
    assert len(stopped) == 1 and KILL_AT <= min(stopped) < MAX_ITER, errors  # both ranks, the same iteration
    name = f"model_iter{stopped.pop()}.pth"
    assert os.path.isfile(os.path.join(ckpt, name))
    with open(os.path.join(ckpt, "last_checkpoint"), encoding="utf-8") as f:
        assert f.read().strip() == name


@pytest.mark.parametrize("message, expected", [
    ("DataLoader worker (pid 42) is killed by signal: Killed. ",
     "data-loading worker (pid 42) was killed by signal SIGKILL (Killed), most likely by the out-of-memory killer"),
    ("DataLoader worker (pid 42) is killed by signal: Segmentation fault. ",
     "data-loading worker (pid 42) was killed by signal SIGSEGV (Segmentation fault)"),
    ("DataLoader worker (pid(s) 42, 43) exited unexpectedly",
     "data-loading worker (pid 42, 43) exited unexpectedly (killed for memory, or crashed in native code)"),
    ("DataLoader worker (pid 42) exited unexpectedly with exit code 1. Details are lost due to multiprocessing.",
     "data-loading worker (pid 42) exited unexpectedly with exit code 1 (killed for memory, or crashed in native "
     "code)"),
    ("CUDA out of memory", None),
])
def test_torchs_worker_errors_are_recognised_and_others_are_not(message, expected):
    assert worker_death(RuntimeError(message)) == expected
    assert worker_death(ValueError(message)) is None


@pytest.fixture
def dying_worker_handler():
    """A SIGCHLD handler that raises as torch's does for a killed worker (pid 7), installed for one test.

    Afterwards both the process's handler and the handler Pet's watch wraps are put back: the watch wrapping this
    fake one would report "pid 7" at every later SIGCHLD of the process (a later test's compile workers exiting).
    """
    def torchs_handler(signum, frame):
        raise RuntimeError("DataLoader worker (pid 7) is killed by signal: Killed. ")

    previous, wrapped = signal.signal(signal.SIGCHLD, torchs_handler), workers._WATCH._wrapped
    yield
    signal.signal(signal.SIGCHLD, previous)
    workers._WATCH._wrapped, workers._WATCH.death = wrapped, None


def test_a_raising_sigchld_handler_becomes_a_note_read_at_the_next_fetch(dying_worker_handler):
    """torch's handler raising mid-step (here, at an arbitrary point) is turned into a death the next fetch reports."""
    batches = iter(range(3))
    assert fetch(batches) == (0, None)  # the first fetch arms the watch over the handler it finds
    signal.raise_signal(signal.SIGCHLD)  # nothing is raised here
    batch, death = fetch(batches)
    assert batch is None and death.startswith("data-loading worker (pid 7) was killed by signal SIGKILL")
    assert fetch(batches) == (2, None)  # reported once


def test_a_death_noted_for_an_earlier_iteration_does_not_stop_the_next_one(dying_worker_handler):
    """A death noted after a run's last fetch (another run in the same process, a finished loader) belongs to
    that run: a new iteration's fetches ignore it, while the iteration it was noted in still reports it."""
    first = iter(range(3))
    assert fetch(first) == (0, None)
    signal.raise_signal(signal.SIGCHLD)  # noted after the first run's last fetch
    second = iter(range(10, 13))
    assert fetch(second) == (10, None)
    signal.raise_signal(signal.SIGCHLD)
    assert fetch(second)[1] is not None  # the iteration it happened in still hears of it


@pytest.mark.slow
def test_a_worker_of_the_test_loader_dying_is_one_line_and_exit_75(uninterrupted, shapes_set, tmp_path):
    data = shapes_set(num_train=8, num_val=8)
    ckpt = str(tmp_path / "test")
    proc = run_tool("test_net.py", "--cfg", DEMO_CFG, *tiny_set_opts(data, ckpt, test_batch=1),
                    "TEST.WEIGHTS", os.path.join(uninterrupted, "model_final.pth"),
                    "DATA.NUM_WORKERS", "2", "DEVICE", "cpu", "MODEL.FLOPS_INPUT_SIZE", "()",
                    "TEST.AMP.ENABLED", "False",  # not measured: the precision is not what is tested
                    "TEST.HOOKS", "[{'type': 'support.kill_plugins.KillTestWorker'}]", check=False)
    assert proc.returncode == WORKER_DIED_EXIT_CODE, proc.stderr[-3000:]
    line = _error_line(proc.stderr)
    assert re.fullmatch(rf"Error: Stopped: a data-loading worker \(pid [\d, ]+\) {DIED}\. Run the same command "
                        r"again \(training resumes from its last checkpoint\); if it happens again, lower "
                        r"DATA.NUM_WORKERS \(now 2\) or SOLVER.IMS_PER_BATCH, or free memory\.", line), line
    assert "Traceback" not in proc.stderr
