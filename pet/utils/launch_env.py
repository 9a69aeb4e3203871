"""Where this process sits in a distributed run, read from what its launcher set: torchrun or SLURM's srun.

torchrun (and Kubernetes' PyTorchJob, which sets the same variables) exports ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; torch's
``env://`` initialisation reads them. ``srun`` starts the processes itself and exports its own names
(``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_JOB_NODELIST``, ...):
:func:`slurm_environment` translates them into torchrun's, so the rest of Pet knows one set of names.
torchrun's win when both exist (``srun torchrun ...`` runs torchrun inside a SLURM step).

The master is the first host of ``SLURM_JOB_NODELIST``, expanded as ``scontrol show hostnames`` does
(:func:`expand_nodelist`: scontrol is not on every machine that runs Pet, e.g. inside a container), and
the port comes from the job id unless ``MASTER_PORT`` is set, so every task of a job picks the same one
and two jobs sharing a node pick different ones. :func:`threads_per_process` shares a machine's cores
among the processes it runs.
"""
from __future__ import annotations

import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["expand_nodelist", "tasks_per_node", "slurm_environment", "slurm_master_port", "LaunchInfo",
           "launch_info", "threads_per_process"]

# SLURM job ids map onto ports 10000-29999: below Linux's ephemeral range (32768-60999), where the OS
# hands out the ports of outgoing connections, and clear of the privileged ones.
_PORT_BASE, _PORT_SPAN = 10000, 20000
_TORCHRUN_NAMES = ("RANK", "WORLD_SIZE")


def expand_nodelist(nodelist: str) -> list[str]:
    """The host names of a SLURM node list, in order: ``"node[01-03,07],gpu1"`` ->
    ``["node01", "node02", "node03", "node07", "gpu1"]``.

    Commas between bracket groups separate hosts; inside brackets they separate ranges. A name may have
    several bracket groups (``a[1-2]-b[3-4]``: every combination, the last group varying fastest), and a
    range keeps the zero-padding of its first bound (``[08-10]`` -> 08, 09, 10).
    """
    hosts: list[str] = []
    for name in _split_outside_brackets(nodelist.strip()):
        hosts.extend(_expand_name(name, nodelist))
    return hosts


def _split_outside_brackets(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in (p.strip() for p in parts) if p]


def _expand_name(name: str, nodelist: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", name)
    if match is None:
        if "[" in name or "]" in name:
            raise ValueError(f"SLURM node list {nodelist!r}: unbalanced brackets in {name!r}")
        return [name]
    head, tail = name[:match.start()], name[match.end():]
    return [head + value + rest for value in _expand_range(match.group(1), nodelist)
            for rest in _expand_name(tail, nodelist)]


def _expand_range(ranges: str, nodelist: str) -> list[str]:
    values = []
    for item in ranges.split(","):
        bounds = item.strip().split("-")
        if not all(b.isdigit() for b in bounds) or len(bounds) > 2:
            raise ValueError(f"SLURM node list {nodelist!r}: {item!r} is not a number or a range like 01-04")
        first, last = int(bounds[0]), int(bounds[-1])
        if last < first:
            raise ValueError(f"SLURM node list {nodelist!r}: the range {item!r} runs backwards")
        width = len(bounds[0])
        values.extend(str(n).zfill(width) for n in range(first, last + 1))
    return values


def tasks_per_node(spec: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` per node: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise ValueError(f"SLURM_TASKS_PER_NODE {spec!r}: cannot read {item!r} (expected N or N(xM))")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def slurm_master_port(job_id: str) -> int:
    """The port every task of SLURM job ``job_id`` agrees on (10000-29999; array jobs count by their own id)."""
    return _PORT_BASE + int(re.sub(r"\D", "", job_id) or 0) % _PORT_SPAN


def slurm_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """torchrun's variables for a process srun started (set nothing when torchrun's exist or there is no
    ``SLURM_PROCID``); ``MASTER_ADDR`` / ``MASTER_PORT`` already set are kept."""
    if "SLURM_PROCID" not in environ or any(name in environ for name in _TORCHRUN_NAMES):
        return {}
    missing = [n for n in ("SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_NODELIST")
               if n not in environ]
    if missing:
        raise ValueError(f"SLURM_PROCID is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: "
                         "start each process with srun (not sbatch alone), or launch with torchrun")
    node = int(environ["SLURM_NODEID"])
    per_node = tasks_per_node(environ.get("SLURM_TASKS_PER_NODE", environ.get("SLURM_NTASKS_PER_NODE", "1")))
    env = {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ["SLURM_NTASKS"],
        "LOCAL_RANK": environ["SLURM_LOCALID"],
        "LOCAL_WORLD_SIZE": str(per_node[min(node, len(per_node) - 1)]),
        "GROUP_RANK": str(node),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or expand_nodelist(environ["SLURM_JOB_NODELIST"])[0],
        "MASTER_PORT": environ.get("MASTER_PORT") or str(slurm_master_port(environ.get("SLURM_JOB_ID", "0"))),
    }
    return env


@dataclass(frozen=True)
class LaunchInfo:
    """This process's place in the run: global, local (on its machine) and node ranks, and who launched it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    launcher: str  # "torchrun", "slurm" or "none" (a single process)
    restart: int  # torchrun's TORCHELASTIC_RESTART_COUNT: how many times this node restarted its workers
    max_restarts: int
    host: str


def launch_info(environ: Mapping[str, str], launcher: str) -> LaunchInfo:
    """Read :class:`LaunchInfo` from torchrun's variables in ``environ`` (after :func:`slurm_environment`)."""
    world = int(environ.get("WORLD_SIZE", "1"))
    local_world = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    return LaunchInfo(rank=int(environ.get("RANK", "0")), world_size=world,
                      local_rank=int(environ.get("LOCAL_RANK", "0")), local_world_size=local_world,
                      node_rank=int(environ.get("GROUP_RANK", "0")), launcher=launcher if world > 1 else "none",
                      restart=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                      max_restarts=int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0")), host=socket.gethostname())


def threads_per_process(configured: int, environ: Mapping[str, str], cores: int, local_world_size: int
                        ) -> tuple[int, str]:
    """How many CPU threads this process takes, and why: ``configured`` (the config's ``NUM_THREADS``) when > 0,
    else ``OMP_NUM_THREADS`` when set, else its share of ``cores`` (torch's default thread count for the whole
    machine), at least 1.

    Processes of one machine that each take every core slow each other down, and a different
    number of threads changes the order in which some CPU kernels sum, so two runs compare
    bit for bit only with the same threads per process.
    """
    if configured > 0:
        return configured, "NUM_THREADS"
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp), "OMP_NUM_THREADS"
    return max(1, cores // max(1, local_world_size)), f"{cores} / {local_world_size} processes on this machine"

