"""Code the test files share: running a tool as a user does, opts and configs for tiny runs, small datasets, batches.

Fixtures live in ``tests/conftest.py`` (``make_cfg``, the session's generated shapes sets), the toy model and loaders in
``support.toys``, two-rank groups and the fork server in ``support.processes``; this module holds plain functions
and constants, imported as ``from support.helpers import ...``.
"""
from __future__ import annotations

import io
import json
import logging
import multiprocessing.reduction
import os
import random
import runpy
import select
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterable, Sequence
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
import torch
from fvcore.common.config import CfgNode

from pet.config import load_cfg
from pet.data import catalog, register_coco_dataset
from pet.engine.inference import evaluate_on_datasets
from pet.predict import PredictionWriter, Predictor, Source
from support.processes import fork_server_context, run_two_ranks

# The repository root, and its tests/ (on the PYTHONPATH of every process the suite starts: conftest.py).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests")
CFGS = os.path.join(ROOT, "cfgs")
DEMO_CFG = os.path.join(CFGS, "shapes", "faster_rcnn_R-10-FPN.yaml")

# The cores a test may use (the suite runs on 2-core machines); a run of N processes gets 2 // N threads each.
_CORES = 2


# ------------------------------------------------------------------------------------------------ tools
def run_tool(
    tool: str,
    *args: object,
    nproc: int = 1,
    threads: int | None = None,
    check: bool = True,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``tools/<tool>`` with ``args`` in a fresh interpreter, as a user runs it; its output is captured.

    ``nproc`` > 1 launches it through torchrun (``--standalone``: a local rendezvous on a port the OS
    picks, so parallel runs never collide). Each process gets ``threads`` OpenMP threads, by default
    the cores shared out among the processes. ``check``: fail with the tail of its output unless it
    exits with 0. ``env``: extra environment variables.
    """
    threads = threads or max(1, _CORES // nproc)
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    proc = subprocess.run([*launcher, os.path.join(ROOT, "tools", tool), *map(str, args)], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads), **(env or {})}, timeout=600)
    if check and proc.returncode != 0:
        output = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        raise AssertionError(f"{tool} x{nproc} failed ({proc.returncode}):\n{output}")
    return proc


def run_tool_in_process(monkeypatch: Any, capsys: Any, tool: str, *args: object) -> subprocess.CompletedProcess:
    """Run ``tools/<tool>`` in this process, as :func:`run_tool` would in a fresh one, without its ~4.5 s of imports.

    The result reads like :func:`run_tool`'s: exit status, stdout, stderr. ``monkeypatch`` and ``capsys``
    are the calling test's fixtures. A test whose point is a process of its own (signals, kills, limits) uses
    :func:`run_tool_forked`; one whose point is a fresh interpreter (start-up, environment read at import, fault
    plugins loaded at start-up, the exact bytes a shell sees) uses :func:`run_tool`.
    """
    capsys.readouterr()  # only this run's output
    status = _run_in_this_process(monkeypatch, tool, args)
    out = capsys.readouterr()
    return subprocess.CompletedProcess([tool, *map(str, args)], status, out.out, out.err)


def run_tool_here(monkeypatch: Any, capsys: Any, tool: str, *args: object) -> tuple[int, str]:
    """:func:`run_tool_in_process`'s (exit status, stderr)."""
    proc = run_tool_in_process(monkeypatch, capsys, tool, *args)
    return proc.returncode, proc.stderr


def run_tool_captured(tool: str, *args: object, threads: int = 1) -> subprocess.CompletedProcess:
    """:func:`run_tool_in_process` for a fixture wider than one test (``monkeypatch`` and ``capsys`` are per test).
    ``threads``: the tool's threads, as OMP_NUM_THREADS gives a tool's process them (a comparison with a reference
    computed on that many threads adds its numbers in the same order)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as monkeypatch, redirect_stdout(stdout), redirect_stderr(stderr):
        monkeypatch.setenv("OMP_NUM_THREADS", str(threads))
        status = _run_in_this_process(monkeypatch, tool, args)
    return subprocess.CompletedProcess([tool, *map(str, args)], status, stdout.getvalue(), stderr.getvalue())


def run_tool_forked(
    tool: str,
    *args: object,
    threads: int = 1,
    check: bool = True,
    env: dict[str, str] | None = None,
    preexec: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess:
    """:func:`run_tool` (one process) in a process forked from the session's fork server (``support.processes``).

    A process of its own, as a user's: its signals, kills, resource limits and exit status (``-N``: killed by
    signal N), its output read from files (complete up to a kill), but not a fresh interpreter: its ~4 s of imports
    were made once, in the server. ``tool``: a file of tools/, or a script's absolute path; ``threads``: its
    OMP_NUM_THREADS; ``env``: more variables; ``preexec``: a module-level function it calls first. A test of a
    fresh interpreter's start-up (what it reads of its environment at import, the exact bytes on a terminal) uses
    :func:`run_tool`.
    """
    proc = start_tool_forked(tool, *args, threads=threads, env=env, preexec=preexec)
    try:
        stdout, stderr = proc.communicate(timeout=600)  # a hang guard only
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    if check and proc.returncode != 0:
        raise AssertionError(f"{tool} (forked) failed ({proc.returncode}):\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess([tool, *map(str, args)], proc.returncode, stdout, stderr)


class ForkedProcess:
    """A tool running in a process forked from the session's fork server (:func:`start_tool_forked`), with what
    tests use of ``subprocess.Popen``: ``pid``, ``returncode``, ``send_signal``, ``kill`` and ``communicate``."""

    def __init__(self, process: Any, outputs: tempfile.TemporaryDirectory, files: tuple[str, str]) -> None:
        self.process, self.outputs, self.files = process, outputs, files

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def kill(self) -> None:
        self.process.kill()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the end (``subprocess.TimeoutExpired`` after ``timeout``); its stdout and stderr."""
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.process.name, timeout)
        try:
            return tuple(Path(path).read_text(errors="replace") for path in self.files)
        finally:
            self.outputs.cleanup()


