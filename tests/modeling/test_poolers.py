"""Pet's sparse RoIAlign gives torchvision's roi_align results and gradients.

Every comparison runs forward and backward (the gradient with respect to the features, which is what
training uses) against torchvision on channels-last and on contiguous features.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torchvision
from torchvision.ops import roi_align

from pet.modeling import poolers
from pet.modeling.poolers import MultiScaleRoIAlign, roi_align_sparse

LAYOUTS = pytest.mark.parametrize("channels_last", [True, False], ids=["channels_last", "contiguous"])

# Boxes (x1, y1, x2, y2) in the pixels of a 128 px wide, 160 px high image, by what makes them awkward.
EDGE_BOXES = {
    "zero_size": [[40, 40, 40, 40], [0, 0, 0, 0], [124, 124, 124, 124], [30, 20, 30, 90], [20, 70, 100, 70]],
    "inverted": [[90, 10, 30, 60], [10, 90, 60, 30], [100, 110, 20, 40]],  # x2 < x1, y2 < y1, both
    "partly_outside": [[-40, -30, 50, 40], [90, 100, 170, 190], [-20, 50, 200, 80], [-60, -60, 190, 190],
                       # At stride 4, 7 bins, one sample per bin: a sample exactly on the map's far edge (in x,
                       # then in y) and one exactly a pixel before its near edge (x = -1); all three still count.
                       [102, 10, 130, 60], [10, 134, 60, 162], [-6, 70, 22, 120]],
    # Less than one feature pixel above or left of the map: roi_align clamps those samples onto the border.
    "outside_within_a_pixel": [[-3.5, 10, -0.5, 60], [10, -3, 60, -1]],
    "wholly_outside": [[-90, -80, -20, -10], [140, 10, 200, 60], [10, -70, 60, -9], [128, 10, 140, 60]],
    "wide": [[0, 50, 128, 58], [10, 10, 110, 40], [4, 60, 124, 61]],  # aspect ratios 16, 3.3 and 120
    "tall": [[50, 0, 58, 128], [10, 10, 40, 110], [60, 4, 61, 124]],
}
ALL_EDGE_BOXES = [box for boxes in EDGE_BOXES.values() for box in boxes]


def _rois(num: int, batch: int, size: int, gen: torch.Generator) -> torch.Tensor:
    """Random boxes in input pixels plus the awkward ones: whole image, tiny, touching and crossing the edges."""
    xy = torch.rand(num, 2, generator=gen) * size * 0.8
    wh = torch.rand(num, 2, generator=gen) * size * 0.5 + 0.5
    boxes = torch.cat([xy, (xy + wh).clamp(max=size)], dim=1)
    boxes[:4] = torch.tensor([[0.0, 0.0, size, size], [3.0, 3.0, 3.2, 3.1],
                              [size - 9.0, size - 7.0, size, size], [-12.0, -20.0, size + 30.0, size / 2]])
    index = torch.randint(0, batch, (num, 1), generator=gen).float()
    return torch.cat([index, boxes], dim=1)


def _with_batch_index(boxes: list[list[float]], batch: int) -> torch.Tensor:
    """``[R, 5]`` RoIs: ``boxes`` spread over the images of the batch in turn."""
    index = torch.arange(len(boxes), dtype=torch.float32)[:, None] % batch
    return torch.cat([index, torch.tensor(boxes, dtype=torch.float32)], dim=1)


def _features(shape: tuple[int, ...], channels_last: bool, gen: torch.Generator,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    features = torch.randn(shape, generator=gen).to(dtype)
    features = features.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    assert features.is_contiguous(memory_format=torch.channels_last) == channels_last
    return features


def _forward_backward(pool: Callable[[dict[str, torch.Tensor]], torch.Tensor], features: dict[str, torch.Tensor],
                      autocast: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``pool(features)`` and the gradient of a fixed random projection of it with respect to each feature map.

    With ``autocast`` the forward runs under bfloat16 autocast and the backward after it, as in the trainer.
    """
    leaves = {name: f.detach().clone().requires_grad_() for name, f in features.items()}  # keeps the layout
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        pooled = pool(leaves)
    upstream = torch.randn(pooled.shape, generator=torch.Generator().manual_seed(123)).to(pooled.dtype)
    (pooled * upstream).sum().backward()
    return pooled.detach(), {name: leaf.grad for name, leaf in leaves.items()}


def _assert_close(ours: tuple, ref: tuple, **tolerance: float) -> None:
    (pooled, grads), (ref_pooled, ref_grads) = ours, ref
    assert pooled.shape == ref_pooled.shape and pooled.dtype == ref_pooled.dtype
    torch.testing.assert_close(pooled, ref_pooled, **tolerance)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **tolerance, msg=lambda m, name=name: f"grad {name}: {m}")


# bfloat16 results are float32 sums rounded once: both sides give the same bfloat16 number or, where their float32
# sums (added in another order) straddle a rounding boundary, adjacent ones. A sum that cancels to about zero has
# no such relative precision (its float32 rounding error is that of its O(1) terms), so those compare absolutely.
CANCELLED = 1e-6


