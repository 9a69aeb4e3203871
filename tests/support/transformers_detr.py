"""What the DETR-family parity tests (RT-DETR, HGNetv2, D-FINE against transformers) build their references with."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pet.config import get_default_cfg
from pet.modeling.dfine.config import add_config
from pet.modeling.hgnetv2 import HGNETV2_VARIANTS
from support.against_reference import Tolerance, match_detections

# The 80 COCO 2017 categories among ids 1-90 (the hub models' labels 0-79 in this order): all but these ten.
UNUSED_COCO_IDS = {12, 26, 29, 30, 45, 66, 68, 69, 71, 83}
COCO_IDS = [i for i in range(1, 91) if i not in UNUSED_COCO_IDS]


def randomised(model: torch.nn.Module, seed: int, scales: dict[str, float] | None = None) -> torch.nn.Module:
    """Every parameter and BatchNorm statistic perturbed: the reference initialises some layers to zeros
    (box heads' last layers, sampling offsets' weights, D-FINE's gates and quality heads), which would hide a
    wrongly mapped or wired layer. The noise is 0.02 N(0, 1), or ``scales[part]`` for a tensor whose name contains
    ``part``; BatchNorm variances are drawn in [0.5, 1.5]."""
    generator = torch.Generator().manual_seed(seed)
    scales = scales or {}
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if not tensor.is_floating_point():
                continue
            if name.endswith("running_var"):
                tensor.uniform_(0.5, 1.5, generator=generator)
            else:
                scale = next((v for part, v in scales.items() if part in name), 0.02)
                tensor.add_(torch.randn(tensor.shape, generator=generator) * scale)
    return model


def hgnetv2_config(variant: str, out_indices: tuple[int, ...] = (1, 2, 3, 4), use_lab: bool | None = None):
    """transformers' ``HGNetV2Config`` for a variant of Pet's table (``out_indices``: 0 is the stem, 1-4 the stages).
    "default" is ``HGNetV2Config()`` unchanged but for ``out_indices``."""
    import transformers  # the reference, installed with the test extra; imported by the tests that skip without it

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


@contextlib.contextmanager
def training(pet: torch.nn.Module, reference: torch.nn.Module, num_denoising: int) -> Iterator[None]:
    """Both models in training mode with ``num_denoising`` denoising queries; afterwards their weights and BatchNorm
    statistics as before, eval mode and the configured denoising again (``pet.decoder.denoising``, and the
    reference's config, which its model reads at each call)."""
    default = reference.config.num_denoising
    states = [{k: v.clone() for k, v in m.state_dict().items()} for m in (pet, reference)]
    reference.config.num_denoising = pet.decoder.denoising.num_denoising = num_denoising
    pet.train()
    reference.train()
    try:
        yield
    finally:
        for model, state in zip((pet, reference), states):
            model.load_state_dict(state)
            model.eval()
        reference.config.num_denoising = pet.decoder.denoising.num_denoising = default


def objects(seed: int, height: int, width: int, num_labels: int) -> list[dict]:
    """Two images' objects (3 and 1) as xyxy pixel boxes and 1-based labels (Pet's targets)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (3, 1):
        xy = torch.rand(n, 2, generator=g) * torch.tensor([width * 0.6, height * 0.6])
        wh = (torch.rand(n, 2, generator=g) * 0.3 + 0.1) * torch.tensor([width, height])
        labels = torch.randint(1, num_labels + 1, (n,), generator=g)
        out.append({"boxes": torch.cat([xy, xy + wh], 1), "labels": labels})
    return out


def reference_labels(targets: list[dict], height: int, width: int) -> list[dict]:
    """Pet's targets as transformers' DETR labels: 0-based ``class_labels``, (cx, cy, w, h) in [0, 1]."""
    scale = torch.tensor([width, height, width, height], dtype=torch.float32)
    out = []
    for t in targets:
        x0, y0, x1, y1 = (t["boxes"] / scale).unbind(1)
        cxcywh = torch.stack([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], 1)
        out.append({"class_labels": t["labels"] - 1, "boxes": cxcywh})
    return out


def reference_detections(outputs: Any, sizes: list[tuple[int, int]], threshold: float) -> list[dict[str, torch.Tensor]]:
    """transformers' post-processed detections of ``outputs`` on pictures of ``sizes``, as Pet gives them: boxes
    clipped to the picture (transformers does not clip), labels as COCO category ids (the hub models' 80 classes)."""
    import transformers  # the reference, installed with the test extra; imported by the tests that skip without it

    found = transformers.RTDetrImageProcessor().post_process_object_detection(outputs, threshold=threshold,
                                                                              target_sizes=sizes)
    out = []
    for (height, width), detections in zip(sizes, found):
        boxes = detections["boxes"].clone()
        boxes[:, 0::2] = boxes[:, 0::2].clamp(0, width)
        boxes[:, 1::2] = boxes[:, 1::2].clamp(0, height)
        labels = torch.tensor([COCO_IDS[int(label)] for label in detections["labels"]], dtype=torch.int64)
        out.append({"boxes": boxes, "scores": detections["scores"], "labels": labels})
    return out


def assert_predictor_gives(predictor: Any, pictures: list[np.ndarray], theirs: list[dict[str, torch.Tensor]],
                           score_thresh: float) -> None:
    """Pet's :class:`~pet.predict.Predictor` on the RGB ``pictures`` gives transformers' detections ``theirs``
    (:func:`reference_detections`): paired one to one by COCO id, score (1e-4) and box (0.5 px), only a score within
    1e-4 of ``score_thresh`` unpaired; every picture keeps 5-100 detections of more than one category."""
    ours = predictor.predict_many([np.ascontiguousarray(image[..., ::-1]) for image in pictures])  # BGR, as opencv
    for image, mine, reference in zip(pictures, ours, theirs):
        assert (mine.height, mine.width) == image.shape[:2]
        assert 5 <= len(reference["scores"]) <= 100
        mine_tensors = {"boxes": torch.as_tensor(mine.boxes), "scores": torch.as_tensor(mine.scores),
                        "labels": torch.as_tensor(mine.labels)}
        pairs = match_detections(mine_tensors, reference, Tolerance(box=0.5, score=1e-4), score_thresh=score_thresh,
                                 capped=False)
        assert len(pairs) >= len(reference["scores"]) - 2
        assert len(set(reference["labels"].tolist())) >= 2


def load_reference_weights(pet: torch.nn.Module, reference: torch.nn.Module) -> None:
    """The reference's ``state_dict`` into Pet's model through its key mapping (``convert_state_dict``): nothing
    missing (but FrozenBN's absent ``num_batches_tracked``) or left over."""
    result = pet.load_state_dict(pet.convert_state_dict(reference.state_dict()), strict=False)
    assert [k for k in result.missing_keys if not k.endswith("num_batches_tracked")] == []
    assert result.unexpected_keys == []


def random_images(height: int, width: int, seed: int = 0, batch: int = 2) -> torch.Tensor:
    """Seeded uint8 noise ``[batch, 3, height, width]``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, 3, height, width), dtype=torch.uint8, generator=generator)


# The loss tests' objects, per image (label, (cx, cy, w, h)): nearly the whole image, tiny, medium, two on the borders
# (predictions for them reach past the image, so the [0, 1] clamp matters), tall; and images without objects.
_OBJECTS = [(1, (0.5, 0.5, 0.95, 0.9)), (3, (0.2, 0.3, 0.04, 0.05)), (0, (0.7, 0.6, 0.3, 0.5)),
            (4, (0.96, 0.92, 0.08, 0.16)), (2, (0.03, 0.5, 0.06, 0.4))]
LOSS_TARGETS = {
    "objects": [_OBJECTS, [(6, (0.4, 0.5, 0.2, 0.3)), (2, (0.85, 0.15, 0.08, 0.12)), (5, (0.3, 0.6, 0.1, 0.7))]],
    "one_empty": [_OBJECTS, []],
    "no_objects": [[], []],  # no matches anywhere, and no denoising queries
}


def loss_targets(name: str) -> list[dict[str, torch.Tensor]]:
    """:data:`LOSS_TARGETS` ``name`` as the criteria take them: 0-based ``labels``, (cx, cy, w, h) ``boxes``."""
    return [{"labels": torch.tensor([label for label, _ in image], dtype=torch.int64),
             "boxes": torch.tensor([box for _, box in image], dtype=torch.float32).reshape(-1, 4)}
            for image in LOSS_TARGETS[name]]


def decoder_outputs(out: Any) -> dict:
    """transformers' D-FINE / DEIMv2 training outputs as Pet's D-FINE decoder returns them: index 0 of the
    intermediate scores and boxes is the pre-box head's, the rest one per layer; the anchors are the same for every
    layer; the denoising meta values under Pet's names."""
    logits, boxes, anchors = out.intermediate_logits, out.intermediate_reference_points, out.initial_reference_points
    assert all(torch.equal(anchors[:, 0], a) for a in anchors.unbind(1))
    meta = out.denoising_meta_values
    denoising = None if meta is None else {
        "split": list(meta["dn_num_split"]), "groups": meta["dn_num_group"], "positive": list(meta["dn_positive_idx"])}
    return {"pre_logits": logits[:, 0], "pre_boxes": boxes[:, 0], "logits": list(logits[:, 1:].unbind(1)),
            "boxes": list(boxes[:, 1:].unbind(1)), "corners": list(out.intermediate_predicted_corners.unbind(1)),
            "anchors": anchors[:, 0], "enc_logits": out.enc_topk_logits, "enc_boxes": out.enc_topk_bboxes,
            "denoising": denoising}


def loss_cfg(reference: Any) -> Any:
    """Pet's config (``MODEL.DFINE``) with a transformers D-FINE / DEIMv2 config's loss and matcher settings."""
    cfg = get_default_cfg()
    add_config(cfg)
    cfg.MODEL.NUM_CLASSES = reference.num_labels
    node = cfg.MODEL.DFINE
    node.DECODER_LAYERS, node.NUM_QUERIES = reference.decoder_layers, reference.num_queries
    node.NUM_DENOISING = reference.num_denoising
    node.NUM_BINS, node.REG_SCALE, node.UP = reference.max_num_bins, reference.reg_scale, reference.up
    node.LOSS_VFL, node.LOSS_BBOX, node.LOSS_GIOU = (reference.weight_loss_vfl, reference.weight_loss_bbox,
                                                     reference.weight_loss_giou)
    node.LOSS_FGL, node.LOSS_DDF = reference.weight_loss_fgl, reference.weight_loss_ddf
    node.DDF_TEMPERATURE = 5.0  # the reference's loss_local(T=5): not a config value
    node.FOCAL_ALPHA, node.FOCAL_GAMMA = reference.focal_loss_alpha, reference.focal_loss_gamma
    node.COST_CLASS, node.COST_BBOX, node.COST_GIOU = (reference.matcher_class_cost, reference.matcher_bbox_cost,
                                                       reference.matcher_giou_cost)
    node.MATCHER_ALPHA, node.MATCHER_GAMMA = reference.matcher_alpha, reference.matcher_gamma
    if hasattr(reference, "weight_loss_mal"):  # DEIMv2 (MAL_ALPHA 0 for the reference's None)
        node.LOSS_MAL, node.MAL_ALPHA = reference.weight_loss_mal, reference.mal_alpha or 0.0
        node.DENSE_ONE_TO_ONE = reference.use_dense_one_to_one
    return cfg


def assert_same_losses(losses: dict[str, torch.Tensor], out: Any, denoising: bool, targets: str) -> None:
    """Pet's criterion's ``losses`` against transformers' training output ``out`` (its ``loss_dict``, on
    :func:`loss_targets` ``targets``): the same names, every term equal (1e-5 relative), the distribution terms
    finite and in the graph (DDF not vanishing with these weights), and the same gradient of their sum with respect
    to every output the losses read (so what each side detaches is the same too)."""
    assert sorted(losses) == sorted(out.loss_dict)
    assert any("_dn_" in k for k in losses) == (denoising and targets != "no_objects")
    assert {k for k in losses if "fgl" in k} >= {"loss_fgl_aux_0", "loss_fgl_aux_1"}
    for name, value in out.loss_dict.items():
        torch.testing.assert_close(losses[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert all(losses[k] > 0 for k in ("loss_ddf_aux_0", "loss_ddf_aux_1")), "DDF must not vanish (weights random)"
    # Without matches the distribution terms are still finite and in the graph (FGL 0, DDF the unmatched side).
    assert all(torch.isfinite(v) for v in losses.values())
    assert all(v.requires_grad for k, v in losses.items() if "fgl" in k or "ddf" in k)
    read = [out.intermediate_logits, out.intermediate_reference_points, out.intermediate_predicted_corners,
            out.enc_topk_logits, out.enc_topk_bboxes]
    expected = torch.autograd.grad(out.loss, read, retain_graph=True)
    actual = torch.autograd.grad(sum(losses.values()), read, retain_graph=True)
    for name, a, e in zip(["logits", "boxes", "corners", "enc_logits", "enc_boxes"], actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-7, msg=name)
