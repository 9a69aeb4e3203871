"""RT-DETR in Pet's modules equals transformers' ``RTDetrForObjectDetection`` (the reference implementation).

For R18 (ResNet-18-vd with the hub checkpoint's encoder and decoder sizes) and R50 (``RTDetrConfig()``'s
defaults), with seeded random weights (``use_pretrained_backbone=False``: nothing is downloaded): the
reference's ``state_dict`` loads into Pet's model through the documented key mapping with nothing missing
or left over; the same pixels give the same logits and boxes (float32, 1e-4 absolute; both run the same
operations in the same order, so the differences measured are 0 or a few ulps) and the same detections as
``RTDetrImageProcessor.post_process_object_detection`` (Pet's boxes are also clipped to the image); the
training loss terms are equal (1e-5 relative) with denoising off, and with it on when both draw the
denoising noise from the same seed. Images are small (160 x 128 px) to keep the module fast on 2 cores.
"""
from __future__ import annotations

import os

import pytest
import torch

from pet.config import load_cfg
from pet.modeling import build_model
from pet.modeling.rtdetr.weights import convert_transformers_state_dict
from support.against_reference import Tolerance, match_detections
from support.helpers import CFGS
from support.transformers_detr import (
    load_reference_weights,
    objects,
    random_images,
    randomised,
    reference_labels,
    training,
)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.numeric

HEIGHT, WIDTH = 128, 160
NUM_LABELS = 7
TOLERANCE = 1e-4  # absolute, on logits and normalised boxes


def reference_config(variant: str, **overrides) -> transformers.RTDetrConfig:
    """``RTDetrConfig()`` defaults (R50), or for R18 what PekingU/rtdetr_r18vd changes: a basic-block ResNet-18
    backbone, its channels into the encoder, CSP layers at half width and three decoder layers."""
    kwargs = {"num_labels": NUM_LABELS, "use_pretrained_backbone": False, **overrides}
    if variant == "R18":
        backbone = transformers.RTDetrResNetConfig(depths=[2, 2, 2, 2], layer_type="basic",
                                                   hidden_sizes=[64, 128, 256, 512], out_indices=[2, 3, 4])
        kwargs.update(backbone_config=backbone, encoder_in_channels=[128, 256, 512], hidden_expansion=0.5,
                      decoder_layers=3)
    return transformers.RTDetrConfig(**kwargs)


def pet_config(reference, *opts: str):
    """Pet's config for the same model: the keys the reference's config sets, and [0, 1] RGB pixels."""
    backbone = reference.backbone_config
    name = {(2, 2, 2, 2): "resnet18", (3, 4, 6, 3): "resnet50" if backbone.layer_type == "bottleneck" else "resnet34"}
    return load_cfg(None, [
        "MODEL.META_ARCHITECTURE", "RTDETR", "MODEL.BACKBONE.TYPE", "resnet_vd",
        "MODEL.BACKBONE.NAME", name[tuple(backbone.depths)], "MODEL.BACKBONE.FREEZE_AT", "0",
        "MODEL.NUM_CLASSES", str(reference.num_labels), "MODEL.CHANNELS_LAST", "False",
        # RT-DETR takes RGB in [0, 1], without mean and std.
        "MODEL.PIXEL_MEAN", "[0.0, 0.0, 0.0]", "MODEL.PIXEL_STD", "[255.0, 255.0, 255.0]",
        "MODEL.RTDETR.EXPANSION", str(reference.hidden_expansion),
        "MODEL.RTDETR.DECODER_LAYERS", str(reference.decoder_layers),
        "MODEL.RTDETR.NUM_DENOISING", str(reference.num_denoising),
        "MODEL.RTDETR.NUM_QUERIES", str(reference.num_queries),
        "MODEL.RTDETR.DETECTIONS_PER_IMAGE", str(reference.num_queries), *opts])


@pytest.fixture(scope="module", params=["R18", "R50"])
def pair(request):
    """(variant, the reference's config, its model, Pet's model with its weights), both in eval mode."""
    torch.manual_seed(0)
    reference_cfg = reference_config(request.param)
    reference = randomised(transformers.RTDetrForObjectDetection(reference_cfg), seed=1).eval()
    pet = build_model(pet_config(reference_cfg)).eval()
    load_reference_weights(pet, reference)
    return request.param, reference_cfg, reference, pet


def images(seed: int = 0, batch: int = 2) -> torch.Tensor:
    return random_images(HEIGHT, WIDTH, seed, batch)


def pet_targets(batch: int) -> list[dict]:
    return [{"image_size": (HEIGHT, WIDTH), "orig_size": (HEIGHT, WIDTH)} for _ in range(batch)]


