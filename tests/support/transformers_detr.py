"""What the DETR-family parity tests (RT-DETR, HGNetv2, D-FINE against transformers) build their references with."""
from __future__ import annotations

import numpy as np
import torch

from pet.modeling.hgnetv2 import HGNETV2_VARIANTS


def randomised(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter and BatchNorm statistic perturbed: the reference initialises some layers to zeros
    (box heads' last layers, sampling offsets' weights, D-FINE's gates and quality heads), which would hide a
    wrongly mapped or wired layer."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if not tensor.is_floating_point():
                continue
            if name.endswith("running_var"):
                tensor.uniform_(0.5, 1.5, generator=generator)
            else:
                tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.02)
    return model


def hgnetv2_config(variant: str, out_indices: tuple[int, ...] = (1, 2, 3, 4), use_lab: bool | None = None):
    """transformers' ``HGNetV2Config`` for a variant of Pet's table (``out_indices``: 0 is the stem, 1-4 the stages).
    "default" is ``HGNetV2Config()`` unchanged but for ``out_indices``."""
    import transformers

    if variant == "default":
        return transformers.HGNetV2Config(out_indices=list(out_indices))
    spec = HGNETV2_VARIANTS[variant]
    stages = spec.stages
    return transformers.HGNetV2Config(
        stem_channels=[3, *spec.stem_channels],
        stage_in_channels=[s.in_channels for s in stages], stage_mid_channels=[s.mid_channels for s in stages],
        stage_out_channels=[s.out_channels for s in stages], stage_num_blocks=[s.num_blocks for s in stages],
        stage_downsample=[s.downsample for s in stages], stage_light_block=[s.light_block for s in stages],
        stage_kernel_size=[s.kernel_size for s in stages], stage_numb_of_layers=[s.num_layers for s in stages],
        hidden_sizes=[s.out_channels for s in stages], depths=[s.num_blocks for s in stages],
        use_learnable_affine_block=spec.use_lab if use_lab is None else use_lab, out_indices=list(out_indices))


def picture(seed: int, height: int, width: int) -> np.ndarray:
    """RGB uint8: gradients, a checkerboard, noise and six flat rectangles (edges and texture for a model)."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    image = np.stack([xs * 255 / width, ys * 255 / height, ((xs // 20 + ys // 20) % 2) * 200], axis=-1)
    image = image + rng.integers(0, 40, (height, width, 3))
    for _ in range(6):
        x0, y0 = rng.integers(0, width - 40), rng.integers(0, height - 40)
        image[y0:y0 + rng.integers(20, height // 2), x0:x0 + rng.integers(20, width // 2)] = rng.integers(0, 256, 3)
    return np.clip(image, 0, 255).astype(np.uint8)


def calibrated(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """A hub-like detector from a freshly built transformers one (eval mode): every tensor but the normalisation
    statistics perturbed (this also gives the zero-initialised heads weights), then every normalisation layer's
    statistics set to those of the activations it sees on a picture, then perturbed by a factor. With uniformly drawn
    statistics instead (:func:`randomised`) every query comes out nearly the same, and a score threshold would be a
    near-tie for most detections; statistics fitted before the weights move let deep backbones (HGNetv2-B4) overflow."""
    generator = torch.Generator().manual_seed(seed + 1)
    statistics = ("running_mean", "running_var")
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point() and not name.endswith(statistics):
                tensor.add_(0.02 * torch.randn(tensor.shape, generator=generator))
    norms = [m for m in model.modules() if hasattr(m, "running_var")]  # BatchNorm2d and transformers' FrozenBN

    def calibrate(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        module.running_mean.copy_(inputs[0].mean((0, 2, 3)))
        module.running_var.copy_(inputs[0].var((0, 2, 3)))

    hooks = [m.register_forward_pre_hook(calibrate) for m in norms]
    calibration = torch.from_numpy(picture(seed + 100, 320, 320)).permute(2, 0, 1)[None].float() / 255
    with torch.no_grad():
        model(pixel_values=calibration)
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        for norm in norms:
            norm.running_var.mul_(1 + 0.1 * torch.randn(norm.running_var.shape, generator=generator))
    return model
