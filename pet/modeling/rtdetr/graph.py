"""RT-DETR's ONNX export graph (:mod:`pet.modeling.export_graph` says what every export graph computes)."""
from __future__ import annotations

import torch
from torch import Tensor

from pet.modeling.export_graph import DetectorGraph, register_export_graph
from pet.modeling.rtdetr.detector import QueryDetector

__all__ = ["RTDETRGraph"]


@register_export_graph(QueryDetector)
class RTDETRGraph(DetectorGraph):
    """RT-DETR and its successors (D-FINE): encoder, query selection and decoder as the model runs them, then the
    top-k post-processing, batched.

    There is no NMS: each image keeps its ``DETECTIONS_PER_IMAGE`` best (query, class) sigmoid scores above
    ``SCORE_THRESH_TEST``, as :meth:`pet.modeling.rtdetr.RTDETR.top_detections` selects them; the number of queries
    is fixed, so the top-k's size is too. Boxes are not clipped here: the model leaves that to
    :func:`pet.modeling.postprocess.detections_to_original`, and so does the runtime.

    The encoder upsamples the stride-32 map by 2 and concatenates it with the stride-16 one (and so on down to
    stride 8), which holds only where the padded sides are multiples of 32; the PyTorch model needs it too
    (``INPUT.SIZE_DIVISIBILITY`` 32, ``RTDETR.size_multiple``). ``size_multiple`` tells the exporter, which then
    makes the height and width 32 x a free size rather than free sizes that torch.export cannot relate (the AIFI
    position embedding and the query-selection anchors are computed in the graph from the feature maps' sizes, so
    they stay dynamic).
    """

    size_multiple = QueryDetector.size_multiple

    def __init__(self, model: QueryDetector, example_images: Tensor, example_sizes: list[tuple[int, int]]) -> None:
        super().__init__(model, example_images, example_sizes)
        self.encoder = model.encoder
        self.decoder = model.decoder
        self.top_detections = model.top_detections

    def forward(self, images: Tensor, image_sizes: Tensor) -> tuple[Tensor, ...]:
        features = self.encoder(list(self.features(images, image_sizes).values()))
        outputs = self.decoder(features)
        height, width = images.shape[-2:]
        boxes, scores, labels, keep = self.top_detections(outputs["logits"][-1], outputs["boxes"][-1], height, width)
        image_index = torch.arange(scores.shape[0], device=scores.device)[:, None].expand_as(scores)
        return boxes[keep], scores[keep], labels[keep], image_index[keep]
