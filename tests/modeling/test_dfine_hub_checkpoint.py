"""A Hugging Face D-FINE-L checkpoint evaluated through cfgs/coco/dfine_hgnetv2_L.yaml gives transformers' detections.

A user's path end to end, as tests/modeling/test_rtdetr_hub_checkpoint.py for RT-DETR: transformers'
``DFineForObjectDetection`` with the hub's D-FINE-L architecture (80 COCO classes, ``ustc-community/dfine-large-coco``'s
config; hub-like seeded weights, nothing is downloaded, :func:`support.transformers_detr.calibrated`) saved with
``save_pretrained`` (a directory holding ``model.safetensors`` and ``config.json``, as the hub lays it out), and Pet's
:class:`~pet.predict.Predictor` built from the shipped config with that directory as its weights. On pictures of
different sizes and aspect ratios, Pet's detections in the original pixels must be those of transformers' own
pipeline (``RTDetrImageProcessor()``, which D-FINE's hub checkpoints name, the model and
``post_process_object_detection``): the same boxes within 0.5 px and the same COCO category ids.

With random weights a D-FINE-L is chaotic at the level of single ulps: many of its 8400 encoder candidates score
within a few ulps of each other, a different rounding anywhere before the query selection keeps another 300 of them,
and the decoder's self-attention spreads that to every query's score (measured: logits up to 6.8 apart when Pet runs
channels-last, as it ships, and the reference contiguous; median 2e-3). So the reference computes as Pet does: on the
processor's pixels re-quantised as Pet's normaliser makes them (the integer values divided by 255, where the
processor multiplies by 1 / 255: within 1e-6, one ulp apart on some pixels), channels-last, in float32. A trained
model's candidates are far apart; tests/modeling/test_dfine_parity.py compares the networks themselves.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pet.predict import Predictor
from support.helpers import CFGS
from support.transformers_detr import assert_predictor_gives, calibrated, picture, reference_detections

# Not numeric (the foreign-CPU pass leaves it out): both sides are fed the same pixels in the same memory format and
# run the same kernels in one process, so another CPU's rounding changes them alike (the module docstring says why
# they must); tests/modeling/test_dfine_parity.py is the numeric check.
transformers = pytest.importorskip("transformers")

CFG = os.path.join(CFGS, "coco", "dfine_hgnetv2_L.yaml")
SIZES = [(240, 320), (300, 200)]  # landscape 4:3 and portrait 2:3, both stretched to 640 x 640
SCORE_THRESH = 0.45  # keeps 10-60 detections of several categories per picture with these weights


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[str, list[np.ndarray], list[dict[str, torch.Tensor]]]:
    """The checkpoint directory, the pictures (RGB) and transformers' detections on them (in COCO category ids)."""
    torch.manual_seed(0)
    config = transformers.DFineConfig(num_labels=80, use_pretrained_backbone=False, decoder_n_points=[3, 6, 3])
    model = calibrated(transformers.DFineForObjectDetection(config).eval())
    path = str(tmp_path_factory.mktemp("hub") / "dfine-large-coco")
    model.save_pretrained(path)
    assert os.path.isfile(os.path.join(path, "model.safetensors"))
    pictures = [picture(seed, h, w) for seed, (h, w) in enumerate(SIZES)]
    processor = transformers.RTDetrImageProcessor()
    inputs = processor(images=[torch.from_numpy(p).permute(2, 0, 1) for p in pictures], return_tensors="pt")
    # The processor's pixels as Pet computes them (module docstring): its integer values divided by 255, channels-last.
    pixels = ((inputs["pixel_values"] * 255).round() / 255).contiguous(memory_format=torch.channels_last)
    assert (pixels - inputs["pixel_values"]).abs().max() <= 1e-6
    with torch.no_grad():
        outputs = model.to(memory_format=torch.channels_last)(pixel_values=pixels)
    theirs = reference_detections(outputs, SIZES, SCORE_THRESH)
    return path, pictures, theirs


def test_detections_are_transformers_on_the_original_pictures(checkpoint):
    """Paired one to one by COCO id, score (1e-4) and box (0.5 px); only a score within 1e-4 of the threshold may
    stay unpaired. Every picture keeps several detections of more than one category."""
    path, pictures, theirs = checkpoint
    predictor = Predictor(CFG, weights=path, score_thresh=SCORE_THRESH,
                          opts=["DEVICE", "cpu", "TEST.AMP.ENABLED", "False"])
    assert_predictor_gives(predictor, pictures, theirs, SCORE_THRESH)