def _bf16_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 steps apart ``a`` and ``b`` are, elementwise (0: equal; 1: adjacent numbers)."""

    def ordered(t: torch.Tensor) -> torch.Tensor:  # bit patterns as integers in the order of their values
        bits = t.view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


def _assert_within_one_bf16_step(ours: tuple, ref: tuple) -> None:
    """Values and gradients one bfloat16 rounding step apart at most (or within ``CANCELLED`` of each other)."""
    (pooled, grads), (ref_pooled, ref_grads) = ours, ref
    assert pooled.shape == ref_pooled.shape and grads.keys() == ref_grads.keys()
    for name, a, b in [("pooled", pooled, ref_pooled), *((f"grad {k}", grads[k], ref_grads[k]) for k in grads)]:
        assert a.dtype == b.dtype == torch.bfloat16, name
        steps = _bf16_steps(a, b)
        off = (steps > 1) & ((a.float() - b.float()).abs() > CANCELLED)
        assert not off.any(), (f"{name}: {int(off.sum())} of {a.numel()} values more than one bfloat16 step off "
                               f"(up to {int(steps[off].max())} steps)")


def _sparse_and_torchvision(features, rois, output_size, scale, ratio):
    """Pet's and torchvision's single-map RoIAlign, each with its gradient."""
    ours = _forward_backward(lambda f: roi_align_sparse(f["x"], rois, output_size, scale, ratio), {"x": features})
    ref = _forward_backward(lambda f: roi_align(f["x"], rois, output_size, scale, ratio, aligned=False),
                            {"x": features})
    return ours, ref


@pytest.mark.numeric
@LAYOUTS
@pytest.mark.parametrize("scale", [0.25, 0.125])
@pytest.mark.parametrize("num_rois", [0, 60])
@pytest.mark.parametrize("ratio", [1, 2])
def test_sparse_roi_align_matches_torchvision_values_and_gradients(channels_last, scale, num_rois, ratio):
    gen = torch.Generator().manual_seed(0)
    size = 128
    features = _features((3, 16, int(size * scale), int(size * scale * 3 / 4)), channels_last, gen)
    rois = _rois(max(num_rois, 4), 3, size, gen)[:num_rois]
    ours, ref = _sparse_and_torchvision(features, rois, (7, 7), scale, ratio)
    assert ours[0].shape == (num_rois, 16, 7, 7)
    _assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.numeric
@LAYOUTS
@pytest.mark.parametrize("output_size", [(7, 7), (14, 14)], ids=["7x7", "14x14"])  # box head, mask head
@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("case", list(EDGE_BOXES))
def test_sparse_roi_align_matches_torchvision_on_awkward_boxes(case, ratio, output_size, channels_last):
    gen = torch.Generator().manual_seed(2)
    features = _features((2, 8, 40, 32), channels_last, gen)  # the image at stride 4
    rois = _with_batch_index(EDGE_BOXES[case], 2)
    ours, ref = _sparse_and_torchvision(features, rois, output_size, 0.25, ratio)
    _assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    # The case is what it says: only boxes wholly outside (by more than a pixel) pool nothing.
    pooled_anything = ref[0].flatten(1).abs().amax(dim=1) > 0
    assert pooled_anything.tolist() == [case != "wholly_outside"] * len(rois)


@pytest.mark.parametrize("ratio", [0, -1])
def test_sparse_roi_align_rejects_adaptive_sampling(ratio):
    """Adaptive sampling gives every RoI its own sample count: torchvision's kernel does it, not a silent zero."""
    with pytest.raises(ValueError, match=rf"sampling_ratio > 0, got {ratio}"):
        roi_align_sparse(torch.randn(1, 4, 16, 16), torch.tensor([[0.0, 1.0, 2.0, 30.0, 40.0]]), (7, 7), 0.25, ratio)


@pytest.mark.numeric
@LAYOUTS
@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "bf16_autocast"])
def test_sparse_roi_align_in_bfloat16_matches_torchvisions_autocast(autocast, ratio, channels_last):
    """bfloat16 features (an FPN under bf16 autocast): computed in float32 like torchvision's autocast kernel,
    so both round the same float32 values to bfloat16, forward and backward."""
    gen = torch.Generator().manual_seed(3)
    features = _features((2, 8, 40, 32), channels_last, gen, torch.bfloat16)
    rois = torch.cat([_with_batch_index(ALL_EDGE_BOXES, 2), _rois(30, 2, 128, gen)])
    ours = _forward_backward(lambda f: roi_align_sparse(f["x"], rois, (7, 7), 0.25, ratio), {"x": features},
                             autocast)
    ref = _forward_backward(lambda f: roi_align(f["x"], rois, (7, 7), 0.25, ratio, aligned=False), {"x": features},
                            autocast=True)
    assert ours[0].dtype == ours[1]["x"].dtype == torch.bfloat16
    _assert_within_one_bf16_step(ours, ref)


