"""An exported Pet detector run by onnxruntime, behind the PyTorch model's interface.

:class:`OnnxRuntimeModel` is an ``nn.Module`` whose ``forward(images, targets)`` takes the test loader's
batches and returns what the PyTorch model returns in eval mode, per image ``{"boxes", "scores", "labels"}``
(and ``"masks"``, or ``"keypoints"`` and ``"keypoints_scores"``) in original-image pixels. So
``pet.engine.inference.inference_on_dataset``, the COCO evaluator, TestHook and any test callback use it
unchanged (``tools/test_net.py --backend onnxruntime``).
"""
from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pet.modeling.keypoint_head import decode_heatmaps
from pet.modeling.postprocess import detections_to_original
from pet.modeling.preprocess import image_sizes
from pet.utils.errors import PetError

__all__ = ["OnnxRuntimeModel", "import_onnxruntime", "session_inputs"]

# How to install what pet.deploy needs beyond PyTorch (onnx, onnxruntime, onnxscript).
INSTALL_EXPORT_EXTRA = 'pip install -e ".[export]"'


def import_onnxruntime() -> ModuleType:
    """onnxruntime, from the optional ``export`` extra; without it, one line saying how to install it, so a tool
    can check before minutes of work (tools/export.py does, before exporting)."""
    try:
        import onnxruntime  # an optional extra ("export"): only a run on an ONNX model needs it
    except ImportError as exc:
        raise PetError(f"onnxruntime is not installed, and ONNX models run in it: {INSTALL_EXPORT_EXTRA}") from exc
    return onnxruntime


class OnnxRuntimeModel(torch.nn.Module):
    """An ONNX file written by :func:`pet.deploy.onnx.export_onnx`, run by an onnxruntime session (CPU by default).

    The graph computes everything up to the final detections in the network input's pixels; ``forward``
    then splits them by image and maps them to the original images with
    :func:`pet.modeling.postprocess.detections_to_original`, which scales and clips the boxes and pastes the
    masks' probabilities into their boxes, exactly as the PyTorch model ends its forward. It has no
    parameters: the engine then runs it on the CPU. It only infers: it starts in eval mode, and training mode
    is an error.

    ``threads``: onnxruntime's intra-op threads (0: its default, one per core). ``providers``: onnxruntime's
    execution providers in order of preference, names or ``(name, options)`` pairs (tools/benchmark.py gpu runs the
    parity gate with ``CUDAExecutionProvider``); onnxruntime falls back to the next one it can start, so a caller
    that needs a provider checks ``session.get_providers()``.
    """

    def __init__(self, path: str, threads: int = 0,
                 providers: Sequence[str | tuple[str, dict[str, str]]] = ("CPUExecutionProvider",)) -> None:
        onnxruntime = import_onnxruntime()
        super().__init__()
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        try:
            self.session = onnxruntime.InferenceSession(path, options, providers=list(providers))
        except Exception as exc:  # onnxruntime raises its own exception types for a missing or invalid file
            raise PetError(f"Cannot load the ONNX model {path}: {exc}") from exc
        self.path = path
        self.output_names = [output.name for output in self.session.get_outputs()]
        metadata = self.session.get_modelmeta().custom_metadata_map
        self.min_image_size = int(metadata.get("pet.min_image_size", 1))
        # What the padded sides must be a multiple of (RT-DETR's graph: 32); 1 in older exports, which do not record it.
        self.size_multiple = int(metadata.get("pet.size_multiple", 1))
        # The score threshold the graph computes with (None where an older export does not record it).
        self.score_thresh = float(metadata["pet.score_thresh"]) if metadata.get("pet.score_thresh") else None
        self.eval()

    def forward(self, images: Tensor, targets: list[dict[str, Any]]) -> list[dict[str, Tensor]]:
        if self.training:
            raise PetError("An ONNX model only infers: call .eval() (the test loop does).")
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
        outputs = self.session.run(None, session_inputs(images, targets))
        named = {name: torch.from_numpy(value) for name, value in zip(self.output_names, outputs)}
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