def start_tool_forked(tool: str, *args: object, threads: int = 1, env: dict[str, str] | None = None,
                      pass_fds: Sequence[int] = (), preexec: Callable[[], None] | None = None) -> ForkedProcess:
    """:func:`run_tool_forked`'s process, started and left running. ``pass_fds``: file descriptors of this process
    that it gets under the same numbers (as ``subprocess.Popen`` passes them); ``preexec``: a module-level function
    it calls before the tool."""
    outputs = tempfile.TemporaryDirectory(prefix="pet-forked-")
    files = os.path.join(outputs.name, "stdout"), os.path.join(outputs.name, "stderr")
    environ = {"OMP_NUM_THREADS": str(threads), **(env or {})}
    process = fork_server_context().Process(
        target=_tool_in_forked_process,
        args=(tool, [str(a) for a in args], environ, files, [_PassedFd(fd) for fd in pass_fds], preexec))
    process.start()
    return ForkedProcess(process, outputs, files)


class _PassedFd:
    """A file descriptor that travels to a forked process in its arguments (the fork server passes it on), where
    it is unpickled under the number it has here."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[int, Any]]:
        return _receive_fd, (self.fd, multiprocessing.reduction.DupFd(self.fd))


def _receive_fd(number: int, passed: Any) -> int:
    received = passed.detach()
    if received != number:
        try:
            os.fstat(number)
        except OSError:
            os.dup2(received, number)
            os.close(received)
        else:
            raise RuntimeError(f"file descriptor {number} is taken in the forked process")
    return number


def _tool_in_forked_process(tool: str, args: list[str], environ: dict[str, str], files: tuple[str, str],
                            passed: list[int], preexec: Callable[[], None] | None) -> None:
    """The body of :func:`start_tool_forked`'s process: its output to ``files``, then the tool as ``__main__``; the
    process's exit status is the tool's (multiprocessing turns a SystemExit into it, as the interpreter does).
    ``passed``: the file descriptors it was given, open from unpickling on."""
    for fd, path in zip((1, 2), files):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ.update(environ)
    if preexec is not None:
        preexec()
    path = os.path.join(ROOT, "tools", tool)
    sys.argv = [path, *args]
    runpy.run_path(path, run_name="__main__")


def run_tool_on_two_ranks(tool: str, *args: object,
                          env: Sequence[dict[str, str]] | None = None) -> list[subprocess.CompletedProcess]:
    """``tools/<tool>`` with ``args`` in two processes that join as torchrun's workers do (its environment variables,
    ``env://`` on a free local port, one thread each), each with its own output: exit status, stdout, stderr, in rank
    order (torchrun mixes the ranks' output, and reports their statuses in its own words). ``env``: each rank's
    launcher variables instead of torchrun's (srun's, say).

    The processes come from the session's fork server (``support.processes.run_two_ranks``): fresh processes, without a
    fresh interpreter's seconds of imports each, and without torchrun's agent. A test of what torchrun itself does (its
    restarts, ending the other processes of a failed run, how a user starts a run) uses ``run_tool(..., nproc=2)``.
    """
    if env is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = [{"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} for rank in range(2)]
    # The precision decisions of this session (conftest.py's PET_CACHE_DIR), as a tool this process starts shares them.
    env = [{**variables, "PET_CACHE_DIR": os.environ["PET_CACHE_DIR"]} for variables in env]
    return [proc for _, proc in run_two_ranks(_tool_on_rank, None, env, tool, [str(a) for a in args], join=False)]


def _tool_on_rank(rank: int, _init_file: Any, env: list[dict[str, str]], tool: str, args: list[str]) -> tuple[int, Any]:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)  # only the launcher variables of ``env``
    os.environ.update(env[rank])
    return rank, run_tool_captured(tool, *args)


def _run_in_this_process(monkeypatch: Any, tool: str, args: Sequence[object]) -> int:
    """``tools/<tool>`` (or the script at ``tool``, an absolute path) run as ``__main__`` with ``args`` as its command
    line; its exit status.

    An exit with a message (``sys.exit("Error: ...")``) gives status 1 and the message on stderr, as the
    interpreter would. What the tools change for the whole process is put back: ``sys.argv``, the 'pet'
    logger (later tests rely on it propagating), the thread count and the random generators
    (``default_setup`` sets both), and the datasets ``DATA.CUSTOM`` registered.
    """
    pet_logger = logging.getLogger("pet")
    saved = pet_logger.handlers[:], pet_logger.propagate, pet_logger.level
    threads, rng = torch.get_num_threads(), (random.getstate(), np.random.get_state(), torch.get_rng_state())
    monkeypatch.setattr(sys, "argv", [tool, *map(str, args)])
    # DATA.CUSTOM registers datasets for the whole process; a later run may give a name another meaning.
    monkeypatch.setattr(catalog, "_REGISTERED", dict(catalog._REGISTERED))
    status = 0
    try:
        runpy.run_path(os.path.join(ROOT, "tools", tool), run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            status = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            status = 1
    finally:
        for handler in set(pet_logger.handlers) - set(saved[0]):
            handler.close()
        pet_logger.handlers[:], pet_logger.propagate = saved[0], saved[1]
        pet_logger.setLevel(saved[2])
        torch.set_num_threads(threads)
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
    return status


# ------------------------------------------------------------------------------------------------ shared work
def session_shared_folder(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder ``name`` of this pytest session that all its xdist workers see (the parent of each worker's base
    temporary folder; without xdist, the base folder itself): work cached there, made under
    :func:`pet.utils.files.file_lock`, is done once per session, not once per worker."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# The start-up FLOP count (pet.utils.model_summary) runs the model once at the test size: ~15 s for an R-50 at 800 px
# on 2 cores. Tests that check detections, not the logged FLOPs, count them on a small image instead.
SMALL_FLOPS = ("MODEL.FLOPS_INPUT_SIZE", "(64, 64)")


def custom_datasets(*datasets: tuple[str, str, str]) -> str:
    """The ``DATA.CUSTOM`` value that registers each ``(name, json file, image dir)``."""
    entries = [f"{{'name': '{name}', 'path': '{json_file}', 'images': '{images}'}}"
               for name, json_file, images in datasets]
    return f"[{', '.join(entries)}]"


def single_dataset_opts(json_file: str, image_dir: str, name: str = "mine") -> list[str]:
    """Command-line opts that register one COCO dataset as ``name`` and both train and test on it."""
    return ["DATA.CUSTOM", custom_datasets((name, json_file, image_dir)),
            "TRAIN.DATASETS", f"('{name}',)", "TEST.DATASETS", f"('{name}',)"]


def tiny_set_opts(
    root: str, ckpt: str, *, max_iter: int = 6, test_batch: int = 2, display_iter: int = 3, checkpoint_period: int = 4
) -> list[str]:
    """Command-line opts for the demo config on the generated set ``root``, a few iterations long, writing to ``ckpt``.

    The set's splits are registered as ``tiny_train`` and ``tiny_val`` (``DATA.CUSTOM``) and used for
    training and testing; 2 images per training batch, no loader workers, one warm-up test iteration.
    """
    return ["CKPT", ckpt,
            "DATA.CUSTOM", custom_datasets(("tiny_train", f"{root}/annotations/train.json", f"{root}/train"),
                                           ("tiny_val", f"{root}/annotations/val.json", f"{root}/val")),
            "TRAIN.DATASETS", "('tiny_train',)", "TEST.DATASETS", "('tiny_val',)", "SOLVER.MAX_ITER", str(max_iter),
            "SOLVER.IMS_PER_BATCH", "2", "TEST.IMS_PER_BATCH", str(test_batch), "DATA.NUM_WORKERS", "0",
            "DISPLAY_ITER", str(display_iter), "TEST.NUM_WARMUP", "1",
            "HOOKS.CHECKPOINT.PERIOD", str(checkpoint_period)]


# ------------------------------------------------------------------------------------------------ toy_train.py
TOY_TRAIN = os.path.join(TESTS, "support", "toy_train.py")


def start_toy_train(ckpt: Any, max_iter: int, *args: str, **popen: Any) -> subprocess.Popen:
    """``tests/support/toy_train.py`` in a subprocess; ``popen``: extra ``subprocess.Popen`` arguments."""
    return subprocess.Popen([sys.executable, TOY_TRAIN, "--ckpt", str(ckpt), "--max-iter", str(max_iter), *args],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def run_toy_train_here(ckpt: Any, max_iter: int, *args: str) -> tuple[int, str, str]:
    """``tests/support/toy_train.py`` to the end in this process, without a fresh interpreter's ~4 s of imports: (exit
    status, stdout, stderr), the same command line and the same code. For the runs around a fault (the one that
    sets a checkpoint up, the one that resumes after it) and for faults that need no process of their own; a
    fault that does (a signal, a kill, a file-size limit, dropped capabilities) runs through
    :func:`run_toy_train_forked`."""
    assert "--file-size-limit" not in args, "a file-size limit would hold for this whole process"
    proc = run_tool_captured(TOY_TRAIN, "--ckpt", ckpt, "--max-iter", max_iter, *args)
    return proc.returncode, proc.stdout, proc.stderr


def run_toy_train_forked(ckpt: Any, max_iter: int, *args: str,
                         preexec: Callable[[], None] | None = None) -> tuple[int, str, str]:
    """``tests/support/toy_train.py`` to the end in a process of its own, forked from the session's fork server
    (:func:`run_tool_forked`): (exit status, stdout, stderr). For a fault that needs a process (a limit, a
    signal, fewer capabilities), not a fresh interpreter."""
    proc = run_tool_forked(TOY_TRAIN, "--ckpt", ckpt, "--max-iter", max_iter, *args, check=False, preexec=preexec)
    return proc.returncode, proc.stdout, proc.stderr


def start_and_wait_for_report(ckpt: Any, max_iter: int, plugin: str, *args: str, also: Sequence[dict] = (),
                              **kwargs: Any) -> tuple[ForkedProcess, str]:
    """Start toy_train with the hook ``support.fault_plugins.<plugin>(fd=<a pipe>, **kwargs)`` and wait for its report.

    ``also``: more ``HOOKS.CUSTOM`` entries. Returns the process (forked from the session's fork
    server: :func:`start_tool_forked`), still running, and the line the hook wrote on the pipe once
    it got where the test wants it: no sleep, no timing assumption. A child that exits before
    reporting fails the test with its output.
    """
    read_end, write_end = os.pipe()
    hooks = [*also, {"type": f"support.fault_plugins.{plugin}", "fd": write_end, **kwargs}]
    try:
        proc = start_tool_forked(TOY_TRAIN, "--ckpt", ckpt, "--max-iter", max_iter, *args, "HOOKS.CUSTOM",
                                 repr(hooks), pass_fds=(write_end,))
    finally:
        os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 300)  # a hang guard only
        report = os.read(read_end, 4096).decode() if ready else ""
    finally:
        os.close(read_end)
    if not report:  # the child exited (end of file) or hung
        proc.kill()
        raise AssertionError(f"{plugin} never reported: {proc.communicate()}")
    return proc, report.strip()


def final_weights(ckpt: Any) -> dict[str, torch.Tensor]:
    """The ``model`` of ``ckpt/model_final.pth``."""
    return torch.load(os.path.join(ckpt, "model_final.pth"), weights_only=True)["model"]


# ------------------------------------------------------------------------------------------------ docs
# The pages users read, README first: their examples are code users copy, so tests run them as written.
DOC_PAGES = (Path(ROOT) / "README.md", *sorted((Path(ROOT) / "docs").glob("*.md")),
             *sorted((Path(ROOT) / "docs" / "benchmarks").glob("*.md")))


def doc_blocks(language: str) -> list[str]:
    """Every fenced ``language`` block of the doc pages, in page order; a block moved to another page keeps its test."""
    blocks: list[str] = []
    for page in DOC_PAGES:
        block: list[str] | None = None
        for line in page.read_text(encoding="utf-8").splitlines(keepends=True):
            if block is None and line.strip() == f"```{language}":
                block = []
            elif block is not None and line.strip() == "```":
                blocks.append("".join(block))
                block = None
            elif block is not None:
                block.append(line)
    return blocks


def doc_block(language: str, marker: str) -> str:
    """The first ``language`` block of the doc pages that contains ``marker``."""
    return next(b for b in doc_blocks(language) if marker in b)


# ------------------------------------------------------------------------------------------------ datasets
def register_split(root: str, split: str) -> str:
    """Register ``split`` of the generated set ``root`` under a fresh name (tests never share a catalog entry)."""
    name = f"shapes_{split}_{uuid.uuid4().hex[:8]}"
    register_coco_dataset(name, os.path.join(root, "annotations", f"{split}.json"), os.path.join(root, split))
    return name


def data_cfg(*opts: object, custom: Iterable[dict[str, str]] = (), num_classes: int = 3) -> CfgNode:
    """A mutable CPU config for building loaders: batch 4, no workers, short sides 160-192 px in training."""
    base = [
        "DEVICE", "cpu", "MODEL.NUM_CLASSES", num_classes, "SOLVER.IMS_PER_BATCH", 4, "DATA.NUM_WORKERS", 0,
        "INPUT.MIN_SIZE_TRAIN", (160, 192), "INPUT.MAX_SIZE_TRAIN", 320, "INPUT.MIN_SIZE_TEST", 192,
        "INPUT.MAX_SIZE_TEST", 320, "SOLVER.MAX_ITER", 10, "DATA.CUSTOM", list(custom),
    ]
    return load_cfg(None, [str(o) for o in (*base, *opts)], freeze=False)


def write_coco(
    tmp_path: Path,
    images: Sequence[tuple[int, int, int]] = ((1, 40, 30),),
    annotations: list[dict[str, Any]] | None = None,
    categories: list[dict[str, Any]] | None = None,
    write_images: bool = True,
) -> tuple[str, str, str]:
    """A small registered COCO dataset on disk; returns (name, json path, image dir).

    ``images`` are ``(id, width, height)`` of gray PNGs; by default each has one box of category 1.
    """
    image_dir = tmp_path / "images"
    image_dir.mkdir(exist_ok=True)
    entries = []
    for image_id, w, h in images:
        entries.append({"id": image_id, "file_name": f"{image_id}.png", "width": w, "height": h})
        if write_images:
            cv2.imwrite(str(image_dir / f"{image_id}.png"), np.full((h, w, 3), 128, np.uint8))
    if annotations is None:
        annotations = [{"id": i + 1, "image_id": e["id"], "category_id": 1, "bbox": [2, 3, 10, 8], "iscrowd": 0}
                       for i, e in enumerate(entries)]
    data = {"images": entries, "annotations": annotations,
            "categories": categories or [{"id": 1, "name": "thing"}]}
    json_file = tmp_path / "ann.json"
    json_file.write_text(json.dumps(data))
    name = f"custom_{uuid.uuid4().hex[:8]}"
    register_coco_dataset(name, str(json_file), str(image_dir))
    return name, str(json_file), str(image_dir)


# ------------------------------------------------------------------------------------------------ models
# The boxes (XYXY, resized-image pixels) of both images in detector_batch unless a test gives its own.
BATCH_BOXES = ((10.0, 12.0, 50.0, 60.0), (30.0, 5.0, 70.0, 40.0))


def detector_batch(
    boxes: Sequence[Sequence[float]] = BATCH_BOXES, *, masks: bool = False
) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """Two padded uint8 images in Pet's batch contract, the same for every seed.

    Image 0 (96x128) stands for a 192x256 original resized 2x down, image 1 (80x100) is its own
    original; both hold ``boxes`` with labels 1 and 3 and, with ``masks``, a filled mask per box.
    """
    gen = torch.Generator().manual_seed(0)
    images = torch.zeros(2, 3, 128, 128, dtype=torch.uint8)
    targets = []
    for i, ((h, w), orig) in enumerate([((96, 128), (192, 256)), ((80, 100), (80, 100))]):
        images[i, :, :h, :w] = torch.randint(0, 255, (3, h, w), generator=gen, dtype=torch.uint8)
        target = {"image_id": i + 1, "image_size": (h, w), "orig_size": orig, "boxes": torch.tensor(boxes),
                  "labels": torch.tensor([1, 3])}
        if masks:
            target["masks"] = torch.zeros(len(boxes), h, w, dtype=torch.uint8)
            for mask, (x0, y0, x1, y1) in zip(target["masks"], target["boxes"].int().tolist()):
                mask[y0:y1, x0:x1] = 1
        targets.append(target)
    return images, targets


def assert_part_trains(
    model: torch.nn.Module, part: torch.nn.Module, losses: set[str], batch: tuple[torch.Tensor, list[dict]]
) -> None:
    """One training step on ``batch`` returns exactly ``losses`` and gives every parameter of ``part`` a gradient.

    What a user's swapped-in part (a head or neck named by dotted path) must do to be trained.
    """
    model.train()
    out = model(*batch)
    assert set(out) == losses
    sum(out.values()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in part.parameters())


class BlobDetector(torch.nn.Module):
    """A real detector for trivial pictures, to test what surrounds a model: every 8-connected region of bright
    pixels (some channel > 127) is one detection, its box the region's extent (pixel edges, as XYXY), its class
    the region's brightest channel (red 1, green 2, blue 3), its score 0.9. It follows Pet's batch contract
    (boxes mapped from ``image_size`` to ``orig_size``) and has no parameters."""

    def forward(self, images: torch.Tensor, targets: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
        outputs = []
        for image, target in zip(images, targets):
            (h, w), (orig_h, orig_w) = target["image_size"], target["orig_size"]
            pixels = image[:, :h, :w].permute(1, 2, 0).numpy()
            count, regions, stats, _ = cv2.connectedComponentsWithStats((pixels.max(axis=2) > 127).astype(np.uint8))
            boxes = stats[1:, :4].astype(np.float32)
            boxes[:, 2:] += boxes[:, :2]
            boxes *= np.array([orig_w / w, orig_h / h, orig_w / w, orig_h / h], dtype=np.float32)
            labels = [int(pixels[regions == k].mean(axis=0).argmax()) + 1 for k in range(1, count)]
            outputs.append({"boxes": torch.from_numpy(boxes), "scores": torch.full((count - 1,), 0.9),
                            "labels": torch.tensor(labels, dtype=torch.int64)})
        return outputs


def detections_of_test_net_and_predict(cfg: CfgNode, val_dir: str, val_json: str, out: Path
                                    ) -> tuple[list, list, Predictor]:
    """One model's detections on one folder, from test_net's evaluation (``bbox.json``) and from a
    :class:`Predictor` stream written in COCO's format (what predict must equal exactly), and that predictor."""
    predictor = Predictor(cfg)
    evaluate_on_datasets(cfg, predictor.model, str(out / "test"))
    source = Source(val_dir)
    with PredictionWriter(str(out / "predict"), ["coco"], predictor.label_space, source, ann=val_json) as writer:
        for detections in predictor.stream(source):
            writer.write(detections)
    with open(out / "test" / "bbox.json") as f:
        expected = json.load(f)
    with open(out / "predict" / "predictions.json") as f:
        return expected, json.load(f), predictor
