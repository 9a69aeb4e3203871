"""Shared fixtures: a tiny regression model and loaders that cost nothing to run, and the session's shapes sets.

Plain helpers (running tools, opts, small COCO files, detector batches) are in ``helpers.py``.
"""
from __future__ import annotations

import faulthandler
import gc
import multiprocessing
import os
import re
import tempfile
import traceback
from collections.abc import Callable, Iterator
from multiprocessing import forkserver
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist

from pet.config import load_cfg
from pet.data import generate_shapes
from pet.engine.hooks import Priority, TrainHook
from pet.engine.trainer import Trainer

# Tests run one thread each; PET_TEST_THREADS gives them more, which changes the order in which every kernel adds
# (the foreign-CPU pass of .ci/run uses it: docs/design.md#the-test-suite).
THREADS = int(os.environ.get("PET_TEST_THREADS", "1"))
os.environ["OMP_NUM_THREADS"] = str(THREADS)
torch.set_num_threads(THREADS)
# Precision decisions measured during the suite (pet.engine.speed_probe) go to a folder of this session, shared by
# the tools it runs: the suite neither reads nor writes the user's ~/.cache/pet.
os.environ["PET_CACHE_DIR"] = tempfile.mkdtemp(prefix="pet-cache-")


# pytest.ini's ``-n auto`` runs one xdist worker per THREADS cores (one per core by default). Past 4 workers the
# suite's few long files set the pace and every worker adds its own copy of the session fixtures and ~2 GB.
MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cores // THREADS))


