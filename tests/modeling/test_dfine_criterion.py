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
from pet.modeling.dfine.criterion import (
    DFineCriterion,
    boxes_to_distances,
    dense_one_to_one,
    distance_bins,
    prediction_sets,
)
from pet.modeling.dfine.distribution import distances_to_boxes, weighting_function
from pet.modeling.rtdetr.matcher import HungarianMatcher
from pet.utils.errors import ConfigError
from support.transformers_detr import (
    LOSS_TARGETS,
    assert_same_losses,
    decoder_outputs,
    hgnetv2_config,
    loss_cfg,
    loss_targets,
    random_images,
    randomised,
)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.numeric

from transformers.loss import loss_d_fine  # noqa: E402  (after the skip: transformers is optional)

HEIGHT, WIDTH = 64, 96
NUM_LABELS = 7
def reference_config(num_denoising: int) -> transformers.DFineConfig:
    """A D-FINE-S-shaped model shrunk: B0-like HGNetV2 with learnable affine blocks, 32-wide encoder and decoder."""
    backbone = hgnetv2_config("B0", out_indices=(2, 3, 4))
    return transformers.DFineConfig(
        backbone_config=backbone, use_pretrained_backbone=False, encoder_in_channels=[256, 512, 1024],
        encoder_hidden_dim=32, encoder_ffn_dim=64, hidden_expansion=0.5, depth_mult=0.34, d_model=32,
        decoder_in_channels=[32, 32, 32], decoder_ffn_dim=64, decoder_layers=3, decoder_n_points=[3, 6, 3],
        num_queries=20, num_labels=NUM_LABELS, num_denoising=num_denoising)


@pytest.fixture(scope="module", params=[False, True], ids=["denoising_off", "denoising_on"])
def reference(request):
    """(whether it denoises, the reference model with random weights in training mode, Pet's config for it)."""
    torch.manual_seed(0)
    config = reference_config(num_denoising=10 if request.param else 0)
    # The box heads get 0.2 rather than 0.02, so that the layers' edge distributions differ clearly (DDF ~0.1, not
    # ~1e-4): from zeros every distribution is uniform and DDF vanishes.
    model = randomised(transformers.DFineForObjectDetection(config), seed=0, scales={"bbox_embed": 0.2}).train()
    return request.param, model, loss_cfg(config)


@pytest.mark.parametrize("targets", sorted(LOSS_TARGETS))
def test_same_losses_and_gradients(reference, targets):
    """Same loss names, every term equal, and the same gradient of their sum with respect to every output the
    losses read (so the detached parts are the same too)."""
    denoising, model, cfg = reference
    torch.manual_seed(1)
    labels = [{"class_labels": t["labels"], "boxes": t["boxes"]} for t in loss_targets(targets)]
    out = model(pixel_values=random_images(HEIGHT, WIDTH).float() / 255, labels=labels)
    matcher = HungarianMatcher(cfg, "DFINE")
    losses = DFineCriterion(cfg, NUM_LABELS)(decoder_outputs(out), loss_targets(targets), matcher)

    assert_same_losses(losses, out, denoising, targets)

    if targets == "objects":
        below, above = _out_of_range(decoder_outputs(out), loss_targets(targets), matcher, cfg)
        assert below and above, "the targets should reach past both ends of W for some matched anchor"
        assert _clamped_match(decoder_outputs(out), loss_targets(targets), matcher), "the clamp should matter"


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
    node, expected = cfg.MODEL.DFINE, loss_cfg(reference).MODEL.DFINE
    keys = ["NUM_BINS", "REG_SCALE", "UP", "LOSS_VFL", "LOSS_BBOX", "LOSS_GIOU", "LOSS_FGL", "LOSS_DDF",
            "DDF_TEMPERATURE", "FOCAL_ALPHA", "FOCAL_GAMMA", "COST_CLASS", "COST_BBOX", "COST_GIOU", "MATCHER_ALPHA",
            "MATCHER_GAMMA"]
    assert {k: node[k] for k in keys} == {k: expected[k] for k in keys}


# ------------------------------------------------------------------------------------ LOSS_LAYOUT original (GO-LSD)
def _original_losses(reference, targets: str) -> tuple[dict, dict, list[dict], DFineCriterion, HungarianMatcher]:
    """The reference's training outputs as Pet's decoder gives them, and Pet's losses under ``LOSS_LAYOUT
    original``: (losses, outputs, targets, criterion, matcher)."""
    _, model, cfg = reference
    cfg = cfg.clone()
    cfg.MODEL.DFINE.LOSS_LAYOUT = "original"
    torch.manual_seed(1)
    labels = [{"class_labels": t["labels"], "boxes": t["boxes"]} for t in loss_targets(targets)]
    outputs = decoder_outputs(model(pixel_values=random_images(HEIGHT, WIDTH).float() / 255, labels=labels))
    matcher, criterion = HungarianMatcher(cfg, "DFINE"), DFineCriterion(cfg, NUM_LABELS)
    return criterion(outputs, loss_targets(targets), matcher), outputs, loss_targets(targets), criterion, matcher


