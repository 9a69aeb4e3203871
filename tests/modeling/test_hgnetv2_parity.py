"""Pet's HGNetv2 equals transformers' ``HGNetV2Backbone`` (the reference implementation), variant by variant.

Each transformers model is built from the variant's row of ``pet.modeling.hgnetv2.HGNETV2_VARIANTS`` (for
"default", from ``HGNetV2Config()`` as it ships, which is B4 without learnable affine blocks), given seeded
random weights that are not the identity anywhere (:func:`randomize`: BatchNorm statistics and affines, the
learnable affine blocks' scale and bias), and its ``state_dict`` loads into Pet's module through the documented
key mapping with nothing missing or left over. Both run in float64, eval mode, on a small non-square image;
every stage's features (and the stem's) must agree to :data:`RELATIVE_TOLERANCE` of the features' scale.

Why 1e-10: both sides run the same float64 operations in the same order, so the measured differences are 0 or
a few ulps (float64's unit roundoff is 1.1e-16; even a sum over thousands of terms through ~30 layers in a
different order stays below 1e-12 relative). Every plausible bug is orders of magnitude above it: a missing or
misplaced affine block, a wrong activation, padding side, concatenation order or residual moves features by
0.1-1 relative, and even BatchNorm's eps of 0 instead of 1e-5 moves them by ~5e-5 relative (running variances
in [0.5, 2]). Measured: 0, bit-identical, for every variant. The features' scale grows with depth (stem ~2-10,
res5 ~20-2000 in B6: the residual blocks add up on statistics not fitted to the data), which a relative
tolerance takes in its stride.

Every variant runs at 64 x 96 px: the largest, B6 (69M parameters), takes 2-3 s on one core, mostly building,
randomizing and copying its weights (its forward is ~0.3 s); the others about 1 s or less.
"""
from __future__ import annotations

import pytest
import torch
from torchvision.ops import FrozenBatchNorm2d

from pet.config import load_cfg
from pet.modeling.backbone import build_backbone
from pet.modeling.hgnetv2 import (
    HGNETV2_VARIANTS,
    HGNetV2,
    hgnetv2_state_dict_from_transformers,
    load_transformers_hgnetv2,
)
from pet.utils.errors import ConfigError
from support.transformers_detr import hgnetv2_config

transformers = pytest.importorskip("transformers")

HEIGHT, WIDTH = 64, 96
RELATIVE_TOLERANCE = 1e-10  # max |Pet - reference| / max |reference|, per feature map, float64


def randomize(model: torch.nn.Module, seed: int) -> int:
    """Seeded weights that keep activations O(1) and make no unit the identity: convolutions He-scaled by their
    fan-in; BatchNorm weight in [0.5, 1.5], bias, running mean ~ N(0, 0.2), running variance in [0.5, 2];
    affine blocks' scale in [0.5, 1.5], bias ~ N(0, 0.2). Returns how many affine-block tensors it set."""
    gen = torch.Generator().manual_seed(seed)
    state = model.state_dict()
    affine = 0
    for key, value in state.items():
        if key.endswith("num_batches_tracked"):
            continue
        if key.endswith("convolution.weight"):
            fan_in = value[0].numel()
            new = torch.randn(value.shape, generator=gen) * (2.0 / fan_in) ** 0.5
        elif key.endswith(("normalization.weight", "lab.scale")):
            new = 0.5 + torch.rand(value.shape, generator=gen)
        elif key.endswith(("normalization.bias", "normalization.running_mean", "lab.bias")):
            new = 0.2 * torch.randn(value.shape, generator=gen)
        elif key.endswith("normalization.running_var"):
            new = 0.5 + 1.5 * torch.rand(value.shape, generator=gen)
        else:
            raise AssertionError(f"randomize does not know {key}")
        affine += ".lab." in key
        value.copy_(new.to(value.dtype))
    return affine


