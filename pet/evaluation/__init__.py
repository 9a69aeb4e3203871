"""Evaluation of detections with pycocotools (COCO AP)."""
from pet.evaluation.coco import BOX_METRICS, COCOEvaluator, detections_to_coco, evaluate_results_file
from pet.evaluation.visualizer import DetectionVisualizer

__all__ = ["BOX_METRICS", "COCOEvaluator", "DetectionVisualizer", "detections_to_coco", "evaluate_results_file"]
