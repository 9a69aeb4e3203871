"""Beyond one torchrun agent: two agents as two nodes (c10d rendezvous on 127.0.0.1, gloo), an elastic restart after
a worker is SIGKILLed, srun's variables without torchrun, a CKPT that is not shared, a hung rank; and the pure parts
(SLURM's node lists and variables, threads per process, the per-round store keys).

Every run is the demo config on the tiny set, 4 iterations of 2 images (one per process), one thread per process:
runs compare bit for bit only with the same threads per process. One uninterrupted two-process run (``reference``)
is what the two-node, the restarted and the SLURM runs must equal, weight for weight.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pet.utils.launch_env import (
    expand_nodelist,
    slurm_environment,
    slurm_master_port,
    tasks_per_node,
    threads_per_process,
)
from pet.utils.process_group import round_store
from support.helpers import (
    DEMO_CFG,
    ROOT,
    final_weights,
    run_tool,
    run_tool_captured,
    run_tool_on_two_ranks,
    tiny_set_opts,
)

MAX_ITER = 4
ENV = {"OMP_NUM_THREADS": "1"}


def _opts(tiny_set: str, ckpt: str, *extra: str) -> list[str]:
    return [*tiny_set_opts(tiny_set, ckpt, max_iter=MAX_ITER, test_batch=1, display_iter=1, checkpoint_period=2),
            "DEVICE", "cpu", "SEED", "3", "HOOKS.EVAL.PERIOD", "0", "SOLVER.AMP.ENABLED", "False", "NUM_THREADS", "1",
            "TEST.AMP.ENABLED", "False", "MODEL.FLOPS_INPUT_SIZE", "()", "TRAIN.USE_TENSORBOARD", "False",
            "TRAIN.SAVE_AS_JSON", "False", *extra]  # no metrics.json, no curves: a second less per run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """(exit status, stdout + stderr) of each process, once all have ended."""
    try:
        return [(p.returncode, out + err) for p in procs for out, err in [p.communicate(timeout=300)]]
    finally:
        for p in procs:
            p.kill()


def _two_nodes(tool: str, ckpts: tuple[str, str], *args: str, max_restarts: int = 0) -> list[tuple[int, str]]:
    """``tools/<tool>`` under two torchrun agents on this machine, one process each, as two nodes would run it
    (``--rdzv-backend c10d`` on a free port); node ``i`` writes to ``ckpts[i]``."""
    endpoint, run_id = f"127.0.0.1:{_free_port()}", uuid.uuid4().hex[:8]
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
                               "--max-restarts", str(max_restarts), os.path.join(ROOT, "tools", tool), *args, "CKPT",
                               ckpt], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **ENV}) for ckpt in ckpts]
    return _finish(procs)


@pytest.fixture(scope="module")
def reference(tiny_set, tmp_path_factory) -> str:
    """The uninterrupted run: two processes as torchrun starts them on one node (forked, not through an agent: the
    weights are what the tests compare, and the agents are theirs); its CKPT."""
    ckpt = str(tmp_path_factory.mktemp("multinode") / "reference")
    ranks = run_tool_on_two_ranks("train_net.py", "--cfg", DEMO_CFG, *_opts(tiny_set, ckpt))
    assert [proc.returncode for proc in ranks] == [0, 0], ranks[0].stderr[-3000:] + ranks[1].stderr[-3000:]
    return ckpt


def _assert_same_weights(ckpt: str, reference: str) -> None:
    ours, ref = final_weights(ckpt), final_weights(reference)
    assert ours.keys() == ref.keys() and len(ref) > 10
    assert [name for name in ref if not torch.equal(ours[name], ref[name])] == []


# ---------------------------------------------------------------------------------------- two nodes, elastic
@pytest.mark.slow
def test_two_nodes_survive_a_killed_worker_and_end_as_one_uninterrupted_node(reference, tiny_set, tmp_path):
    """Rank 1 is SIGKILLed after iteration 3 (its checkpoint of iteration 2 complete): rank 0 stops with one line,
    both agents start a new round (--max-restarts 1) whose process group forms, and it resumes from
    model_iter2.pth by itself, ending with the weights of one agent with two processes that was never stopped."""
    ckpt = str(tmp_path / "two_nodes")
    kill = "[{'type': 'support.kill_plugins.KillRankAt', 'at': 3, 'rank': 1}]"
    results = _two_nodes("train_net.py", (ckpt, ckpt), "--cfg", DEMO_CFG, *_opts(tiny_set, ckpt)[2:],
                         "HOOKS.CUSTOM", kill, max_restarts=1)
    output = "\n".join(out for _, out in results)
    assert [code for code, _ in results] == [0, 0], output[-4000:]
    assert os.path.exists(os.path.join(ckpt, "killed_rank1_at_3"))
    assert "Error: Stopped: rank 0 lost another process of the run" in output
    assert "Traceback" not in "".join(line for line in output.splitlines(keepends=True) if line.startswith("[rank"))
    with open(os.path.join(ckpt, "log.txt")) as f:
        log = f.read()
    assert "2 processes on 2 node(s), launched by torchrun" in log  # the ranks table, once per start
    assert "Restart 1 of at most 1 (torchrun --max-restarts)" in log
    assert f"Resumed from {ckpt}/model_iter2.pth at iteration 2" in log
    _assert_same_weights(ckpt, reference)


@pytest.mark.slow
def test_two_node_test_net_writes_the_detections_of_one_process(reference, tiny_set, tmp_path):
    weights = os.path.join(reference, "model_final.pth")
    one = str(tmp_path / "one")  # one process: this one (the same code, the same single thread)
    proc = run_tool_captured("test_net.py", "--cfg", DEMO_CFG, *_opts(tiny_set, one), "TEST.WEIGHTS", weights)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = str(tmp_path / "two")
    results = _two_nodes("test_net.py", (two, two), "--cfg", DEMO_CFG, *_opts(tiny_set, two)[2:],
                         "TEST.WEIGHTS", weights, "TEST.IMS_PER_BATCH", "2")  # one image per process, as above
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:]
    detections = []
    for ckpt in (one, two):
        with open(os.path.join(ckpt, "test", "bbox.json")) as f:
            detections.append(json.load(f))
    assert detections[0] and detections[0] == detections[1]


# ---------------------------------------------------------------------------------------- SLURM without torchrun
@pytest.mark.slow
def test_processes_started_as_srun_starts_them_train_as_torchrun_does(reference, tiny_set, tmp_path):
    """Two processes (forked, with srun's variables and none of torchrun's) that Pet joins by itself."""
    ckpt = str(tmp_path / "slurm")
    slurm = {"SLURM_NTASKS": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "4242",
             "SLURM_TASKS_PER_NODE": "2", "MASTER_PORT": str(_free_port())}
    ranks = run_tool_on_two_ranks("train_net.py", "--cfg", DEMO_CFG, *_opts(tiny_set, ckpt),
                                  env=[{**slurm, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)} for r in range(2)])
    assert [proc.returncode for proc in ranks] == [0, 0], ranks[0].stderr[-3000:] + ranks[1].stderr[-3000:]
    with open(os.path.join(ckpt, "log.txt")) as f:
        assert "2 processes on 1 node(s), launched by slurm" in f.read()
    _assert_same_weights(ckpt, reference)


# ---------------------------------------------------------------------------------------- one clear line
@pytest.mark.slow
def test_a_node_that_sees_another_ckpt_stops_every_rank_naming_it(reference, tiny_set, tmp_path):
    """Node A resumes from a copy of the reference run, node B's CKPT is an empty folder (not the shared one)."""
    shared, other = str(tmp_path / "shared"), str(tmp_path / "not_shared")
    shutil.copytree(reference, shared)
    os.makedirs(other)
    results = _two_nodes("train_net.py", (shared, other), "--cfg", DEMO_CFG, *_opts(tiny_set, shared)[2:])
    output = "\n".join(out for _, out in results)
    assert [code for code, _ in results] != [0, 0]
    errors = [line for line in output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 2 and errors[0] == errors[1], output[-3000:]  # every rank, the same one line
    assert "do not see the same checkpoint" in errors[0] and f"no last_checkpoint in {other}" in errors[0]
    assert "last_checkpoint model_iter4.pth" in errors[0] and socket.gethostname() in errors[0]
    assert "Traceback" not in "".join(line for line in output.splitlines(keepends=True) if line.startswith("[rank"))
    assert sorted(os.listdir(other)) in (["log.txt"], ["log.txt.rank1"])  # nothing trained or saved there


@pytest.mark.slow
def test_a_hung_rank_ends_the_run_after_dist_timeout(tiny_set, tmp_path):
    ckpt = str(tmp_path / "hang")
    sleep = "[{'type': 'support.kill_plugins.SleepAt', 'at': 2, 'rank': 1, 'seconds': 12}]"
    proc = run_tool("train_net.py", "--cfg", DEMO_CFG, *_opts(tiny_set, ckpt), "DIST.TIMEOUT_S", "3",
                    "HOOKS.CUSTOM", sleep, nproc=2, threads=1, check=False, env=ENV)
    assert proc.returncode != 0
    assert "Error: Stopped: rank 0 waited DIST.TIMEOUT_S for another process of the run, which hung or died " \
           "(Timed out waiting 3000ms" in proc.stderr, proc.stderr[-3000:]
    assert "[rank0]: Traceback" not in proc.stderr
    assert not os.path.exists(os.path.join(ckpt, "model_final.pth"))


# ---------------------------------------------------------------------------------------- the parts
@pytest.mark.parametrize("nodelist, hosts", [
    ("node07", ["node07"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu1,gpu[3-5]", ["gpu1", "gpu3", "gpu4", "gpu5"]),
    ("a[1-2]-b[3-4]", ["a1-b3", "a1-b4", "a2-b3", "a2-b4"]),
    ("n[08-10]", ["n08", "n09", "n10"]),  # the padding of the first bound
    ("rack1-n[1,3],login", ["rack1-n1", "rack1-n3", "login"]),
])
def test_slurm_node_lists_expand_as_scontrol_does(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["node[1-3", "node[a-b]", "node[3-1]"])
def test_a_malformed_node_list_is_an_error_naming_it(nodelist):
    with pytest.raises(ValueError, match=r"SLURM node list"):
        expand_nodelist(nodelist)


def test_slurm_variables_become_torchruns():
    srun = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
            "SLURM_JOB_NODELIST": "gpu[03-06]", "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_JOB_ID": "123456"}
    assert slurm_environment(srun) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                       "GROUP_RANK": "2", "MASTER_ADDR": "gpu03", "MASTER_PORT": "13456"}
    assert slurm_master_port("123456") == 13456 and 10000 <= slurm_master_port("99999999") < 30000
    assert slurm_environment({**srun, "MASTER_PORT": "29999"})["MASTER_PORT"] == "29999"  # a port set is kept
    assert slurm_environment({**srun, "RANK": "0", "WORLD_SIZE": "8"}) == {}  # torchrun inside srun: torchrun's win
    assert slurm_environment({}) == {}
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST is not: start each process with srun"):
        slurm_environment({k: v for k, v in srun.items() if k != "SLURM_JOB_NODELIST"})


def test_threads_are_the_config_then_omp_then_a_share_of_the_machine():
    assert threads_per_process(3, {"OMP_NUM_THREADS": "2"}, 16, 4) == (3, "NUM_THREADS")
    assert threads_per_process(0, {"OMP_NUM_THREADS": "2"}, 16, 4) == (2, "OMP_NUM_THREADS")
    assert threads_per_process(0, {}, 16, 4) == (4, "16 / 4 processes on this machine")
    assert threads_per_process(0, {}, 2, 4)[0] == 1


def test_each_round_of_a_restarted_group_gets_fresh_keys_in_a_store_that_outlives_it():
    """Two rounds of two ranks on one TCPStore (as torchrun's agent keeps it), with a dead process's request left
    over: in each round rank 0 reads the key rank 1 writes late (after a pause), and gets this round's value, not
    the one the previous round left."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))

    def one_round(name: str) -> str | None:
        seen: list[str] = []

        def join(rank: int) -> None:
            client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
            store = round_store(client, rank, 2, timeout_s=10)
            if rank == 1:
                time.sleep(0.5)
                store.set("address_of_rank1", name)
            else:
                seen.append(store.get("address_of_rank1").decode())

        threads = [threading.Thread(target=join, args=(rank,)) for rank in (1, 0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return seen[0] if seen else None

    assert one_round("first") == "first"
    server.set("pet/round/ask/1", "a-token-of-a-dead-worker")
    assert one_round("second") == "second"
