"""Deprecated (removed in 0.3.0): moved to :mod:`pet.checkpoint.files`, with every other checkpoint module."""
import warnings

from pet.checkpoint.files import LAST_CHECKPOINT, atomic_save, read_last_checkpoint, write_last_checkpoint  # noqa: F401
from pet.checkpoint.loading import load_checkpoint  # noqa: F401
from pet.utils.files import temporary_path  # noqa: F401

warnings.warn("pet.engine.checkpoint is deprecated; import from pet.checkpoint", DeprecationWarning, stacklevel=2)
