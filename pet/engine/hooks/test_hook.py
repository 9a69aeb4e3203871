"""Deprecated (removed in 0.4.0): renamed :mod:`pet.engine.hooks.inference_speed`; import TestHook from
:mod:`pet.engine.hooks`."""
import warnings

from pet.engine.hooks.inference_speed import TestHook  # noqa: F401

warnings.warn("pet.engine.hooks.test_hook is now pet.engine.hooks.inference_speed (import TestHook from "
              "pet.engine.hooks); the old path goes in Pet 0.4.0", DeprecationWarning, stacklevel=2)
