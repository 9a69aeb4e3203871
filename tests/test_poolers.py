"""Pet's sparse RoIAlign gives torchvision's roi_align results and gradients."""
from __future__ import annotations

import pytest
import torch
import torchvision
from torchvision.ops import roi_align

from pet.modeling import poolers
from pet.modeling.poolers import MultiScaleRoIAlign, roi_align_sparse


def _rois(num: int, batch: int, size: int, gen: torch.Generator) -> torch.Tensor:
    """Random boxes in input pixels plus the awkward ones: whole image, tiny, touching and crossing the edges."""
    xy = torch.rand(num, 2, generator=gen) * size * 0.8
    wh = torch.rand(num, 2, generator=gen) * size * 0.5 + 0.5
    boxes = torch.cat([xy, (xy + wh).clamp(max=size)], dim=1)
    boxes[:4] = torch.tensor([[0.0, 0.0, size, size], [3.0, 3.0, 3.2, 3.1],
                              [size - 9.0, size - 7.0, size, size], [-12.0, -20.0, size + 30.0, size / 2]])
    index = torch.randint(0, batch, (num, 1), generator=gen).float()
    return torch.cat([index, boxes], dim=1)


@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("scale", [0.25, 0.125])
@pytest.mark.parametrize("num_rois", [0, 60])
@pytest.mark.parametrize("ratio", [1, 2])
def test_sparse_roi_align_matches_torchvision_values_and_gradients(channels_last, scale, num_rois, ratio):
    gen = torch.Generator().manual_seed(0)
    size = 128
    side = int(size * scale)
    features = torch.randn(3, 16, side, side, generator=gen)
    if channels_last:
        features = features.contiguous(memory_format=torch.channels_last)
    rois = _rois(max(num_rois, 4), 3, size, gen)[:num_rois]
    upstream = torch.randn(num_rois, 16, 7, 7, generator=gen)

    ours_in = features.clone().requires_grad_()
    ours = roi_align_sparse(ours_in, rois, (7, 7), scale, ratio)
    (ours * upstream).sum().backward()
    ref_in = features.clone().requires_grad_()
    ref = roi_align(ref_in, rois, (7, 7), scale, sampling_ratio=ratio, aligned=False)
    (ref * upstream).sum().backward()

    assert ours.shape == ref.shape == (num_rois, 16, 7, 7)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours_in.grad, ref_in.grad, atol=1e-4, rtol=1e-4)


def test_sparse_roi_align_returns_the_feature_dtype():
    features = torch.randn(2, 8, 16, 16).to(torch.bfloat16)
    rois = torch.tensor([[0.0, 1.0, 2.0, 30.0, 40.0], [1.0, 0.0, 0.0, 64.0, 64.0]])
    pooled = roi_align_sparse(features, rois, (7, 7), 0.25, 2)
    assert pooled.dtype == torch.bfloat16
    torch.testing.assert_close(pooled.float(), roi_align(features.float(), rois, 7, 0.25, 2), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("sampling_ratio", [1, 2, 0])  # 0 (adaptive): torchvision's kernel itself
def test_multiscale_pooling_matches_torchvisions_in_training_and_is_torchvisions_in_inference(
    sampling_ratio, monkeypatch
):
    gen = torch.Generator().manual_seed(1)
    image_size = (256, 256)
    features = {str(i): torch.randn(2, 8, 256 // 2 ** (i + 2), 256 // 2 ** (i + 2), generator=gen)
                for i in range(4)}
    boxes = [_rois(40, 1, 256, gen)[:, 1:].clamp(0, 256) for _ in range(2)]
    boxes = [torch.cat([b[:, :2], torch.maximum(b[:, 2:], b[:, :2] + 1)], 1) for b in boxes]
    names = list(features)
    sparse_calls = []
    monkeypatch.setattr(poolers, "roi_align_sparse",
                        lambda *args: sparse_calls.append(1) or roi_align_sparse(*args))
    ref = torchvision.ops.MultiScaleRoIAlign(names, 7, sampling_ratio)(features, boxes, [image_size] * 2)

    inference = MultiScaleRoIAlign(names, 7, sampling_ratio)(features, boxes, [image_size] * 2)
    assert torch.equal(inference, ref) and not sparse_calls  # torchvision's kernel: detections stay torchvision's

    trainable = {name: f.clone().requires_grad_() for name, f in features.items()}
    training = MultiScaleRoIAlign(names, 7, sampling_ratio)(trainable, boxes, [image_size] * 2)
    torch.testing.assert_close(training, ref, atol=1e-4, rtol=1e-4)
    assert len(sparse_calls) == (4 if sampling_ratio > 0 else 0)  # one product per level
