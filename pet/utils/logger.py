"""Logging set-up: terminal on the main process, a log file under CKPT."""
from __future__ import annotations

import logging
import os
import sys

_FORMAT = "[%(asctime)s] %(name)s %(levelname)s: %(message)s"
_DATEFMT = "%m/%d %H:%M:%S"


def setup_logger(output_dir: str | None = None, rank: int = 0, filename: str = "log.txt") -> logging.Logger:
    """Configure the ``pet`` logger: INFO to stdout on rank 0 (warnings elsewhere), and a file.

    The file is ``output_dir/filename`` on rank 0 and ``filename.rank{N}`` on other ranks.
    Calling it again replaces the handlers (tools may set up before and after CKPT is known).
    """
    logger = logging.getLogger("pet")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter(_FORMAT, datefmt=_DATEFMT)
    console = logging.StreamHandler(sys.stdout)
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    console.setFormatter(formatter)
    logger.addHandler(console)
    if output_dir:
        os.makedirs(output_dir, exist_ok=True)
        name = filename if rank == 0 else f"{filename}.rank{rank}"
        file_handler = logging.FileHandler(os.path.join(output_dir, name))
        file_handler.setFormatter(formatter)
        logger.addHandler(file_handler)
    # Fvcore's precise_bn and similar dependencies log under their own names.
    logging.getLogger("fvcore").setLevel(logging.INFO)
    return logger