def reference_and_pet(variant: str, *, seed: int = 0, frozen_bn_eps: float | None = None
                      ) -> tuple[torch.nn.Module, HGNetV2]:
    """The randomized reference and Pet's module loaded from its ``state_dict``, both float64 and in eval mode."""
    config = hgnetv2_config(variant)
    reference = transformers.HGNetV2Backbone(config)
    affine = randomize(reference, seed)
    assert (affine > 0) == config.use_learnable_affine_block
    pet = HGNetV2("B4" if variant == "default" else variant, use_lab=config.use_learnable_affine_block,
                  return_stages=(0, 1, 2, 3), frozen_bn_eps=frozen_bn_eps)
    load_transformers_hgnetv2(pet, reference.state_dict())
    return reference.double().eval(), pet.double().eval()


def feature_differences(reference: torch.nn.Module, pet: HGNetV2, x: torch.Tensor) -> dict[str, float]:
    """``{name: max |Pet - reference| / max |reference|}`` for the stem and every stage."""
    with torch.no_grad():
        out = reference(x, output_hidden_states=True)
        theirs = {"stem": out.hidden_states[0], **dict(zip(pet.out_features, out.feature_maps))}
        ours = {"stem": pet.stem(x), **pet(x)}
    assert list(ours) == list(theirs) == ["stem", "res2", "res3", "res4", "res5"]
    differences = {}
    for name, expected in theirs.items():
        assert ours[name].shape == expected.shape, name
        assert ours[name].dtype == torch.float64
        scale = expected.abs().max().item()
        assert 1e-2 < scale < 1e4, f"{name}: features of scale {scale} test little"
        differences[name] = (ours[name] - expected).abs().max().item() / scale
    return differences


