"""Where the decoder's queries come from: IoU-aware query selection, and the denoising queries of training.

**Query selection.** Every encoder location is a candidate: a linear layer and LayerNorm turn its
feature into a query, a class head scores it and a box head refines an anchor centred on it (0.05 of
the image at stride 8, doubling per level). The ``num_queries`` best-scoring candidates (their highest
class logit) become the decoder's initial queries (features detached) and reference boxes. The loss on
these candidates (varifocal: the score is trained towards the IoU) is what makes the selection IoU-aware.

**Contrastive denoising** (DN-DETR / DINO): ground-truth boxes and labels with noise are fed to the
decoder as extra queries, which must reconstruct the objects; this stabilises the bipartite matching
early in training. Each group has a positive copy of every object (noise under half its size) and a
negative one (noise between one and two halves, to be classified as background); an attention mask
stops the matching queries from seeing the denoising ones and groups from seeing each other.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torchvision.ops import box_convert

from pet.modeling.rtdetr.layers import MLP, inverse_sigmoid

__all__ = ["QuerySelection", "ContrastiveDenoising", "encoder_anchors", "DecoderInputs", "decoder_inputs"]


def encoder_anchors(shapes: list[tuple[int, int]], device: torch.device, dtype: torch.dtype,
                    size: float = 0.05, eps: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates' anchors as logits ``[1, S, 4]`` (cx, cy, w, h) and a ``[1, S, 1]`` mask of those inside
    ``[eps, 1 - eps]`` on every coordinate; the others' logits are the dtype's largest value (never selected
    boxes), and the selection ignores their features."""
    anchors = []
    for level, (h, w) in enumerate(shapes):
        y, x = torch.meshgrid(torch.arange(h, device=device, dtype=dtype), torch.arange(w, device=device, dtype=dtype),
                              indexing="ij")
        centre = torch.stack([(x + 0.5) / w, (y + 0.5) / h], -1)
        wh = torch.full_like(centre, size * 2.0**level)
        anchors.append(torch.cat([centre, wh], -1).reshape(1, h * w, 4))
    boxes = torch.cat(anchors, 1)
    valid = ((boxes > eps) & (boxes < 1 - eps)).all(-1, keepdim=True)
    logits = torch.where(valid, torch.log(boxes / (1 - boxes)), torch.tensor(torch.finfo(dtype).max, dtype=dtype,
                                                                              device=device))
    return logits, valid


