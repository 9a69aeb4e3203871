"""A Hugging Face RT-DETR checkpoint evaluated through cfgs/coco/rtdetr_R-18.yaml gives transformers' detections.

This is a user's path end to end: transformers' ``RTDetrForObjectDetection`` with the hub's R18 architecture (80 COCO
classes, the config of ``PekingU/rtdetr_r18vd``; seeded random weights, nothing is downloaded) saved with
``save_pretrained`` as the hub lays a model out (a directory with ``model.safetensors``), and Pet's
:class:`~pet.predict.Predictor` built from the shipped config with that directory as its weights. On pictures of
different sizes and aspect ratios, Pet's detections in the original pixels must be those of transformers' own
pipeline, ``RTDetrImageProcessor()`` (which stretches every picture to 640 x 640), the model and
``post_process_object_detection``: the same boxes within 0.5 px and the same COCO category ids. So the config's
test-time resize (``INPUT.FIXED_SIZE_TEST``) is the processor's, the key mapping takes the checkpoint as it is, and
labels reach COCO's ids through the label space.

The weights: transformers' initialisation, then every normalisation layer's statistics set to those of the
activations it sees on a picture, then every tensor perturbed (``support.transformers_detr.calibrated``). With
uniformly drawn statistics instead (``randomised()``), every query comes out nearly the same (measured: each
picture's five best scores within 0.0003 of each other, all of one class): a score threshold would then be a
near-tie for most detections, which the pairing below may leave unpaired.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pet.data import coco_categories
from pet.predict import Predictor
from pet.predict.sources import Preparer
from support.helpers import CFGS
from support.transformers_detr import COCO_IDS, assert_predictor_gives, calibrated, picture, reference_detections

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.numeric

CFG = os.path.join(CFGS, "coco", "rtdetr_R-18.yaml")
# (height, width): landscape 4:3, portrait 2:3 and a wide 16:9 picture; all are stretched up to 640 x 640.
SIZES = [(240, 320), (300, 200), (280, 500)]
# Keeps 20-40 detections of several categories per picture with these weights (the best score is 0.25-0.31, the 100th
# 0.15-0.16).
SCORE_THRESH = 0.2


def r18_config() -> transformers.RTDetrConfig:
    """PekingU/rtdetr_r18vd's architecture: RTDetrConfig() with a basic-block ResNet-18-vd, its channels into the
    encoder, CSP layers at half width and three decoder layers (as test_rtdetr_parity.reference_config("R18"))."""
    backbone = transformers.RTDetrResNetConfig(depths=[2, 2, 2, 2], layer_type="basic",
                                               hidden_sizes=[64, 128, 256, 512], out_indices=[2, 3, 4])
    return transformers.RTDetrConfig(num_labels=80, use_pretrained_backbone=False, backbone_config=backbone,
                                     encoder_in_channels=[128, 256, 512], hidden_expansion=0.5, decoder_layers=3)


def hub_like_model(seed: int = 0) -> torch.nn.Module:
    """The R18 model with weights whose detections depend on the picture (module docstring)."""
    torch.manual_seed(seed)
    return calibrated(transformers.RTDetrForObjectDetection(r18_config()).eval(), seed)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[str, list[np.ndarray], list[dict[str, torch.Tensor]], torch.Tensor]:
    """The checkpoint file, the pictures (RGB), transformers' detections on them (in COCO category ids) and the
    processor's pixels."""
    model = hub_like_model()
    path = str(tmp_path_factory.mktemp("hub") / "rtdetr_r18vd")
    model.save_pretrained(path)  # the hub's layout: model.safetensors (with the file names of tensors) and config.json
    pictures = [picture(seed, h, w) for seed, (h, w) in enumerate(SIZES)]
    processor = transformers.RTDetrImageProcessor()
    inputs = processor(images=[torch.from_numpy(p).permute(2, 0, 1) for p in pictures], return_tensors="pt")
    with torch.no_grad():
        outputs = model(**inputs)
    theirs = reference_detections(outputs, SIZES, SCORE_THRESH)
    return path, pictures, theirs, inputs["pixel_values"]


@pytest.fixture(scope="module")
def predictor(checkpoint) -> Predictor:
    """Pet's predictor as a user builds it, on the CPU in float32 (transformers' precision)."""
    path = checkpoint[0]
    return Predictor(CFG, weights=path, score_thresh=SCORE_THRESH,
                     opts=["DEVICE", "cpu", "TEST.AMP.ENABLED", "False"])


def test_coco_ids_of_the_hub_labels():
    assert COCO_IDS == sorted(coco_categories())


def test_input_pixels_are_the_image_processors(checkpoint, predictor):
    """The config's test-time resize gives the processor's pixels (Pet's model then divides by 255, as its
    rescale does)."""
    _, pictures, _, pixel_values = checkpoint
    prepare = Preparer(predictor.augmentations)
    for image, expected in zip(pictures, pixel_values):
        ours = prepare.sample(image)
        assert ours["image_size"] == (640, 640)
        torch.testing.assert_close(ours["image"].float() / 255, expected, rtol=0, atol=1e-6)


def test_detections_are_transformers_on_the_original_pictures(checkpoint, predictor):
    """Paired one to one by COCO id, score (1e-4) and box (0.5 px); only a score within 1e-4 of the threshold may
    stay unpaired. Every picture keeps several detections of more than one category."""
    _, pictures, theirs, _ = checkpoint
    assert_predictor_gives(predictor, pictures, theirs, SCORE_THRESH)
