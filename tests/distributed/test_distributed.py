"""Two real processes (gloo on CPU): training and sharded inference as a user runs them (torchrun), resume and the
errors every rank must stop at (two processes forked as torchrun's workers, each with its own output)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from pet import cli
from pet.checkpoint import load_checkpoint
from pet.cli import distributed_backend, init_distributed
from pet.engine.events import read_metrics
from pet.utils import comm
from support.helpers import DEMO_CFG, run_tool, run_tool_captured, run_tool_on_two_ranks, tiny_set_opts
from support.processes import run_two_ranks


def _opts(tiny_set: str, ckpt: str, max_iter: int = 4, test_batch: int = 1) -> list[str]:
    return [*tiny_set_opts(tiny_set, ckpt, max_iter=max_iter, test_batch=test_batch, display_iter=2,
                           checkpoint_period=2),
            "DEVICE", "cpu", "SEED", "3", "HOOKS.EVAL.PERIOD", "0"]


@pytest.fixture(scope="module")
def trained(tiny_set, tmp_path_factory):
    """A 4-iteration run in 2 processes (1 image each); its output directory and stdout."""
    ckpt = str(tmp_path_factory.mktemp("dist") / "run")
    proc = run_tool("train_net.py", "--cfg", DEMO_CFG, *_opts(tiny_set, ckpt), nproc=2)
    return ckpt, proc.stdout


@pytest.mark.slow
def test_two_process_training_writes_one_set_of_outputs(trained):
    ckpt, stdout = trained
    assert [r["iteration"] for r in read_metrics(os.path.join(ckpt, "metrics.json"))] == [2, 4]
    checkpoints = sorted(f for f in os.listdir(ckpt) if f.endswith(".pth"))
    assert checkpoints == ["model_final.pth", "model_iter2.pth", "model_iter4.pth"]
    with open(os.path.join(ckpt, "last_checkpoint")) as f:
        assert f.read() == "model_iter4.pth"  # the newest regular checkpoint
    assert load_checkpoint(os.path.join(ckpt, "model_iter4.pth"))["iter"] == 4
    assert not [f for f in os.listdir(ckpt) if ".tmp" in f]  # Pet stages writes in "<name>.tmp<pid>"
    with open(os.path.join(ckpt, "log.txt")) as f:
        log = f.read()
    assert "Rank 0 of 2" in log and "Rank 1 of 2" not in log
    # Rank 1 keeps its own file (log.txt.rank1, warnings and its set-up line) and prints nothing but warnings.
    assert set(f for f in os.listdir(ckpt) if f.startswith("log.txt")) == {"log.txt", "log.txt.rank1"}
    assert "Rank 1 of 2" not in stdout and stdout.count("Overall training speed") == 1


@pytest.mark.slow
def test_two_process_test_matches_one_process(trained, tiny_set):
    """Same weights, 1 vs 2 processes: identical image ids, detections and AP.

    Batch 1 per process in both runs: in a batch, images are zero-padded to the largest one, and a
    different padding changes the backbone's output at the borders, so per-image outputs are only
    comparable when each process sees the same batches (here, one image each).
    """
    ckpt, _ = trained
    weights = os.path.join(ckpt, "model_final.pth")
    reports, detections = [], []
    for nproc in (1, 2):
        out = os.path.join(os.path.dirname(ckpt), f"test{nproc}")
        # One thread per process in both runs: the same arithmetic, whatever the number of processes. The precision
        # is not what is compared. One process: in this one (the same code; torchrun's runs are the point).
        args = ("--cfg", DEMO_CFG, *_opts(tiny_set, out, test_batch=nproc), "TEST.WEIGHTS", weights,
                "TEST.AMP.ENABLED", "False")
        if nproc == 1:
            proc = run_tool_captured("test_net.py", *args, threads=1)
            assert proc.returncode == 0, proc.stderr[-3000:]
        else:
            run_tool("test_net.py", *args, nproc=nproc, threads=1)
        with open(os.path.join(out, "test", "metrics.json")) as f:
            reports.append(json.load(f))
        with open(os.path.join(out, "test", "bbox.json")) as f:
            detections.append(json.load(f))
    one, two = detections
    with open(os.path.join(tiny_set, "annotations", "val.json")) as f:
        all_ids = {img["id"] for img in json.load(f)["images"]}
    assert one, "the model should keep some low-score detections (SCORE_THRESH_TEST 0.01)"
    assert {d["image_id"] for d in one} == {d["image_id"] for d in two} and {d["image_id"] for d in two} <= all_ids
    assert len(one) == len(two)
    # Compared in file order (images by id, each image's detections by score): both runs do the same arithmetic
    # (one thread per process, batches of one image, the same kernels), so near-ties fall the same way in both.
    for a, b in zip(one, two):
        assert a["image_id"] == b["image_id"] and a["category_id"] == b["category_id"]
        assert a["bbox"] == pytest.approx(b["bbox"], abs=1e-3) and a["score"] == pytest.approx(b["score"], abs=1e-5)
    m1, m2 = reports[0]["metrics"], reports[1]["metrics"]
    assert m1.keys() == m2.keys() and "bbox/AP" in m1
    for key in m1:
        assert m1[key] == pytest.approx(m2[key], abs=1e-6, nan_ok=True), key
    # Each rank timed its shard of 3 images; both summaries and their combination are reported.
    assert "speed_per_rank" not in reports[0]
    per_rank = reports[1]["speed_per_rank"]
    assert len(per_rank["ranks"]) == 2 and all(r["timed_iters"] == 2 for r in per_rank["ranks"])
    assert per_rank["combined"]["iter"]["mean_ms"] > 0 and per_rank["combined"]["images_per_second"] > 0


@pytest.mark.slow
def test_two_process_resume_continues_from_the_last_checkpoint(trained, tiny_set, tmp_path):
    ckpt = str(tmp_path / "resumed")
    shutil.copytree(trained[0], ckpt)
    ranks = run_tool_on_two_ranks("train_net.py", "--cfg", DEMO_CFG, "--resume", *_opts(tiny_set, ckpt, max_iter=6))
    assert [proc.returncode for proc in ranks] == [0, 0], ranks[0].stderr[-3000:] + ranks[1].stderr[-3000:]
    with open(os.path.join(ckpt, "log.txt")) as f:
        log = f.read()
    assert "Resumed from" in log and "at iteration 4" in log
    with open(os.path.join(ckpt, "log.txt.rank1")) as f:
        assert "at iteration 4" in f.read().split("Rank 1 of 2")[-1]  # rank 1 resumed from the same point
    assert [r["iteration"] for r in read_metrics(os.path.join(ckpt, "metrics.json"))] == [2, 4, 6]
    assert "model_final.pth" in os.listdir(ckpt)
    with open(os.path.join(ckpt, "last_checkpoint")) as f:
        assert f.read() == "model_iter6.pth"
    assert load_checkpoint(os.path.join(ckpt, "model_iter6.pth"))["iter"] == 6
    assert not [f for f in os.listdir(ckpt) if ".tmp" in f]


@pytest.mark.slow
def test_sync_bn_on_cpu_is_a_config_error_in_every_rank(tiny_set, tmp_path):
    """torch's SyncBatchNorm is GPU-only: a distributed CPU run says so in one line instead of a DDP traceback."""
    opts = _opts(tiny_set, str(tmp_path / "sync"), max_iter=1)
    ranks = run_tool_on_two_ranks("train_net.py", "--cfg", DEMO_CFG, *opts, "MODEL.BACKBONE.NORM", "SyncBN")
    for proc in ranks:  # each rank: exit status 2 and the one line, no traceback
        assert proc.returncode == 2, proc.stderr[-3000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: SyncBN (MODEL.BACKBONE.NORM) needs CUDA devices"), lines


@pytest.mark.slow
@pytest.mark.parametrize("key, opts", [
    ("SOLVER.IMS_PER_BATCH", ("SOLVER.IMS_PER_BATCH", "3")),
    # Validation's batch is checked when the hooks are built, not after the run has trained for hours.
    ("TEST.IMS_PER_BATCH", ("HOOKS.EVAL.PERIOD", "1")),
])
def test_a_batch_that_cannot_be_split_stops_every_rank_before_anything_is_written(tiny_set, tmp_path, key, opts):
    ckpt = tmp_path / "uneven"
    ranks = run_tool_on_two_ranks("train_net.py", "--cfg", DEMO_CFG, *_opts(tiny_set, str(ckpt), max_iter=2), *opts)
    value = opts[1] if key == "SOLVER.IMS_PER_BATCH" else "1"
    for proc in ranks:  # each rank: exit status 2 (a config error) and the one line, no traceback
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert proc.stderr.strip().splitlines() == [
            f"Error: {key} ({value}) must be a positive multiple of the number of processes (2)."]
    assert sorted(os.listdir(ckpt)) == ["log.txt", "log.txt.rank1"]


# ---------------------------------------------------------------------------------------- backend and comm helpers
def test_backend_follows_the_run_device():
    assert distributed_backend(torch.device("cuda", 1)) == "nccl"
    assert distributed_backend(torch.device("cpu")) == "gloo"


@pytest.mark.parametrize("device, backend, current_gpu", [
    ("cpu", "gloo", None),  # a CPU run on a GPU machine: NCCL would reject its CPU tensors
    ("auto", "nccl", torch.device("cuda", 1)),
    ("cuda", "nccl", torch.device("cuda", 1)),
])
def test_init_distributed_picks_the_backend_from_cfg_device(monkeypatch, device, backend, current_gpu):
    """On a (pretend) GPU machine: the backend and current device follow DEVICE, as the trainer resolves it."""
    joined, selected = [], []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    monkeypatch.setattr(cli.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(cli.dist, "init_process_group", lambda backend, **options: joined.append(backend))
    init_distributed(device=device)
    assert joined == [backend]
    assert selected == ([current_gpu] if current_gpu else [])


def test_collective_device_is_the_current_gpu_under_nccl(monkeypatch):
    assert comm.collective_device() == torch.device("cpu")  # no process group
    monkeypatch.setattr(comm.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert comm.collective_device() == torch.device("cuda", 1)
    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: "gloo")
    assert comm.collective_device() == torch.device("cpu")


def test_reduce_scalars_builds_its_tensor_on_the_collective_device(monkeypatch):
    """What NCCL needs, checked without a GPU: the tensors reduced are built where ``collective_device`` says."""
    asked, reduced_on = [], []

    def collective_device():
        asked.append(True)
        return torch.device("cpu")

    monkeypatch.setattr(comm, "get_world_size", lambda: 2)
    monkeypatch.setattr(comm, "collective_device", collective_device)
    monkeypatch.setattr(comm.dist, "all_reduce", lambda tensor, op=None: reduced_on.append(tensor.device))
    assert comm.reduce_scalars({"loss": 1.0, "data_time": 2.0}, maximum=("data_time",)) == {
        "loss": 0.5, "data_time": 2.0}  # the fake all-reduce leaves the values as they are
    # the names' check, the sum and the max
    assert asked == [True] and reduced_on == [torch.device("cpu")] * 3


def _reduce_worker(rank, init_file):
    values = {"loss": float(rank + 1), "data_time": 0.1 * (rank + 1)}
    if rank == 0:  # a term only rank 0 has (as denoising losses in a process whose images have objects)
        values["loss_dn"] = 4.0
    return rank, str(comm.collective_device()), comm.reduce_scalars(values, maximum=("data_time",))


@pytest.mark.slow
def test_reduce_scalars_under_gloo_averages_and_takes_the_max(tmp_path):
    """The mean and max over the ranks, a term one rank lacks counting as 0 there."""
    results = run_two_ranks(_reduce_worker, tmp_path / "init", timeout=60)
    assert [rank for rank, _, _ in results] == [0, 1]
    for _, device, reduced in results:
        assert device == "cpu"
        assert reduced == pytest.approx({"loss": 1.5, "data_time": 0.2, "loss_dn": 2.0})
