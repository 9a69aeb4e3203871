"""Evaluation of detections with pycocotools (COCO AP)."""
from pet.evaluation.coco import BOX_METRICS, COCOEvaluator, detections_to_coco, evaluate_results_file

__all__ = ["BOX_METRICS", "COCOEvaluator", "detections_to_coco", "evaluate_results_file"]
