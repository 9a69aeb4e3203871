"""Deprecated: moved to :mod:`pet.engine.inference_timer` (beside utils/timers.py, the name said too little)."""
import warnings

from pet.engine.inference_timer import InferenceTimer, StageTimer  # noqa: F401

warnings.warn("pet.engine.timing is deprecated; import from pet.engine.inference_timer",
              DeprecationWarning, stacklevel=2)
