"""A toy training run driven by the reliability tests in a subprocess (real signals, real kills).

  PYTHONPATH=tests python tests/support/toy_train.py --ckpt DIR --max-iter N [--nan-at N] [--interval N] [KEY VALUE ...]
"""
from __future__ import annotations

import argparse
import resource
import signal

import torch

from pet.cli import launch_cli, seed_everything
from pet.config import load_cfg
from pet.engine.trainer import Trainer
from pet.utils.logger import setup_logger
from support.toys import InfiniteToyLoader, NanLossModel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--max-iter", required=True)
    parser.add_argument("--nan-at", type=int, default=-1)
    parser.add_argument("--interval", default="1")
    parser.add_argument("--file-size-limit", type=int, default=0, help="bytes; emulates a full disk (EFBIG)")
    args, opts = parser.parse_known_args()
    if args.file_size_limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write with EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (args.file_size_limit, args.file_size_limit))
    torch.set_num_threads(1)
    cfg = load_cfg(None, ["CKPT", args.ckpt, "DEVICE", "cpu", "SOLVER.MAX_ITER", args.max_iter, "SOLVER.BASE_LR",
                          "0.01", "SOLVER.WARMUP_ITERS", "3", "DISPLAY_ITER", "1",
                          "HOOKS.CHECKPOINT.PERIOD", args.interval, *opts])
    setup_logger(cfg.CKPT)
    seed_everything(cfg.SEED)
    trainer = Trainer(cfg, model=NanLossModel(args.nan_at), data_loader=InfiniteToyLoader())
    trainer.resume_or_load(resume=True)
    trainer.train()


if __name__ == "__main__":
    launch_cli(main)
