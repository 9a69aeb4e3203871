"""The session's set-up (threads, environment, worker count, file order) and its fixtures: shapes sets and configs.

Plain helpers are in the ``support`` package (tests/support/; pytest.ini puts tests/ on ``sys.path``, and this
module puts it on the ``PYTHONPATH`` of every process the suite starts): ``support.toys`` (the toy model and
loaders), ``support.processes`` (two-rank groups, the fork server), ``support.helpers`` (running tools, opts, small
COCO files, detector batches).
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from multiprocessing import forkserver

import pytest
import torch

from pet.config import load_cfg
from pet.data import generate_shapes
from support.processes import remember_session_environ

# Tests run one thread each; PET_TEST_THREADS gives them more, which changes the order in which every kernel adds
# (the foreign-CPU pass of .ci/run uses it: docs/design.md#the-test-suite).
THREADS = int(os.environ.get("PET_TEST_THREADS", "1"))
os.environ["OMP_NUM_THREADS"] = str(THREADS)
torch.set_num_threads(THREADS)
# Precision decisions measured during the suite (pet.engine.speed_probe) go to a folder of this session, shared by
# the tools it runs: the suite neither reads nor writes the user's ~/.cache/pet.
os.environ["PET_CACHE_DIR"] = tempfile.mkdtemp(prefix="pet-cache-")
# Every process the suite starts (a tool, toy_train, torchrun's workers, the fork server) imports ``support`` and the
# plugin modules named in configs (``support.fault_plugins.CloseMarker``) from tests/, as this one does.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)),
                                                      os.environ.get("PYTHONPATH")]))
remember_session_environ()


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
    "test_keypoint_rcnn.py", "test_plugin_detectors.py", "test_int8.py", "test_export.py", "test_rtdetr_export.py",
    "test_torchvision_weights.py", "test_mask_rcnn.py", "test_multinode.py", "test_rtdetr_distributed.py",
    "test_zoo.py", "test_worker_death.py", "test_modeling.py", "test_distributed.py", "test_rtdetr.py",
    "test_cascade_rcnn.py", "test_openvino.py", "test_predict.py", "test_end_to_end.py", "test_trackers.py",
    "test_rtdetr_predict.py", "test_speed_probe.py", "test_data_formats.py", "test_data_coco.py", "test_precision.py",
    "test_dfine_hub_checkpoint.py", "test_rtdetr_parity.py", "test_checkpoint_files.py", "test_augmentations.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of :data:`SLOWEST_FILES` first, in its order; the others after, as collected."""
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


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


@pytest.fixture
def cfg_for(make_cfg):
    """``make_cfg`` with metrics.json and curves off (fast) and a rare display: ``cfg_for(KEY, VALUE, ...)``."""
    return lambda *opts: make_cfg("TRAIN.SAVE_AS_JSON", False, "DISPLAY_ITER", 100, *opts)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop the fork server and wait for it: its CPU time (and its children's) is the session's."""
    forkserver._forkserver._stop()
