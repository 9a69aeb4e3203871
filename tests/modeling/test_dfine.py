"""D-FINE's config: named by its path it brings its keys; what it cannot build is one line naming the key.

(Equality with transformers' model is tests/modeling/test_dfine_parity.py; the tools, export, prediction, resume and
two processes run it with RT-DETR's tests, on a tiny D-FINE.)"""
from __future__ import annotations

import pytest

from pet.config import load_cfg
from pet.modeling import build_model
from pet.modeling.dfine.encoder import DFineHybridEncoder
from pet.modeling.rtdetr.encoder import CSPRepLayer, HybridEncoder
from pet.utils.errors import ConfigError
from support.tiny_models import TINY_QUERY_DETECTORS

TINY = TINY_QUERY_DETECTORS["dfine"]


def test_its_path_adds_its_keys_and_its_registered_name_says_to_use_the_path():
    cfg = TINY.cfg()
    assert cfg.MODEL.DFINE.NUM_BINS == 16 and cfg.MODEL.DFINE.REG_SCALE == 4.0
    with pytest.raises(ConfigError, match="MODEL.DFINE is missing: name DFINE by its path, MODEL.META_ARCHITECTURE "
                                          "pet.modeling.dfine.DFINE"):
        build_model(load_cfg(None, ["MODEL.META_ARCHITECTURE", "DFINE", "INPUT.SIZE_DIVISIBILITY", "32"]))


@pytest.mark.parametrize("opts, message", [
    (("MODEL.DFINE.NUM_LEVELS", "4"), r"MODEL.DFINE.NUM_LEVELS 4: the backbone returns 3 levels"),
    (("MODEL.DFINE.DECODER_POINTS", "[4, 4]"), r"DECODER_POINTS \[4, 4\] needs one number of sampling points per "
                                                r"level \(MODEL.DFINE.NUM_LEVELS 3\)"),
    (("INPUT.SIZE_DIVISIBILITY", "16"), r"DFINE needs INPUT.SIZE_DIVISIBILITY a multiple of 32, got 16"),
    (("MODEL.DFINE.ENCODER", "lite"), r"MODEL.DFINE.ENCODER 'lite' is not one of hybrid, rtdetr"),
], ids=["levels", "points", "divisibility", "encoder"])
def test_what_it_cannot_build_is_one_line_naming_the_key(opts, message):
    with pytest.raises(ConfigError, match=message):
        build_model(TINY.cfg(*opts))


def test_two_levels_take_the_backbones_last_two():
    """D-FINE-N's layout: strides 16 and 32 only, 6 + 6 sampling points."""
    model = build_model(TINY.cfg("MODEL.DFINE.NUM_LEVELS", "2", "MODEL.DFINE.DECODER_POINTS", "[6, 6]"))
    assert [p.conv.in_channels for p in model.encoder.input_proj] == list(model.backbone.out_channels[-2:])
    assert model.decoder.layers[0].cross_attn.points == [6, 6]


def test_the_rtdetr_encoder_is_rtdetrs_with_the_fusion_blocks_sized_by_d_fines_keys():
    """``MODEL.DFINE.ENCODER rtdetr``: RT-DETR's CSP-RepVGG fusion blocks and strided 3x3 downsampling, with
    ``round(3 * DEPTH_MULT)`` RepVGG blocks of ``EXPANSION * HIDDEN_DIM`` channels; the rest of D-FINE unchanged."""
    cfg = TINY.cfg("MODEL.DFINE.ENCODER", "rtdetr", "MODEL.DFINE.EXPANSION", "0.5", "MODEL.DFINE.DEPTH_MULT", "0.67")
    encoder = build_model(cfg).encoder
    dim = cfg.MODEL.DFINE.HIDDEN_DIM
    assert type(encoder) is HybridEncoder
    for block in [*encoder.fpn_blocks, *encoder.pan_blocks]:
        assert isinstance(block, CSPRepLayer) and len(block.blocks) == 2
        assert block.conv1.conv.out_channels == dim // 2 and block.conv3.conv.out_channels == dim
    assert all(down.conv.stride == (2, 2) and down.conv.kernel_size == (3, 3) for down in encoder.downsample_convs)
    assert type(build_model(TINY.cfg()).encoder) is DFineHybridEncoder


def test_the_defaults_are_the_references():
    """MODEL.DFINE's defaults are DFineConfig()'s (D-FINE-L, but for its points: the L checkpoint's [3, 6, 3]) and,
    for the DEIMv2-only keys, Deimv2Config()'s (but for the query head's activation: the authors' SiLU)."""
    transformers = pytest.importorskip("transformers")
    node, dfine, deimv2 = TINY.cfg().MODEL.DFINE, transformers.DFineConfig(), transformers.Deimv2Config()
    defaults = load_cfg(None, ["MODEL.META_ARCHITECTURE", "pet.modeling.dfine.DFINE"]).MODEL.DFINE
    assert (defaults.HIDDEN_DIM, defaults.ENCODER_FFN_DIM, defaults.DECODER_DIM, defaults.DECODER_LAYERS) == (
        dfine.encoder_hidden_dim, dfine.encoder_ffn_dim, dfine.d_model, dfine.decoder_layers)
    assert (defaults.NUM_BINS, defaults.REG_SCALE, defaults.UP, defaults.LQE_TOPK, defaults.LQE_HIDDEN_DIM) == (
        dfine.max_num_bins, dfine.reg_scale, dfine.up, dfine.top_prob_values, dfine.lqe_hidden_dim)
    assert (defaults.LOSS_FGL, defaults.LOSS_DDF, defaults.OFFSET_SCALE) == (
        dfine.weight_loss_fgl, dfine.weight_loss_ddf, dfine.decoder_offset_scale)
    assert (node.TRAILING_CONV, node.GATEWAY, node.SHARE_BOX_HEAD) == (
        deimv2.encoder_has_trailing_conv, deimv2.use_gateway, deimv2.share_bbox_head)
    assert (node.LOSS_MAL, node.MAL_ALPHA or None, node.DENSE_ONE_TO_ONE) == (
        deimv2.weight_loss_mal, deimv2.mal_alpha, deimv2.use_dense_one_to_one)
