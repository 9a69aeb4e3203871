"""What the entry points (tools/*.py) share: argument parsing, set-up, building the trainer from the config,
and clean failure (a model for inference: :func:`pet.predict.loading.load_inference_model`).

Outside :mod:`pet.engine`: it sets up a whole process (config, process group, logging, datasets) for a
command. Only tools/ import it; the library's own modules never do (docs/design.md).
"""
from __future__ import annotations

import argparse
import errno
import gc
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from fvcore.common.config import CfgNode

from pet.config import load_cfg
from pet.data import register_custom_datasets
from pet.data.workers import WORKER_DIED_EXIT_CODE, remedy, worker_death
from pet.engine.models import resolve_device, unwrap_model
from pet.engine.trainer import Trainer
from pet.utils import comm
from pet.utils.errors import ConfigError, PetError
from pet.utils.files import write_failure_remedy
from pet.utils.launch_env import LaunchInfo, launch_info, slurm_environment, threads_per_process
from pet.utils.logger import setup_logger
from pet.utils.model_summary import log_model_summary
from pet.utils.process_group import PEER_LOST_EXIT_CODE, collective_failure, join_process_group
from pet.utils.rng import seed_everything
from pet.utils.table import format_table

__all__ = [
    "default_argument_parser",
    "default_setup",
    "build_trainer",
    "launch_cli",
    "init_distributed",
    "distributed_backend",
    "seed_everything",
]

logger = logging.getLogger(__name__)


