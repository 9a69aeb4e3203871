"""Evaluation of detections: COCO AP (pycocotools or faster-coco-eval) and its diagnostics."""
import warnings
from typing import Any

from pet.evaluation.build import EVALUATOR_REGISTRY, build_evaluator
from pet.evaluation.coco import BOX_METRICS, COCOEvaluator, detections_to_coco, evaluate_results_file
from pet.evaluation.visualizer import VisualizationHook

__all__ = ["BOX_METRICS", "COCOEvaluator", "EVALUATOR_REGISTRY", "build_evaluator", "VisualizationHook",
           "detections_to_coco", "evaluate_results_file"]


def __getattr__(name: str) -> Any:
    """``DetectionVisualizer``, VisualizationHook's name before 0.2.0, with a DeprecationWarning until 0.3.0."""
    if name == "DetectionVisualizer":
        warnings.warn("pet.evaluation.DetectionVisualizer is now pet.evaluation.VisualizationHook; the old name goes "
                      "in Pet 0.3.0", DeprecationWarning, stacklevel=2)
        return VisualizationHook
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
