"""Evaluation of detections: COCO AP (pycocotools or faster-coco-eval) and its diagnostics."""
from pet.evaluation.build import EVALUATOR_REGISTRY, build_evaluator
from pet.evaluation.coco import BOX_METRICS, COCOEvaluator, detections_to_coco, evaluate_results_file
from pet.evaluation.visualizer import DetectionVisualizer

__all__ = ["BOX_METRICS", "COCOEvaluator", "EVALUATOR_REGISTRY", "build_evaluator", "DetectionVisualizer",
           "detections_to_coco", "evaluate_results_file"]
