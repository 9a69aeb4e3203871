"""Evaluation of detections: COCO AP (pycocotools or faster-coco-eval) and its diagnostics."""
from pet.evaluation.coco import BOX_METRICS, COCOEvaluator, detections_to_coco, evaluate_results_file
from pet.evaluation.visualizer import DetectionVisualizer

__all__ = ["BOX_METRICS", "COCOEvaluator", "DetectionVisualizer", "detections_to_coco", "evaluate_results_file"]
