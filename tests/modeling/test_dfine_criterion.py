"""D-FINE's losses in Pet (:class:`~pet.modeling.dfine.criterion.DFineCriterion`) equal transformers'
``DFineLoss`` as ``DFineForObjectDetection`` computes it, term by term, and with the same gradient.

A tiny transformers D-FINE (HGNetV2 B0-like backbone, 3 decoder layers, 20 queries, 7 classes) with seeded random
weights (its box heads start at zero, which would make every distribution uniform and DDF 0) runs in training mode
on random pixels with labels; its own ``loss_dict`` is the reference. Its intermediate outputs, rearranged into what
Pet's D-FINE decoder returns in training (:func:`pet_outputs`), go through Pet's criterion with Pet's Hungarian
matcher on the same targets. Both run the same float32 operations in the same order on the same tensors, so the
terms agree to rounding (measured: bit-identical); the tolerance (1e-5 relative) is far below any layout, clamp,
weighting or normalisation mistake (those move a term by percents). Denoising off and on (its noise is drawn inside
the reference model; Pet reads the queries' split and positives from its ``denoising_meta_values``); targets with
objects in both images, in one only, and in none (no matches: every term finite, FGL 0 but still in the graph).
The targets include a large and a tiny box, so some matched anchors are far too small or too far off for W's range
and the end-bin clamps of the FGL targets are exercised (asserted).

The loss-side helpers are also checked alone against transformers' ``bbox2distance`` / ``translate_gt``, at the
edge cases: below W_0, above W_N, exactly on a bin.
"""
from __future__ import annotations

import pytest
import torch

from pet.config import get_default_cfg
from pet.modeling.dfine.config import add_config
from pet.modeling.dfine.criterion import DFineCriterion, boxes_to_distances, distance_bins, prediction_sets
from pet.modeling.dfine.distribution import distances_to_boxes, weighting_function
from pet.modeling.rtdetr.matcher import HungarianMatcher
from support.transformers_detr import randomised

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.numeric

from transformers.loss import loss_d_fine  # noqa: E402  (after the skip: transformers is optional)

HEIGHT, WIDTH = 64, 96
NUM_LABELS = 7
# Per image (label, (cx, cy, w, h)): nearly the whole image, tiny, medium, two on the borders (predictions for them
# reach past the image, so the [0, 1] clamp matters), tall, and images without objects.
OBJECTS = [(1, (0.5, 0.5, 0.95, 0.9)), (3, (0.2, 0.3, 0.04, 0.05)), (0, (0.7, 0.6, 0.3, 0.5)),
           (4, (0.96, 0.92, 0.08, 0.16)), (2, (0.03, 0.5, 0.06, 0.4))]
TARGETS = {
    "objects": [OBJECTS, [(6, (0.4, 0.5, 0.2, 0.3)), (2, (0.85, 0.15, 0.08, 0.12)), (5, (0.3, 0.6, 0.1, 0.7))]],
    "one_empty": [OBJECTS, []],
    "no_objects": [[], []],  # no matches anywhere, and no denoising queries
}


def reference_config(num_denoising: int) -> transformers.DFineConfig:
    """A D-FINE-S-shaped model shrunk: B0-like HGNetV2 with learnable affine blocks, 32-wide encoder and decoder."""
    backbone = transformers.HGNetV2Config(
        stem_channels=[3, 16, 16], stage_in_channels=[16, 64, 256, 512], stage_mid_channels=[16, 32, 64, 128],
        stage_out_channels=[64, 256, 512, 1024], stage_num_blocks=[1, 1, 2, 1],
        stage_downsample=[False, True, True, True], stage_light_block=[False, False, True, True],
        stage_kernel_size=[3, 3, 5, 5], stage_numb_of_layers=[3, 3, 3, 3], hidden_sizes=[64, 256, 512, 1024],
        depths=[1, 1, 2, 1], out_indices=[2, 3, 4], use_learnable_affine_block=True)
    return transformers.DFineConfig(
        backbone_config=backbone, use_pretrained_backbone=False, encoder_in_channels=[256, 512, 1024],
        encoder_hidden_dim=32, encoder_ffn_dim=64, hidden_expansion=0.5, depth_mult=0.34, d_model=32,
        decoder_in_channels=[32, 32, 32], decoder_ffn_dim=64, decoder_layers=3, decoder_n_points=[3, 6, 3],
        num_queries=20, num_labels=NUM_LABELS, num_denoising=num_denoising)


def pet_config(reference: transformers.DFineConfig):
    """Pet's config with the reference's loss and matcher settings."""
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
    return cfg


def pixels(seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (2, 3, HEIGHT, WIDTH), generator=generator).float() / 255