# The files that take longest, longest first (CPU seconds of a quiet run on 2 cores): pytest.ini hands xdist's
# workers whole files in collection order (--no-loadscope-reorder), so starting with these keeps one worker from
# being left with a long file while the other has finished (longest-processing-time-first scheduling).
SLOWEST_FILES = (
    "test_keypoint_rcnn.py", "test_multinode.py", "test_torchvision_weights.py", "test_export.py", "test_mask_rcnn.py",
    "test_distributed.py", "test_worker_death.py", "test_zoo.py", "test_modeling.py", "test_cascade_rcnn.py",
    "test_rtdetr_export.py", "test_rtdetr_parity.py", "test_int8.py", "test_predict.py", "test_end_to_end.py",
    "test_speed_probe.py", "test_trackers.py", "test_evaluation.py", "test_checkpoint_files.py", "test_stops.py",
    "test_precision.py", "test_kill_resume.py", "test_rtdetr.py", "test_rtdetr_distributed.py", "test_trainer_api.py",
    "test_benchmarks.py", "test_rtdetr_predict.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of :data:`SLOWEST_FILES` first, in its order; the others after, as collected."""
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


class ToyModel(torch.nn.Module):
    """Linear regression with a BatchNorm, returning a loss dict like a detector."""

    def __init__(self, with_bn: bool = False) -> None:
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(4) if with_bn else torch.nn.Identity()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        pred = self.linear(self.bn(x))
        return {"loss_mse": torch.nn.functional.mse_loss(pred, y), "loss_l1": (pred - y).abs().mean()}


class NanLossModel(ToyModel):
    """A :class:`ToyModel` whose ``loss_l1`` is NaN at its ``nan_at``-th call (on process ``rank`` only, when given)."""

    def __init__(self, nan_at: int, rank: int | None = None) -> None:
        super().__init__()
        self.nan_at = nan_at
        self.rank = rank
        self.calls = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        losses = super().forward(x, y)
        if self.calls == self.nan_at and (self.rank is None or torch.distributed.get_rank() == self.rank):
            losses["loss_l1"] = losses["loss_l1"] * float("nan")
        return losses


class ToyLoader:
    """A finite, re-iterable loader of ``(x, y)`` batches with a fixed seed per pass."""

    def __init__(self, num_batches: int = 10, batch_size: int = 8, seed: int = 0, offset: float = 0.0) -> None:
        self.num_batches = num_batches
        self.batch_size = batch_size
        self.seed = seed
        self.offset = offset

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(self.seed)
        for _ in range(self.num_batches):
            x = torch.randn(self.batch_size, 4, generator=gen) * 3 + self.offset
            yield x, x.sum(dim=1, keepdim=True)


class InfiniteToyLoader(ToyLoader):
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(self.seed)
        while True:
            x = torch.randn(self.batch_size, 4, generator=gen) * 3 + self.offset
            yield x, x.sum(dim=1, keepdim=True)


@pytest.fixture(scope="session")
def shapes_set(tmp_path_factory) -> Callable[..., str]:
    """``shapes_set(num_train, num_val, seed=1)``: the root of a generated shapes set, written once per session.

    Tests that ask for the same arguments share one set (tests only read it). Image ``i`` of a split
    depends only on the seed and ``i``, so a smaller set holds the first images of a larger one.
    """
    base = tmp_path_factory.mktemp("shapes")

    def make(num_train: int, num_val: int, seed: int = 1) -> str:
        return generate_shapes(str(base / f"train{num_train}-val{num_val}-seed{seed}"), num_train=num_train,
                               num_val=num_val, seed=seed)

    return make


@pytest.fixture(scope="session")
def shapes_root(shapes_set) -> str:
    """12 training and 6 validation images: the set the data-pipeline tests read."""
    return shapes_set(num_train=12, num_val=6)


@pytest.fixture(scope="session")
def tiny_set(shapes_set) -> str:
    """8 training and 6 validation images: the set tiny real runs (a few iterations of tools/train_net.py, or of
    ``Trainer`` on its config's loader) train and test on. With 2 images a batch, 4 iterations are one pass
    and 6 go past it; in two processes each rank tests 3 images."""
    return shapes_set(num_train=8, num_val=6)


@pytest.fixture
def make_cfg(tmp_path):
    """``make_cfg(KEY, VALUE, ...)``: defaults for a toy CPU run writing under tmp_path."""

    def _make(*opts: object, freeze: bool = True):
        base = [
            "CKPT", str(tmp_path / "run"), "DEVICE", "cpu", "SOLVER.MAX_ITER", "20", "SOLVER.BASE_LR", "0.01",
            "SOLVER.WARMUP_ITERS", "0", "SOLVER.LR_POLICY", "cosine", "DISPLAY_ITER", "5",
            "TRAIN.AUTO_RESUME", "False",
        ]
        if "SOLVER.MAX_EPOCHS" in opts:  # epoch mode: the iteration count comes from the loader
            base[base.index("SOLVER.MAX_ITER") + 1] = "0"
        return load_cfg(None, base + [str(o) for o in opts], freeze=freeze)

    return _make


class IndexedToyLoader(ToyLoader):
    """Batch ``i`` depends only on ``i`` (seeded by ``seed + i``); ``set_start_iter`` jumps to a batch.

    The trainer calls ``set_start_iter`` at the start of every pass, so a resumed run sees
    exactly the batches an uninterrupted one would. ``num_batches <= 0``: infinite.
    """

    def __init__(self, num_batches: int = 0, batch_size: int = 8, seed: int = 0) -> None:
        super().__init__(num_batches, batch_size, seed)
        self.start_iter = 0
        self.start_iters: list[int] = []

    def set_start_iter(self, start_iter: int) -> None:
        self.start_iter = start_iter
        self.start_iters.append(start_iter)

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed + index)
        x = torch.randn(self.batch_size, 4, generator=gen) * 3
        return x, x.sum(dim=1, keepdim=True)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        index = self.start_iter
        while self.num_batches <= 0 or index < self.num_batches:
            yield self.batch(index)
            index += 1


def toy_trainer(cfg: Any, *hooks: Any, loader: Any = None, seed: int = 0, default_hooks: bool = True) -> Trainer:
    """A Trainer of a seeded :class:`ToyModel` on an :class:`IndexedToyLoader` (or ``loader``), plus ``hooks``."""
    torch.manual_seed(seed)
    trainer = Trainer(cfg, model=ToyModel(), data_loader=loader if loader is not None else IndexedToyLoader(),
                      default_hooks=default_hooks)
    trainer.register_hooks(hooks)
    return trainer


