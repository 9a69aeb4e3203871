"""Tiny detectors several test files build: the config overrides that make them tiny, and what gives a random one
varied, non-trivial outputs (random norms, a classifier rescaled to O(1) scores)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import cv2
import numpy as np
import torch
from torchvision.ops import FrozenBatchNorm2d

from pet.config import load_cfg
from pet.data import DatasetMapper, collate_batch, read_image
from support.helpers import CFGS

# A tiny two-stage detector on a shapes config (Faster, Mask, Cascade or Keypoint R-CNN): ResNet stages 2-3, a
# 32-channel FPN with three anchor sizes, a 64-wide box head, few proposals. A test adds its own heads' opts.
TINY_TWO_STAGE = ["MODEL.FPN.RETURNED_LAYERS", "[2, 3]", "MODEL.RPN.ANCHOR_SIZES", "[[32], [64], [128]]",
                  "MODEL.FPN.OUT_CHANNELS", "32", "MODEL.ROI_BOX_HEAD.MLP_DIM", "64",
                  "MODEL.RPN.PRE_NMS_TOPK_TEST", "200", "MODEL.RPN.POST_NMS_TOPK_TEST", "100"]

# A tiny RT-DETR on the shapes config RTDETR_SHAPES_CFG.
RTDETR_SHAPES_CFG = os.path.join(CFGS, "shapes", "rtdetr_R-18.yaml")
TINY_RTDETR = ["MODEL.RTDETR.BACKBONE_WIDTH", "8", "MODEL.RTDETR.HIDDEN_DIM", "16", "MODEL.RTDETR.ENCODER_HEADS", "2",
               "MODEL.RTDETR.ENCODER_FFN_DIM", "32", "MODEL.RTDETR.DECODER_DIM", "16", "MODEL.RTDETR.DECODER_LAYERS",
               "2", "MODEL.RTDETR.DECODER_HEADS", "2", "MODEL.RTDETR.DECODER_FFN_DIM", "32",
               "MODEL.RTDETR.NUM_QUERIES", "20", "MODEL.RTDETR.NUM_DENOISING", "10",
               "MODEL.RTDETR.DETECTIONS_PER_IMAGE", "20"]


def tiny_rtdetr_cfg(*opts: str):
    """The config of the tiny RT-DETR (:data:`TINY_RTDETR`), with ``opts``."""
    return load_cfg(RTDETR_SHAPES_CFG, [*TINY_RTDETR, *opts])


# A tiny D-FINE on the shapes config DFINE_SHAPES_CFG, on the tiny RT-DETR's backbone (an 8-channel ResNet-18-vd stem:
# HGNetv2-B0, the smallest HGNetv2, has 1.8 M parameters and takes torch.export twice as long; the parity tests cover
# HGNetv2 and transformers' loss layout), with D-FINE's own encoder blocks and the paper's loss layout (the shapes
# config takes RT-DETR's blocks, which RT-DETR's tests export and train, and transformers' layout).
DFINE_SHAPES_CFG = os.path.join(CFGS, "shapes", "dfine_R-18.yaml")
TINY_DFINE = ["MODEL.DFINE.ENCODER", "hybrid", "MODEL.DFINE.EXPANSION", "0.5", "MODEL.DFINE.LOSS_LAYOUT", "original",
              "MODEL.RTDETR.BACKBONE_WIDTH", "8", "MODEL.DFINE.HIDDEN_DIM", "16", "MODEL.DFINE.ENCODER_HEADS", "2",
              "MODEL.DFINE.ENCODER_FFN_DIM", "32",
              "MODEL.DFINE.DECODER_DIM", "16", "MODEL.DFINE.DECODER_LAYERS", "2", "MODEL.DFINE.DECODER_HEADS", "2",
              "MODEL.DFINE.DECODER_FFN_DIM", "32", "MODEL.DFINE.NUM_BINS", "16", "MODEL.DFINE.LQE_HIDDEN_DIM", "16",
              "MODEL.DFINE.NUM_QUERIES", "20", "MODEL.DFINE.NUM_DENOISING", "10",
              "MODEL.DFINE.DETECTIONS_PER_IMAGE", "20"]


@dataclass(frozen=True)
class TinyQueryDetector:
    """A tiny detector of the RT-DETR family (RT-DETR, D-FINE): its shipped shapes config, the opts that make it tiny,
    and its config node (``MODEL.<node>``)."""

    cfg_file: str
    opts: tuple[str, ...]
    node: str

    def cfg(self, *opts: str):
        return load_cfg(self.cfg_file, [*self.opts, *opts])


TINY_QUERY_DETECTORS = {"rtdetr": TinyQueryDetector(RTDETR_SHAPES_CFG, tuple(TINY_RTDETR), "RTDETR"),
                        "dfine": TinyQueryDetector(DFINE_SHAPES_CFG, tuple(TINY_DFINE), "DFINE")}
# DEIMv2 on D-FINE's tiny config: what differs from D-FINE is its training (MAL, dense one-to-one matching), which the
# tests of training (resume, two processes) run it for; its export graph and prediction are D-FINE's.
TINY_DEIMV2 = TinyQueryDetector(DFINE_SHAPES_CFG, (*TINY_DFINE, "MODEL.META_ARCHITECTURE", "pet.modeling.dfine.DEIMV2"),
                                "DFINE")
TINY_TRAINING_DETECTORS = {**TINY_QUERY_DETECTORS, "deimv2": TINY_DEIMV2}


def randomize_norms(model: torch.nn.Module, seed: int = 0) -> None:
    """Random but non-trivial statistics and affine parameters in every BatchNorm and GroupNorm."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.BatchNorm2d, FrozenBatchNorm2d, torch.nn.GroupNorm)):
                n = module.weight.numel()
                module.weight.copy_(0.5 + torch.rand(n, generator=gen))
                module.bias.copy_(0.2 * torch.randn(n, generator=gen))
            if isinstance(module, (torch.nn.BatchNorm2d, FrozenBatchNorm2d)):
                module.running_mean.copy_(0.2 * torch.randn(module.num_features, generator=gen))
                module.running_var.copy_(0.5 + 1.5 * torch.rand(module.num_features, generator=gen))


def rescale_layer_output(model: torch.nn.Module, layer: str, batch) -> None:
    """Scale ``layer``'s weight so its outputs less the bias have std 1 on ``batch`` (scores then vary across
    images; torchvision initialises classifiers to give every location the prior)."""
    module = model.get_submodule(layer)
    outputs = []

    def record(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        outputs.append(output)

    handle = module.register_forward_hook(record)
    with torch.no_grad():
        model(*batch)
        handle.remove()
        out = outputs[0]
        module.weight.mul_(1 / (out - module.bias.view(1, -1, *([1] * (out.dim() - 2)))).std())


def shapes_val_batch(cfg, shapes_root: str, indices: list[int], scale: float = 1.0):
    """Validation images ``indices`` of the shapes set, resized by ``scale``, as the test loader batches them."""
    mapper = DatasetMapper.from_config(cfg, is_train=False)
    samples = []
    for i in indices:
        image = read_image(os.path.join(shapes_root, "val", sorted(os.listdir(os.path.join(shapes_root, "val")))[i]))
        image = cv2.resize(image, None, fx=scale, fy=scale, interpolation=cv2.INTER_LINEAR)
        record = {"image_id": i + 1, "boxes": np.zeros((0, 4), dtype=np.float32), "labels": []}
        samples.append(mapper(record, image, np.random.default_rng(0)))
    return collate_batch(samples, cfg.INPUT.SIZE_DIVISIBILITY)
