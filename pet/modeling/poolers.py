"""RoI pooling: torchvision's MultiScaleRoIAlign, with a faster CPU path for a fixed sampling ratio.

torchvision's CPU ``roi_align`` backward is a single-threaded loop over every output element;
it took a quarter of the shapes demo's training step and over a second of an R-50-FPN Faster
R-CNN step at 512 px. RoIAlign is linear in the features: with ``sampling_ratio`` s > 0 each
output cell averages s x s bilinear samples, a fixed weighted sum of at most 4 s^2 input pixels.
:func:`roi_align_sparse` builds those weights as a sparse matrix and pools every RoI of a level
with one sparse-dense product over the channels-last features (whose memory already is a
``[B*H*W, C]`` matrix); its gradient is the transposed product. Both run multi-threaded. The
result is torchvision's ``roi_align(..., aligned=False)`` to float rounding (same sample points,
same border rules), in another order of additions. It is used in training only, where the
backward is the cost: inference keeps torchvision's kernel, so Pet's detections stay exactly
torchvision's for the same weights. Adaptive sampling (``sampling_ratio <= 0``) and CUDA keep
torchvision's kernel too.
"""
from __future__ import annotations

import torch
import torchvision
from torchvision.ops.poolers import _convert_to_roi_format, _setup_scales

from pet.utils.tensor import at_least_float32

__all__ = ["MultiScaleRoIAlign", "roi_align_sparse"]


def _axis_samples(
    start: torch.Tensor, length: torch.Tensor, bins: int, ratio: int, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neighbouring pixel indices and bilinear weights along one axis, ``[R, bins, ratio, 2]`` each.

    roi_align's rules: a sample more than a pixel outside the map weighs 0; one within a pixel
    of the border is clamped onto it.
    """
    bin_size = (length / bins)[:, None]
    device = start.device
    # Rounded as torchvision's kernel rounds (start + bin * size) + (sample + 0.5) * size / ratio: a sample that
    # lands on the map's far edge (a box reaching past it) is then in or out for both alike.
    bin_start = start[:, None] + torch.arange(bins, device=device) * bin_size
    step = (torch.arange(ratio, device=device) + 0.5) * bin_size / ratio
    position = bin_start[:, :, None] + step[:, None, :]
    inside = (position >= -1) & (position <= size)
    position = position.clamp(min=0)
    low = position.floor().long().clamp(max=size - 1)
    position = torch.where(low >= size - 1, low.to(position.dtype), position)
    fraction = position - low
    index = torch.stack([low, (low + 1).clamp(max=size - 1)], dim=-1)
    weight = torch.stack([1 - fraction, fraction], dim=-1) * inside[..., None]
    return index, weight


def roi_align_sparse(
    features: torch.Tensor,
    rois: torch.Tensor,
    output_size: tuple[int, int],
    spatial_scale: float,
    sampling_ratio: int,
) -> torch.Tensor:
    """``torchvision.ops.roi_align(features, rois, output_size, spatial_scale, sampling_ratio, aligned=False)``.

    ``rois`` is ``[R, 5]`` (batch index, x1, y1, x2, y2 in input pixels) and ``sampling_ratio`` > 0
    (adaptive sampling gives each RoI its own sample count: use torchvision's kernel for it).
    Computed in float32 (float64 for float64 features) and returned in ``features``' dtype, as torchvision's
    autocast wrapper does.
    The result is a channels-last ``[R, C, out_h, out_w]`` view.
    """
    if sampling_ratio <= 0:
        raise ValueError(f"roi_align_sparse needs a fixed sampling_ratio > 0, got {sampling_ratio}; "
                         "adaptive sampling (<= 0) is torchvision.ops.roi_align's")
    batch, channels, height, width = features.shape
    out_h, out_w = output_size
    ratio = sampling_ratio
    boxes = at_least_float32(rois[:, 1:]) * spatial_scale
    widths = (boxes[:, 2] - boxes[:, 0]).clamp(min=1.0)
    heights = (boxes[:, 3] - boxes[:, 1]).clamp(min=1.0)
    y_index, y_weight = _axis_samples(boxes[:, 1], heights, out_h, ratio, height)  # [R, out_h, ratio, 2]
    x_index, x_weight = _axis_samples(boxes[:, 0], widths, out_w, ratio, width)  # [R, out_w, ratio, 2]
    # Every (RoI, out_y, out_x) row gets ratio^2 samples x 4 corners: dims [R, oy, ox, sy, sx, cy, cx].
    image = rois[:, 0].long()[:, None, None, None, None, None, None]
    columns = (image * height + y_index[:, :, None, :, None, :, None]) * width + x_index[:, None, :, None, :, None, :]
    values = y_weight[:, :, None, :, None, :, None] * x_weight[:, None, :, None, :, None, :] / (ratio * ratio)
    rows = torch.arange(rois.shape[0] * out_h * out_w, device=rois.device).repeat_interleave(4 * ratio * ratio)
    # Left uncoalesced (duplicate entries just add up): sorting the entries would cost more than the product.
    weights = torch.sparse_coo_tensor(torch.stack([rows, columns.reshape(-1)]), values.reshape(-1),
                                      (rois.shape[0] * out_h * out_w, batch * height * width), check_invariants=False)
    # A view if channels-last.
    pixels = at_least_float32(features).permute(0, 2, 3, 1).reshape(batch * height * width, channels)
    with torch.autocast(features.device.type, enabled=False):  # autocast would cast only the dense operand
        pooled = torch.sparse.mm(weights, pixels)
    return pooled.view(-1, out_h, out_w, channels).permute(0, 3, 1, 2).to(features.dtype)


class MultiScaleRoIAlign(torchvision.ops.MultiScaleRoIAlign):
    """torchvision's multi-level RoIAlign (same level mapping, same results, no parameters).

    In training with a fixed ``sampling_ratio`` (> 0) on the CPU each level is pooled by
    :func:`roi_align_sparse`, 2-5x faster than torchvision's kernel forward and backward together
    (docs/benchmarks/detectors.md); otherwise by torchvision's kernel.
    """

    def forward(
        self, x: dict[str, torch.Tensor], boxes: list[torch.Tensor], image_shapes: list[tuple[int, int]]
    ) -> torch.Tensor:
        features = [x[name] for name in self.featmap_names]
        training = torch.is_grad_enabled() and features[0].requires_grad
        if not training or self.sampling_ratio <= 0 or features[0].device.type != "cpu":
            return super().forward(x, boxes, image_shapes)
        if self.scales is None or self.map_levels is None:
            self.scales, self.map_levels = _setup_scales(
                features, image_shapes, self.canonical_scale, self.canonical_level
            )
        rois = _convert_to_roi_format(boxes)
        # As torchvision: one level takes every RoI unmapped (the mapper gives a box of negative area,
        # x2 < x1 or y2 < y1, a NaN level that no level would pool).
        levels = self.map_levels(boxes) if len(features) > 1 else rois.new_zeros(len(rois), dtype=torch.long)
        first = features[0]
        result = first.new_zeros((len(rois), first.shape[1], *self.output_size))
        for level, (feature, scale) in enumerate(zip(features, self.scales)):
            index = torch.where(levels == level)[0]
            pooled = roi_align_sparse(feature, rois[index], self.output_size, scale, self.sampling_ratio)
            result[index] = pooled.to(result.dtype)
        return result
