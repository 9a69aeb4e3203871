"""The detector contract: all that code outside :mod:`pet.modeling` may know about a detector.

The engine trains any ``nn.Module`` whose training forward returns a dict of losses. Everything else that
serves a detector (predicting, exporting to ONNX, quantizing to int8, making a sample batch, naming the
outputs) asks it through :class:`Detector`'s attributes and methods below, and never by its class name, an
``isinstance`` on an architecture or a ``MODEL.META_ARCHITECTURE`` string. So a detector, Pet's or a plugin's,
is a subclass of :class:`Detector` (or of one of Pet's families, whose answers it inherits) registered in
``META_ARCH_REGISTRY``, plus its ONNX export graph registered for its class
(:func:`pet.modeling.export_graph.register_export_graph`, inherited by subclasses).

Two kinds of answers:

- **Config level**, class attributes and class methods, read before a model is built (the predictor lowers the
  score threshold in the config, a sample batch needs to know whether the model learns keypoints):
  :attr:`Detector.score_thresh_key`, :meth:`Detector.keypoint_count`, :attr:`Detector.size_multiple`,
  :attr:`Detector.float_parts`, :attr:`Detector.class_dependent_prefixes`. The functions :func:`detector_class`,
  :func:`score_thresh_key` and :func:`keypoint_count` answer them for a config, with the neutral answer for a
  meta-architecture that is not a :class:`Detector` (a builder function, say).
- **Model level**, on a built model: ``score_thresh`` and ``detections_per_img`` (torchvision's names; what an
  export computes with), :meth:`Detector.network_detections` (eval detections before they are mapped to the
  original image; the export parity gate compares an export's outputs with them) and
  :meth:`Detector.convert_state_dict` (foreign checkpoint names to the model's).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from fvcore.common.config import CfgNode

from pet.modeling.build import META_ARCH_REGISTRY
from pet.modeling.state_dict_names import convert_state_dict

__all__ = ["Detector", "detector_class", "keypoint_count", "score_thresh_key"]


class Detector(torch.nn.Module):
    """The base of every Pet detector; what a subclass sets or overrides is documented here, once.

    ``forward(images, targets)``: ``images`` uint8 ``[B, 3, H, W]`` padded to a multiple of ``size_multiple``
    (``INPUT.SIZE_DIVISIBILITY``), ``targets`` per-image dicts with ``image_size`` / ``orig_size`` (and the
    annotations when training). Training returns a dict of ``loss_*`` tensors; eval returns per image ``boxes``
    (XYXY, original-image pixels), ``scores`` and ``labels`` (1..NUM_CLASSES), plus ``masks`` / ``keypoints``
    where the detector has them.

    A subclass calls ``torch.nn.Module.__init__`` as usual; this class adds no state of its own, so it mixes
    with torchvision's detectors (Pet's one-stage family lists it before them).
    """

    # The config key of the test score threshold (a detection scoring at or below it is dropped inside the model),
    # which the predictor lowers when a user asks for lower scores; None: the detector has none.
    score_thresh_key: ClassVar[str | None] = None
    # What the padded height and width must be a multiple of (RT-DETR's encoder needs 32); the export's sizes too.
    size_multiple: ClassVar[int] = 1
    # Module paths (two levels down the detector, as ``roi_heads.box_predictor``) that int8 quantization keeps in
    # float: the export records them, and pet.deploy.int8 reads them from the file.
    float_parts: ClassVar[tuple[str, ...]] = ()
    # state_dict prefixes of the parameters whose shapes follow MODEL.NUM_CLASSES: weights for another number of
    # classes re-initialise them when fine-tuning (pet.checkpoint.load_weights).
    class_dependent_prefixes: ClassVar[tuple[str, ...]] = ()

    # Set by every detector's __init__ (or a property): what the eval forward and its export compute with.
    score_thresh: float
    detections_per_img: int

    @classmethod
    def keypoint_count(cls, cfg: CfgNode) -> int:
        """How many keypoints per instance this detector learns and predicts under ``cfg`` (0: none). Training
        data then carries ``keypoints`` and predictions name them after the test set's points."""
        return 0

    @staticmethod
    def convert_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A foreign checkpoint's ``state_dict`` under this detector's names (torchvision's classification weights
        by default, :func:`pet.modeling.state_dict_names.convert_state_dict`)."""
        return convert_state_dict(state)

    def network_detections(self, images: torch.Tensor, targets: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Eval mode's detections before :func:`pet.modeling.postprocess.detections_to_original`: boxes in the
        network input's pixels, ``masks`` (if any) as probabilities ``[N, 1, M, M]`` of each detection's class.
        The eval forward returns exactly these, mapped; the export parity gate compares an export with them."""
        raise NotImplementedError(f"{type(self).__name__} does not define network_detections(images, targets), "
                                  "which the ONNX export's parity gate compares the export with (see "
                                  "pet.modeling.detector.Detector).")


def detector_class(cfg: CfgNode) -> type[Detector] | None:
    """The :class:`Detector` class ``MODEL.META_ARCHITECTURE`` names, or None when that entry is not one (a
    function that builds a model, a plain ``nn.Module``)."""
    entry = META_ARCH_REGISTRY.get(cfg.MODEL.META_ARCHITECTURE)
    return entry if isinstance(entry, type) and issubclass(entry, Detector) else None


def score_thresh_key(cfg: CfgNode) -> str | None:
    """The config key of ``cfg``'s detector's test score threshold (``MODEL.ROI_HEADS.SCORE_THRESH_TEST`` ...),
    or None when it has none or is not a :class:`Detector`."""
    cls = detector_class(cfg)
    return cls.score_thresh_key if cls is not None else None


def keypoint_count(cfg: CfgNode) -> int:
    """How many keypoints per instance ``cfg``'s detector learns and predicts (0 when none)."""
    cls = detector_class(cfg)
    return cls.keypoint_count(cfg) if cls is not None else 0

