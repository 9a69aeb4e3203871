"""Deprecated (removed in 0.3.0): moved to :mod:`pet.checkpoint.loading`, with every other checkpoint module."""
import warnings

from pet.checkpoint.loading import load_checkpoint, load_weights  # noqa: F401

warnings.warn("pet.utils.weights is deprecated; import from pet.checkpoint", DeprecationWarning, stacklevel=2)
