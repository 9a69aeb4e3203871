"""Deprecated: moved to :mod:`pet.engine.hooks.inference_speed` (the name read as a test file)."""
import warnings

from pet.engine.hooks.inference_speed import StageTimer, TestCallback, TestHook  # noqa: F401

warnings.warn("pet.engine.hooks.test_hook is deprecated; import from pet.engine.hooks",
              DeprecationWarning, stacklevel=2)