# Boxes in a 256 x 192 px image for the P2-P5 levels (torchvision's FPN mapping: level 4 + log2(sqrt(area) / 224),
# clamped to 2..5), with awkward ones on each: zero-size and inverted (both axes: positive area) on P2,
# a wide box on P3, a tall one mostly outside on P4, a box bigger than the image on P5. Inverted along one
# axis the area is negative: torchvision's mapper gives it no level, so both leave it zero.
LEVEL_BOXES = [[10, 10, 30, 40], [100, 100, 160, 150], [50, 50, 50, 50], [200, 200, 100, 100],
               [20, 30, 170, 180], [0, 40, 256, 120], [-20, -20, 280, 280], [100, -400, 180, 656],
               [-500, 100, 756, 140], [-150, -150, 400, 400], [200, 10, 100, 60]]


def _multiscale_inputs(channels_last: bool, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(1)
    features = {str(i): _features((2, 8, 48 >> i, 64 >> i), channels_last, gen, dtype) for i in range(4)}
    boxes = [torch.cat([torch.tensor(LEVEL_BOXES, dtype=torch.float32), _rois(40, 1, 256, gen)[:, 1:]])
             for _ in range(2)]
    return features, boxes, [(192, 256)] * 2


@pytest.mark.numeric
@LAYOUTS
@pytest.mark.parametrize("output_size", [7, 14])
@pytest.mark.parametrize("sampling_ratio", [1, 2, 0])  # 0 (adaptive): torchvision's kernel itself
def test_multiscale_pooling_matches_torchvision_on_every_level_forward_and_backward(
    sampling_ratio, output_size, channels_last, monkeypatch
):
    features, boxes, image_sizes = _multiscale_inputs(channels_last)
    names = list(features)
    sparse_calls = []
    monkeypatch.setattr(poolers, "roi_align_sparse",
                        lambda *args: sparse_calls.append(1) or roi_align_sparse(*args))
    reference = torchvision.ops.MultiScaleRoIAlign(names, output_size, sampling_ratio)
    ref = _forward_backward(lambda f: reference(f, boxes, image_sizes), features)

    pet = MultiScaleRoIAlign(names, output_size, sampling_ratio)
    inference = pet(features, boxes, image_sizes)
    assert torch.equal(inference, ref[0]) and not sparse_calls  # torchvision's kernel: detections stay torchvision's

    training = _forward_backward(lambda f: pet(f, boxes, image_sizes), features)
    _assert_close(training, ref, atol=1e-4, rtol=1e-4)
    assert len(sparse_calls) == (4 if sampling_ratio > 0 else 0)  # one product per level
    levels = reference.map_levels(boxes)
    assert [int((levels == level).sum()) >= 2 for level in range(4)] == [True] * 4, levels  # every level pools
    assert all(grad.abs().sum() > 0 for grad in training[1].values())


@pytest.mark.numeric
@LAYOUTS
@pytest.mark.parametrize("sampling_ratio", [1, 2])
def test_single_level_pooling_matches_torchvision_including_inverted_boxes(sampling_ratio, channels_last):
    """With one map torchvision pools every RoI without its level mapper, which would drop inverted boxes."""
    gen = torch.Generator().manual_seed(4)
    features = {"p": _features((2, 8, 40, 32), channels_last, gen)}
    boxes = [torch.tensor(ALL_EDGE_BOXES, dtype=torch.float32), _rois(20, 1, 128, gen)[:, 1:]]
    reference = torchvision.ops.MultiScaleRoIAlign(["p"], 7, sampling_ratio)
    ref = _forward_backward(lambda f: reference(f, boxes, [(160, 128)] * 2), features)
    ours = _forward_backward(lambda f: MultiScaleRoIAlign(["p"], 7, sampling_ratio)(f, boxes, [(160, 128)] * 2),
                             features)
    _assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    inverted = [ALL_EDGE_BOXES.index(box) for box in EDGE_BOXES["inverted"]]
    assert (ref[0][inverted].flatten(1).abs().amax(dim=1) > 0).all()


@pytest.mark.numeric
@LAYOUTS
def test_multiscale_pooling_under_bfloat16_autocast_matches_torchvisions(channels_last):
    """Training with SOLVER.AMP.ENABLED (bfloat16): bf16 FPN maps under autocast, four levels, forward and backward."""
    features, boxes, image_sizes = _multiscale_inputs(channels_last, torch.bfloat16)
    names = list(features)
    reference = torchvision.ops.MultiScaleRoIAlign(names, 7, 1)
    pet = MultiScaleRoIAlign(names, 7, 1)
    ref = _forward_backward(lambda f: reference(f, boxes, image_sizes), features, autocast=True)
    ours = _forward_backward(lambda f: pet(f, boxes, image_sizes), features, autocast=True)
    assert ours[0].dtype == torch.bfloat16
    _assert_within_one_bf16_step(ours, ref)