class CrashAt(TrainHook):
    """Raises in ``before_step`` once ``at`` iterations are complete, like a process killed there."""

    priority = Priority.HIGHEST

    def __init__(self, at: int) -> None:
        self.at = at

    def before_step(self, trainer: Any, **kwargs: Any) -> None:
        if trainer.iter == self.at + 1:
            raise RuntimeError("simulated crash")


def hook_of(trainer: Trainer, cls: type) -> Any:
    """The first hook of class ``cls`` the trainer has."""
    return next(h for h in trainer.hooks if isinstance(h, cls))


def regular_iters(directory: Any) -> list[int]:
    """The N of every ``model_iter{N}.pth`` in ``directory``, sorted."""
    return sorted(int(m.group(1)) for f in os.listdir(directory) if (m := re.fullmatch(r"model_iter(\d+)\.pth", f)))


def scripted_eval(table: dict[int, dict[str, float]], calls: list[int] | None = None) -> Callable[[Any], dict]:
    """An eval function returning ``table[iterations completed]`` (a dict of metrics); records the calls."""

    def evaluate(trainer: Any) -> dict[str, float]:
        if calls is not None:
            calls.append(trainer.iter)
        return table[trainer.iter]

    return evaluate


def record_saves(trainer: Trainer) -> list[tuple[str, int]]:
    """``(filename, iteration)`` of every checkpoint the trainer writes from now on."""
    saves = []
    original = trainer.checkpointer.save

    def spy(filename: str, **kwargs: Any) -> str:
        saves.append((filename, trainer.iter))
        return original(filename, **kwargs)

    trainer.checkpointer.save = spy
    return saves


@pytest.fixture
def cfg_for(make_cfg):
    """``make_cfg`` with metrics.json and curves off (fast) and a rare display: ``cfg_for(KEY, VALUE, ...)``."""
    return lambda *opts: make_cfg("TRAIN.SAVE_AS_JSON", False, "DISPLAY_ITER", 100, *opts)


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
_FORK_SERVER_PRELOAD = ["conftest", "helpers"]
_SESSION_ENVIRON = dict(os.environ)  # as this module set it up, before any test changed it


def fork_server_context() -> Any:
    """The multiprocessing context of ``run_two_ranks`` and ``helpers.run_tool_forked``: a fork server that
    imported :data:`_FORK_SERVER_PRELOAD` once.

    Each process is forked from that server, a process that imported torch but never ran an operation (no
    OpenMP thread pool to copy), so it is a fresh process without a fresh interpreter's seconds of imports.
    The server starts at the first call, in the environment of this session's start (a test's monkeypatched
    variables must not outlive it in every later process); a process sets what it needs itself.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_FORK_SERVER_PRELOAD)
    environ = dict(os.environ)
    os.environ.clear()
    # The server is a `python -c` that (before Python 3.12) ignores this process's sys.path: it finds the
    # preloaded modules through PYTHONPATH.
    tests = os.path.dirname(os.path.abspath(__file__))
    os.environ.update(_SESSION_ENVIRON,
                      PYTHONPATH=os.pathsep.join(filter(None, [tests, _SESSION_ENVIRON.get("PYTHONPATH")])))
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(environ)
    return context


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop the fork server and wait for it: its CPU time (and its children's) is the session's."""
    forkserver._forkserver._stop()


def run_two_ranks(worker: Any, init_file: Any, *args: Any, timeout: float = 600, join: bool = True) -> list[Any]:
    """``worker(rank, init_file, *args)`` in each process of a two-process gloo group; what they return, sorted.

    Started by a fork server (:func:`fork_server_context`), not forked from this process: a fork copies
    torch's OpenMP thread pool, which hangs the child once an earlier test has used it. A worker that
    raises fails the test at once with its traceback; a hang shows up as ``queue.Empty`` after
    ``timeout``. Both processes must exit cleanly. ``join=False``: the worker joins (and leaves) a
    group itself, as a tool does under torchrun (``helpers.run_tool_on_two_ranks``).
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


class FakeClock:
    """A ``time.perf_counter`` stand-in that moves only when told: measured durations are exact on any machine.

    Code under test "takes" time by calling ``advance(seconds)`` instead of sleeping, so a test
    asserts the exact split a timer must report instead of comparing to wall-clock bounds.
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
