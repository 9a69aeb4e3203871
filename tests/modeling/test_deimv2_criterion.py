"""DEIMv2's losses in Pet (:class:`~pet.modeling.dfine.deimv2_criterion.Deimv2Criterion`) equal transformers'
``Deimv2Loss`` as ``Deimv2ForObjectDetection`` computes it, term by term, and with the same gradient.

As the D-FINE test (test_dfine_criterion.py): a tiny transformers DEIMv2 (HGNetV2 B0-like backbone, hybrid encoder,
3 decoder layers, 20 queries, 7 classes) with seeded random weights runs in training mode on random pixels with
labels; its own ``loss_dict`` is the reference, and its intermediate outputs, rearranged into what Pet's D-FINE
decoder returns in training, go through Pet's criterion with Pet's Hungarian matcher. Both run the same float32
operations on the same tensors (measured: equal to rounding); the tolerance (1e-5 relative) is far below a wrong
MAL target or weight, a wrong union or a wrong normaliser. Denoising off and on, dense one-to-one on and off, MAL's
alpha off and 0.75, gamma 1.5 (DEIMv2's published configs') so that ``IoU^gamma`` differs from ``IoU^2`` too;
targets with objects in both images, in one only, and in none.

The dense one-to-one union alone is checked against transformers' on random matchings full of conflicts and ties
(pairs and order equal).
"""
from __future__ import annotations

import pytest
import torch

from pet.modeling.dfine.criterion import dense_one_to_one, prediction_sets
from pet.modeling.dfine.deimv2_criterion import Deimv2Criterion
from pet.modeling.rtdetr.matcher import HungarianMatcher
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

from transformers.loss.loss_deimv2 import Deimv2Loss  # noqa: E402  (after the skip: transformers is optional)

HEIGHT, WIDTH = 64, 96
NUM_LABELS = 7
def reference_config(num_denoising: int) -> transformers.Deimv2Config:
    """A DEIMv2-N-shaped model shrunk (hybrid encoder, B0-like HGNetV2), with DEIMv2's MAL gamma 1.5."""
    backbone = hgnetv2_config("B0", out_indices=(2, 3, 4))
    return transformers.Deimv2Config(
        backbone_config=backbone, use_pretrained_backbone=False, encoder_type="hybrid",
        encoder_in_channels=[256, 512, 1024], encoder_hidden_dim=32, encoder_ffn_dim=64, hidden_expansion=0.5,
        depth_mult=0.34, d_model=32, decoder_in_channels=[32, 32, 32], decoder_ffn_dim=64, decoder_layers=3,
        decoder_n_points=[3, 6, 3], num_queries=20, num_labels=NUM_LABELS, num_denoising=num_denoising,
        focal_loss_gamma=1.5)


@pytest.fixture(scope="module", params=[False, True], ids=["denoising_off", "denoising_on"])
def reference(request):
    """(whether it denoises, the reference model with random weights in training mode)."""
    torch.manual_seed(0)
    config = reference_config(num_denoising=10 if request.param else 0)
    # Box heads at 0.2 (not 0.02) so that the layers' edge distributions differ clearly and DDF does not vanish.
    model = randomised(transformers.Deimv2ForObjectDetection(config), seed=0, scales={"bbox_embed": 0.2}).train()
    return request.param, model


@pytest.mark.parametrize("targets", sorted(LOSS_TARGETS))
@pytest.mark.parametrize("mal_alpha", [None, 0.75], ids=["alpha_none", "alpha_0.75"])
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "own_matching"])
def test_same_losses_and_gradients(reference, dense, mal_alpha, targets):
    """Same loss names, every term equal, and the same gradient of their sum with respect to every output the
    losses read (so the detached parts are the same too)."""
    denoising, model = reference
    model.config.use_dense_one_to_one, model.config.mal_alpha = dense, mal_alpha  # the loss reads them per call
    cfg = loss_cfg(model.config)
    torch.manual_seed(1)
    labels = [{"class_labels": t["labels"], "boxes": t["boxes"]} for t in loss_targets(targets)]
    out = model(pixel_values=random_images(HEIGHT, WIDTH).float() / 255, labels=labels)
    matcher = HungarianMatcher(cfg, "DFINE")
    outputs = decoder_outputs(out)
    losses = Deimv2Criterion(cfg, NUM_LABELS)(outputs, loss_targets(targets), matcher)

    assert_same_losses(losses, out, denoising, targets)
    # Layer L-2's scores, which no matched set reads, are in the graph with gradient 0 (for DDP; raises if not).
    (unsupervised,) = torch.autograd.grad(losses["loss_mal"], outputs["logits"][-2], retain_graph=True)
    assert not unsupervised.any()

    if dense and targets == "objects":
        _assert_union_matters(decoder_outputs(out), loss_targets(targets), matcher)


def _assert_union_matters(outputs: dict, targets: list[dict], matcher) -> None:
    """The union is larger than any one set's matching (its size is not the object count) and some query is
    matched to different objects by different sets (the choice of the most frequent pair matters)."""
    matchings = [matcher(p.logits, p.boxes, targets) for p in prediction_sets(outputs)[0]]
    union = dense_one_to_one(matchings)
    assert sum(len(src) for src, _ in union) > sum(len(t["labels"]) for t in targets)
    pairs = [{(int(q), int(o)) for m in matchings for q, o in zip(*m[i])} for i in range(len(targets))]
    assert any(len({q for q, _ in p}) < len(p) for p in pairs), "no query matched to two objects"


def _random_matchings(generator: torch.Generator, sets: int, queries: int, objects: int) -> list:
    """``sets`` matchings of one image: each a random injective query -> object assignment of all objects (few
    queries, so the sets collide and counts tie)."""
    return [[(torch.randperm(queries, generator=generator)[:objects], torch.randperm(objects, generator=generator))]
            for _ in range(sets)]


@pytest.mark.parametrize("seed", range(3))
def test_dense_one_to_one_is_the_references(seed):
    """The same (query, object) pairs in the same order as ``Deimv2Loss._get_dense_o2o_indices``, on matchings with
    many conflicting queries and tied counts, for images with objects and without."""
    generator = torch.Generator().manual_seed(seed)
    loss = Deimv2Loss(reference_config(num_denoising=0))
    for sets, queries, objects in [(4, 6, 3), (5, 8, 5), (2, 3, 2), (4, 5, 0)]:
        images = [_random_matchings(generator, sets, queries, objects) for _ in range(3)]
        matchings = [[image[s][0] for image in images] for s in range(sets)]  # per set, per image
        expected = loss._get_dense_o2o_indices(matchings[0], matchings[1:])
        actual = dense_one_to_one(matchings)
        for (src, dst), (ref_src, ref_dst) in zip(actual, expected, strict=True):
            assert torch.equal(src, ref_src) and torch.equal(dst, ref_dst)
