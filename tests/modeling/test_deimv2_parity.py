"""DEIMv2 in Pet's modules equals transformers' ``Deimv2ForObjectDetection`` (the reference implementation).

Four models, each with seeded random weights (every tensor perturbed, as tests/modeling/test_dfine_parity.py says why),
then BatchNorm statistics fitted to the activations on a picture (``calibrated``), so that the encoder's maps vary
over the image and a slip in the encoder shows in the outputs:

* **N**: the hub's DEIMv2-N (``Intellindust/DEIMv2_HGNetv2_N_COCO``): HGNetv2-B0 with affine blocks, strides 16 and 32,
  128 channels, RepNCSPELAN5 fusion with trailing convs, gateways, the authors' SiLU query-position head, as
  transformers' conversion script configures it, but for 80 queries (the test images have 100 locations);
* **tiny**: three levels of 32 channels with the other switches: no trailing convs (DEIMv2-M/L/X), no gateway (a
  residual sum and RMSNorm), one box head shared by the layers (Atto/Femto/Pico), the reference's default ReLU query
  head;
* **atto** and **pico**: the hub's DEIMv2-Atto and -Pico as the conversion script configures them, but for 80
  queries: the Lite encoder (``encoder_type="lite"``: one stride-16 level, a stride-32 one pooled from it, the
  global-average-pool fusion, one FPN and one PAN block) on the three-stage HGNetv2-Atto (third stage 256 wide, 3x3
  kernels) and -Pico (512 wide, two blocks), 64 and 112 channels, 4 + 2 sampling points, no gateway, a shared box
  head. (Femto is Pico with one block in the last stage; its tensors are checked against the shipped config below.)

For each, the reference's ``state_dict`` loads through the key mapping with nothing missing or left over; the same
pixels give the same encoder maps, logits, boxes and edge distributions (float32, 1e-4; measured 0) and, in training,
every layer's outputs; every training loss term (MAL, boxes, FGL, DDF, with dense one-to-one matching; denoising off and
on from the same seed) is equal. The losses alone are tests/modeling/test_deimv2_criterion.py's.
"""
from __future__ import annotations

import os

import pytest
import torch

