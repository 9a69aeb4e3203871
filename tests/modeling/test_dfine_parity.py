"""D-FINE in Pet's modules equals transformers' ``DFineForObjectDetection`` (the reference implementation).

Three sizes, each with seeded random weights (``use_pretrained_backbone=False``: nothing is downloaded; every tensor
perturbed, as the reference initialises gates, quality heads and box heads' last layers to zeros):

* **L**: ``DFineConfig()``'s defaults (D-FINE-L's architecture: HGNetv2-B4, 256 channels, 6 decoder layers, 4
  sampling points per level) with 7 classes;
* **N**: the hub's D-FINE-N (HGNetv2-B0 with affine blocks, two levels at strides 16 and 32, 128 channels, RepNCSPELAN4
  blocks of 21 channels, 6 + 6 points), as transformers' conversion script configures it, but for 80 queries (the
  test images have 100 locations at strides 16 and 32);
* **X-tiny**: a small model with D-FINE-X's particulars: an encoder wider than the decoder (so the decoder projects
  its inputs) and a weighting function with ``reg_scale`` 8, on B0.

For each, the reference's ``state_dict`` loads through the documented key mapping with nothing missing or left over;
the same pixels give the same class logits, boxes and last layer's edge distributions (float32, 1e-4 absolute: both
run the same operations in the same order, the measured differences are 0 or a few ulps) and the same detections as
``RTDetrImageProcessor.post_process_object_detection``, paired one to one (near-tied scores may order differently on
another CPU). Images are small (128 x 160 px) to keep the module fast on 2 cores.
"""
from __future__ import annotations

import os

import pytest
import torch

