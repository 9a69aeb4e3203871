"""D-FINE's config: named by its path it brings its keys; what it cannot build is one line naming the key.

(Equality with transformers' model is tests/modeling/test_dfine_parity.py; the tools, export, prediction, resume and
two processes run it with RT-DETR's tests, on a tiny D-FINE.)"""
from __future__ import annotations

import pytest

from pet.config import load_cfg
from pet.modeling import build_model
from pet.utils.errors import ConfigError
from support.tiny_models import TINY_QUERY_DETECTORS

TINY = TINY_QUERY_DETECTORS["dfine"]


def test_its_path_adds_its_keys_and_its_registered_name_says_to_use_the_path():
    cfg = TINY.cfg()
    assert cfg.MODEL.DFINE.NUM_BINS == 16 and cfg.MODEL.DFINE.REG_SCALE == 4.0
    with pytest.raises(ConfigError, match="MODEL.DFINE is missing: name D-FINE by its path, MODEL.META_ARCHITECTURE "
                                          "pet.modeling.dfine.DFINE"):
        build_model(load_cfg(None, ["MODEL.META_ARCHITECTURE", "DFINE", "INPUT.SIZE_DIVISIBILITY", "32"]))


@pytest.mark.parametrize("opts, message", [
    (("MODEL.DFINE.NUM_LEVELS", "4"), r"MODEL.DFINE.NUM_LEVELS 4: the backbone returns 3 levels"),
    (("MODEL.DFINE.DECODER_POINTS", "[4, 4]"), r"DECODER_POINTS \[4, 4\] needs one number of sampling points per "
                                                r"level \(MODEL.DFINE.NUM_LEVELS 3\)"),
    (("INPUT.SIZE_DIVISIBILITY", "16"), r"DFINE needs INPUT.SIZE_DIVISIBILITY a multiple of 32, got 16"),
], ids=["levels", "points", "divisibility"])
def test_what_it_cannot_build_is_one_line_naming_the_key(opts, message):
    with pytest.raises(ConfigError, match=message):
        build_model(TINY.cfg(*opts))


def test_two_levels_take_the_backbones_last_two():
    """D-FINE-N's layout: strides 16 and 32 only, 6 + 6 sampling points."""
    model = build_model(TINY.cfg("MODEL.DFINE.NUM_LEVELS", "2", "MODEL.DFINE.DECODER_POINTS", "[6, 6]"))
    assert [p.conv.in_channels for p in model.encoder.input_proj] == list(model.backbone.out_channels[-2:])
    assert model.decoder.layers[0].cross_attn.points == [6, 6]
