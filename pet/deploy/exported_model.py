"""What every runtime of an exported Pet detector shares: the batch contract of the PyTorch model.

An export (:func:`pet.deploy.onnx.export_onnx`) computes everything up to the final detections in the network
input's pixels, whatever runs it. :class:`ExportedModel` holds the part around the graph that does not depend on
the runtime: the input checks from the file's metadata, splitting the flat outputs by image, decoding keypoint
heatmaps and mapping the detections to the original images. A runtime (:class:`pet.deploy.OnnxRuntimeModel`,
:class:`pet.deploy.OpenVinoModel`) only loads the file and runs the graph (:meth:`ExportedModel.run_graph`), so the
runtimes cannot drift apart in what they return.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pet.modeling.keypoint_head import decode_heatmaps
from pet.modeling.postprocess import detections_to_original
from pet.modeling.preprocess import image_sizes
from pet.utils.errors import PetError

__all__ = ["ExportedModel", "FLOAT_SHA256_KEY", "WEIGHTS_SHA256_KEY", "session_inputs"]

# The metadata key under which tools/export.py records the sha256 of the weights file it exported.
WEIGHTS_SHA256_KEY = "pet.weights_sha256"
# The metadata key under which a file made from the float ONNX export (its int8 model, its OpenVINO IRs) records that
# export's sha256: it computes with that export's thresholds, so --backend auto offers it only beside that very file.
FLOAT_SHA256_KEY = "pet.int8.float_sha256"


class ExportedModel(torch.nn.Module):
    """An exported detector behind the PyTorch model's interface: ``forward(images, targets)`` takes the test
    loader's batches and returns, per image, ``{"boxes", "scores", "labels"}`` (and ``"masks"``, or ``"keypoints"``
    and ``"keypoints_scores"``) in original-image pixels, as the PyTorch model in eval mode does. So
    ``pet.engine.inference.inference_on_dataset``, the evaluators and the parity gate use any runtime unchanged.

    It has no parameters (the engine then runs it on the CPU) and only infers: it starts in eval mode, and
    training mode is an error. A subclass sets ``path`` and ``output_names``, calls :meth:`read_metadata` with the
    file's metadata, and implements :meth:`run_graph`.
    """

    # The runtime's name in messages (the parity gate's included).
    runtime = "the runtime"
    path: str
    output_names: list[str]

    def read_metadata(self, metadata: Mapping[str, str]) -> None:
        """What the export recorded about the inputs it takes and the threshold it computes with."""
        self.metadata = dict(metadata)
        self.min_image_size = int(metadata.get("pet.min_image_size", 1))
        # What the padded sides must be a multiple of (RT-DETR's graph: 32); 1 in older exports, which do not record it.
        self.size_multiple = int(metadata.get("pet.size_multiple", 1))
        # The score threshold the graph computes with (None where an older export does not record it).
        self.score_thresh = float(metadata["pet.score_thresh"]) if metadata.get("pet.score_thresh") else None
        self.eval()

    def run_graph(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The graph's outputs for ``inputs`` (:func:`session_inputs`), in the order of ``output_names``."""
        raise NotImplementedError

    def forward(self, images: Tensor, targets: list[dict[str, Any]]) -> list[dict[str, Tensor]]:
        if self.training:
            raise PetError("An exported model only infers: call .eval() (the test loop does).")
        with torch.autocast("cpu", enabled=False):  # mask pasting in float32, as the graph computed
            return detections_to_original(self.network_detections(images, targets), targets)

    def network_detections(self, images: Tensor, targets: list[dict[str, Any]]) -> list[dict[str, Tensor]]:
        """The graph's detections split by image: boxes in the network input's pixels, masks (Mask R-CNN) as
        ``[N, 1, M, M]`` probabilities, keypoints (Keypoint R-CNN) decoded from the graph's heatmaps in the boxes'
        frame, as the PyTorch model's RoI heads give them before its last step."""
        if min(images.shape[-2:]) < self.min_image_size:
            raise PetError(f"{self.path} takes padded images of at least {self.min_image_size} px a side (so that "
                           f"every feature map is larger than 1 cell); this batch is {tuple(images.shape[-2:])} px.")
        if any(side % self.size_multiple for side in images.shape[-2:]):
            raise PetError(f"{self.path} takes padded images whose height and width are multiples of "
                           f"{self.size_multiple}; this batch is {tuple(images.shape[-2:])} px. Pad batches with "
                           f"INPUT.SIZE_DIVISIBILITY {self.size_multiple} (or a multiple of it).")
        outputs = self.run_graph(session_inputs(images, targets))
        named = {name: torch.from_numpy(np.asarray(value)) for name, value in zip(self.output_names, outputs)}
        counts = torch.bincount(named.pop("image_index"), minlength=len(targets)).tolist()
        detections = [dict(zip(named, parts)) for parts in zip(*(value.split(counts) for value in named.values()))]
        for detection in detections:
            if "keypoint_heatmaps" in detection:
                heatmaps = detection.pop("keypoint_heatmaps")
                detection["keypoints"], detection["keypoints_scores"] = decode_heatmaps(heatmaps, detection["boxes"])
        return detections


def session_inputs(images: Tensor, targets: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """The graph's inputs for a batch as the test loader gives it: ``images`` uint8 ``[B, 3, H, W]`` and
    ``image_sizes`` int64 ``[B, 2]``."""
    sizes = np.asarray(image_sizes(targets), dtype=np.int64).reshape(-1, 2)
    return {"images": images.cpu().contiguous().numpy(), "image_sizes": sizes}