def pet_targets(name: str) -> list[dict[str, torch.Tensor]]:
    return [{"labels": torch.tensor([label for label, _ in image], dtype=torch.int64),
             "boxes": torch.tensor([box for _, box in image], dtype=torch.float32).reshape(-1, 4)}
            for image in TARGETS[name]]


def pet_outputs(out) -> dict:
    """The reference's training outputs as Pet's D-FINE decoder returns them: index 0 of the intermediate scores
    and boxes is the pre-box head's, the rest one per layer; the anchors are the same for every layer."""
    logits, boxes, anchors = out.intermediate_logits, out.intermediate_reference_points, out.initial_reference_points
    assert all(torch.equal(anchors[:, 0], a) for a in anchors.unbind(1))
    meta = out.denoising_meta_values
    denoising = None if meta is None else {
        "split": list(meta["dn_num_split"]), "groups": meta["dn_num_group"], "positive": list(meta["dn_positive_idx"])}
    return {"pre_logits": logits[:, 0], "pre_boxes": boxes[:, 0], "logits": list(logits[:, 1:].unbind(1)),
            "boxes": list(boxes[:, 1:].unbind(1)), "corners": list(out.intermediate_predicted_corners.unbind(1)),
            "anchors": anchors[:, 0], "enc_logits": out.enc_topk_logits, "enc_boxes": out.enc_topk_bboxes,
            "denoising": denoising}


@pytest.fixture(scope="module", params=[False, True], ids=["denoising_off", "denoising_on"])
def reference(request):
    """(whether it denoises, the reference model with random weights in training mode, Pet's config for it)."""
    torch.manual_seed(0)
    config = reference_config(num_denoising=10 if request.param else 0)
    # The box heads get 0.2 rather than 0.02, so that the layers' edge distributions differ clearly (DDF ~0.1, not
    # ~1e-4): from zeros every distribution is uniform and DDF vanishes.
    model = randomised(transformers.DFineForObjectDetection(config), seed=0, scales={"bbox_embed": 0.2}).train()
    return request.param, model, pet_config(config)


@pytest.mark.parametrize("targets", sorted(TARGETS))
def test_same_losses_and_gradients(reference, targets):
    """Same loss names, every term equal, and the same gradient of their sum with respect to every output the
    losses read (so the detached parts are the same too)."""
    denoising, model, cfg = reference
    torch.manual_seed(1)
    labels = [{"class_labels": t["labels"], "boxes": t["boxes"]} for t in pet_targets(targets)]
    out = model(pixel_values=pixels(), labels=labels)
    matcher = HungarianMatcher(cfg, "DFINE")
    losses = DFineCriterion(cfg, NUM_LABELS)(pet_outputs(out), pet_targets(targets), matcher)

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
    actual = torch.autograd.grad(sum(losses.values()), read)
    for name, a, e in zip(["logits", "boxes", "corners", "enc_logits", "enc_boxes"], actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-7, msg=name)

    if targets == "objects":
        below, above = _out_of_range(pet_outputs(out), pet_targets(targets), matcher, cfg)
        assert below and above, "the targets should reach past both ends of W for some matched anchor"
        assert _clamped_match(pet_outputs(out), pet_targets(targets), matcher), "the clamp should matter"


def _clamped_match(outputs: dict, targets: list[dict], matcher) -> bool:
    """Whether a box the last layer's set matches, or a positive denoising query's box the losses read, lies outside
    [0, 1] before the clamp."""
    raw = [outputs["pre_boxes"], *outputs["boxes"]]
    main = prediction_sets(outputs)[0][0]
    chosen = [(raw[-1][:, -main.boxes.shape[1]:], matcher(main.logits, main.boxes, targets))]
    if outputs["denoising"] is not None:  # denoising queries come first: their indices index the full tensors
        chosen += [(boxes, [(p, p) for p in outputs["denoising"]["positive"]]) for boxes in raw[:-1]]
    return any(((boxes[i, src] < 0) | (boxes[i, src] > 1)).any()
               for boxes, matches in chosen for i, (src, _) in enumerate(matches))


def _out_of_range(outputs: dict, targets: list[dict], matcher, cfg) -> tuple[bool, bool]:
    """Whether any matched (anchor, object) edge distance of the sets with distributions lies below W_0 / beyond W_N."""
    node = cfg.MODEL.DFINE
    values = weighting_function(node.NUM_BINS, torch.tensor([node.UP]), torch.tensor([node.REG_SCALE]))
    distances = []
    for pset in prediction_sets(outputs)[0]:
        if pset.corners is None:
            continue
        for i, ((src, dst), t) in enumerate(zip(matcher(pset.logits, pset.boxes, targets), targets)):
            distances.append(boxes_to_distances(pset.anchors[i, src], t["boxes"][dst], node.REG_SCALE).flatten())
    distances = torch.cat(distances)
    return bool((distances < values[0]).any()), bool((distances > values[-1]).any())


