"""Deprecated: the inference timer moved to :mod:`pet.engine.inference_timer` (beside
:mod:`pet.utils.timers`, the name said less than it holds)."""
import warnings

from pet.engine.inference_timer import InferenceTimer, StageTimer  # noqa: F401

warnings.warn("pet.engine.timing is deprecated; import from pet.engine.inference_timer",
              DeprecationWarning, stacklevel=2)