def test_same_logits_boxes_and_detections(pair):
    """Logits and boxes equal at every query; the detections equal once paired one to one.

    The detections are the top 300 of 100 queries x 7 classes: near-tied scores (a few ulps apart, the two sides
    adding in different orders) may leave the top-k in either order, and on some CPUs do (a real AVX2 AMD EPYC,
    and ``ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41``: 442 of 1,200 coordinates apart by index). So
    they are paired by label, score and box (:func:`parity.match_detections`), and only a detection whose score
    is a near-tie at the other side's cut-off may go unpaired."""
    _, _, reference, pet = pair
    pixels = images()
    with torch.no_grad():
        expected = reference(pixel_values=pixels.float() / 255)
        features = pet.encoder(list(pet.backbone(pet.normalizer(pixels, [(HEIGHT, WIDTH)] * 2)).values()))
        outputs = pet.decoder(features)
        detections = pet(pixels, pet_targets(2))
    assert (outputs["logits"][-1] - expected.logits).abs().max() <= TOLERANCE
    assert (outputs["boxes"][-1] - expected.pred_boxes).abs().max() <= TOLERANCE
    processor = transformers.RTDetrImageProcessor()
    reference_detections = processor.post_process_object_detection(expected, threshold=0.0,
                                                                   target_sizes=[(HEIGHT, WIDTH)] * 2)
    tolerance = Tolerance(box=TOLERANCE * WIDTH, score=TOLERANCE)
    for ours, theirs in zip(detections, reference_detections):
        assert len(ours["scores"]) == len(theirs["scores"]) == 300
        clipped = theirs["boxes"].clone()
        clipped[:, 0::2] = clipped[:, 0::2].clamp(0, WIDTH)
        clipped[:, 1::2] = clipped[:, 1::2].clamp(0, HEIGHT)
        # Pet's labels are 1..K
        pairs = match_detections(ours, {**theirs, "boxes": clipped, "labels": theirs["labels"] + 1}, tolerance,
                                 score_thresh=0.0, capped=True)
        assert len(pairs) >= 295  # a handful at most tie at the 300th score


@pytest.mark.parametrize("denoising", [False, True], ids=["no-denoising", "denoising"])
def test_same_training_losses(pair, denoising):
    """Every loss term (last layer, auxiliary layers, encoder candidates, denoising groups) equals the reference's.
    Both models train from the same state (their BatchNorm statistics are restored afterwards)."""
    _, reference_cfg, reference, pet = pair
    targets = objects(3, HEIGHT, WIDTH, NUM_LABELS)
    pixels = images(seed=4)
    with training(pet, reference, reference_cfg.num_denoising if denoising else 0):
        torch.manual_seed(5)
        expected = reference(pixel_values=pixels.float() / 255,
                             labels=reference_labels(targets, HEIGHT, WIDTH)).loss_dict
        torch.manual_seed(5)
        losses = pet(pixels, [{**t, **p} for t, p in zip(targets, pet_targets(2))])
    assert sorted(losses) == sorted(expected)
    assert any("_dn_" in k for k in losses) == denoising
    for name, value in expected.items():
        torch.testing.assert_close(losses[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("variant", ["R18", "R50"])
def test_shipped_coco_config_takes_the_hub_checkpoints_tensors_and_the_papers_recipe(variant):
    """cfgs/coco/rtdetr_R-{18,50}.yaml build the model of the hub's PekingU/rtdetr_{r18,r50}vd (80 COCO classes):
    every tensor of the reference's state_dict has a place of the same shape, and the solver is the paper's."""
    cfg = load_cfg(os.path.join(CFGS, "coco", f"rtdetr_{variant[0]}-{variant[1:]}.yaml"))
    torch.manual_seed(0)
    reference = transformers.RTDetrForObjectDetection(reference_config(variant, num_labels=80))
    expected = {k: tuple(v.shape) for k, v in convert_transformers_state_dict(reference.state_dict()).items()}
    counted = "num_batches_tracked"  # BatchNorm's counter, which FrozenBN lacks
    ours = {k: tuple(v.shape) for k, v in build_model(cfg).state_dict().items() if not k.endswith(counted)}
    assert ours == {k: v for k, v in expected.items() if not k.endswith(counted)}
    solver = cfg.SOLVER
    assert solver.OPTIMIZER == "AdamW" and solver.BASE_LR == 1e-4 and solver.BACKBONE_LR_FACTOR == 0.1
    assert solver.WEIGHT_DECAY == 1e-4
    assert solver.CLIP_GRAD_NORM == 0.1 and cfg.HOOKS.EMA.ENABLED and cfg.HOOKS.EMA.MOMENTUM == 1e-4
    assert solver.MAX_ITER * solver.IMS_PER_BATCH // 117_266 == 72  # epochs of COCO train2017
    assert cfg.INPUT.MAX_SIZE_TEST == 640 and tuple(cfg.MODEL.PIXEL_STD) == (255.0, 255.0, 255.0)
