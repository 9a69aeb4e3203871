"""The process's random-number generators (Python, numpy, torch, CUDA): seed them, save and restore them.

A checkpoint carries :func:`get_rng_state` so a resumed run draws what the uninterrupted one would
have drawn; the validation loss during training restores it afterwards, so validating never changes
what training draws next.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["seed_everything", "get_rng_state", "set_rng_state"]


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators (all CUDA devices included)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def get_rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states in a form ``weights_only`` loading accepts."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_python_state(state["python"]))
    np_state = state["numpy"]
    np.random.set_state(
        ("MT19937", np_state["keys"].numpy().astype(np.uint32), np_state["pos"], np_state["has_gauss"],
         np_state["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_python_state(state: Any) -> tuple:
    # Saved tuples may come back as lists; random.setstate needs tuples.
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