class QuerySelection(nn.Module):
    """Encoder memory ``[B, S, C]`` -> the top ``num_queries`` candidates (see the module docstring)."""

    def __init__(self, dim: int, num_classes: int, num_queries: int) -> None:
        super().__init__()
        self.num_queries = num_queries
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.score_head = nn.Linear(dim, num_classes)
        self.box_head = MLP(dim, dim, 4, 3)

    def forward(self, memory: torch.Tensor, shapes: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
        """``queries`` [B, K, C] (detached), ``reference`` [B, K, 4] box logits, and the candidates' ``logits``
        [B, K, classes] and ``boxes`` [B, K, 4] (sigmoid of ``reference``, not detached) for the loss."""
        anchors, valid = encoder_anchors(shapes, memory.device, memory.dtype)
        features = self.norm(self.proj(valid.to(memory.dtype) * memory))
        logits = self.score_head(features)
        box_logits = self.box_head(features) + anchors
        top = torch.topk(logits.max(-1).values, self.num_queries, dim=1).indices

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t.gather(1, top.unsqueeze(-1).expand(-1, -1, t.shape[-1]))

        reference = pick(box_logits)
        return {"queries": pick(features).detach(), "reference": reference, "logits": pick(logits),
                "boxes": reference.sigmoid()}


class ContrastiveDenoising(nn.Module):
    """Noised ground truth -> denoising queries, their reference boxes, the attention mask and what the loss
    needs to match them (see the module docstring).

    The random draws (label flips, then box noise signs and magnitudes) are made in the order and shapes of
    transformers' ``get_contrastive_denoising_training_group``, so the two give the same queries under the same seed.
    """

    def __init__(self, dim: int, num_classes: int, num_denoising: int, label_noise_ratio: float,
                 box_noise_scale: float) -> None:
        super().__init__()
        self.num_classes, self.num_denoising = num_classes, num_denoising
        self.label_noise_ratio, self.box_noise_scale = label_noise_ratio, box_noise_scale
        # Row num_classes is the padding of images with fewer objects than the batch's most.
        self.label_embed = nn.Embedding(num_classes + 1, dim, padding_idx=num_classes)

    def forward(self, targets: list[dict[str, torch.Tensor]], num_queries: int) -> dict | None:
        """``targets``: per image ``labels`` (0-based) and ``boxes`` (cx, cy, w, h in [0, 1]). None when there is
        nothing to denoise. Otherwise ``queries`` [B, D, C], ``reference`` [B, D, 4] (logits), ``attn_mask``
        [D + num_queries] squared (0 / -inf), ``positive`` (per image, the indices of its positive queries,
        group after group) and ``groups``."""
        counts = [len(t["labels"]) for t in targets]
        most = max(counts, default=0)
        if self.num_denoising <= 0 or most == 0:
            return None
        groups = max(self.num_denoising // most, 1)
        b, device = len(targets), targets[0]["labels"].device
        labels = torch.full([b, most], self.num_classes, dtype=torch.int32, device=device)
        boxes = torch.zeros([b, most, 4], device=device)
        real = torch.zeros([b, most], dtype=torch.bool, device=device)
        for i, (t, n) in enumerate(zip(targets, counts)):
            labels[i, :n], boxes[i, :n], real[i, :n] = t["labels"], t["boxes"], True
        labels, boxes, real = labels.tile([1, 2 * groups]), boxes.tile([1, 2 * groups, 1]), real.tile([1, 2 * groups])
        # Within each group: `most` positive slots, then `most` negative ones.
        negative = torch.zeros([b, 2 * most, 1], device=device)
        negative[:, most:] = 1
        negative = negative.tile([1, groups, 1])
        positive_slots = (1 - negative).squeeze(-1) * real
        positive = torch.nonzero(positive_slots)[:, 1].split([n * groups for n in counts])
        if self.label_noise_ratio > 0:
            flip = torch.rand_like(labels, dtype=torch.float) < self.label_noise_ratio * 0.5
            random_labels = torch.randint_like(flip, 0, self.num_classes, dtype=labels.dtype)
            labels = torch.where(flip & real, random_labels, labels)
        if self.box_noise_scale > 0:
            corners = box_convert(boxes, "cxcywh", "xyxy")
            half_size = boxes[..., 2:].repeat(1, 1, 2) * 0.5 * self.box_noise_scale
            sign = torch.randint_like(boxes, 0, 2) * 2.0 - 1.0
            magnitude = torch.rand_like(boxes)
            magnitude = (magnitude + 1.0) * negative + magnitude * (1 - negative)
            corners = (corners + magnitude * sign * half_size).clamp(0.0, 1.0)
            boxes = box_convert(corners, "xyxy", "cxcywh")
        total = 2 * most * groups
        size = total + num_queries
        mask = torch.zeros([size, size], device=device)
        mask[total:, :total] = -torch.inf
        for g in range(groups):
            start, end = 2 * most * g, 2 * most * (g + 1)
            mask[start:end, :start] = -torch.inf
            mask[start:end, end:total] = -torch.inf
        return {"queries": self.label_embed(labels), "reference": inverse_sigmoid(boxes), "attn_mask": mask,
                "positive": positive, "groups": groups, "split": [total, num_queries]}


class DecoderInputs(NamedTuple):
    """What a DETR decoder's layers start from: the flattened ``memory`` [B, S, C] and its levels' ``shapes``, the
    ``queries`` [B, N, C] and their ``reference`` box logits [B, N, 4] (denoising queries first, when training
    with them), the denoising ``attn_mask`` (or None), the query selection's outputs and the denoising's."""

    memory: torch.Tensor
    shapes: list[tuple[int, int]]
    queries: torch.Tensor
    reference: torch.Tensor
    attn_mask: torch.Tensor | None
    selected: dict[str, torch.Tensor]
    denoising: dict | None


def decoder_inputs(maps: list[torch.Tensor], query_selection: QuerySelection, denoising: ContrastiveDenoising,
                   targets: list[dict[str, torch.Tensor]] | None) -> DecoderInputs:
    """The encoder's (projected) ``maps`` flattened, the selected queries, and in training (``targets`` given) the
    denoising queries put before them (RT-DETR's and D-FINE's decoders alike)."""
    shapes = [(m.shape[-2], m.shape[-1]) for m in maps]
    memory = torch.cat([m.flatten(2).transpose(1, 2) for m in maps], 1)
    selected = query_selection(memory, shapes)
    queries, reference, attn_mask = selected["queries"], selected["reference"].detach(), None
    noised = denoising(targets, queries.shape[1]) if targets is not None else None
    if noised is not None:
        queries = torch.cat([noised["queries"], queries], 1)
        reference = torch.cat([noised["reference"], reference], 1)
        attn_mask = noised["attn_mask"]
    elif targets is not None:
        # No denoising queries (no object in this process's images, or NUM_DENOISING 0): the label embedding
        # joins the graph with weight 0, so DistributedDataParallel, which all-reduces every parameter's
        # gradient at every step, finds one in every process; else a process without objects stops the run
        # ("Expected to have finished reduction"). The reference instead runs DDP with find_unused_parameters,
        # which walks the graph at every step.
        queries = queries + 0.0 * denoising.label_embed.weight.sum()
    return DecoderInputs(memory, shapes, queries, reference, attn_mask, selected, noised)
