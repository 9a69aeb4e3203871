"""Model-agnostic training and inference machinery."""
from pet.engine import experiment_trackers  # noqa: F401 - registers WandbWriter and MLflowWriter in WRITERS
from pet.engine.events import EventStorage, EventWriter, get_event_storage
from pet.engine.inference import evaluate_on_datasets, inference_on_dataset
from pet.engine.trainer import Trainer

__all__ = ["EventStorage", "EventWriter", "get_event_storage", "Trainer", "inference_on_dataset",
           "evaluate_on_datasets"]
