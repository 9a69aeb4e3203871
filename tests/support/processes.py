"""Processes forked from the session's fork server: two-process gloo groups (:func:`run_two_ranks`) and the
context that ``support.helpers.run_tool_forked`` starts tools in."""
from __future__ import annotations

import faulthandler
import gc
import multiprocessing
import os
import traceback
from multiprocessing import forkserver
from typing import Any, NamedTuple

import pytest
import torch.distributed as dist


class RankFailure(NamedTuple):
    """What a ``run_two_ranks`` worker that raised sends instead of its result."""

    rank: int
    traceback: str


def _rank_main(worker: Any, rank: int, init_file: Any, args: tuple, queue: Any, join: bool = True) -> None:
    """One process of ``run_two_ranks``: join the gloo group (unless the worker does), run ``worker``, tear down,
    report.

    The worker returns before the group goes, and a garbage collection frees what it built (a
    Trainer, its DistributedDataParallel reducer and any Python comm hook) while the interpreter
    and the group are alive. Left to interpreter exit, gloo's C++ threads can drop the last
    reference to a Python object after finalization began, and the process aborts ("terminate
    called without an active exception", SIGABRT; seen twice in full suite runs, never alone).
    The barrier keeps either process from tearing its connections down while the other's last
    collective is in flight. faulthandler prints every thread's stack if a process dies anyway.
    """
    faulthandler.enable(all_threads=True)
    if join:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        result = worker(rank, init_file, *args)
        gc.collect()
        if join:
            dist.barrier()
    except BaseException:
        queue.put(RankFailure(rank, traceback.format_exc()))
        raise
    finally:
        if join:
            dist.destroy_process_group()
    queue.put(result)


# What the fork server imports before a test asks it for a process: torch, Pet and the test helpers (seconds of CPU).
_FORK_SERVER_PRELOAD = ["support.toys", "support.helpers"]
_SESSION_ENVIRON: dict[str, str] = {}  # as conftest.py set it up, before any test changed it


def remember_session_environ() -> None:
    """Keep the environment as it is now (conftest.py set it up) for the fork server, which starts later."""
    _SESSION_ENVIRON.clear()
    _SESSION_ENVIRON.update(os.environ)


def fork_server_context() -> Any:
    """The multiprocessing context of ``run_two_ranks`` and ``support.helpers.run_tool_forked``: a fork server that
    imported :data:`_FORK_SERVER_PRELOAD` once.

    Each process is forked from that server, a process that imported torch but never ran an operation (no
    OpenMP thread pool to copy), so it is a fresh process without a fresh interpreter's seconds of imports.
    The server starts at the first call, in the environment of this session's start (a test's monkeypatched
    variables must not outlive it in every later process); a process sets what it needs itself. The server is a
    `python -c` that (before Python 3.12) ignores this process's sys.path: it finds the preloaded modules through
    the PYTHONPATH conftest.py set.
    """
    assert _SESSION_ENVIRON, "conftest.py calls remember_session_environ() at the session's start"
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_FORK_SERVER_PRELOAD)
    environ = dict(os.environ)
    os.environ.clear()
    os.environ.update(_SESSION_ENVIRON)
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(environ)
    return context


def run_two_ranks(worker: Any, init_file: Any, *args: Any, timeout: float = 600, join: bool = True) -> list[Any]:
    """``worker(rank, init_file, *args)`` in each process of a two-process gloo group; what they return, sorted.

    Started by a fork server (:func:`fork_server_context`), not forked from this process: a fork copies
    torch's OpenMP thread pool, which hangs the child once an earlier test has used it. A worker that
    raises fails the test at once with its traceback; a hang shows up as ``queue.Empty`` after
    ``timeout``. Both processes must exit cleanly. ``join=False``: the worker joins (and leaves) a
    group itself, as a tool does under torchrun (``support.helpers.run_tool_on_two_ranks``).
    """
    context = fork_server_context()
    queue = context.Queue()
    workers = [context.Process(target=_rank_main, args=(worker, rank, init_file, args, queue, join))
               for rank in range(2)]
    for process in workers:
        process.start()
    results = []
    try:
        for _ in workers:
            reported = queue.get(timeout=timeout)
            if isinstance(reported, RankFailure):
                pytest.fail(f"rank {reported.rank} raised:\n{reported.traceback}", pytrace=False)
            results.append(reported)
    finally:
        for process in workers:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert [process.exitcode for process in workers] == [0, 0]
    return sorted(results)