from pet.config import load_cfg
from pet.modeling import build_model
from pet.modeling.dfine.weights import convert_transformers_state_dict
from support.against_reference import Tolerance, match_detections
from support.helpers import CFGS
from support.transformers_detr import (
    hgnetv2_config,
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
TOLERANCE = 1e-4  # absolute, on logits, normalised boxes and edge logits


def reference_config(variant: str, **overrides) -> transformers.DFineConfig:
    """``DFineConfig()`` (L), the conversion script's N, or the small X-like model (see the module docstring)."""
    kwargs = {"num_labels": NUM_LABELS, "use_pretrained_backbone": False, **overrides}
    if variant == "N":
        kwargs.update(backbone_config=hgnetv2_config("B0", out_indices=(3, 4)), num_feature_levels=2,
                      encoder_in_channels=[512, 1024], feat_strides=[16, 32], encode_proj_layers=[1],
                      encoder_hidden_dim=128, encoder_ffn_dim=512, d_model=128, decoder_ffn_dim=512,
                      decoder_in_channels=[128, 128], decoder_n_points=[6, 6], decoder_layers=3, depth_mult=0.5,
                      hidden_expansion=0.34, num_queries=80)
    elif variant == "X-tiny":
        kwargs.update(backbone_config=hgnetv2_config("B0", out_indices=(2, 3, 4)),
                      encoder_in_channels=[256, 512, 1024], encoder_hidden_dim=64, encoder_ffn_dim=128,
                      decoder_in_channels=[64, 64, 64], d_model=32, decoder_ffn_dim=64, decoder_attention_heads=4,
                      decoder_n_points=[3, 6, 3], decoder_layers=3, num_queries=60, reg_scale=8.0)
    return transformers.DFineConfig(**kwargs)


def pet_config(reference, variant: str, *opts: str):
    """Pet's config for the same model: the keys the reference's config sets, and [0, 1] RGB pixels."""
    points = reference.decoder_n_points
    points = list(points) if isinstance(points, list) else [points] * reference.num_feature_levels
    return load_cfg(None, [
        "MODEL.META_ARCHITECTURE", "pet.modeling.dfine.DFINE", "MODEL.BACKBONE.TYPE", "hgnetv2",
        "MODEL.BACKBONE.NAME", "B4" if variant == "L" else "B0", "MODEL.BACKBONE.FREEZE_AT", "0",
        "MODEL.NUM_CLASSES", str(reference.num_labels), "MODEL.CHANNELS_LAST", "False",
        "MODEL.PIXEL_MEAN", "[0.0, 0.0, 0.0]", "MODEL.PIXEL_STD", "[255.0, 255.0, 255.0]",
        "MODEL.DFINE.NUM_LEVELS", str(reference.num_feature_levels),
        "MODEL.DFINE.HIDDEN_DIM", str(reference.encoder_hidden_dim),
        "MODEL.DFINE.ENCODER_FFN_DIM", str(reference.encoder_ffn_dim),
        "MODEL.DFINE.EXPANSION", str(reference.hidden_expansion), "MODEL.DFINE.DEPTH_MULT", str(reference.depth_mult),
        "MODEL.DFINE.DECODER_DIM", str(reference.d_model),
        "MODEL.DFINE.DECODER_FFN_DIM", str(reference.decoder_ffn_dim),
        "MODEL.DFINE.DECODER_HEADS", str(reference.decoder_attention_heads),
        "MODEL.DFINE.DECODER_LAYERS", str(reference.decoder_layers), "MODEL.DFINE.DECODER_POINTS", str(points),
        "MODEL.DFINE.REG_SCALE", str(reference.reg_scale),
        "MODEL.DFINE.NUM_DENOISING", str(reference.num_denoising),
        "MODEL.DFINE.NUM_QUERIES", str(reference.num_queries),
        "MODEL.DFINE.DETECTIONS_PER_IMAGE", str(reference.num_queries), *opts])


@pytest.fixture(scope="module", params=["L", "N", "X-tiny"])
def pair(request):
    """(variant, the reference's config, its model, Pet's model with its weights), both in eval mode."""
    torch.manual_seed(0)
    reference_cfg = reference_config(request.param)
    reference = randomised(transformers.DFineForObjectDetection(reference_cfg), seed=1).eval()
    pet = build_model(pet_config(reference_cfg, request.param)).eval()
    load_reference_weights(pet, reference)
    return request.param, reference_cfg, reference, pet


def images(seed: int = 0, batch: int = 2) -> torch.Tensor:
    return random_images(HEIGHT, WIDTH, seed, batch)


def pet_targets(batch: int) -> list[dict]:
    return [{"image_size": (HEIGHT, WIDTH), "orig_size": (HEIGHT, WIDTH)} for _ in range(batch)]


def pet_outputs(pet, pixels: torch.Tensor) -> dict:
    features = pet.encoder(list(pet.backbone(pet.normalizer(pixels, [(HEIGHT, WIDTH)] * len(pixels))).values()))
    return pet.decoder(features)


def test_same_logits_boxes_distributions_and_detections(pair):
    """Logits, boxes and edge logits equal at every query; the detections equal once paired one to one."""
    _, _, reference, pet = pair
    pixels = images()
    with torch.no_grad():
        expected = reference(pixel_values=pixels.float() / 255)
        outputs = pet_outputs(pet, pixels)
        detections = pet(pixels, pet_targets(2))
    assert (outputs["logits"][-1] - expected.logits).abs().max() <= TOLERANCE
    assert (outputs["boxes"][-1] - expected.pred_boxes).abs().max() <= TOLERANCE
    assert (outputs["corners"][-1] - expected.intermediate_predicted_corners[:, -1]).abs().max() <= TOLERANCE
    assert (outputs["anchors"] - expected.initial_reference_points[:, -1]).abs().max() <= TOLERANCE
    assert (outputs["enc_logits"] - expected.enc_topk_logits).abs().max() <= TOLERANCE
    processor = transformers.RTDetrImageProcessor()
    reference_detections = processor.post_process_object_detection(expected, threshold=0.0,
                                                                   target_sizes=[(HEIGHT, WIDTH)] * 2)
    tolerance = Tolerance(box=TOLERANCE * WIDTH, score=TOLERANCE)
    queries = pet.detections_per_img
    for ours, theirs in zip(detections, reference_detections):
        assert len(ours["scores"]) == len(theirs["scores"]) == queries
        clipped = theirs["boxes"].clone()
        clipped[:, 0::2] = clipped[:, 0::2].clamp(0, WIDTH)
        clipped[:, 1::2] = clipped[:, 1::2].clamp(0, HEIGHT)
        pairs = match_detections(ours, {**theirs, "boxes": clipped, "labels": theirs["labels"] + 1}, tolerance,
                                 score_thresh=0.0, capped=True)
        assert len(pairs) >= queries - 5  # a handful at most tie at the last score kept


def test_training_outputs_of_every_layer(pair):
    """In training (denoising off) every layer's logits, boxes and edge logits, and layer 0's pre-box head, equal
    the reference's intermediate outputs (transformers stacks the pre-box head first)."""
    _, reference_cfg, reference, pet = pair
    pixels = images(seed=2)
    with training(pet, reference, 0), torch.no_grad():
        expected = reference(pixel_values=pixels.float() / 255)
        outputs = pet_outputs(pet, pixels)
    layers = reference_cfg.decoder_layers
    assert len(outputs["logits"]) == len(outputs["boxes"]) == len(outputs["corners"]) == layers
    logits = [outputs["pre_logits"], *outputs["logits"]]
    boxes = [outputs["pre_boxes"], *outputs["boxes"]]
    for i in range(layers + 1):
        assert (logits[i] - expected.intermediate_logits[:, i]).abs().max() <= TOLERANCE, i
        assert (boxes[i] - expected.intermediate_reference_points[:, i]).abs().max() <= TOLERANCE, i
    for i in range(layers):
        assert (outputs["corners"][i] - expected.intermediate_predicted_corners[:, i]).abs().max() <= TOLERANCE, i


def hub_config(size: str) -> transformers.DFineConfig:
    """The config transformers' conversion script gives the hub's ``dfine-{nano,small,medium,large,xlarge}-coco``."""
    backbone = {"N": ("B0", (3, 4)), "S": ("B0", (2, 3, 4)), "M": ("B2", (2, 3, 4)), "L": ("B4", (2, 3, 4)),
                "X": ("B5", (2, 3, 4))}[size]
    kwargs = {"num_labels": 80, "use_pretrained_backbone": False, "decoder_n_points": [3, 6, 3],
              "backbone_config": hgnetv2_config(backbone[0], out_indices=backbone[1])}
    kwargs["encoder_in_channels"] = [kwargs["backbone_config"].stage_out_channels[i - 1] for i in backbone[1]]
    if size == "N":
        kwargs.update(num_feature_levels=2, encoder_ffn_dim=512, encode_proj_layers=[1], d_model=128,
                      encoder_hidden_dim=128, decoder_ffn_dim=512, decoder_n_points=[6, 6],
                      decoder_in_channels=[128, 128], feat_strides=[16, 32], depth_mult=0.5, decoder_layers=3,
                      hidden_expansion=0.34)
    elif size == "S":
        kwargs.update(decoder_layers=3, hidden_expansion=0.5, depth_mult=0.34)
    elif size == "M":
        kwargs.update(decoder_layers=4, depth_mult=0.67)
    elif size == "X":
        kwargs.update(encoder_hidden_dim=384, encoder_ffn_dim=2048, decoder_in_channels=[384, 384, 384])
    return transformers.DFineConfig(**kwargs)


@pytest.mark.parametrize("size", ["N", "S", "M", "L", "X"])
def test_shipped_coco_config_takes_the_hub_checkpoints_tensors_and_the_papers_recipe(size):
    """cfgs/coco/dfine_hgnetv2_{N,S,M,L,X}.yaml build the model of the hub's D-FINE checkpoints (80 COCO classes): every
    tensor of the reference's state_dict has a place of the same shape (both built on the meta device: shapes only),
    and the training recipe is the authors'."""
    cfg = load_cfg(os.path.join(CFGS, "coco", f"dfine_hgnetv2_{size}.yaml"))
    with torch.device("meta"):
        reference = transformers.DFineForObjectDetection(hub_config(size))
        ours = build_model(cfg)
    expected = {k: tuple(v.shape) for k, v in convert_transformers_state_dict(reference.state_dict()).items()}
    counted = "num_batches_tracked"  # BatchNorm's counter, which FrozenBN lacks
    ours = {k: tuple(v.shape) for k, v in ours.state_dict().items() if not k.endswith(counted)}
    assert ours == {k: v for k, v in expected.items() if not k.endswith(counted)}
    solver = cfg.SOLVER
    epochs = {"N": 160, "S": 132, "M": 132, "L": 80, "X": 80}[size]
    assert solver.OPTIMIZER == "AdamW" and solver.CLIP_GRAD_NORM == 0.1 and cfg.HOOKS.EMA.ENABLED
    assert round(solver.MAX_ITER * solver.IMS_PER_BATCH / 117_266) == epochs  # epochs of COCO train2017
    stop = {a["until_epoch"] for a in cfg.INPUT.AUGMENTATIONS if "until_epoch" in a}
    assert stop == {{"N": 148, "S": 120, "M": 120, "L": 72, "X": 72}[size]}
    assert cfg.INPUT.FIXED_SIZE_TEST == (640, 640) and tuple(cfg.MODEL.PIXEL_STD) == (255.0, 255.0, 255.0)


@pytest.mark.parametrize("denoising", [False, True], ids=["no-denoising", "denoising"])
def test_same_training_losses(pair, denoising):
    """The whole model in training: every loss term (varifocal, L1, GIoU, FGL and DDF of the last layer, the
    auxiliary sets, the encoder candidates and the denoising groups) equals the reference's, from the same state and,
    with denoising, the same seed for its noise (tests/modeling/test_dfine_criterion.py checks the losses alone, on
    the reference's own outputs, gradients included)."""
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
    assert any("fgl" in k for k in losses) and any("ddf" in k for k in losses)
    for name, value in expected.items():
        torch.testing.assert_close(losses[name], value, rtol=1e-5, atol=1e-6, msg=name)