def default_argument_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--cfg", dest="cfg_file", required=True, metavar="FILE", help="YAML config file")
    parser.add_argument("--unsafe-load", action="store_true",
                        help="load checkpoints with weights_only=False (only for files you trust)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="deprecated, goes in Pet 0.3.0 (torch.distributed.launch's); torchrun sets LOCAL_RANK")
    parser.add_argument("opts", nargs=argparse.REMAINDER, metavar="KEY VALUE",
                        help="config overrides, e.g. SOLVER.BASE_LR 0.01")
    return parser


def distributed_backend(device: torch.device) -> str:
    """``nccl`` when this process runs on a CUDA device, ``gloo`` otherwise.

    The choice follows the run's device, not whether CUDA exists: a ``DEVICE cpu`` run on
    a GPU machine needs gloo, because NCCL cannot move CPU tensors.
    """
    return dist.Backend.NCCL if device.type == "cuda" else dist.Backend.GLOO


def init_distributed(local_rank: int | None = None, device: str = "auto", timeout_s: float = 1800) -> LaunchInfo:
    """Join the process group described by torchrun's environment, or srun's (no-op without either); where
    this process sits in the run.

    srun's variables are translated into torchrun's first (:func:`pet.utils.launch_env.slurm_environment`;
    torchrun's win when both exist). ``device`` is the config's ``DEVICE`` (resolved as the trainer does,
    per ``LOCAL_RANK``); on CUDA it becomes this process's current device and the backend is NCCL, else
    gloo. Every collective then fails after ``timeout_s`` (``DIST.TIMEOUT_S``) instead of waiting forever
    for a hung peer. ``local_rank`` is the deprecated ``--local_rank`` flag's value (until 0.3.0).
    """
    if local_rank is not None:
        logger.warning("--local_rank is deprecated and goes in Pet 0.3.0: launch with torchrun, which sets LOCAL_RANK")
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
    try:
        slurm = slurm_environment(os.environ)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    os.environ.update(slurm)
    info = launch_info(os.environ, "slurm" if slurm else "torchrun")
    if info.world_size <= 1 or dist.is_initialized():
        return info
    run_device = resolve_device(device)
    if run_device.type == "cuda":
        torch.cuda.set_device(run_device)
    join_process_group(distributed_backend(run_device), timeout_s)
    return info


def default_setup(cfg_file: str, opts: list[str], local_rank: int | None = None) -> CfgNode:
    """Load the config, join the process group, set up logging, threads and seeds, register ``DATA.CUSTOM``."""
    cfg = load_cfg(cfg_file, opts)
    default_threads = torch.get_num_threads()  # torch's choice for this machine, before Pet changes it
    info = init_distributed(local_rank, cfg.DEVICE, cfg.DIST.TIMEOUT_S)
    rank = comm.get_rank()
    setup_logger(cfg.CKPT, rank)
    logger.info(f"Rank {rank} of {comm.get_world_size()}; config {cfg_file}; overrides {opts}")
    threads, why = threads_per_process(cfg.NUM_THREADS, os.environ, default_threads, info.local_world_size)
    torch.set_num_threads(threads)
    _log_processes(info, threads, why)
    seed = cfg.SEED if cfg.SEED >= 0 else int.from_bytes(os.urandom(2), "little")
    seed_everything(seed + rank)
    register_custom_datasets(cfg)
    return cfg


def _log_processes(info: LaunchInfo, threads: int, why: str) -> None:
    """One table on the main process, at start-up: every process's ranks, node, host and threads, and the restart."""
    rows = comm.all_gather_object((info, threads, why))
    if not comm.is_main_process():
        return
    if info.world_size == 1:
        logger.info(f"One process, {threads} CPU threads ({why})")
        return
    restarts = {i.restart for i, _, _ in rows}
    if max(restarts):
        logger.info(f"Restart {max(restarts)} of at most {info.max_restarts} (torchrun --max-restarts): "
                    "the run resumes from its last complete checkpoint")
    table = format_table(["rank", "local rank", "node", "host", "threads", "restart"],
                         [[i.rank, f"{i.local_rank}/{i.local_world_size}", i.node_rank, i.host, f"{t} ({w})",
                           i.restart] for i, t, w in rows])
    logger.info(f"{info.world_size} processes on {len({i.node_rank for i, _, _ in rows})} node(s), "
                f"launched by {info.launcher}:\n{table}")


def build_trainer(cfg: CfgNode, *, resume: bool = False, unsafe: bool = False, weights_only: bool = False,
                  **parts: Any) -> Trainer:
    """A :class:`Trainer` set up as tools/train_net.py runs it, ready for ``train()``.

    ``parts`` (model, optimizer, scheduler, data_loader, default_hooks) go to the Trainer;
    the rest is built from ``cfg``. Building fails on a bad model, data, hook or writer
    setting before anything is written; then the trainer resumes from ``last_checkpoint`` when
    ``resume`` or ``TRAIN.AUTO_RESUME`` (else loads ``TRAIN.WEIGHTS``; ``weights_only`` resumes
    all but the optimizer's state), and only then the main process writes ``CKPT/config.yaml``
    and logs the model summary: a checkpoint this config cannot resume leaves the config.yaml
    of the run that wrote it.
    """
    trainer = Trainer(cfg, **parts)
    trainer.resume_or_load(resume=resume or weights_only or cfg.TRAIN.AUTO_RESUME, unsafe=unsafe,
                           weights_only=weights_only)
    if comm.is_main_process():
        os.makedirs(cfg.CKPT, exist_ok=True)
        with open(os.path.join(cfg.CKPT, "config.yaml"), "w", encoding="utf-8") as f:
            f.write(cfg.dump())
        log_model_summary(unwrap_model(trainer.model), cfg)
    return trainer


_WRITE_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def launch_cli(main: Callable[[], None]) -> None:
    """Run ``main``; a :class:`PetError`, or a file that cannot be written (an unwritable or full
    ``CKPT`` before any checkpoint exists), becomes one line on stderr and exit status 2 (or the
    error's ``exit_code``); a data-loading worker that died, one line and exit status 75."""
    try:
        main()
    except PetError as exc:
        _exit_with_one_line(str(exc), getattr(exc, "exit_code", 2))
    except OSError as exc:
        if exc.errno not in _WRITE_ERRNOS or not exc.filename:
            raise
        advice = write_failure_remedy(exc, os.path.dirname(os.path.abspath(exc.filename)))
        _exit_with_one_line(f"Could not write {exc.filename}: {exc.strerror}; {advice}.", 2)
    except RuntimeError as exc:
        # A peer process lost or hung (seen by gloo in a collective), or torch's worker-death error raised
        # before Pet's fetch watched for it (the first batch).
        lost = collective_failure(exc, comm.get_rank()) if comm.is_distributed() else None
        if lost is not None:
            _exit_with_one_line(lost, PEER_LOST_EXIT_CODE)
        death = worker_death(exc)
        if death is None:
            raise
        _exit_with_one_line(f"Stopped: a {death}. Run the same command again (training resumes from its last "
                            f"checkpoint); if it happens again, {remedy(None)}.", WORKER_DIED_EXIT_CODE)
    finally:
        if dist.is_initialized():
            # The trainer outlives main() in reference cycles: collected now, its DDP reducer releases the
            # group while the interpreter is whole rather than during interpreter exit.
            gc.collect()
            dist.destroy_process_group()


def _exit_with_one_line(message: str, exit_code: int) -> None:
    for handler in logging.getLogger("pet").handlers:
        if isinstance(handler, logging.FileHandler):  # the terminal gets the line below, once
            handler.emit(logging.makeLogRecord({"name": "pet", "levelname": "ERROR", "levelno": 40, "msg": message}))
    print(f"Error: {message}", file=sys.stderr)
    sys.exit(exit_code)