def test_the_original_layout_aligns_each_layers_scores_boxes_and_distributions(reference):
    """Layer k's own scores, boxes and edge distributions in ``_aux_{k}`` (transformers' layout shifts them by one),
    the last layer's in the main set with FGL and no DDF, the pre-box head and the encoder as sets of their own; the
    denoising sets aligned the same way, with the pre-box head's ``_dn_pre``."""
    denoising, _, _ = reference
    losses, outputs, _, _, _ = _original_losses(reference, "objects")
    sets, dn_sets = prediction_sets(outputs, "original")
    layers, queries = len(outputs["corners"]), sets[0].logits.shape[1]
    assert [p.suffix for p in sets] == ["", *(f"_aux_{k}" for k in range(layers - 1)), "_pre", "_enc_0"]
    own = [*range(layers - 1)]
    for pset, k in zip([sets[0], *sets[1:layers]], [layers - 1, *own]):
        assert torch.equal(pset.logits, outputs["logits"][k][:, -queries:])
        assert torch.equal(pset.boxes, outputs["boxes"][k][:, -queries:].clamp(0, 1))
        assert torch.equal(pset.corners, outputs["corners"][k][:, -queries:])
    assert torch.equal(sets[-2].logits, outputs["pre_logits"][:, -queries:]) and sets[-2].corners is None
    assert torch.equal(sets[-1].boxes, outputs["enc_boxes"].clamp(0, 1)) and sets[-1].corners is None
    five, three = ("vfl", "bbox", "giou", "fgl", "ddf"), ("vfl", "bbox", "giou")
    expected = {f"loss_{t}" for t in five[:4]} | {f"loss_{t}_aux_{k}" for t in five for k in own}
    expected |= {f"loss_{t}_{s}" for t in three for s in ("pre", "enc_0")}
    if denoising:
        assert [p.suffix for p in dn_sets] == [*(f"_dn_{k}" for k in range(layers)), "_dn_pre"]
        assert torch.equal(dn_sets[0].logits, outputs["logits"][0][:, :-queries])
        expected |= {f"loss_{t}_dn_{k}" for t in five for k in range(layers)} | {f"loss_{t}_dn_pre" for t in three}
    else:
        assert dn_sets == []
    assert set(losses) == expected
    assert all(torch.isfinite(v) for v in losses.values())


def _union_by_counting(matchings: list, image: int) -> dict[int, set[int]]:
    """Per query of ``image``, the objects chosen for it by the most sets (several on a tie), counted directly."""
    counts: dict[int, dict[int, int]] = {}
    for matching in matchings:
        src, dst = matching[image]
        for q, o in zip(src.tolist(), dst.tolist()):
            counts.setdefault(q, {}).setdefault(o, 0)
            counts[q][o] += 1
    return {q: {o for o, c in per.items() if c == max(per.values())} for q, per in counts.items()}


@pytest.mark.parametrize("targets", ["objects", "one_empty"])
def test_the_original_layout_trains_boxes_and_distributions_on_the_union_of_matchings(reference, targets):
    """GO-LSD: the union of every matched set's matching (each query once, with an object the most sets chose for
    it, counted here independently) supervises every set's L1 and GIoU, normalised by its size; the varifocal loss
    keeps each set's own matching and the object count. The union differs from the sets' own matchings here, so a
    layout that kept them would fail."""
    losses, outputs, targets, criterion, matcher = _original_losses(reference, targets)
    sets = prediction_sets(outputs, "original")[0]
    matchings = [matcher(p.logits, p.boxes, targets) for p in sets]
    union = dense_one_to_one(matchings)
    for image, (src, dst) in enumerate(union):
        allowed = _union_by_counting(matchings, image)
        assert sorted(src.tolist()) == sorted(allowed) and len(set(src.tolist())) == len(src)
        assert all(o in allowed[q] for q, o in zip(src.tolist(), dst.tolist()))
    pairs = sum(len(src) for src, _ in union)
    assert any(len(m[0][0]) != len(union[0][0]) or not torch.equal(m[0][0], union[0][0]) for m in matchings)
    weights = criterion.weights
    for pset, own in zip(sets, matchings):
        index = (torch.cat([torch.full_like(s, i) for i, (s, _) in enumerate(union)]), torch.cat([s for s, _ in union]))
        gt = torch.cat([t["boxes"][d] for t, (_, d) in zip(targets, union)])
        l1 = (pset.boxes[index] - gt).abs().sum() / pairs * weights["loss_bbox"]
        torch.testing.assert_close(losses[f"loss_bbox{pset.suffix}"], l1, rtol=1e-6, atol=1e-7)
        vfl = criterion.loss_vfl(pset.logits, pset.boxes, targets, own, float(len(targets[0]["labels"]) +
                                                                             len(targets[1]["labels"])))
        torch.testing.assert_close(losses[f"loss_vfl{pset.suffix}"], vfl["loss_vfl"] * weights["loss_vfl"])


def test_an_unknown_loss_layout_is_one_error_naming_the_key():
    cfg = get_default_cfg()
    add_config(cfg)
    cfg.MODEL.DFINE.LOSS_LAYOUT = "paper"
    with pytest.raises(ConfigError, match=r"MODEL.DFINE.LOSS_LAYOUT 'paper' is not one of transformers, original"):
        DFineCriterion(cfg, NUM_LABELS)