@pytest.mark.parametrize(("num_bins", "reg_scale"), [(32, 4.0), (16, 8.0)])
def test_distance_bins_edge_cases(num_bins, reg_scale):
    """Below W_0, on every bin, halfway between bins, on W_N and beyond: the same two bins and weights as
    ``translate_gt`` (whose index N - 0.1 in the last cases truncates to bin N - 1, all the weight on bin N)."""
    up = torch.tensor([0.5])
    values = weighting_function(num_bins, up, torch.tensor([reg_scale]))

    def both(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bins, left, right = distance_bins(t, values)
        index, ref_right, ref_left = loss_d_fine.translate_gt(t.clone(), num_bins, reg_scale, up)
        assert torch.equal(bins, index.long()) and torch.equal(left, ref_left) and torch.equal(right, ref_right)
        return bins, left, right

    bins, left, right = both(torch.cat([values[:1] - 1e-3, values[:1] - 1, torch.tensor([-1e6])]))
    assert (bins == 0).all() and (left == 1).all() and (right == 0).all()
    bins, left, right = both(values[:-1])
    assert torch.equal(bins, torch.arange(num_bins)) and (left == 1).all() and (right == 0).all()
    bins, left, right = both((values[:-1] + values[1:]) / 2)
    assert torch.equal(bins, torch.arange(num_bins)) and ((left - 0.5).abs() < 1e-4).all()
    torch.testing.assert_close(left + right, torch.ones(num_bins))
    bins, left, right = both(torch.cat([values[-1:], values[-1:] + 1e-3, values[-1:] + 10, torch.tensor([1e6])]))
    assert (bins == num_bins - 1).all() and (left == 0).all() and (right == 1).all()


def random_boxes(n: int, size: float, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``n`` boxes (cx, cy, w, h): centres in [0, 1], sides in [0.01, 0.01 + size]."""
    centres = torch.rand(n, 2, generator=generator, dtype=dtype)
    return torch.cat([centres, torch.rand(n, 2, generator=generator, dtype=dtype) * size + 0.01], 1)


def test_boxes_to_distances_inverts_distances_to_boxes():
    """Within W's inner range, boxes made from distances give the distances back (float64)."""
    generator = torch.Generator().manual_seed(0)
    anchors = random_boxes(64, 0.5, generator, torch.float64)
    distances = torch.rand(64, 4, generator=generator, dtype=torch.float64) * 4 - 2
    boxes = distances_to_boxes(anchors, distances, torch.tensor([4.0], dtype=torch.float64))
    torch.testing.assert_close(boxes_to_distances(anchors, boxes, 4.0), distances, rtol=0, atol=1e-9)


def test_fgl_targets_match_bbox2distance():
    """Box -> distances -> bins of random anchors and boxes (many beyond W's range) as ``bbox2distance`` (float32)."""
    generator = torch.Generator().manual_seed(1)
    anchors, boxes = random_boxes(256, 0.3, generator), random_boxes(256, 0.6, generator)
    up, values = torch.tensor([0.5]), weighting_function(32, torch.tensor([0.5]), torch.tensor([4.0]))
    xyxy = torch.cat([boxes[:, :2] - 0.5 * boxes[:, 2:], boxes[:, :2] + 0.5 * boxes[:, 2:]], 1)
    index, ref_right, ref_left = loss_d_fine.bbox2distance(anchors, xyxy, 32, 4.0, up)
    distances = boxes_to_distances(anchors, boxes, 4.0)
    bins, left, right = distance_bins(distances, values)
    assert (distances < values[0]).any() and (distances > values[-1]).any()
    assert torch.equal(bins, index.long()) and torch.equal(left, ref_left) and torch.equal(right, ref_right)


def test_default_config_is_the_references():
    """``MODEL.DFINE``'s loss and matcher defaults are ``DFineConfig()``'s."""
    cfg, reference = get_default_cfg(), transformers.DFineConfig()
    add_config(cfg)
    node, expected = cfg.MODEL.DFINE, pet_config(reference).MODEL.DFINE
    keys = ["NUM_BINS", "REG_SCALE", "UP", "LOSS_VFL", "LOSS_BBOX", "LOSS_GIOU", "LOSS_FGL", "LOSS_DDF",
            "DDF_TEMPERATURE", "FOCAL_ALPHA", "FOCAL_GAMMA", "COST_CLASS", "COST_BBOX", "COST_GIOU", "MATCHER_ALPHA",
            "MATCHER_GAMMA"]
    assert {k: node[k] for k in keys} == {k: expected[k] for k in keys}
