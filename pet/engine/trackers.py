"""Deprecated (removed in 0.4.0): renamed :mod:`pet.engine.experiment_trackers`, the experiment-tracker writers."""
import warnings

from pet.engine.experiment_trackers import MLflowWriter, TrackerWriter, WandbWriter  # noqa: F401

warnings.warn("pet.engine.trackers is now pet.engine.experiment_trackers; the old path goes in Pet 0.4.0",
              DeprecationWarning, stacklevel=2)