def image(batch: int = 1, height: int = HEIGHT, width: int = WIDTH, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.numeric
@pytest.mark.parametrize("variant", ["B0", "default", "B1", "B2", "B3", "B4", "B5", "B6"])
def test_features_equal_transformers(variant):
    reference, pet = reference_and_pet(variant)
    differences = feature_differences(reference, pet, image())
    assert max(differences.values()) <= RELATIVE_TOLERANCE, differences


@pytest.mark.numeric
def test_b0_odd_sized_batch_and_frozen_bn():
    """Odd sizes exercise the stem's one-sided padding and ceil-mode pooling; FrozenBN (eps 1e-5, the default) is
    BatchNorm's eval formula in another order, so equal to the same tolerance."""
    reference, pet = reference_and_pet("B0", seed=3, frozen_bn_eps=1e-5)
    assert isinstance(pet.stem.stem1.bn, FrozenBatchNorm2d)
    differences = feature_differences(reference, pet, image(batch=2, height=45, width=67, seed=2))
    assert max(differences.values()) <= RELATIVE_TOLERANCE, differences


def test_default_config_is_b4_without_learnable_affine_blocks():
    """transformers' ``HGNetV2Config()`` is D-FINE-L's backbone: B4, no affine blocks, ReLU, stem strides
    2-1-1-2-1, every later stage downsampled by 2."""
    config = transformers.HGNetV2Config()
    spec = HGNETV2_VARIANTS["B4"]
    assert list(config.stem_channels) == [3, *spec.stem_channels]
    rows = list(zip(config.stage_in_channels, config.stage_mid_channels, config.stage_out_channels,
                    config.stage_num_blocks, config.stage_downsample, config.stage_light_block,
                    config.stage_kernel_size, config.stage_numb_of_layers))
    assert rows == [tuple(vars(stage).values()) for stage in spec.stages]
    assert config.use_learnable_affine_block is False and spec.use_lab is False
    assert config.hidden_act == "relu"
    assert list(config.stem_strides) == [2, 1, 1, 2, 1] and list(config.stage_downsample_strides) == [2, 2, 2, 2]


def test_outputs_interface_matches_resnet_vd():
    """D-FINE's return_idx [1, 2, 3] by default: res3-res5 with their channels and strides as attributes, the
    interface ResNetVd gives RT-DETR's encoder; DEIMv2-N's [2, 3] gives two levels."""
    model = HGNetV2("B0", frozen_bn_eps=None).eval()
    assert (model.out_features, model.out_channels, model.out_strides) == (
        ["res3", "res4", "res5"], [256, 512, 1024], [8, 16, 32])
    with torch.no_grad():
        features = model(torch.zeros(1, 3, 64, 96))
    assert [(k, tuple(v.shape)) for k, v in features.items()] == [
        ("res3", (1, 256, 8, 12)), ("res4", (1, 512, 4, 6)), ("res5", (1, 1024, 2, 3))]
    two = HGNetV2("B0", return_stages=[2, 3])
    assert (two.out_features, two.out_channels, two.out_strides) == (["res4", "res5"], [512, 1024], [16, 32])
    assert HGNetV2("B0").use_lab and not HGNetV2("B4").use_lab  # the variants' reference settings
    with pytest.raises(ConfigError, match="'B7' is not an HGNetv2 variant"):
        HGNetV2("B7")
    with pytest.raises(ConfigError, match="return_stages"):
        HGNetV2("B0", return_stages=[4])


def test_registered_backbone_builds_from_config():
    cfg = load_cfg(None, ["MODEL.BACKBONE.TYPE", "hgnetv2", "MODEL.BACKBONE.NAME", "B0",
                          "MODEL.BACKBONE.NORM", "FrozenBN", "MODEL.BACKBONE.FREEZE_AT", "2"])
    model = build_backbone(cfg)
    assert isinstance(model, HGNetV2) and model.out_channels == [256, 512, 1024]
    assert not any(p.requires_grad for p in [*model.stem.parameters(), *model.stages[0].parameters()])
    assert all(p.requires_grad for p in model.stages[1].parameters())


class TestStrictMapping:
    @pytest.fixture(scope="class")
    def state(self):
        torch.manual_seed(0)
        return transformers.HGNetV2Backbone(hgnetv2_config("B0")).state_dict()

    def test_every_key_maps_and_fills_the_model(self, state):
        renamed = hgnetv2_state_dict_from_transformers(state)
        assert len(renamed) == len(state)
        assert set(renamed) == set(HGNetV2("B0", frozen_bn_eps=None).state_dict())
        assert renamed["stem.stem2a.lab.scale"] is state["embedder.stem2a.lab.scale"]
        assert renamed["stages.2.blocks.1.layers.0.conv2.bn.running_var"] is (
            state["encoder.stages.2.blocks.1.layers.0.conv2.normalization.running_var"])

    def test_unknown_key_is_named(self, state):
        extra = {**state, "encoder.stages.0.blocks.0.extra.weight": torch.zeros(1)}
        with pytest.raises(ConfigError, match=r"1 tensors .* no Pet name: encoder\.stages\.0\.blocks\.0\.extra"):
            hgnetv2_state_dict_from_transformers(extra)
        with pytest.raises(ConfigError, match="no Pet name: model.backbone.model.embedder"):
            hgnetv2_state_dict_from_transformers({f"model.backbone.model.{k}": v for k, v in state.items()})

    def test_missing_key_is_named(self, state):
        partial = {k: v for k, v in state.items() if k != "encoder.stages.3.blocks.0.aggregation.1.lab.bias"}
        with pytest.raises(ConfigError, match=r"missing: stages\.3\.blocks\.0\.aggregation\.1\.lab\.bias"):
            load_transformers_hgnetv2(HGNetV2("B0"), partial)

    def test_other_use_lab_or_variant_is_named(self, state):
        with pytest.raises(ConfigError, match=r"HGNetv2-B0 \(use_lab=False\): unexpected: stem\.stem1\.lab\.scale"):
            load_transformers_hgnetv2(HGNetV2("B0", use_lab=False), state)
        with pytest.raises(ConfigError, match=r"HGNetv2-B1 .*shape \(file vs model\): stem\.stem1\.conv\.weight"):
            load_transformers_hgnetv2(HGNetV2("B1"), state)
