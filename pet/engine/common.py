"""Deprecated: split into :mod:`pet.engine.models` (the model) and :mod:`pet.engine.metrics` (metric rules)."""
import warnings

from pet.engine.metrics import flatten_metrics, is_better, metric_rule  # noqa: F401
from pet.engine.models import call_model, model_device, resolve_device, unwrap_model  # noqa: F401

warnings.warn("pet.engine.common is deprecated; import from pet.engine.models or pet.engine.metrics",
              DeprecationWarning, stacklevel=2)