from pet.checkpoint import load_weights
from pet.config import load_cfg
from pet.modeling import build_model
from pet.utils.errors import ConfigError
from support.helpers import CFGS
from support.transformers_detr import (
    calibrated,
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
TOLERANCE = 1e-4
# Each test model's HGNetv2 variant (Pet's MODEL.BACKBONE.NAME).
BACKBONES = {"N": "B0", "tiny": "B0", "atto": "Atto", "pico": "Pico"}
# The Lite-encoder hub models (the authors' configs/deimv2/deimv2_hgnetv2_{atto,femto,pico}_coco.yml): backbone
# channels at stride 16, encoder and decoder width, decoder FFN width, queries.
LITE = {"Atto": (256, 64, 160, 100), "Femto": (512, 96, 256, 150), "Pico": (512, 112, 320, 200)}


def lite_kwargs(backbone: str, num_queries: int | None = None) -> dict:
    """``Deimv2Config`` arguments of a Lite-encoder model as transformers' conversion script sets them from the
    authors' config: the backbone's stage 3 alone (their ``return_idx [2]``), ``encoder_layers`` 0, two decoder levels
    of 4 and 2 points, three decoder layers, no gateway, a shared box head, SiLU query head."""
    in_channels, dim, ffn_dim, queries = LITE[backbone]
    return {"backbone_config": hgnetv2_config(backbone, out_indices=(3,)), "encoder_type": "lite",
            "encoder_layers": 0, "encoder_in_channels": [in_channels], "feat_strides": [16],
            "encoder_hidden_dim": dim, "d_model": dim, "decoder_in_channels": [dim, dim], "num_feature_levels": 2,
            "decoder_n_points": [4, 2], "decoder_layers": 3, "decoder_ffn_dim": ffn_dim,
            "num_queries": num_queries or queries, "hidden_expansion": 0.34, "depth_mult": 0.5, "use_gateway": False,
            "share_bbox_head": True, "decoder_activation_function": "silu"}


def reference_config(variant: str) -> transformers.Deimv2Config:
    kwargs = {"num_labels": NUM_LABELS, "use_pretrained_backbone": False}
    if variant in ("atto", "pico"):
        kwargs.update(lite_kwargs(BACKBONES[variant], num_queries=80))
    elif variant == "N":
        kwargs.update(backbone_config=hgnetv2_config("B0", out_indices=(3, 4)), num_feature_levels=2,
                      encoder_in_channels=[512, 1024], feat_strides=[16, 32], encode_proj_layers=[1],
                      encoder_hidden_dim=128, encoder_ffn_dim=512, d_model=128, decoder_ffn_dim=512,
                      decoder_in_channels=[128, 128], decoder_n_points=[6, 6], decoder_layers=3, depth_mult=0.5,
                      hidden_expansion=0.34, num_queries=80, decoder_activation_function="silu")
    else:
        kwargs.update(backbone_config=hgnetv2_config("B0", out_indices=(2, 3, 4)),
                      encoder_in_channels=[256, 512, 1024], encoder_hidden_dim=32, encoder_ffn_dim=64,
                      encoder_attention_heads=4, d_model=32, decoder_in_channels=[32, 32, 32], decoder_ffn_dim=64,
                      decoder_attention_heads=4, decoder_n_points=[3, 6, 3], decoder_layers=3, num_queries=40,
                      hidden_expansion=0.5, depth_mult=0.34, encoder_has_trailing_conv=False, use_gateway=False,
                      share_bbox_head=True)
    return transformers.Deimv2Config(**kwargs)


def pet_config(reference, backbone: str = "B0"):
    points = reference.decoder_n_points
    return load_cfg(None, [
        "MODEL.META_ARCHITECTURE", "pet.modeling.dfine.DEIMV2", "MODEL.BACKBONE.TYPE", "hgnetv2",
        "MODEL.BACKBONE.NAME", backbone, "MODEL.BACKBONE.FREEZE_AT", "0", "MODEL.DFINE.ENCODER", reference.encoder_type,
        "MODEL.NUM_CLASSES", str(reference.num_labels),
        "MODEL.CHANNELS_LAST", "False", "MODEL.PIXEL_MEAN", "[0.0, 0.0, 0.0]",
        "MODEL.PIXEL_STD", "[255.0, 255.0, 255.0]",
        "MODEL.DFINE.NUM_LEVELS", str(reference.num_feature_levels),
        "MODEL.DFINE.HIDDEN_DIM", str(reference.encoder_hidden_dim),
        "MODEL.DFINE.ENCODER_HEADS", str(reference.encoder_attention_heads),
        "MODEL.DFINE.ENCODER_FFN_DIM", str(reference.encoder_ffn_dim),
        "MODEL.DFINE.EXPANSION", str(reference.hidden_expansion), "MODEL.DFINE.DEPTH_MULT", str(reference.depth_mult),
        "MODEL.DFINE.DECODER_DIM", str(reference.d_model),
        "MODEL.DFINE.DECODER_FFN_DIM", str(reference.decoder_ffn_dim),
        "MODEL.DFINE.DECODER_HEADS", str(reference.decoder_attention_heads),
        "MODEL.DFINE.DECODER_LAYERS", str(reference.decoder_layers), "MODEL.DFINE.DECODER_POINTS", str(list(points)),
        "MODEL.DFINE.NUM_QUERIES", str(reference.num_queries),
        "MODEL.DFINE.DETECTIONS_PER_IMAGE", str(reference.num_queries),
        "MODEL.DFINE.TRAILING_CONV", str(reference.encoder_has_trailing_conv),
        "MODEL.DFINE.GATEWAY", str(reference.use_gateway), "MODEL.DFINE.SHARE_BOX_HEAD", str(reference.share_bbox_head),
        "MODEL.DFINE.QUERY_POS_ACTIVATION", reference.decoder_activation_function,
        "MODEL.DFINE.FOCAL_GAMMA", str(reference.focal_loss_gamma)])


@pytest.fixture(scope="module", params=["N", "tiny", "atto", "pico"])
def pair(request):
    torch.manual_seed(0)
    reference_cfg = reference_config(request.param)
    # Statistics fitted after the noise: with randomised's alone the encoder's maps are nearly constant over the image
    # (spatial std ~1e-4 of maps ~0.05), and a slip in the encoder moves the logits by ~1e-4, about the tolerance.
    reference = calibrated(randomised(transformers.Deimv2ForObjectDetection(reference_cfg), seed=1,
                                      scales={"bbox_embed": 0.2}).eval())
    pet = build_model(pet_config(reference_cfg, BACKBONES[request.param])).eval()
    load_reference_weights(pet, reference)
    return request.param, reference_cfg, reference, pet


def pet_outputs(pet, pixels: torch.Tensor) -> dict:
    features = pet.encoder(list(pet.backbone(pet.normalizer(pixels, [(HEIGHT, WIDTH)] * len(pixels))).values()))
    return pet.decoder(features)


def test_same_encoder_maps(pair):
    """The encoder's maps, each level, before the decoder: its parts (the Lite encoder's pooled level, global-average
    fusion, FPN and PAN blocks) checked where a slip is not damped by the decoder's random weights."""
    _, _, reference, pet = pair
    pixels = random_images(HEIGHT, WIDTH, seed=3)
    with torch.no_grad():
        expected = reference.model.encoder(reference.model.conv_encoder(pixels.float() / 255)).feature_maps
        maps = pet.encoder(list(pet.backbone(pet.normalizer(pixels, [(HEIGHT, WIDTH)] * len(pixels))).values()))
    assert [m.shape for m in maps] == [e.shape for e in expected]
    for level, (ours, theirs) in enumerate(zip(maps, expected)):
        assert theirs.std((2, 3)).mean() > 0.5, level  # maps that vary over the image (scale ~10-100)
        assert (ours - theirs).abs().max() <= TOLERANCE, level


def test_same_logits_boxes_and_distributions(pair):
    _, _, reference, pet = pair
    pixels = random_images(HEIGHT, WIDTH)
    with torch.no_grad():
        expected = reference(pixel_values=pixels.float() / 255)
        outputs = pet_outputs(pet, pixels)
    assert (outputs["logits"][-1] - expected.logits).abs().max() <= TOLERANCE
    assert (outputs["boxes"][-1] - expected.pred_boxes).abs().max() <= TOLERANCE
    assert (outputs["corners"][-1] - expected.intermediate_predicted_corners[:, -1]).abs().max() <= TOLERANCE
    assert (outputs["enc_logits"] - expected.enc_topk_logits).abs().max() <= TOLERANCE


def test_training_outputs_of_every_layer(pair):
    _, reference_cfg, reference, pet = pair
    pixels = random_images(HEIGHT, WIDTH, seed=2)
    with training(pet, reference, 0), torch.no_grad():
        expected = reference(pixel_values=pixels.float() / 255)
        outputs = pet_outputs(pet, pixels)
    logits = [outputs["pre_logits"], *outputs["logits"]]
    boxes = [outputs["pre_boxes"], *outputs["boxes"]]
    for i in range(reference_cfg.decoder_layers + 1):
        assert (logits[i] - expected.intermediate_logits[:, i]).abs().max() <= TOLERANCE, i
        assert (boxes[i] - expected.intermediate_reference_points[:, i]).abs().max() <= TOLERANCE, i


@pytest.mark.parametrize("denoising", [False, True], ids=["no-denoising", "denoising"])
def test_same_training_losses(pair, denoising):
    """Every loss term of the whole model in training equals the reference's (dense one-to-one matching on)."""
    _, reference_cfg, reference, pet = pair
    targets = objects(3, HEIGHT, WIDTH, NUM_LABELS)
    pixels = random_images(HEIGHT, WIDTH, seed=4)
    with training(pet, reference, reference_cfg.num_denoising if denoising else 0):
        torch.manual_seed(5)
        expected = reference(pixel_values=pixels.float() / 255,
                             labels=reference_labels(targets, HEIGHT, WIDTH)).loss_dict
        torch.manual_seed(5)
        image_sizes = [{"image_size": (HEIGHT, WIDTH), "orig_size": (HEIGHT, WIDTH)}] * 2
        losses = pet(pixels, [{**t, **p} for t, p in zip(targets, image_sizes)])
    assert sorted(losses) == sorted(expected)
    assert any("mal" in k for k in losses) and any("_dn_" in k for k in losses) == denoising
    for name, value in expected.items():
        torch.testing.assert_close(losses[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("size", ["N", "Atto", "Femto", "Pico"])
def test_shipped_coco_config_takes_the_hub_checkpoints_tensors(size):
    """cfgs/coco/deimv2_hgnetv2_{size}.yaml builds the model of the hub's DEIMv2 checkpoint of that size (80 COCO
    classes; N 300 queries, Atto / Femto / Pico their configs' 100 / 150 / 200): every tensor of the reference's
    state_dict has a place of the same shape (both built on the meta device). Atto, Femto and Pico train without
    dense one-to-one matching and without the distribution losses, as the authors' configs do."""
    if size == "N":
        config = reference_config("N")
        config.num_labels, config.num_queries = 80, 300
    else:
        config = transformers.Deimv2Config(num_labels=80, use_pretrained_backbone=False, **lite_kwargs(size))
    cfg = load_cfg(os.path.join(CFGS, "coco", f"deimv2_hgnetv2_{size}.yaml"))
    with torch.device("meta"):
        reference = transformers.Deimv2ForObjectDetection(config)
        ours = build_model(cfg)
    expected = {k: tuple(v.shape) for k, v in ours.convert_state_dict(reference.state_dict()).items()}
    counted = "num_batches_tracked"
    ours = {k: tuple(v.shape) for k, v in ours.state_dict().items() if not k.endswith(counted)}
    assert ours == {k: v for k, v in expected.items() if not k.endswith(counted)}
    node = cfg.MODEL.DFINE
    assert node.FOCAL_GAMMA == 1.5 and node.NUM_QUERIES == config.num_queries
    assert node.DENSE_ONE_TO_ONE == (size == "N") and (node.LOSS_FGL > 0) == (size == "N")
    # The authors' policy epochs ([4, 78, 148] for N, [4, 250, 400] for the Lite models): strong transforms on from
    # epoch 4, mosaic (and N's mixup) off at the middle one, the photometric / zoom-out / IoU-crop trio at the last.
    mosaic, trio = (78, 148) if size == "N" else (250, 400)
    expected = {"Mosaic": mosaic, "MixUp": mosaic, "RandomPhotometricDistort": trio, "RandomZoomOut": trio,
                "RandomIoUCrop": trio}
    schedules = {a["type"]: (a.get("from_epoch"), a.get("until_epoch")) for a in cfg.INPUT.AUGMENTATIONS
                 if a["type"] in expected}
    assert schedules == {t: (4, stop) for t, stop in expected.items() if size == "N" or t != "MixUp"}


def test_a_hub_layout_directory_loads_as_the_state_dict_does(pair, tmp_path):
    """``save_pretrained``'s directory (model.safetensors, the names transformers' files use) through Pet's weight
    loader gives the model the reference's own state_dict gives it."""
    variant, reference_cfg, reference, pet = pair
    reference.save_pretrained(str(tmp_path))
    loaded = build_model(pet_config(reference_cfg, BACKBONES[variant])).eval()
    assert load_weights(loaded, str(tmp_path), for_inference=True) == {"missing": [], "unexpected": [],
                                                                       "mismatched": []}
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in pet.state_dict().items())


@pytest.mark.parametrize("opts, message", [
    (["MODEL.DFINE.ENCODER", "Lite"], "ENCODER 'Lite' is not one of hybrid, lite"),
    (["MODEL.DFINE.NUM_LEVELS", "3", "MODEL.DFINE.DECODER_POINTS", "[4, 2, 2]"], "NUM_LEVELS 3: the lite encoder"),
])
def test_lite_encoder_config_errors_name_the_key(opts, message):
    """An unknown encoder, or the lite encoder asked for other than two decoder levels, is refused by name."""
    cfg = load_cfg(os.path.join(CFGS, "coco", "deimv2_hgnetv2_Atto.yaml"),
                   ["MODEL.BACKBONE.NAME", "B0", "MODEL.DFINE.ENCODER", "lite", *opts])
    with pytest.raises(ConfigError, match=message):
        build_model(cfg)
