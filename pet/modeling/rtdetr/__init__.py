"""RT-DETR: Pet's own modules (backbone, hybrid encoder, query selection, denoising, decoder, matcher, losses).

See :mod:`pet.modeling.rtdetr.detector` for the model, :mod:`pet.modeling.rtdetr.graph` for its export graph and
:mod:`pet.modeling.rtdetr.weights` for loading transformers' weights.
"""
from pet.modeling.rtdetr.backbone import ResNetVd, resnet_vd
from pet.modeling.rtdetr.criterion import RTDETRCriterion
from pet.modeling.rtdetr.detector import RTDETR, QueryDetector
from pet.modeling.rtdetr.graph import RTDETRGraph
from pet.modeling.rtdetr.matcher import RTDETR_MATCHER_REGISTRY, HungarianMatcher, build_matcher
from pet.modeling.rtdetr.weights import TRANSFORMERS_TO_PET, convert_transformers_state_dict

__all__ = ["RTDETR", "QueryDetector", "RTDETRGraph", "ResNetVd", "resnet_vd", "RTDETRCriterion", "HungarianMatcher",
           "RTDETR_MATCHER_REGISTRY", "build_matcher", "TRANSFORMERS_TO_PET", "convert_transformers_state_dict"]
